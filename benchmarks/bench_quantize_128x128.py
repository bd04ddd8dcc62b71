"""quantize_128x128 (weights, with the exact transpose for dgrad) against torch.compile(fullgraph=True)
of ``quantize_128x128_reference``.

Cases (PERF.md, DeepSeek-V3-like experts): E = 8 and 32 experts of W13 ``[2H, D] = [4096, 7168]``
and W2 ``[D, H] = [7168, 2048]``, bf16, ``with_transpose=True``. Bytes at the algorithmic minimum:
read w (2 B/elem) + write data and data_t (1 B/elem each) + write both scale tensors (4 B per tile).
``device_us`` (ours) is the call's device time with the host excluded (``_bench.device_us``).

Pair rows: the MoE layer's forward weights, ``quantize_128x128_pair(w1, w2, with_transpose=False,
w_tail=w3)`` (W13 = [w1; w3] and w2 in one launch) against the two ``quantize_128x128`` calls it replaces
(DeepSeek-V3-like and Qwen3-30B-A3B-like experts); bytes: read the bf16 weights, write the fp8 tiles and
scales; ``baseline_device_us`` is the two calls' device time, measured as ours.

    python benchmarks/bench_quantize_128x128.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import DEVICE_NOTE, device_us, n_rotations, versus_baseline, write_results  # noqa: E402

from fp8flow_ao._format import BLOCK  # noqa: E402
from fp8flow_ao.kernels.quantize_128x128 import (  # noqa: E402
    quantize_128x128,
    quantize_128x128_pair,
    quantize_128x128_reference,
)
from fp8flow_ao.shapes import DEEPSEEK_V3, DEEPSEEK_V3_E8, QWEN3_30B_A3B, MoEShape  # noqa: E402

BASELINE = "torch.compile(fullgraph=True) reference"
TWO_CALLS = "two quantize_128x128 calls"


def _two_calls(w1, w2, with_transpose, with_data, w3):
    """What ``quantize_128x128_pair`` replaces: W13 (``w1`` with its tail ``w3``), then ``w2``."""
    return quantize_128x128(w1, with_transpose, with_data, w_tail=w3), quantize_128x128(w2, with_transpose, with_data)


def _pair_row(shape: MoEShape) -> dict:
    e, d, h = shape.experts, shape.dim, shape.hidden
    numel = 3 * e * h * d
    bytes_moved = 2 * numel + numel + 4 * numel // (BLOCK * BLOCK)
    sets = [
        (*(torch.randn(e, *s, device="cuda", dtype=torch.bfloat16) for s in ((h, d), (d, h))), False, True)
        + (torch.randn(e, h, d, device="cuda", dtype=torch.bfloat16),)
        for _ in range(n_rotations(bytes_moved))
    ]

    def pair(w1, w2, with_transpose, with_data, w3):
        return quantize_128x128_pair(w1, w2, with_transpose, with_data, w_tail=w3)

    case = f"W13+W2 forward pair {shape.name} E={e} D={d} H={h}"
    return versus_baseline(
        case, pair, _two_calls, TWO_CALLS, sets, bytes_moved, baseline_device_us=device_us(_two_calls, sets)
    )


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
    rows += [_pair_row(shape) for shape in (DEEPSEEK_V3, QWEN3_30B_A3B)]
    notes = (
        "bytes = read w bf16 + write fp8 data and data_t + fp32 scale_inv and scale_inv_t (pair rows: forward "
        "tiles only; baseline = the two calls the pair replaces, baseline_device_us their device time). " + DEVICE_NOTE
    )
    write_results("quantize_128x128", rows, notes)


if __name__ == "__main__":
    main()
