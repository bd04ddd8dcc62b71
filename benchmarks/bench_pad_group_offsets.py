"""pad_group_offsets against the maps' earlier construction: ``torch.searchsorted`` of every row's group,
then ``route_pad`` over E + 1 groups (three launches), the same outputs bit for bit.

Cases: M = 16384 and 32768 rows in skewed, unaligned groups (Zipf, some empty) over E = 32, 128 and 256
experts: what ``fp8_grouped_mm`` computes once per call on unaligned offsets. Bytes: write src_rows and
dst_rows (4 B per padded row and per row) + read the offsets. The op is launch- and latency-bound;
``ours_us`` includes the host, ``device_us`` does not.

    python benchmarks/bench_pad_group_offsets.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import DEVICE_NOTE, require_cuda, unaligned_offsets, versus_baseline, write_results  # noqa: E402

from fp8flow_ao.kernels.pad_group_offsets import pad_group_offsets  # noqa: E402
from fp8flow_ao.kernels.permute_pad import padded_rows_bound, route_pad  # noqa: E402
from fp8flow_ao.shapes import BENCH_ROUTED_ROWS  # noqa: E402

BASELINE = "searchsorted + route_pad"


def searchsorted_route_pad(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = torch.searchsorted(offs, torch.arange(rows, dtype=offs.dtype, device=offs.device), right=True)
    src_rows, dst_rows, ends = route_pad(group.view(rows, 1), offs.shape[0] + 1)
    return src_rows, dst_rows, ends[:-1]


def main() -> None:
    if not require_cuda("bench_pad_group_offsets"):
        return
    rows = []
    for m in BENCH_ROUTED_ROWS:
        for experts in (32, 128, 256):
            offs = unaligned_offsets(m, experts)
            bytes_moved = 4 * (padded_rows_bound(m, experts + 1) + m + experts)
            case = f"M={m} E={experts} skewed unaligned"
            rows.append(
                versus_baseline(case, pad_group_offsets, searchsorted_route_pad, BASELINE, [(offs, m)], bytes_moved)
            )
    write_results("pad_group_offsets", rows, "bytes = write src_rows + dst_rows, read offs. " + DEVICE_NOTE)


if __name__ == "__main__":
    main()
