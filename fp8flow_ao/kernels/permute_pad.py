"""permute_pad: token rows ``[T, D]`` -> padded expert-major rows ``[M_pad, D]``, FP8 data and scales together.

Two steps, both on the device with sizes that depend only on shapes (no device-to-host sync, so they
run under ``torch.compile(fullgraph=True)`` and CUDA graphs):

1. :func:`route_pad` (three Triton kernels, no sort: per-block expert counts, their scan per expert into
   per-block bases and expert totals, a scatter of each block's rows that also writes the offsets) turns
   the router's top-k expert ids ``[T, k]`` into the row maps and the group end offsets, and permutes
   the router probs. It replaced a stable ``torch.sort`` + one kernel: measured on an H200 (torch 2.11),
   that sort blocked the host until the device caught up when the GPU queue was busy (5.1 ms a call
   behind a sleeping kernel), and route_pad took 336 us of host time per call inside the compiled
   Qwen-like step (152 us now); device time 71 us for the three kernels, 55 us for the sort alone, and
   17 us since the count table's scan runs a program per 4 experts (it was one program: 45 us of the
   71). Every expert's group starts at a multiple of 128 (rounded up, empty experts get a zero-length
   group) and lies inside ``M_pad = 128 * floor((T*k + E*127) / 128)``, a static upper bound on the
   padded total. Within an expert, rows keep (token, slot) order.
2. :func:`permute_pad_rows` (one Triton kernel) gathers ``x[src_rows[r] // k]`` into row ``r``,
   moving a row's data and its 1x128 ``scale_inv`` in the same program; pad rows and rows past the
   last offset get data 0 and scale 0. Given ``dst_rows`` too (``permute_pad`` and the FP8-Flow layer's
   backward pass it), the same kernel scatters instead where rows are wide (:func:`scatter_pays`): each
   token row is read once and written to its ``k`` rows, and programs of their own zero the pad rows.
   Measured on an H200 (device time, FP8, top-8, D = 7168): the gather, which reads every token ``k``
   times, reached 62-70% of copy bandwidth, the scatter 79-82%. Under a top-1 row map (expert
   parallelism's dispatch, unaligned groups) both read each row once, and the launcher gathers.
   With ``quantize=True`` (``fp8flow::quantize_permute_pad_rows``) the scatter reads BF16 tokens and
   quantizes each 1 x 128 block as it goes (``quantize_1x128``'s rule, bit for bit), optionally also
   writing the token-order FP8 rows: the FP8-Flow layer's two activation casts without a kernel of their
   own (x in forward, keeping x8 for backward; dy in backward).

The same gather, given the same ``src_rows``, is the backward of the FP8-Flow layer's unweighted
combine (an FP8 ``[T, D]`` output gradient with its scales). The backward of the gather for
floating-point ``x`` (``grad_x[t] = sum_j grad_data[dst_rows[t*k + j]]``) is exactly
:func:`~fp8flow_ao.kernels.unpermute_unpad.unpermute_unpad` without probs, and reuses its kernel.

Layouts: ``x`` row-major (row stride free); ``x_scale`` COMPACT ``[T, ceil(D/128)]`` fp32, row-major.
Outputs contiguous; ``scale_inv`` is the dequantize multiplier (``x ~= data * scale_inv``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fp8flow_ao._checks import (
    check_bool,
    check_no_grad,
    check_positive_int,
    check_row_major,
    check_row_map,
    check_same_device,
    check_shape,
    check_tensor,
    validate_index_range,
    validation_enabled,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, quantize_rows_reference
from fp8flow_ao.kernels._launch import cdiv, launch_kernel, next_pow2
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._triton_common import col_block, jit_any_count, nan_free_abs, pow2_scale_inv_and_scale

# Importing it also registers fp8flow::unpermute_unpad, which is the backward of the gather here.
from fp8flow_ao.kernels.unpermute_unpad import _unpermute_unpad_op, take_rows_or_zero

_INPUT_DTYPES = (FP8_DTYPE, torch.bfloat16, torch.float16, torch.float32)
_PROBS_DTYPES = (torch.float32, torch.bfloat16)
_EXPERT_ID_DTYPES = (torch.int32, torch.int64)
# The quantizing scatter's scale block (a global a kernel reads must be a constexpr).
SCALE_BLOCK = tl.constexpr(BLOCK)
# Rows move as raw bits (integers of the same width): exact for every value, NaN payloads included.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# 8 KiB of data per program, 4 warps: each thread moves four 16-byte vectors. On sm_90 (ptxas via
# triton 3.9) 8 x 1024 FP8 tiles take 96 registers (5 programs and ~40 KiB in flight per SM);
# 16 KiB tiles took 168 (3 programs per SM), since every row of a tile costs its own addresses.
_TILE_BYTES = 8192
# scatter_pays: the narrowest row that scatters (between the measured 2048 bytes, no gain, and 7168, a gain).
SCATTER_MIN_ROW_BYTES = 4096
# Scattering permute_pad_rows: rows per program of the programs that zero the pad rows (they read only
# src_rows and write only where it is -1; 64 and 128 measured the same on the H200, 64 by ~1%).
_PAD_ROWS = 64
# Widest column tile: 2 KiB of a row (FP8 D = 7168 gets 1024 columns: 7 tiles, no masked tail).
_MAX_COL_BYTES = 2048
# Route kernels: routed rows x expert lanes per program (a row's expert is a one-hot [rows, E] compare;
# its rank within the block a cumsum down that), at most 128 rows; pad-row defaults in 1024-row stores.
# H200 sweep of 16-256 rows (route_pad device time, E = 8-256, T*k = 2K-256K): 128 rows was best or
# within 10% of it wherever E >= 32; 256 rows lost up to 2x at E >= 128, 16-32 rows up to 3x at E = 32.
_ROUTE_TILE = 16384
_ROUTE_MAX_ROWS = 128
_ROUTE_FILL_BLOCK = 1024
# Expert lanes per program of the count table's scan (4 int32 of each block's row), so E = 128 scans in
# 32 programs: one program scanning all lanes had taken 23-45 us of route_pad's 39-70 (E = 128, H200).
_ROUTE_SCAN_LANES = 4
# Blocks per step of that scan (more loop with a carried count). One tile for every count, masked past the
# last block: a tile sized to the count would compile a kernel for each new power of two of blocks.
_ROUTE_SCAN_ROWS = 1024


def padded_rows_bound(num_rows: int, num_experts: int) -> int:
    """Static upper bound on the padded row count of ``num_rows`` routed rows in ``num_experts`` groups:
    rounding a group up to a multiple of 128 adds at most 127 rows, and the total is a multiple of 128."""
    return BLOCK * ((num_rows + num_experts * (BLOCK - 1)) // BLOCK)


@triton.jit
def _clamped_expert_ids(ids_ptr, rows, row_ok, num_experts):
    """The expert of each routed row, clamped into ``[0, E)`` (a bad id joins the first or last expert,
    so no later kernel reads out of bounds); -1 past the last row, where no expert lane matches."""
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    return tl.where(row_ok, tl.minimum(tl.maximum(ids, 0), num_experts - 1), -1)


@jit_any_count("num_routed")
def _route_count_kernel(
    ids_ptr,
    counts_ptr,
    src_rows_ptr,
    probs_out_ptr,
    num_routed,
    num_rows,
    num_experts,
    fill_per_program,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """One program: the expert histogram of ``BLOCK_R`` routed rows (``counts[pid, :]``), and its share of
    the padded rows' defaults (``src_rows`` -1, permuted probs 0) that the scatter then overwrites."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    expert = _clamped_expert_ids(ids_ptr, rows, rows < num_routed, num_experts)
    e = tl.arange(0, BLOCK_E)
    hits = (expert[:, None] == e[None, :]).to(tl.int32)
    tl.store(counts_ptr + pid * BLOCK_E + e, tl.sum(hits, axis=0))
    fill_start = pid * fill_per_program
    fill_end = tl.minimum(fill_start + fill_per_program, num_rows)
    for start in range(fill_start, fill_end, FILL_BLOCK):
        offs = start + tl.arange(0, FILL_BLOCK)
        ok = offs < fill_end
        tl.store(src_rows_ptr + offs, tl.full([FILL_BLOCK], -1, tl.int32), mask=ok)
        if HAS_PROBS:
            tl.store(probs_out_ptr + offs, tl.zeros([FILL_BLOCK], tl.float32), mask=ok)


@jit_any_count("num_blocks")
def _route_scan_kernel(
    counts_ptr, totals_ptr, num_blocks, SCAN_R: tl.constexpr, SCAN_E: tl.constexpr, BLOCK_E: tl.constexpr
):
    """One program per ``SCAN_E`` expert lanes: in place of each block's count of an expert, the expert's
    rows in the blocks before it (an exclusive scan down the column), and the expert's total rows."""
    e = tl.program_id(0) * SCAN_E + tl.arange(0, SCAN_E)
    carry = tl.zeros([SCAN_E], tl.int32)
    for start in range(0, num_blocks, SCAN_R):
        blocks = start + tl.arange(0, SCAN_R)
        ptrs = counts_ptr + blocks[:, None] * BLOCK_E + e[None, :]
        ok = (blocks < num_blocks)[:, None]
        counts = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(counts, 0) - counts, mask=ok)
        carry += tl.sum(counts, axis=0)
    tl.store(totals_ptr + e, carry)


@jit_any_count("num_routed")
def _route_scatter_kernel(
    ids_ptr,
    bases_ptr,
    totals_ptr,
    offsets_ptr,
    probs_ptr,
    src_rows_ptr,
    dst_rows_ptr,
    probs_out_ptr,
    num_routed,
    num_experts,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """One program: ``BLOCK_R`` routed rows to their padded rows: the expert's group start, plus its rows in
    the blocks before (``bases[pid, expert]``), plus the row's rank among the block's earlier rows of its
    expert -- the order a stable sort by expert gives. Every program derives the 128-aligned group starts
    from the experts' totals (E values); the first also stores their ends to ``offsets``."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_routed
    expert = _clamped_expert_ids(ids_ptr, rows, row_ok, num_experts)
    e = tl.arange(0, BLOCK_E)
    hits = expert[:, None] == e[None, :]
    rank = tl.sum(tl.where(hits, tl.cumsum(hits.to(tl.int32), 0), 0), axis=1) - 1
    padded = (tl.load(totals_ptr + e) + 127) // 128 * 128
    group_ends = tl.cumsum(padded, 0)
    tl.store(offsets_ptr + e, group_ends, mask=e < tl.where(pid == 0, num_experts, 0))
    base = group_ends - padded + tl.load(bases_ptr + pid * BLOCK_E + e)
    # A register gather: 2-30% less route_pad time than a select through the one-hot (H200, most at E >= 60).
    dst = tl.gather(base, tl.maximum(expert, 0), 0) + rank
    tl.store(dst_rows_ptr + rows, dst, mask=row_ok)
    tl.store(src_rows_ptr + dst, rows, mask=row_ok)
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(probs_out_ptr + dst, p, mask=row_ok)


def _empty_probs(expert_indices: torch.Tensor, probs: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """fp32 ``[num_rows]`` when probs are given, else an empty tensor (custom ops cannot return None)."""
    return torch.empty(num_rows if probs is not None else 0, dtype=torch.float32, device=expert_indices.device)


def launch_route_pad(
    expert_indices: torch.Tensor, num_experts: int, probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three Triton kernels, no sort (GPU, or CPU under ``TRITON_INTERPRET=1``); contract of
    :func:`route_pad_reference`: per-block expert counts, their scan down each expert's column (a program
    per 4 experts) into per-block bases and expert totals, then each block scatters its rows to group
    start + base + rank, the group starts derived from the totals (module docstring)."""
    n, device = expert_indices.numel(), expert_indices.device
    num_rows = padded_rows_bound(n, num_experts)
    block_e = next_pow2(num_experts)
    block_r = min(_ROUTE_MAX_ROWS, max(16, _ROUTE_TILE // block_e))
    num_blocks = max(1, cdiv(n, block_r))  # >= 1: the pad-row defaults are written by these programs
    ids = expert_indices.reshape(-1)
    counts = torch.empty((num_blocks, block_e), dtype=torch.int32, device=device)
    src_rows = torch.empty(num_rows, dtype=torch.int32, device=device)
    dst_rows = torch.empty(n, dtype=torch.int32, device=device)
    totals = torch.empty(block_e, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    probs_out = _empty_probs(expert_indices, probs, num_rows)
    flags = {"BLOCK_E": block_e, "HAS_PROBS": probs is not None}
    launch_kernel(
        _route_count_kernel,
        (num_blocks,),
        ids,
        counts,
        src_rows,
        probs_out,
        n,
        num_rows,
        num_experts,
        # a multiple of 16 for every count: Triton keeps it specialized (no recompile) and vectorizes the stores
        16 * cdiv(num_rows, 16 * num_blocks),
        BLOCK_R=block_r,
        FILL_BLOCK=_ROUTE_FILL_BLOCK,
        **flags,
        num_warps=4,
    )
    scan_e = min(block_e, _ROUTE_SCAN_LANES)
    launch_kernel(
        _route_scan_kernel,
        (block_e // scan_e,),
        counts,
        totals,
        num_blocks,
        SCAN_R=_ROUTE_SCAN_ROWS,
        SCAN_E=scan_e,
        BLOCK_E=block_e,
    )
    launch_kernel(
        _route_scatter_kernel,
        (num_blocks,),
        ids,
        counts,
        totals,
        offsets,
        probs.reshape(-1) if probs is not None else ids,  # unread when HAS_PROBS is False
        src_rows,
        dst_rows,
        probs_out,
        n,
        num_experts,
        BLOCK_R=block_r,
        **flags,
        num_warps=4,
    )
    return probs_out, src_rows, dst_rows, offsets


def route_pad_reference(
    expert_indices: torch.Tensor, num_experts: int, probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path): ``(permuted_probs, src_rows, dst_rows, group_end_offsets)``.

    ``permuted_probs`` is fp32 ``[M_pad]`` (0 on pad rows), or an empty tensor when ``probs`` is None; it
    comes first so that the outputs' sum in ``opcheck``'s autograd check starts from a float tensor.
    Out-of-range ids are clamped (below 0 -> expert 0, >= E -> the last), as in the kernel.
    """
    device, n = expert_indices.device, expert_indices.numel()
    # Clamped first, then a stable sort: each expert's rows in (token, slot) order, as the kernels place them.
    clamped = expert_indices.reshape(-1).clamp(0, num_experts - 1).to(torch.int32)
    sorted_ids, order = torch.sort(clamped, stable=True)
    experts = torch.arange(num_experts, dtype=torch.int32, device=device)
    # Sorted rows of experts <= e, by binary search (a histogram with a static size).
    count_ends = torch.searchsorted(sorted_ids, experts, right=True)
    counts = torch.diff(count_ends, prepend=count_ends.new_zeros(1))
    padded = (counts + (BLOCK - 1)) // BLOCK * BLOCK
    group_ends = torch.cumsum(padded, 0)
    # Sorted row i is row i - count_start[e] of its expert e, whose group starts at group_end[e] - padded[e].
    shift = (group_ends - padded) - (count_ends - counts)
    dst_sorted = torch.arange(n, device=device) + shift[sorted_ids.long()]
    dst_rows = torch.empty(n, dtype=torch.int32, device=device).scatter_(0, order, dst_sorted.to(torch.int32))
    num_rows = padded_rows_bound(n, num_experts)
    src_rows = torch.full((num_rows,), -1, dtype=torch.int32, device=device).scatter_(
        0, dst_sorted, order.to(torch.int32)
    )
    probs_out = _empty_probs(expert_indices, probs, 0)
    if probs is not None:
        probs_out = take_rows_or_zero(probs.reshape(-1).float(), src_rows, 1)
    return probs_out, src_rows, dst_rows, group_ends.to(torch.int32)


@define_op("route_pad")
def _route_pad_op(
    expert_indices: torch.Tensor, num_experts: int, probs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return route_pad_reference(expert_indices, num_experts, probs)


_route_pad_op.register_kernel("cuda")(launch_route_pad)


@_route_pad_op.register_fake
def _(expert_indices, num_experts, probs):
    n = expert_indices.numel()
    num_rows = padded_rows_bound(n, num_experts)
    new = functools.partial(expert_indices.new_empty, dtype=torch.int32)
    return _empty_probs(expert_indices, probs, num_rows), new(num_rows), new(n), new(num_experts)


def _route_setup_context(ctx, inputs, output) -> None:
    _, _, probs = inputs
    ctx.probs_dtype, ctx.probs_shape = (None, None) if probs is None else (probs.dtype, probs.shape)
    ctx.save_for_backward(output[2])


def _route_backward(ctx, grad_probs_out, grad_src, grad_dst, grad_offsets):
    """Each prob moved to exactly one padded row: its gradient is gathered back from there."""
    if ctx.probs_dtype is None:
        return None, None, None
    (dst_rows,) = ctx.saved_tensors
    return None, None, grad_probs_out.index_select(0, dst_rows).view(ctx.probs_shape).to(ctx.probs_dtype)


_route_pad_op.register_autograd(_route_backward, setup_context=_route_setup_context)


def route_pad(expert_indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row maps and 128-aligned group offsets for the router's top-k choice (on the device, no sync).

    Args:
        expert_indices: int32/int64 ``[T, k]``, the expert of (token t, slot j), in ``[0, num_experts)``.
            Checked on CPU tensors; on the GPU only when ``FP8FLOW_VALIDATE=1`` (it reads the device);
            otherwise an out-of-range id is clamped into the first or last expert (wrong routing, but never
            an out-of-bounds access).
        num_experts: E, the number of (local) experts.

    Returns:
        ``(src_rows, dst_rows, group_end_offsets)``, all int32 on ``expert_indices``' device:
        ``src_rows`` ``[M_pad]`` with ``M_pad = padded_rows_bound(T*k, E)``: the flattened ``t*k + j``
        that fills each padded row, ``-1`` on pad rows and past the last offset; ``dst_rows``
        ``[T*k]``: the padded row of ``t*k + j``; ``group_end_offsets`` ``[E]``: padded group ends,
        non-decreasing multiples of 128. Within an expert, rows are in ``t*k + j`` order.
    """
    _check_expert_indices(expert_indices, num_experts)
    _, src_rows, dst_rows, offsets = _route_pad_op(expert_indices, num_experts, None)
    return src_rows, dst_rows, offsets


def _check_expert_indices(expert_indices: torch.Tensor, num_experts: int) -> None:
    check_tensor("expert_indices", expert_indices, dtypes=_EXPERT_ID_DTYPES, ndim=2)
    check_positive_int("num_experts", num_experts)
    check_positive_int("top_k (expert_indices.shape[1])", expert_indices.shape[1])
    if validation_enabled(expert_indices):
        validate_index_range("expert_indices", expert_indices, 0, num_experts)


@triton.jit
def _row_block(rows_of, rows, ok, cols_):
    """Pointers and masks of a block of rows of ``rows_of = (data, scales, data row stride, scale row
    stride)``: ``[rows, offs]`` of the data and ``[rows, s_offs]`` of the scales (``cols_ = (offs, col_ok,
    s_offs, s_ok)``)."""
    ptr, scale_ptr, stride, scale_stride = rows_of
    offs, col_ok, s_offs, s_ok = cols_
    data = ptr + rows[:, None] * stride + offs[None, :]
    scale = scale_ptr + rows[:, None] * scale_stride + s_offs[None, :]
    return data, ok[:, None] & col_ok[None, :], scale, ok[:, None] & s_ok[None, :]


@jit_any_count("num_rows", "num_tokens")
def _permute_pad_rows_kernel(
    x_ptr,
    x_scale_ptr,
    src_rows_ptr,
    dst_rows_ptr,
    data_ptr,
    scale_ptr,
    tok_data_ptr,
    tok_scale_ptr,
    num_rows,
    num_tokens,
    cols,
    num_scale_cols,
    top_k,
    stride_xm,
    stride_sm,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCATTER: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    KEEP_TOKENS: tl.constexpr = False,
):
    """Gather: one program is ``BLOCK_M`` padded rows x ``BLOCK_D`` columns and their ``SCALE_COLS``
    scales; row ``r`` copies token ``src_rows[r] // top_k``, rows with ``src_rows[r] < 0`` are written 0
    and read nothing. Consecutive programs walk the columns of the same rows (one src_rows load, shared).

    ``SCATTER``: the first programs each read ``BLOCK_M`` tokens x ``BLOCK_D`` columns once and write
    them to their ``top_k`` rows ``dst_rows[t * top_k + j]``; the programs after them write 0 into the
    pad rows (``src_rows[r] < 0``) of ``PAD_ROWS``-row blocks. Same output; a token is read once, not
    ``top_k`` times.

    ``QUANTIZE`` (with ``SCATTER``; ``BLOCK_D`` a multiple of 128): ``x`` is high precision; the scatter
    programs quantize their tile to 1x128 E4M3 (the scale rule of ``quantize_1x128``) before writing it, and
    with ``KEEP_TOKENS`` also write the quantized tokens in token order (``tok_data``, ``tok_scale``).
    """
    pid = tl.program_id(0)
    num_col_blocks = tl.cdiv(cols, BLOCK_D)
    pid_d = pid % num_col_blocks
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = offs < cols
    s_offs = pid_d * SCALE_COLS + tl.arange(0, SCALE_COLS)
    s_ok = s_offs < num_scale_cols
    scatter_programs = tl.cdiv(num_tokens, BLOCK_M) * num_col_blocks if SCATTER else 0
    cols_ = (offs, col_ok, s_offs, s_ok)
    x = (x_ptr, x_scale_ptr, stride_xm, stride_sm)
    out = (data_ptr, scale_ptr, cols, num_scale_cols)
    if pid < scatter_programs:
        toks = ((pid // num_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        tokens_out = (tok_data_ptr, tok_scale_ptr, cols, num_scale_cols)
        _scatter_tokens(
            x, out, tokens_out, dst_rows_ptr, toks, num_tokens, top_k, cols_, HAS_SCALE, QUANTIZE, KEEP_TOKENS
        )
    else:
        block_rows: tl.constexpr = PAD_ROWS if SCATTER else BLOCK_M
        rows = (((pid - scatter_programs) // num_col_blocks) * block_rows + tl.arange(0, block_rows)).to(tl.int64)
        _fill_rows(x, out, src_rows_ptr, rows, num_rows, top_k, cols_, HAS_SCALE, SCATTER)


@triton.jit
def _scatter_tokens(
    x,
    out,
    tokens_out,
    dst_rows_ptr,
    toks,
    num_tokens,
    top_k,
    cols_,
    HAS_SCALE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    KEEP_TOKENS: tl.constexpr,
):
    """Read the tokens ``toks`` of ``x`` once (the column block ``cols_``) and write them to their ``top_k``
    rows of ``out``; ``QUANTIZE``: as one 1x128 E4M3 block per row (and to ``tokens_out``, ``KEEP_TOKENS``)."""
    tok_ok = toks < num_tokens
    src, m, src_s, m_s = _row_block(x, toks, tok_ok, cols_)
    # other=0: a ragged last scale block's missing columns must not enter its amax
    vals = tl.load(src, mask=m, other=0)
    if QUANTIZE:
        vals, s = _quantize_rows(vals)
        if KEEP_TOKENS:
            tok_data, _, tok_s, _ = _row_block(tokens_out, toks, tok_ok, cols_)
            tl.store(tok_data, vals, mask=m)
            tl.store(tok_s, s, mask=m_s)
    elif HAS_SCALE:
        s = tl.load(src_s, mask=m_s)
    for j in range(top_k):
        dst = tl.load(dst_rows_ptr + toks * top_k + j, mask=tok_ok, other=0).to(tl.int64)
        dst_data, _, dst_s, _ = _row_block(out, dst, tok_ok, cols_)
        tl.store(dst_data, vals, mask=m)
        if HAS_SCALE:
            tl.store(dst_s, s, mask=m_s)


@triton.jit
def _quantize_rows(x):
    """``[rows, n * 128]`` high-precision values -> (E4M3 of the same shape and fp32 scale_inv ``[rows, n]``, as
    the bits the row kernel moves: uint8, int32): one power-of-two scale per 1 x 128 block, ``quantize_1x128``'s
    rule."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    blocks = tl.reshape(x.to(tl.float32), [rows, cols // SCALE_BLOCK, SCALE_BLOCK])
    scale_inv, scale = pow2_scale_inv_and_scale(tl.max(nan_free_abs(blocks), axis=2))
    q = (blocks * scale[:, :, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.reshape(q, [rows, cols]), scale_inv.to(tl.int32, bitcast=True)


@triton.jit
def _fill_rows(x, out, src_rows_ptr, rows, num_rows, top_k, cols_, HAS_SCALE: tl.constexpr, SCATTER: tl.constexpr):
    """Padded rows ``rows`` of ``out`` (the column block ``cols_``): pad rows 0; real rows their tokens of
    ``x`` (gather), or left to the scatter programs (``SCATTER``)."""
    row_ok = rows < num_rows
    src = tl.load(src_rows_ptr + rows, mask=row_ok, other=-1)
    real = src >= 0
    dst_data, m, dst_s, m_s = _row_block(out, rows, row_ok, cols_)
    if SCATTER:
        pad = ~real[:, None]
        tl.store(dst_data, tl.zeros(dst_data.shape, dst_data.dtype.element_ty), mask=m & pad)
        if HAS_SCALE:
            tl.store(dst_s, tl.zeros(dst_s.shape, dst_s.dtype.element_ty), mask=m_s & pad)
    else:
        tok = (tl.where(real, src, 0) // top_k).to(tl.int64)
        src_data, m_in, src_s, m_in_s = _row_block(x, tok, real, cols_)
        tl.store(dst_data, tl.load(src_data, mask=m_in, other=0), mask=m)
        if HAS_SCALE:
            tl.store(dst_s, tl.load(src_s, mask=m_in_s, other=0), mask=m_s)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _empty_scale(x: torch.Tensor, x_scale: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """``[num_rows, ceil(D/128)]`` fp32 for FP8 input, else an empty tensor (custom ops cannot return None)."""
    shape = (num_rows, x_scale.shape[1]) if x_scale is not None else (0,)
    return torch.empty(shape, dtype=torch.float32, device=x.device)


def _empty_rows(x: torch.Tensor, x_scale: torch.Tensor | None, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather's outputs: ``[num_rows, D]`` in ``x``'s dtype and :func:`_empty_scale`."""
    return x.new_empty((num_rows, x.shape[1])), _empty_scale(x, x_scale, num_rows)


def _empty_quantized(x: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 ``[num_rows, D]`` and its fp32 ``[num_rows, ceil(D/128)]`` scales, for high-precision ``x``."""
    return x.new_empty((num_rows, x.shape[1]), dtype=FP8_DTYPE), x.new_empty(
        (num_rows, -(-x.shape[1] // BLOCK)), dtype=torch.float32
    )


def scatter_pays(row_bytes: int, top_k: int) -> bool:
    """Whether the row kernel scatters (reads each token once, writes its ``top_k`` rows) rather than gathers
    (each padded row reads its token), given ``dst_rows``: with ``top_k > 1`` and rows of at least
    :data:`SCATTER_MIN_ROW_BYTES`.

    Measured on an H200 (device time, top-8, ``benchmarks/results/memory_bound_notes.md``): FP8 rows of 7168
    bytes 14-26% faster scattered (T*k = 32768-131072, the source just written by the quantizer as in the
    layer, or read cold); rows of 2048 bytes 10% slower at T*k = 32768 and equal at 65536 (the pad-row
    programs and the scattered 2 KiB writes cost what the saved reads bring). At ``top_k = 1`` both read
    each row once."""
    return top_k > 1 and row_bytes >= SCATTER_MIN_ROW_BYTES


def launch_permute_pad_rows(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    src_rows: torch.Tensor,
    top_k: int,
    dst_rows: torch.Tensor | None = None,
    *,
    scatter: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`permute_pad_rows`,
    but returns an empty scale tensor instead of ``None``. Given ``dst_rows``, it scatters where that pays
    (:func:`scatter_pays`) and gathers otherwise; ``scatter`` pins the form (tests, benchmarks; ``True``
    needs ``dst_rows``)."""
    if scatter is None:
        scatter = dst_rows is not None and scatter_pays(x.shape[1] * x.element_size(), top_k)
    elif scatter and dst_rows is None:
        raise ValueError("scatter=True needs dst_rows")
    data, scale = _empty_rows(x, x_scale, src_rows.shape[0])
    _launch_rows(x, x_scale, src_rows, top_k, dst_rows if scatter else None, (data, scale), None)
    return data, scale


def launch_quantize_permute_pad_rows(
    x: torch.Tensor, src_rows: torch.Tensor, top_k: int, dst_rows: torch.Tensor, keep_token_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``) of :func:`permute_pad_rows` with
    ``quantize=True``: the scatter form, quantizing as it reads; returns ``(data, scale_inv, token_data,
    token_scale_inv)``, the last two empty unless ``keep_token_rows``."""
    num_tokens = x.shape[0] if keep_token_rows else 0
    out = _empty_quantized(x, src_rows.shape[0])
    tokens = _empty_quantized(x, num_tokens)
    _launch_rows(x, None, src_rows, top_k, dst_rows, out, tokens if keep_token_rows else None)
    return (*out, *tokens)


def _launch_rows(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    src_rows: torch.Tensor,
    top_k: int,
    dst_rows: torch.Tensor | None,
    out: tuple[torch.Tensor, torch.Tensor],
    tokens: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Launch the row kernel into ``out`` (data, scales): scattering when ``dst_rows`` is given, else
    gathering; quantizing high-precision ``x`` where ``out`` is FP8 (scatter only), then also into
    ``tokens`` when given."""
    (num_rows, cols), (data, scale) = out[0].shape, out
    if num_rows == 0 or cols == 0:
        return
    quantize = x.dtype != data.dtype
    has_scale = x_scale is not None or quantize
    scatter = dst_rows is not None
    # A column tile holds whole 128-column scale blocks, so each program moves (or makes) its rows' scales too.
    block_d = col_block(cols, _MAX_COL_BYTES // data.element_size(), BLOCK if has_scale else 16)
    block_d = max(block_d, BLOCK) if has_scale else block_d
    block_m = max(1, _TILE_BYTES // (block_d * data.element_size()))
    col_blocks = cdiv(cols, block_d)
    programs = cdiv(num_rows, _PAD_ROWS if scatter else block_m) * col_blocks
    if scatter:
        programs += cdiv(x.shape[0], block_m) * col_blocks
    tok_data, tok_scale = tokens if tokens is not None else out  # unread without KEEP_TOKENS
    launch_kernel(
        _permute_pad_rows_kernel,
        (programs,),
        x if quantize else _bits(x),
        _bits(x_scale) if x_scale is not None else src_rows,  # unread without an input scale
        src_rows,
        dst_rows if scatter else src_rows,  # unread without SCATTER
        _bits(data),
        _bits(scale),
        _bits(tok_data),
        _bits(tok_scale),
        num_rows,
        x.shape[0],
        cols,
        scale.shape[1] if has_scale else 0,
        top_k,
        x.stride(0),
        x_scale.stride(0) if x_scale is not None else 0,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        SCALE_COLS=block_d // BLOCK if has_scale else 1,
        HAS_SCALE=has_scale,
        SCATTER=scatter,
        PAD_ROWS=_PAD_ROWS,
        QUANTIZE=quantize,
        KEEP_TOKENS=tokens is not None,
        num_warps=4,
    )


def permute_pad_rows_reference(
    x: torch.Tensor, x_scale: torch.Tensor | None, src_rows: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path); an empty scale tensor when ``x_scale`` is None."""
    data = take_rows_or_zero(_bits(x), src_rows, top_k).view(x.dtype)
    if x_scale is None:
        return data, _empty_scale(x, None, 0)
    return data, take_rows_or_zero(_bits(x_scale), src_rows, top_k).view(torch.float32)


def _permute_pad_rows_fake(x, x_scale, src_rows, top_k, dst_rows=None):
    return _empty_rows(x, x_scale, src_rows.shape[0])


def quantize_permute_pad_rows_reference(
    x: torch.Tensor, src_rows: torch.Tensor, top_k: int, dst_rows: torch.Tensor, keep_token_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path) of :func:`launch_quantize_permute_pad_rows`: the tokens
    quantized 1x128 (as ``quantize_1x128``), then gathered as :func:`permute_pad_rows_reference` does;
    ``dst_rows`` names the same rows, so it is not read."""
    tok_data, tok_scale = quantize_rows_reference(x, BLOCK)
    data, scale = permute_pad_rows_reference(tok_data, tok_scale, src_rows, top_k)
    if not keep_token_rows:
        tok_data, tok_scale = _empty_quantized(x, 0)
    return data, scale, tok_data, tok_scale


@define_op("quantize_permute_pad_rows")
def _quantize_permute_pad_rows_op(
    x: torch.Tensor, src_rows: torch.Tensor, top_k: int, dst_rows: torch.Tensor, keep_token_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_permute_pad_rows_reference(x, src_rows, top_k, dst_rows, keep_token_rows)


_quantize_permute_pad_rows_op.register_kernel("cuda")(launch_quantize_permute_pad_rows)


@_quantize_permute_pad_rows_op.register_fake
def _(x, src_rows, top_k, dst_rows, keep_token_rows):
    return (*_empty_quantized(x, src_rows.shape[0]), *_empty_quantized(x, x.shape[0] if keep_token_rows else 0))


def _dst_rows_from_src_rows(src_rows: torch.Tensor, num_src: int) -> torch.Tensor:
    """Invert the row map: ``dst_rows[src_rows[r]] = r`` (a scatter, no sync; every pad row writes a
    spare last slot that is dropped)."""
    index = torch.where(src_rows >= 0, src_rows, num_src).long()
    rows = torch.arange(src_rows.numel(), dtype=torch.int32, device=src_rows.device)
    return torch.empty(num_src + 1, dtype=torch.int32, device=src_rows.device).scatter_(0, index, rows)[:num_src]


def _setup_context(ctx, inputs, output) -> None:
    x, _, src_rows, top_k = inputs[:4]
    ctx.top_k, ctx.num_src, ctx.is_fp8 = top_k, x.shape[0] * top_k, x.dtype == FP8_DTYPE
    ctx.save_for_backward(src_rows)


def _backward(ctx, grad_data: torch.Tensor, grad_scale: torch.Tensor):
    if ctx.is_fp8:  # FP8 data is not differentiated here: the FP8-Flow layer owns its FP8 backward
        return None, None, None, None, None
    (src_rows,) = ctx.saved_tensors
    dst_rows = _dst_rows_from_src_rows(src_rows, ctx.num_src)
    # grad_x[t] = sum_j grad_data[dst_rows[t*k + j]]: unpermute_unpad without probs (itself differentiable,
    # for a backward with create_graph).
    grad_x = _unpermute_unpad_op(grad_data.contiguous(), dst_rows, ctx.top_k, None)
    return grad_x, None, None, None, None


def _rows_reference(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    src_rows: torch.Tensor,
    top_k: int,
    dst_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`permute_pad_rows_reference` with the ops' signature: ``dst_rows`` (the inverse map) names the
    same rows, so the reference gathers by ``src_rows`` alone."""
    return permute_pad_rows_reference(x, x_scale, src_rows, top_k)


def _register_permute_pad_rows(name: str):
    """The gather as the custom op ``fp8flow::<name>``: reference on the CPU, Triton on CUDA, fake, gradient."""
    op = define_op(name)(_rows_reference)
    op.register_kernel("cuda")(launch_permute_pad_rows)
    op.register_fake(_permute_pad_rows_fake)
    op.register_autograd(_backward, setup_context=_setup_context)
    return op


# The same gather twice, under two names: backward gathers again rows that forward gathered (the FP8-Flow
# layer keeps x8 [T, D], not the permuted rows [~k*T, D]), and under torch.compile AOT autograd's
# common-subexpression elimination merges two calls of one op on the same inputs, so the compiled graph
# would save the permuted rows (k times the bytes, padding included) for backward. A call of the second
# op is a different expression. (A view of the inputs does not do it: inductor removes no-op views
# before the partitioner runs the elimination.)
_permute_pad_rows_op, _permute_pad_rows_recompute_op = map(
    _register_permute_pad_rows, ("permute_pad_rows", "permute_pad_rows_recompute")
)


def _check_rows_input(x: torch.Tensor, x_scale: torch.Tensor | None, quantize: bool = False) -> None:
    check_tensor("x", x, dtypes=_INPUT_DTYPES, ndim=2)
    check_row_major("x", x)
    check_bool("quantize", quantize)
    if quantize:
        if x.dtype == FP8_DTYPE or x_scale is not None:
            raise ValueError(f"quantize=True takes bf16/fp16/fp32 x without x_scale, got {x.dtype} x")
        check_no_grad("permute_pad_rows(quantize=True)", x)
        return
    if x.dtype == FP8_DTYPE:
        if x_scale is None:
            raise ValueError("x_scale is required for E4M3 x (COMPACT [T, ceil(D/128)] fp32 scale_inv)")
        check_tensor("x_scale", x_scale, dtypes=torch.float32, ndim=2)
        check_shape("x_scale", x_scale, (x.shape[0], -(-x.shape[1] // BLOCK)))
        check_row_major("x_scale", x_scale)
    elif x_scale is not None:
        raise ValueError(f"x_scale must be None for {x.dtype} x (only E4M3 x carries scales)")


def _check_dst_rows(dst_rows: torch.Tensor, src_rows: torch.Tensor, routed: int) -> None:
    """``dst_rows``: an int32 map of the ``routed`` rows into ``src_rows``' padded rows, its inverse."""
    check_row_map("dst_rows", dst_rows, 0, src_rows.shape[0])
    check_shape("dst_rows", dst_rows, (routed,))
    check_same_device(src_rows=src_rows, dst_rows=dst_rows)
    if routed and validation_enabled(dst_rows):
        back = src_rows.index_select(0, dst_rows.long())
        inverse = torch.equal(back, torch.arange(routed, dtype=back.dtype, device=back.device))
        if not inverse or int((src_rows >= 0).sum()) != routed:
            raise ValueError("dst_rows must be the inverse of src_rows (src_rows[dst_rows[i]] == i for every i)")


def permute_pad_rows(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    src_rows: torch.Tensor,
    top_k: int,
    recompute: bool = False,
    dst_rows: torch.Tensor | None = None,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather token rows into padded expert-major order: row ``r`` = ``x[src_rows[r] // top_k]``.

    Args:
        x: ``[T, D]`` E4M3 (FP8 activations or output gradients) or bf16/fp16/fp32, row-major.
        x_scale: for E4M3 ``x``, its COMPACT fp32 ``scale_inv`` ``[T, ceil(D/128)]``, row-major;
            ``None`` otherwise.
        src_rows: int32 ``[M_pad]`` contiguous, flattened ``t * top_k + j`` per padded row, ``-1`` on
            pad rows (from :func:`route_pad`).
        top_k: experts per token.
        recompute: ``True`` in a backward that gathers again what its forward gathered: the same
            result from a distinct op (``fp8flow::permute_pad_rows_recompute``), so torch.compile
            cannot merge the two gathers and save the gathered rows instead of ``x``.
        dst_rows: optional int32 ``[T * top_k]`` contiguous inverse of ``src_rows`` (``src_rows[dst_rows[i]]
            == i``; :func:`route_pad`'s). Given, the CUDA kernel may read each token once and write its
            ``top_k`` rows instead of reading it once per row (same result; where :func:`scatter_pays`).
            Its values and the inverse relation are checked on CPU tensors, on the GPU only with
            ``FP8FLOW_VALIDATE=1``.
        quantize: ``True``: quantize high-precision ``x`` (``x_scale`` None) to 1x128 E4M3 on the way, in
            the kernel that moves it (``fp8flow::quantize_permute_pad_rows``; needs ``dst_rows``): the rows
            of ``quantize_1x128(x)`` gathered, bit for bit, in one pass that reads each token once and
            writes no token-order FP8 copy. Not differentiable (``x`` must not require grad).

    Returns:
        ``(data, scale_inv)``: ``data`` ``[M_pad, D]`` in ``x``'s dtype (E4M3 with ``quantize``),
        ``scale_inv`` fp32 ``[M_pad, ceil(D/128)]`` (``None`` for non-FP8 output); both contiguous, 0 on
        pad rows. Differentiable in floating-point ``x`` without ``quantize`` (backward:
        :func:`unpermute_unpad` without probs).
    """
    _check_rows_input(x, x_scale, quantize)
    check_positive_int("top_k", top_k)
    check_row_map("src_rows", src_rows, -1, x.shape[0] * top_k)
    check_same_device(x=x, x_scale=x_scale, src_rows=src_rows)
    check_bool("recompute", recompute)
    if quantize and dst_rows is None:
        raise ValueError("quantize=True needs dst_rows (route_pad's inverse row map)")
    if quantize and recompute:
        raise ValueError("recompute=True gathers rows a forward gathered; it does not combine with quantize=True")
    if dst_rows is not None:
        _check_dst_rows(dst_rows, src_rows, x.shape[0] * top_k)
    if quantize:
        data, scale, _, _ = torch.ops.fp8flow.quantize_permute_pad_rows(x, src_rows, top_k, dst_rows, False)
        return data, scale
    op = _permute_pad_rows_recompute_op if recompute else _permute_pad_rows_op
    data, scale = op(x, x_scale, src_rows, top_k, dst_rows)
    return data, (scale if x_scale is not None else None)


class PermutePadResult(NamedTuple):
    """Output of :func:`permute_pad` (all on the input's device)."""

    data: torch.Tensor
    """``[M_pad, D]`` rows in padded expert-major order, ``x``'s dtype; pad rows 0."""
    scale_inv: torch.Tensor | None
    """fp32 ``[M_pad, ceil(D/128)]`` COMPACT scales of ``data`` (pad rows 0), or ``None`` for non-FP8 ``x``."""
    probs: torch.Tensor | None
    """fp32 ``[M_pad]`` router probs of each padded row (pad rows 0), or ``None``."""
    src_rows: torch.Tensor
    """int32 ``[M_pad]``: flattened ``t * k + j`` of each padded row, ``-1`` on pad rows."""
    dst_rows: torch.Tensor
    """int32 ``[T * k]``: padded row of (token t, slot j) at ``t * k + j``."""
    group_end_offsets: torch.Tensor
    """int32 ``[E]``: padded group ends, multiples of 128 (every group starts on a 128-row boundary)."""
    token_data: torch.Tensor | None = None
    """``quantize=True``: E4M3 ``[T, D]``, the tokens quantized 1x128 in token order (``quantize_1x128(x)``'s
    data); else ``None``."""
    token_scale_inv: torch.Tensor | None = None
    """``quantize=True``: fp32 ``[T, ceil(D/128)]`` COMPACT scales of ``token_data``; else ``None``."""


def _permute_pad(x, x_scale, expert_indices, probs, num_experts, quantize, reference) -> PermutePadResult:
    """route_pad, then the row kernel (quantizing with ``quantize``): the ops, or their references."""
    route = route_pad_reference if reference else _route_pad_op
    permuted_probs, src_rows, dst_rows, offsets = route(expert_indices, num_experts, probs)
    top_k, tokens = expert_indices.shape[1], ()
    if quantize:
        rows = quantize_permute_pad_rows_reference if reference else torch.ops.fp8flow.quantize_permute_pad_rows
        data, scale, *tokens = rows(x, src_rows, top_k, dst_rows, True)
    else:
        data, scale = (_rows_reference if reference else _permute_pad_rows_op)(x, x_scale, src_rows, top_k, dst_rows)
        scale = scale if x_scale is not None else None
    return PermutePadResult(
        data, scale, permuted_probs if probs is not None else None, src_rows, dst_rows, offsets, *tokens
    )


def permute_pad_reference(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    num_experts: int,
    quantize: bool = False,
) -> PermutePadResult:
    """Torch reference of :func:`permute_pad` (no checks; the torch gather instead of the kernel)."""
    return _permute_pad(x, x_scale, expert_indices, probs, num_experts, quantize, reference=True)


def permute_pad(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    num_experts: int,
    quantize: bool = False,
) -> PermutePadResult:
    """Permute token rows into 128-aligned expert groups (route + one fused gather kernel, no sync).

    Args:
        x: ``[T, D]`` E4M3 or bf16/fp16/fp32 token rows, row-major.
        x_scale: COMPACT fp32 ``scale_inv`` ``[T, ceil(D/128)]`` for E4M3 ``x``, else ``None``.
        expert_indices: int32/int64 ``[T, k]`` router top-k expert ids in ``[0, num_experts)``
            (a token may name one expert twice: two rows).
        probs: optional ``[T, k]`` fp32/bf16 router probs, permuted alongside.
        num_experts: E.
        quantize: ``True``: quantize high-precision ``x`` (``x_scale`` None) to 1x128 E4M3 in the kernel
            that permutes it (:func:`permute_pad_rows`' ``quantize``): ``data``/``scale_inv`` are the
            permuted rows of ``quantize_1x128(x)``, bit for bit, and ``token_data``/``token_scale_inv``
            that quantization itself in token order, from the same pass (each token read once). ``x``
            must not require grad.

    Returns:
        :class:`PermutePadResult` ``(data, scale_inv, probs, src_rows, dst_rows, group_end_offsets,
        token_data, token_scale_inv)`` with ``M_pad = padded_rows_bound(T*k, E)`` rows; see its fields.
        Differentiable in ``probs``, and in floating-point ``x`` without ``quantize``.
    """
    _check_rows_input(x, x_scale, quantize)
    _check_expert_indices(expert_indices, num_experts)
    if expert_indices.shape[0] != x.shape[0]:
        raise ValueError(f"expert_indices must have x's {x.shape[0]} rows, got shape {tuple(expert_indices.shape)}")
    if probs is not None:
        check_tensor("probs", probs, dtypes=_PROBS_DTYPES, ndim=2)
        check_shape("probs", probs, tuple(expert_indices.shape))
    check_same_device(x=x, x_scale=x_scale, expert_indices=expert_indices, probs=probs)
    return _permute_pad(x, x_scale, expert_indices, probs, num_experts, quantize, reference=False)
