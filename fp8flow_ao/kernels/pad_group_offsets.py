"""pad_group_offsets: row maps that pad each group of consecutive rows to a multiple of 128 rows.

``torch._grouped_mm``'s groups are consecutive runs of rows given by their END offsets ``offs [E]``; the
FP8-Flow layout needs every group to START on a multiple of 128 rows. From ``offs`` alone (on the device,
no host sync, static shapes) one kernel launch gives the maps between the two layouts: row ``i`` of group
``g`` (``offs[g-1] <= i < offs[g]``) goes to padded row ``padded_start[g] + i - offs[g-1]``. The rows at or
past the last end form one group more, padded like the others, so they stay out of every expert's GEMM.

Outputs (int32, contiguous): ``src_rows [M_pad]`` (``M_pad = padded_rows_bound(M, E + 1)``), the row that
fills each padded row, ``-1`` on pad rows and past the last padded end; ``dst_rows [M]``, the padded row of
each row; ``padded_offs [E]``, the padded group ends (non-decreasing multiples of 128). They are what
:func:`~fp8flow_ao.kernels.permute_pad.route_pad` gives for the expert ids ``searchsorted(offs, i,
right=True)`` (the same maps, one launch instead of a search and route_pad's three).

Offsets are not checked on the device: each end is clamped into ``[previous end, M]`` (a running maximum,
then ``min(., M)``), so a bad offset gives a wrong grouping, never an out-of-bounds row.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fp8flow_ao._checks import check_contiguous, check_tensor
from fp8flow_ao._format import BLOCK
from fp8flow_ao.kernels._launch import launch_kernel, next_pow2
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._triton_common import jit_any_count
from fp8flow_ao.kernels.permute_pad import padded_rows_bound

_GROUP_ALIGN = tl.constexpr(BLOCK)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@jit_any_count("M")
def _pad_group_offsets_kernel(
    offs_ptr,
    src_rows_ptr,
    dst_rows_ptr,
    padded_offs_ptr,
    M,
    E,
    BLOCK_G: tl.constexpr,
):
    """One program: 128 padded rows (``src_rows``) and the real rows that land there (``dst_rows``).

    Every program derives the ``E + 1`` groups (lane ``E``: the rows past the last end) from ``offs``
    itself, a few scans over ``BLOCK_G`` lanes; program 0 also stores the padded ends. A padded group
    spans whole 128-row chunks, so this program's chunk lies in one group, found by one lane compare."""
    g = tl.arange(0, BLOCK_G)
    # Group ends and starts (the previous lane's end), each clamped into [running maximum, M]; lane E and
    # the power-of-two lanes past it end at M (lane E: the rows past the last end; the others are empty).
    raw_ends = tl.load(offs_ptr + g, mask=g < E, other=M)
    raw_starts = tl.where(g > E, M, tl.load(offs_ptr + g - 1, mask=(g > 0) & (g <= E), other=0))
    ends = tl.minimum(tl.associative_scan(tl.maximum(raw_ends, 0), 0, _max_combine), M)
    starts = tl.minimum(tl.associative_scan(tl.maximum(raw_starts, 0), 0, _max_combine), M)
    padded = (ends - starts + (_GROUP_ALIGN - 1)) // _GROUP_ALIGN * _GROUP_ALIGN
    padded_ends = tl.cumsum(padded, 0)
    if tl.program_id(0) == 0:
        tl.store(padded_offs_ptr + g, padded_ends, mask=g < E)
    first = tl.program_id(0) * _GROUP_ALIGN
    # The lanes whose padded range ends at or before this chunk are the groups before its own (ends are
    # non-decreasing): the largest of their ends is its group's start, padded and not; the smallest end
    # of the others is its group's end. Past the last group: start = end = M, no row.
    before = padded_ends <= first
    start = tl.max(tl.where(before, ends, 0), axis=0)
    count = tl.min(tl.where(before, M, ends), axis=0) - start
    local = first - tl.max(tl.where(before, padded_ends, 0), axis=0) + tl.arange(0, _GROUP_ALIGN)
    real = local < count
    padded_rows = first + tl.arange(0, _GROUP_ALIGN)
    tl.store(src_rows_ptr + padded_rows, tl.where(real, start + local, -1))
    tl.store(dst_rows_ptr + start + local, padded_rows, mask=real)


def _outputs(offs: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new = functools.partial(offs.new_empty, dtype=torch.int32)
    return new(padded_rows_bound(num_rows, offs.shape[0] + 1)), new(num_rows), new(offs.shape[0])


def launch_pad_group_offsets(offs: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`pad_group_offsets`."""
    src_rows, dst_rows, padded_offs = _outputs(offs, num_rows)
    launch_kernel(
        _pad_group_offsets_kernel,
        (src_rows.shape[0] // BLOCK,),  # >= 1: the bound counts 127 rows per group
        offs,
        src_rows,
        dst_rows,
        padded_offs,
        num_rows,
        offs.shape[0],
        BLOCK_G=next_pow2(offs.shape[0] + 1),
        num_warps=4,
    )
    return src_rows, dst_rows, padded_offs


def pad_group_offsets_reference(offs: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path), with the kernel's clamping of bad offsets."""
    device = offs.device
    clamped = offs.to(torch.int64).clamp(min=0).cummax(0).values.clamp(max=num_rows)
    ends = torch.cat([clamped, clamped.new_full((1,), num_rows)])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (ends - starts + (BLOCK - 1)) // BLOCK * BLOCK
    padded_ends = torch.cumsum(padded, 0)
    rows = torch.arange(num_rows, device=device)
    group = torch.searchsorted(ends, rows, right=True)
    dst_rows = padded_ends[group] - padded[group] + rows - starts[group]
    src_rows = torch.full((padded_rows_bound(num_rows, offs.shape[0] + 1),), -1, dtype=torch.int64, device=device)
    src_rows.scatter_(0, dst_rows, rows)
    return src_rows.to(torch.int32), dst_rows.to(torch.int32), padded_ends[:-1].to(torch.int32)


@define_op("pad_group_offsets")
def _pad_group_offsets_op(offs: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return pad_group_offsets_reference(offs, num_rows)


_pad_group_offsets_op.register_kernel("cuda")(launch_pad_group_offsets)
_pad_group_offsets_op.register_fake(_outputs)


def pad_group_offsets(offs: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row maps from ``num_rows`` rows in consecutive groups (END offsets ``offs``) to the same groups each
    padded to a multiple of 128 rows (module docstring).

    Args:
        offs: int32 ``[E]`` group END offsets, contiguous, non-decreasing, last ``<= num_rows`` (not
            checked: bad values are clamped, see the module docstring). ``E >= 1``.
        num_rows: ``M``, the rows the offsets index (rows at or past ``offs[-1]`` form one more group).

    Returns:
        ``(src_rows, dst_rows, padded_offs)``, int32 on ``offs``' device: ``src_rows [M_pad]`` (``M_pad =
        padded_rows_bound(M, E + 1)``, a multiple of 128): the row that fills each padded row, ``-1`` on
        pad rows; ``dst_rows [M]``: the padded row of each row; ``padded_offs [E]``: the padded group ends.
    """
    check_tensor("offs", offs, dtypes=torch.int32, ndim=1)
    check_contiguous("offs", offs)
    if offs.shape[0] == 0:
        raise ValueError("offs must hold at least one group end")
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    return torch.ops.fp8flow.pad_group_offsets(offs, num_rows)
