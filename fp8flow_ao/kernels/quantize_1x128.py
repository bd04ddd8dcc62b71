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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8flow_ao._checks import check_no_grad, check_row_major, check_row_map, check_same_device, check_tensor
from fp8flow_ao._format import BLOCK, FP8_DTYPE, quantize_rows_reference
from fp8flow_ao.kernels._launch import cdiv, launch_kernel, next_pow2
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._triton_common import gathered_rows, nan_free_abs, pow2_scale_inv_and_scale
from fp8flow_ao.kernels.unpermute_unpad import take_rows_or_zero

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 64 rows x 128 cols of bf16 is 16 KiB per program: enough bytes in flight per SM for a
# memory-bound pass without spilling; 4 warps give each thread 16-byte vector loads.
_ROWS_PER_PROGRAM_1x128 = 64
# A whole-row block keeps the full row in registers; cap elements per program near 8K.
_MAX_ELEMS_PER_PROGRAM = 8192


@triton.jit
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


def quantize_1x128(
    x: torch.Tensor, block_k: int | None = BLOCK, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to E4M3 with one power-of-two scale per 1 x ``block_k`` block.

    Args:
        x: ``[M, K]`` bf16, fp16 or fp32, row-major (last dim contiguous). ``K`` need not be a
            multiple of ``block_k``: the last block of a row is ragged.
        block_k: block width along K (128 for FP8-Flow activations), or ``None`` for one scale per
            row (the row-wise recipe's scale + cast).
        src_rows: optional int32 ``[M_out]`` contiguous row map on ``x``'s device: output row ``r`` is the
            quantized ``x[src_rows[r]]``, or a pad row (data 0, scale 0) where ``src_rows[r] < 0``. Values
            below ``M`` (checked on CPU tensors; on the GPU only with ``FP8FLOW_VALIDATE=1``: it reads the device).

    Returns:
        ``(data, scale_inv)``: ``data`` E4M3 ``[M, K]`` contiguous (``[M_out, K]`` with ``src_rows``);
        ``scale_inv`` fp32 ``[M, ceil(K / block_k)]`` contiguous (``[M, 1]`` for ``block_k=None``), the
        dequantize multiplier (``x ~= data * scale_inv``), a power of two (0 on pad rows).
    """
    check_tensor("x", x, dtypes=_INPUT_DTYPES, ndim=2)
    check_row_major("x", x)
    if block_k is not None and (not isinstance(block_k, int) or isinstance(block_k, bool) or block_k <= 0):
        raise ValueError(f"block_k must be a positive int or None, got {block_k!r}")
    if src_rows is not None:
        check_row_map("src_rows", src_rows, -1, x.shape[0])
        check_same_device(x=x, src_rows=src_rows)
    check_no_grad("quantize_1x128", x)
    return torch.ops.fp8flow.quantize_1x128(x, block_k, src_rows)
