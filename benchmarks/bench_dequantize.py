"""dequantize (every layout, one kernel) against torch.compile(fullgraph=True) of ``dequantize_reference``.

Cases (PERF.md): row-wise ``[M, D]`` and column-wise ``[D, M]`` activations for M = 16384 and 32768
routed rows, D = 7168; 128x128 weights W13 ``[E, 2H, D]`` for E = 8 and 32. bf16 output. Bytes at the
algorithmic minimum: read data (1 B/elem) + read scale_inv (4 B per block) + write out (2 B/elem).
``device_us`` (ours) is the call's device time with the host excluded (``_bench.device_us``).

    python benchmarks/bench_dequantize.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import DEVICE_NOTE, n_rotations, versus_baseline, write_results  # noqa: E402

from fp8flow_ao._format import FP8_DTYPE  # noqa: E402
from fp8flow_ao.kernels.dequantize import _scale_shape, dequantize, dequantize_reference  # noqa: E402
from fp8flow_ao.shapes import BENCH_ROUTED_ROWS, DEEPSEEK_V3, DEEPSEEK_V3_E8  # noqa: E402

BASELINE = "torch.compile(fullgraph=True) reference"
D = DEEPSEEK_V3.dim
CASES = (
    [("rowwise", (m, D)) for m in BENCH_ROUTED_ROWS]
    + [("colwise", (D, m)) for m in BENCH_ROUTED_ROWS]
    + [("128x128", (s.experts, 2 * s.hidden, s.dim)) for s in (DEEPSEEK_V3_E8, DEEPSEEK_V3)]
)


def fp8_input(shape: tuple[int, ...], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E4M3 data (normal values, never all zeros) and power-of-two scales of the layout."""
    data = torch.randn(shape, device="cuda").mul_(32).to(FP8_DTYPE)  # |x| < 448: the cast never overflows
    scale_inv = torch.exp2(torch.randint(-12, 4, _scale_shape(torch.Size(shape), layout), device="cuda").float())
    return data, scale_inv


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_dequantize: no CUDA device, nothing to measure")
        return
    compiled = torch.compile(dequantize_reference, fullgraph=True)
    rows = []
    for layout, shape in CASES:
        bytes_moved = 3 * math.prod(shape) + 4 * math.prod(_scale_shape(torch.Size(shape), layout))
        sets = [(*fp8_input(shape, layout), layout, torch.bfloat16) for _ in range(n_rotations(bytes_moved))]
        case = f"{layout} {'x'.join(map(str, shape))}"
        rows.append(versus_baseline(case, dequantize, compiled, BASELINE, sets, bytes_moved))
        del sets
    write_results("dequantize", rows, "bytes = read fp8 data + fp32 scale_inv + write bf16 out. " + DEVICE_NOTE)


if __name__ == "__main__":
    main()
