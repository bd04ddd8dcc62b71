"""pad_group_offsets: the kernel equals its reference and route_pad's maps for the same grouping (empty
groups, rows past the last end, one row per group, many groups), bad offsets clamp, op checks, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from fp8flow_ao.kernels.pad_group_offsets import (
    launch_pad_group_offsets,
    pad_group_offsets,
    pad_group_offsets_reference,
)
from fp8flow_ao.kernels.permute_pad import padded_rows_bound, route_pad

_SMALL_COUNTS = torch.randint(0, 40, (300,), generator=torch.Generator().manual_seed(0)).tolist()
# (rows per group, rows past the last end)
CASES = {
    "ragged": ([5, 0, 130, 128, 1], 7),
    "all_empty": ([0, 0, 0], 3),
    "no_rows": ([0], 0),
    "one_group": ([200], 0),
    "row_per_group": ([1] * 40, 100),
    "aligned": ([0, 256, 0, 128], 0),
    # more groups than 256 lanes; mostly small (under the interpreter a program per padded block costs ~75 ms),
    # every 50th spanning three blocks
    "many_groups": ([300 if g % 50 == 0 else c for g, c in enumerate(_SMALL_COUNTS)], 50),
}


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def _via_route_pad(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """The same maps the long way: each row's group by binary search, then route_pad over E + 1 groups."""
    group = torch.searchsorted(offs, torch.arange(rows, dtype=offs.dtype), right=True)
    src_rows, dst_rows, ends = route_pad(group.view(rows, 1), offs.shape[0] + 1)
    return src_rows, dst_rows, ends[:-1]


def _assert_all_equal(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for name, a, e in zip(("src_rows", "dst_rows", "padded_offs"), actual, expected, strict=True):
        assert a.dtype == e.dtype == torch.int32, name
        assert torch.equal(a.cpu(), e.cpu()), (name, a, e)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_and_route_pad(case):
    counts, extra = CASES[case]
    offs = _offs(counts)
    rows = int(offs[-1]) + extra
    expected = pad_group_offsets_reference(offs, rows)
    _assert_all_equal(launch_pad_group_offsets(offs.to(DEVICE), rows), expected)
    _assert_all_equal(_via_route_pad(offs, rows), expected)
    src_rows, dst_rows, padded_offs = expected
    assert src_rows.shape[0] == padded_rows_bound(rows, len(counts) + 1)
    # Every row lands where its source map points back to it; groups start on multiples of 128.
    assert torch.equal(src_rows[dst_rows.long()], torch.arange(rows, dtype=torch.int32))
    assert int((src_rows >= 0).sum()) == rows
    assert bool((padded_offs % 128 == 0).all())


def test_bad_offsets_are_clamped_not_out_of_bounds():
    """Decreasing offsets and ends past the rows: a running maximum, clamped to the rows (no sync, no check)."""
    offs = torch.tensor([50, 10, 300, 20], dtype=torch.int32)
    expected = pad_group_offsets_reference(offs, 200)
    _assert_all_equal(launch_pad_group_offsets(offs.to(DEVICE), 200), expected)
    _assert_all_equal(expected, pad_group_offsets_reference(torch.tensor([50, 50, 200, 200], dtype=torch.int32), 200))


def test_op_dispatch_compile_and_opcheck():
    offs = _offs([5, 0, 130]).to(DEVICE)
    eager = pad_group_offsets(offs, 140)
    _assert_all_equal(torch.compile(pad_group_offsets, fullgraph=True)(offs, 140), eager)
    torch.library.opcheck(torch.ops.fp8flow.pad_group_offsets.default, (offs, 140))


@pytest.mark.parametrize(
    ("offs", "rows", "error", "match"),
    [
        (torch.zeros(2, dtype=torch.int64), 4, TypeError, "offs must have dtype"),
        (torch.zeros(2, 2, dtype=torch.int32), 4, ValueError, "offs must have 1 dims"),
        (torch.zeros(4, dtype=torch.int32)[::2], 4, ValueError, "offs must be contiguous"),
        (torch.zeros(0, dtype=torch.int32), 4, ValueError, "at least one group end"),
        (torch.zeros(2, dtype=torch.int32), -1, ValueError, "num_rows must be a non-negative int"),
        (torch.zeros(2, dtype=torch.int32), 2.0, ValueError, "num_rows must be a non-negative int"),
    ],
)
def test_bad_input(offs, rows, error, match):
    with pytest.raises(error, match=match):
        pad_group_offsets(offs, rows)
