"""quantize_128x128 (weights, with the exact transpose for dgrad) against torch.compile(fullgraph=True)
of ``quantize_128x128_reference``.

Cases (PERF.md, DeepSeek-V3-like experts): E = 8 and 32 experts of W13 ``[2H, D] = [4096, 7168]``
and W2 ``[D, H] = [7168, 2048]``, bf16, ``with_transpose=True``. Bytes at the algorithmic minimum:
read w (2 B/elem) + write data and data_t (1 B/elem each) + write both scale tensors (4 B per tile).
``device_us`` (ours) is the call's device time with the host excluded (``_bench.device_us``).

    python benchmarks/bench_quantize_128x128.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import DEVICE_NOTE, n_rotations, versus_baseline, write_results  # noqa: E402

from fp8flow_ao._format import BLOCK  # noqa: E402
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128, quantize_128x128_reference  # noqa: E402
from fp8flow_ao.shapes import DEEPSEEK_V3, DEEPSEEK_V3_E8  # noqa: E402

BASELINE = "torch.compile(fullgraph=True) reference"


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_quantize_128x128: no CUDA device, nothing to measure")
        return
    compiled = torch.compile(quantize_128x128_reference, fullgraph=True)
    rows = []
    for shape in (DEEPSEEK_V3_E8, DEEPSEEK_V3):
        for name, n, k in (("W13", 2 * shape.hidden, shape.dim), ("W2", shape.dim, shape.hidden)):
            e = shape.experts
            numel = e * n * k
            bytes_moved = 2 * numel + 2 * numel + 2 * 4 * numel // (BLOCK * BLOCK)
            sets = [
                (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16), True)
                for _ in range(n_rotations(bytes_moved))
            ]
            case = f"{name} E={e} N={n} K={k}"
            rows.append(versus_baseline(case, quantize_128x128, compiled, BASELINE, sets, bytes_moved))
            del sets
    notes = "bytes = read w bf16 + write fp8 data and data_t + fp32 scale_inv and scale_inv_t. " + DEVICE_NOTE
    write_results("quantize_128x128", rows, notes)


if __name__ == "__main__":
    main()
