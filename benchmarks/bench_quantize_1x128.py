"""quantize_1x128 against torch.compile(fullgraph=True) of ``quantize_1x128_reference``.

Cases (PERF.md): M = 16384 and 32768 routed rows x D = 7168, bf16, with 1 x 128 blocks and with one
scale per row (``block_k=None``, the row-wise recipe's cast); and gathered (``src_rows``) into the padded
groups of skewed, unaligned offsets over E = 128 experts (``fp8_grouped_mm``'s forward on such groups).
With ``transpose=True`` (``fp8_grouped_mm``'s forward where the weight needs a gradient: the rows and their
scaling-aware transpose from one kernel) against the two launches it replaces, ``quantize_1x128`` then
``scaling_aware_transpose`` of its rows; bytes: read x, write the rows and the copy (each 1 B/elem + scales).
Bytes at the algorithmic minimum: read x (2 B/elem) + write data (1 B/elem) + write scale_inv (4 B per
block), gathered: + read src_rows (4 B per padded row), data and scales over the padded rows. Issue targets: >= 80% of copy
bandwidth, >= 1.3x the compiled reference. ``device_us`` (ours) is the call's device time with the
host excluded (``_bench.device_us``), next to ``ours_us``.

    python benchmarks/bench_quantize_1x128.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import DEVICE_NOTE, n_rotations, unaligned_offsets, versus_baseline, write_results  # noqa: E402

from fp8flow_ao.kernels.pad_group_offsets import pad_group_offsets  # noqa: E402
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128, quantize_1x128_reference  # noqa: E402
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose  # noqa: E402
from fp8flow_ao.shapes import BENCH_ROUTED_ROWS, DEEPSEEK_V3  # noqa: E402

BASELINE = "torch.compile(fullgraph=True) reference"
GATHER_EXPERTS = 128
TWO_LAUNCHES = "quantize_1x128 + scaling_aware_transpose"


def _rows_then_transpose(
    x: torch.Tensor, src_rows: torch.Tensor | None, offs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    data, scale_inv = quantize_1x128(x, 128, src_rows)
    return data, scale_inv, *scaling_aware_transpose(data, scale_inv, offs)


def _with_transpose(x: torch.Tensor, src_rows: torch.Tensor | None, offs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return quantize_1x128(x, 128, src_rows, transpose=True, group_end_offsets=offs)


def _transpose_rows(d: int) -> list[dict]:
    """The transposing form, on 128-aligned rows and gathered into unaligned groups' padded layout."""
    rows = []
    for m in BENCH_ROUTED_ROWS:
        for gathered in (False, True):
            src_rows, offs = None, torch.tensor([m], dtype=torch.int32, device="cuda")
            if gathered:
                src_rows, _, offs = pad_group_offsets(unaligned_offsets(m, GATHER_EXPERTS), m)
            out_rows = m if src_rows is None else src_rows.shape[0]
            bytes_moved = 2 * m * d + 2 * (out_rows * d + 4 * out_rows * (d // 128)) + 4 * out_rows * gathered
            sets = [
                (torch.randn(m, d, device="cuda", dtype=torch.bfloat16), src_rows, offs)
                for _ in range(n_rotations(bytes_moved))
            ]
            where = f" gathered into {out_rows} padded rows (E={GATHER_EXPERTS} unaligned)" if gathered else ""
            case = f"M={m} K={d} block_k=128 transpose=True{where}"
            rows.append(versus_baseline(case, _with_transpose, _rows_then_transpose, TWO_LAUNCHES, sets, bytes_moved))
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_quantize_1x128: no CUDA device, nothing to measure")
        return
    compiled = torch.compile(quantize_1x128_reference, fullgraph=True)
    d = DEEPSEEK_V3.dim
    rows = []
    for block_k in (128, None):
        for m in BENCH_ROUTED_ROWS:
            blocks = m * (d // block_k if block_k else 1)
            bytes_moved = 2 * m * d + m * d + 4 * blocks
            sets = [
                (torch.randn(m, d, device="cuda", dtype=torch.bfloat16), block_k)
                for _ in range(n_rotations(bytes_moved))
            ]
            case = f"M={m} K={d} block_k={block_k}"
            rows.append(versus_baseline(case, quantize_1x128, compiled, BASELINE, sets, bytes_moved))
    for m in BENCH_ROUTED_ROWS:
        src_rows = pad_group_offsets(unaligned_offsets(m, GATHER_EXPERTS), m)[0]
        padded = src_rows.shape[0]
        bytes_moved = 2 * m * d + padded * d + 4 * padded * (d // 128) + 4 * padded
        sets = [
            (torch.randn(m, d, device="cuda", dtype=torch.bfloat16), 128, src_rows)
            for _ in range(n_rotations(bytes_moved))
        ]
        case = f"M={m} K={d} block_k=128 gathered into {padded} padded rows (E={GATHER_EXPERTS} unaligned)"
        rows.append(versus_baseline(case, quantize_1x128, compiled, BASELINE, sets, bytes_moved))
    rows += _transpose_rows(d)
    notes = (
        "bytes = read x bf16 + write fp8 data + fp32 scale_inv; block_k=None: one scale per row; transpose=True: "
        f"+ the column-wise copy and its scales, baseline {TWO_LAUNCHES} of the same rows. " + DEVICE_NOTE
    )
    write_results("quantize_1x128", rows, notes)


if __name__ == "__main__":
    main()
