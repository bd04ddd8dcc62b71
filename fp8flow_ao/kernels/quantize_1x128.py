"""quantize_1x128: BF16/FP16/FP32 ``[M, K]`` -> E4M3 ``[M, K]`` + power-of-two ``scale_inv``.

One fused pass per 1 x ``block`` block: amax, power-of-two scale, round-to-nearest-even cast.
``block=None`` makes the block span the whole row: the per-row scale + cast that row-wise FP8
GEMMs (``torch._scaled_grouped_mm``) need, from the same kernel.

Layouts: ``x`` row-major (last dim contiguous; the row stride is free). ``data`` contiguous
``[M, K]``. ``scale_inv`` contiguous fp32 ``[M, ceil(K / block)]`` (COMPACT; ``[M, 1]`` for
``block=None``), the dequantize multiplier: ``x ~= data * scale_inv``.

``src_rows`` (int32 ``[M_out]``) gathers as it quantizes: output row ``r`` quantizes ``x[src_rows[r]]``,
and rows with ``src_rows[r] < 0`` are pad rows, written as data 0 and scale 0 (the FP8-Flow format's pad
rows): :func:`~fp8flow_ao.kernels.permute_pad.permute_pad_rows` of the quantized ``x`` bit for bit, in
one pass that reads each row once and writes no high-precision copy (``fp8_grouped_mm`` pads its groups
so, from :func:`~fp8flow_ao.kernels.pad_group_offsets.pad_group_offsets`' maps).

``transpose=True`` (op ``fp8flow::quantize_1x128_transpose``) also writes the column-wise copy that a weight
gradient reads, from the same kernel: :func:`~fp8flow_ao.kernels.scaling_aware_transpose.scaling_aware_transpose`
of the rows it quantizes, bit for bit (each 128 x 128 tile re-encoded to its rows' largest scale by exponent
shifts, no second rounding), without writing the rows and reading them back in backward. ``fp8_grouped_mm``'s
forward makes ``A``'s copy so where the weight needs a gradient, and keeps only the copy for backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8flow_ao._checks import (
    check_bool,
    check_group_end_offsets,
    check_multiple,
    check_no_grad,
    check_row_major,
    check_row_map,
    check_same_device,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, empty_row_and_column_wise, quantize_rows_reference
from fp8flow_ao.kernels._launch import cdiv, launch_kernel, next_pow2
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._triton_common import (
    gathered_rows,
    jit_any_count,
    last_group_end,
    nan_free_abs,
    pow2_scale_inv_and_scale,
    reencode_tile_transposed,
    store_rowwise,
)
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose_reference
from fp8flow_ao.kernels.unpermute_unpad import take_rows_or_zero

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 64 rows x 128 cols of bf16 is 16 KiB per program: enough bytes in flight per SM for a
# memory-bound pass without spilling; 4 warps give each thread 16-byte vector loads.
_ROWS_PER_PROGRAM_1x128 = 64
# A whole-row block keeps the full row in registers; cap elements per program near 8K.
_MAX_ELEMS_PER_PROGRAM = 8192
# With the transposed copy a program owns one 128 x 128 tile (the copy's scale block), as four 32-row slices;
# 8 warps, as swiglu_quant's transposing forward (the same tile work).
_TRANSPOSE_NUM_WARPS = 8
_TL_BLOCK = tl.constexpr(BLOCK)


@jit_any_count("M")
def _quantize_1x128_kernel(
    x_ptr,
    src_rows_ptr,
    data_ptr,
    scale_inv_ptr,
    M,
    K,
    block,
    stride_xm,
    num_scale_cols,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program: ``BLOCK_M`` output rows x one scale block (``block`` real columns, padded to
    ``BLOCK_K``); ``GATHER``: output row ``r`` reads ``x[src_rows[r]]``, nothing where that is negative."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK_K)
    cols = pid_k * block + offs
    row_ok = rows < M
    col_ok = ((offs < block) & (cols < K))[None, :]
    rows64 = rows.to(tl.int64)
    read_ok, src64 = gathered_rows(src_rows_ptr, rows, row_ok, GATHER)
    x = tl.load(x_ptr + src64[:, None] * stride_xm + cols[None, :], mask=read_ok[:, None] & col_ok, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(nan_free_abs(x), axis=1)
    scale_inv, scale = pow2_scale_inv_and_scale(amax)
    q = (x * scale[:, None]).to(tl.float8e4nv)
    tl.store(data_ptr + rows64[:, None] * K + cols[None, :], q, mask=row_ok[:, None] & col_ok)
    tl.store(scale_inv_ptr + rows64 * num_scale_cols + pid_k, tl.where(read_ok, scale_inv, 0.0), mask=row_ok)


@triton.jit
def _quantize_row_slice(
    x_ptr, src_rows_ptr, rows, M, K, cols, pid_k, stride_xm, data_ptr, scale_inv_ptr, GATHER: tl.constexpr
):
    """Rows ``rows`` of column block ``pid_k`` (columns ``cols``) quantized 1 x 128 and stored (gathered
    through ``src_rows`` with ``GATHER``; pad rows data 0, scale 0); returns what was stored."""
    read_ok, src64 = gathered_rows(src_rows_ptr, rows, rows < M, GATHER)
    x = tl.load(x_ptr + src64[:, None] * stride_xm + cols[None, :], mask=read_ok[:, None], other=0.0)
    cols64 = cols.to(tl.int64)
    return store_rowwise(x.to(tl.float32), rows, read_ok, data_ptr, scale_inv_ptr, cols64, K, K // _TL_BLOCK, pid_k)


@triton.jit
def _row_slice_for_transpose(q, s, rows, end):
    """A stored row slice as the transposed copy sees it: rows at or past the last group ``end`` are pad
    rows there (data 0 -- NaN too --, scale 0), as :func:`scaling_aware_transpose` treats them. The data
    comes back in fp16 (exact for E4M3; the re-encode multiplies in fp16 anyway): a select on the E4M3 tile
    itself, ``tl.where(valid, q, 0)``, gave wrong bytes in a quarter of the copy when compiled by triton 3.6
    for sm_90a (H200, 2026-11-29), though right in the interpreter."""
    valid = rows < end
    return tl.where(valid[:, None], q.to(tl.float16), 0.0), tl.where(valid, s, 0.0)


@triton.jit
def _quantize_1x128_transpose_kernel(
    x_ptr,
    src_rows_ptr,
    offsets_ptr,
    data_ptr,
    scale_inv_ptr,
    data_t_ptr,
    scale_inv_t_ptr,
    M,
    K,
    stride_xm,
    num_groups,
    GATHER: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
):
    """One program: the 128 x 128 tile (row block ``pid_m``, column block ``pid_k``) held as four 32-row
    slices (slice ``b``: rows ``4q + b``), each quantized 1 x 128 and stored row-wise, then the tile of those
    E4M3 rows re-encoded to one scale and stored transposed (``data_t [K, M]``, ``scale_inv_t [M/128, K]``)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m * _TL_BLOCK
    cols = pid_k * _TL_BLOCK + tl.arange(0, _TL_BLOCK)
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    rows = row0 + 4 * tl.arange(0, _TL_BLOCK // 4)
    args = (M, K, cols, pid_k, stride_xm, data_ptr, scale_inv_ptr, GATHER)
    q0, s0 = _row_slice_for_transpose(*_quantize_row_slice(x_ptr, src_rows_ptr, rows, *args), rows, end)
    q1, s1 = _row_slice_for_transpose(*_quantize_row_slice(x_ptr, src_rows_ptr, rows + 1, *args), rows + 1, end)
    q2, s2 = _row_slice_for_transpose(*_quantize_row_slice(x_ptr, src_rows_ptr, rows + 2, *args), rows + 2, end)
    q3, s3 = _row_slice_for_transpose(*_quantize_row_slice(x_ptr, src_rows_ptr, rows + 3, *args), rows + 3, end)
    y_t, s_max = reencode_tile_transposed(q0, q1, q2, q3, s0, s1, s2, s3)
    tokens = row0 + tl.arange(0, _TL_BLOCK)
    cols64 = cols.to(tl.int64)
    tl.store(data_t_ptr + cols64[:, None] * M + tokens[None, :], y_t)
    tl.store(scale_inv_t_ptr + pid_m.to(tl.int64) * K + cols64, tl.zeros([_TL_BLOCK], tl.float32) + s_max)


def _block_width(k: int, block_k: int | None) -> int:
    return max(k, 1) if block_k is None else block_k


def launch_quantize_1x128(
    x: torch.Tensor, block_k: int | None = BLOCK, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`quantize_1x128`."""
    m, k = _output_shape(x, src_rows)
    block = _block_width(k, block_k)
    nb = cdiv(k, block)
    data = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale_inv = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return data, scale_inv
    block_pow2 = next_pow2(block)
    block_m = min(_ROWS_PER_PROGRAM_1x128, max(1, _MAX_ELEMS_PER_PROGRAM // block_pow2))
    grid = (cdiv(m, block_m), nb)
    launch_kernel(
        _quantize_1x128_kernel,
        grid,
        x,
        x if src_rows is None else src_rows,  # unread without GATHER
        data,
        scale_inv,
        m,
        k,
        block,
        x.stride(0),
        nb,
        GATHER=src_rows is not None,
        BLOCK_M=block_m,
        BLOCK_K=block_pow2,
        num_warps=4 if block_pow2 * block_m <= 8192 else 8,
    )
    return data, scale_inv


def launch_quantize_1x128_transpose(
    x: torch.Tensor, src_rows: torch.Tensor | None = None, group_end_offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of ``fp8flow::quantize_1x128_transpose`` (GPU, or CPU under ``TRITON_INTERPRET=1``):
    :func:`quantize_1x128` with ``transpose=True``, the same contract."""
    m, k = _output_shape(x, src_rows)
    out = empty_row_and_column_wise(x, m, k)
    if m == 0 or k == 0:
        return out
    launch_kernel(
        _quantize_1x128_transpose_kernel,
        (m // BLOCK, k // BLOCK),
        x,
        x if src_rows is None else src_rows,  # unread without GATHER
        x if group_end_offsets is None else group_end_offsets,  # unread without HAS_OFFSETS
        *out,
        m,
        k,
        x.stride(0),
        0 if group_end_offsets is None else group_end_offsets.numel(),
        GATHER=src_rows is not None,
        HAS_OFFSETS=group_end_offsets is not None,
        num_warps=_TRANSPOSE_NUM_WARPS,
    )
    return out


def _output_shape(x: torch.Tensor, src_rows: torch.Tensor | None) -> tuple[int, int]:
    return (x.shape[0] if src_rows is None else src_rows.shape[0]), x.shape[1]


def quantize_1x128_reference(
    x: torch.Tensor, block_k: int | None = BLOCK, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path): the gathered rows (zeros on pad rows) quantized,
    the pad rows' scales then set to 0."""
    block = _block_width(x.shape[-1], block_k)
    if src_rows is None:
        return quantize_rows_reference(x, block)
    data, scale_inv = quantize_rows_reference(take_rows_or_zero(x, src_rows, 1), block)
    return data, torch.where((src_rows >= 0)[:, None], scale_inv, 0.0)


def quantize_1x128_transpose_reference(
    x: torch.Tensor, src_rows: torch.Tensor | None = None, group_end_offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the transposing form: the 1 x 128 rows, then their scaling-aware transpose."""
    data, scale_inv = quantize_1x128_reference(x, BLOCK, src_rows)
    return data, scale_inv, *scaling_aware_transpose_reference(data, scale_inv, group_end_offsets)


@define_op("quantize_1x128")
def _quantize_1x128_op(
    x: torch.Tensor, block_k: int | None, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_1x128_reference(x, block_k, src_rows)


_quantize_1x128_op.register_kernel("cuda")(launch_quantize_1x128)


@_quantize_1x128_op.register_fake
def _(x: torch.Tensor, block_k: int | None, src_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = _output_shape(x, src_rows)
    nb = -(-k // _block_width(k, block_k))
    return x.new_empty((m, k), dtype=FP8_DTYPE), x.new_empty((m, nb), dtype=torch.float32)


@define_op("quantize_1x128_transpose")
def _quantize_1x128_transpose_op(
    x: torch.Tensor, src_rows: torch.Tensor | None = None, group_end_offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_1x128_transpose_reference(x, src_rows, group_end_offsets)


_quantize_1x128_transpose_op.register_kernel("cuda")(launch_quantize_1x128_transpose)


@_quantize_1x128_transpose_op.register_fake
def _(
    x: torch.Tensor, src_rows: torch.Tensor | None = None, group_end_offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return empty_row_and_column_wise(x, *_output_shape(x, src_rows))


def quantize_1x128(
    x: torch.Tensor,
    block_k: int | None = BLOCK,
    src_rows: torch.Tensor | None = None,
    *,
    transpose: bool = False,
    group_end_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Quantize ``x`` to E4M3 with one power-of-two scale per 1 x ``block_k`` block.

    Args:
        x: ``[M, K]`` bf16, fp16 or fp32, row-major (last dim contiguous). ``K`` need not be a
            multiple of ``block_k``: the last block of a row is ragged.
        block_k: block width along K (128 for FP8-Flow activations), or ``None`` for one scale per
            row (the row-wise recipe's scale + cast).
        src_rows: optional int32 ``[M_out]`` contiguous row map on ``x``'s device: output row ``r`` is the
            quantized ``x[src_rows[r]]``, or a pad row (data 0, scale 0) where ``src_rows[r] < 0``. Values
            below ``M`` (checked on CPU tensors; on the GPU only with ``FP8FLOW_VALIDATE=1``: it reads the device).
        transpose: also return the column-wise copy of the output rows that a weight gradient reads
            (tokens contiguous): :func:`~fp8flow_ao.kernels.scaling_aware_transpose.scaling_aware_transpose`
            of ``(data, scale_inv, group_end_offsets)`` bit for bit, from the same kernel. Needs
            ``block_k=128`` and ``K`` and the output rows (``M``, or ``M_out``) multiples of 128.
        group_end_offsets: with ``transpose`` only: optional int32 ``[E]`` group END offsets on ``x``'s
            device; output rows at or past the last one are pad rows of the copy (data 0, scale 0).

    Returns:
        ``(data, scale_inv)``: ``data`` E4M3 ``[M, K]`` contiguous (``[M_out, K]`` with ``src_rows``);
        ``scale_inv`` fp32 ``[M, ceil(K / block_k)]`` contiguous (``[M, 1]`` for ``block_k=None``), the
        dequantize multiplier (``x ~= data * scale_inv``), a power of two (0 on pad rows). With ``transpose``
        also ``(data_t, scale_inv_t)``: E4M3 ``[K, M]`` contiguous and fp32 ``[M / 128, K]`` contiguous (every
        column of a 128 x 128 tile carries the tile's scale), ``x ~= data_t.t() * scale_inv_t`` per tile.
    """
    check_tensor("x", x, dtypes=_INPUT_DTYPES, ndim=2)
    check_row_major("x", x)
    if block_k is not None and (not isinstance(block_k, int) or isinstance(block_k, bool) or block_k <= 0):
        raise ValueError(f"block_k must be a positive int or None, got {block_k!r}")
    check_bool("transpose", transpose)
    if src_rows is not None:
        check_row_map("src_rows", src_rows, -1, x.shape[0])
        check_same_device(x=x, src_rows=src_rows)
    check_no_grad("quantize_1x128", x)
    if not transpose:
        if group_end_offsets is not None:
            raise ValueError("group_end_offsets is for transpose=True (the column-wise copy's pad rows)")
        return torch.ops.fp8flow.quantize_1x128(x, block_k, src_rows)
    if block_k != BLOCK:
        raise ValueError(f"transpose=True needs block_k={BLOCK} (the copy re-encodes 128 x 128 tiles), got {block_k!r}")
    m, k = _output_shape(x, src_rows)
    check_multiple("x", m, what="output rows (transpose=True)")
    check_multiple("x", k, what="columns K (transpose=True)")
    if group_end_offsets is not None:
        check_group_end_offsets("group_end_offsets", group_end_offsets, rows=m)
        if group_end_offsets.numel() == 0:
            raise ValueError("group_end_offsets must hold at least one group end, got an empty tensor")
        check_same_device(x=x, group_end_offsets=group_end_offsets)
    return torch.ops.fp8flow.quantize_1x128_transpose(x, src_rows, group_end_offsets)
