"""unpermute_unpad: padded expert-major rows ``[M_pad, D]`` -> tokens ``[T, D]``, fused with the combine.

``out[t] = sum_j probs[t, j] * y[dst_rows[t * k + j]]`` summed in fp32 in slot order ``j = 0 .. k-1``
and stored in ``y``'s dtype; ``probs=None`` is the plain sum (the FP8-Flow layer applies the router
probs inside SwiGLU, so its combine is unweighted). Each program *gathers* a token's ``k`` rows, so
there are no atomics and the result is deterministic; pad rows are never read.

Backward (one fused kernel, also token-major): for each token, ``grad_out[t]`` is read once and, for
each slot, ``grad_y[dst_rows[t * k + j]] = probs[t, j] * grad_out[t]`` is written and
``grad_probs[t, j] = dot(grad_out[t], y[dst_rows[t * k + j]])`` is accumulated in fp32 over the row. A
second set of programs in the same launch writes zeros to the pad rows of ``grad_y`` (``src_rows < 0``).

Layouts: ``y`` row-major (row stride free); ``dst_rows`` int32 ``[T * k]`` (flattened ``t * k + j``),
``src_rows`` int32 ``[M_pad]`` (``-1`` on pad rows), both from :func:`~fp8flow_ao.kernels.permute_pad.route_pad`;
``probs`` contiguous ``[T, k]`` fp32 or bf16. Outputs contiguous.
"""

from __future__ import annotations

import torch
import triton.language as tl

from fp8flow_ao._checks import (
    check_contiguous,
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
from fp8flow_ao.kernels._launch import cdiv, launch_kernel, next_pow2
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._triton_common import col_block, jit_any_count

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PROBS_DTYPES = (torch.float32, torch.bfloat16)
# Widest column tile: 2 KiB of a bf16 row (16-byte vectors for 128 threads); D = 7168 gets 1024.
_MAX_COL_BYTES = 2048
# fp32 tile elements per program (1 token x 1024 columns at D = 7168). The k row loads of a tile are
# unrolled and independent, so k tiles are in flight at once. On sm_90 (ptxas via triton 3.9, k = 8,
# 4 warps) this tile takes 80 registers in the forward (6 programs, ~96 KiB of loads in flight per
# SM) and 62 in the backward, whose grid is tokens only (each program walks all of D for its dots);
# 2048 elements took 155 / 86 registers for the same bytes in flight and half the programs.
_TILE_ELEMS = 1024
# Pad-row zeroing programs of the backward: rows per program (they only read src_rows).
_ZERO_ROWS = 16


def _tiles(cols: int, elem_size: int) -> tuple[int, int]:
    """(tokens, columns) per program."""
    block_d = col_block(cols, _MAX_COL_BYTES // elem_size)
    return max(1, _TILE_ELEMS // block_d), block_d


@jit_any_count("num_tokens")
def _unpermute_unpad_kernel(
    y_ptr,
    dst_rows_ptr,
    probs_ptr,
    out_ptr,
    num_tokens,
    cols,
    stride_ym,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """One program: ``BLOCK_T`` tokens x ``BLOCK_D`` columns, summing their ``TOP_K`` rows in slot order."""
    pid = tl.program_id(0)
    num_col_blocks = tl.cdiv(cols, BLOCK_D)
    toks = ((pid // num_col_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs = (pid % num_col_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = toks < num_tokens
    mask = tok_ok[:, None] & (offs < cols)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: k independent row loads in flight
        row = tl.load(dst_rows_ptr + toks * TOP_K + j, mask=tok_ok, other=0).to(tl.int64)
        v = tl.load(y_ptr + row[:, None] * stride_ym + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_PROBS:
            p = tl.load(probs_ptr + toks * TOP_K + j, mask=tok_ok, other=0.0).to(tl.float32)
            v = v * p[:, None]
        acc = acc + v
    tl.store(out_ptr + toks[:, None] * cols + offs[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_unpermute_unpad(
    y: torch.Tensor, dst_rows: torch.Tensor, top_k: int, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`unpermute_unpad`."""
    num_tokens, cols = dst_rows.numel() // top_k, y.shape[1]
    out = torch.empty((num_tokens, cols), dtype=y.dtype, device=y.device)
    if num_tokens == 0 or cols == 0:
        return out
    block_t, block_d = _tiles(cols, y.element_size())
    grid = (cdiv(num_tokens, block_t) * cdiv(cols, block_d),)
    launch_kernel(
        _unpermute_unpad_kernel,
        grid,
        y,
        dst_rows,
        probs if probs is not None else y,  # unread when HAS_PROBS is False
        out,
        num_tokens,
        cols,
        y.stride(0),
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        HAS_PROBS=probs is not None,
        num_warps=4,
        # round(p * y) then add, like the reference: a fused multiply-add would round once and differ.
        enable_fp_fusion=False,
    )
    return out


@jit_any_count("num_tokens", "token_programs")
def _unpermute_unpad_backward_kernel(
    grad_out_ptr,
    y_ptr,
    probs_ptr,
    src_rows_ptr,
    dst_rows_ptr,
    grad_y_ptr,
    grad_probs_ptr,
    num_tokens,
    num_rows,
    cols,
    stride_gm,
    stride_ym,
    token_programs,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_Y: tl.constexpr,
):
    """Programs ``< token_programs``: ``BLOCK_T`` tokens each, walking all of D (the dots need the whole
    row); the rest: ``BLOCK_R`` padded rows each, zeroing the pad rows of ``grad_y``."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    if pid < token_programs:
        toks = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        tok_ok = toks < num_tokens
        slots = tl.arange(0, BLOCK_K)
        dots = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
        for c0 in range(0, cols, BLOCK_D):
            c = c0 + offs
            mask = tok_ok[:, None] & (c < cols)[None, :]
            g = tl.load(grad_out_ptr + toks[:, None] * stride_gm + c[None, :], mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(TOP_K):
                row = tl.load(dst_rows_ptr + toks * TOP_K + j, mask=tok_ok, other=0).to(tl.int64)
                gy = g
                if HAS_PROBS:
                    p = tl.load(probs_ptr + toks * TOP_K + j, mask=tok_ok, other=0.0).to(tl.float32)
                    gy = g * p[:, None]
                tl.store(grad_y_ptr + row[:, None] * cols + c[None, :], gy.to(grad_y_ptr.dtype.element_ty), mask=mask)
                if HAS_Y:
                    yv = tl.load(y_ptr + row[:, None] * stride_ym + c[None, :], mask=mask, other=0.0).to(tl.float32)
                    part = tl.sum(g * yv, axis=1)
                    dots = tl.where(slots[None, :] == j, dots + part[:, None], dots)
        if HAS_Y:
            dmask = tok_ok[:, None] & (slots < TOP_K)[None, :]
            tl.store(grad_probs_ptr + toks[:, None] * TOP_K + slots[None, :], dots, mask=dmask)
    else:
        rows = ((pid - token_programs) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = rows < num_rows
        pad = row_ok & (tl.load(src_rows_ptr + rows, mask=row_ok, other=0) < 0)
        zeros = tl.zeros((BLOCK_R, BLOCK_D), grad_y_ptr.dtype.element_ty)
        for c0 in range(0, cols, BLOCK_D):
            c = c0 + offs
            tl.store(grad_y_ptr + rows[:, None] * cols + c[None, :], zeros, mask=pad[:, None] & (c < cols)[None, :])


def launch_unpermute_unpad_backward(
    grad_out: torch.Tensor,
    y: torch.Tensor | None,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    probs: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`unpermute_unpad_backward`."""
    num_tokens, cols = grad_out.shape
    num_rows = src_rows.shape[0]
    grad_y = torch.empty((num_rows, cols), dtype=grad_out.dtype, device=grad_out.device)
    grad_probs = _empty_grad_probs(grad_out, y, top_k)
    if num_rows == 0 or cols == 0:
        return grad_y, grad_probs.zero_()
    block_t, block_d = _tiles(cols, grad_out.element_size())
    token_programs = cdiv(num_tokens, block_t)
    grid = (token_programs + cdiv(num_rows, _ZERO_ROWS),)
    launch_kernel(
        _unpermute_unpad_backward_kernel,
        grid,
        grad_out,
        y if y is not None else grad_out,  # unread when HAS_Y is False
        probs if probs is not None else grad_out,  # unread when HAS_PROBS is False
        src_rows,
        dst_rows,
        grad_y,
        grad_probs,
        num_tokens,
        num_rows,
        cols,
        grad_out.stride(0),
        y.stride(0) if y is not None else 0,
        token_programs,
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_K=next_pow2(top_k),
        BLOCK_R=_ZERO_ROWS,
        BLOCK_D=block_d,
        HAS_PROBS=probs is not None,
        HAS_Y=y is not None,
        num_warps=4,
    )
    return grad_y, grad_probs


def _empty_grad_probs(grad_out: torch.Tensor, y: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """``[T, k]`` fp32 when ``y`` is given (probs gradient wanted), else an empty tensor (custom ops cannot return None)."""
    shape = (grad_out.shape[0], top_k) if y is not None else (0,)
    return torch.empty(shape, dtype=torch.float32, device=grad_out.device)


def take_rows_or_zero(t: torch.Tensor, src_rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """``t[src_rows // top_k]`` along dim 0, zeros where ``src_rows < 0`` (they read an appended zero row).

    The torch form of the padded gather, shared by the references here and in ``permute_pad``.
    """
    padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
    return padded[torch.where(src_rows >= 0, src_rows // top_k, t.shape[0]).long()]


def unpermute_unpad_reference(
    y: torch.Tensor, dst_rows: torch.Tensor, top_k: int, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference (the oracle and the CPU path): the same fp32 sum, slot by slot."""
    num_tokens = dst_rows.numel() // top_k
    rows = y[dst_rows.long()].float().view(num_tokens, top_k, y.shape[1])
    acc = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    for j in range(top_k):
        term = rows[:, j] if probs is None else rows[:, j] * probs[:, j, None].float()
        acc = acc + term
    return acc.to(y.dtype)


def unpermute_unpad_backward_reference(
    grad_out: torch.Tensor,
    y: torch.Tensor | None,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    probs: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path) of :func:`unpermute_unpad_backward`."""
    num_tokens, cols = grad_out.shape
    g_rows = take_rows_or_zero(grad_out.float(), src_rows, top_k)
    if probs is not None:
        g_rows = g_rows * take_rows_or_zero(probs.reshape(-1).float(), src_rows, 1)[:, None]
    grad_probs = _empty_grad_probs(grad_out, y, top_k)
    if y is not None:
        y_rows = y[dst_rows.long()].float().view(num_tokens, top_k, cols)
        grad_probs = (grad_out.float()[:, None, :] * y_rows).sum(-1)
    return g_rows.to(grad_out.dtype), grad_probs


@define_op("unpermute_unpad_backward")
def _unpermute_unpad_backward_op(
    grad_out: torch.Tensor,
    y: torch.Tensor | None,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    probs: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return unpermute_unpad_backward_reference(grad_out, y, src_rows, dst_rows, probs, top_k)


_unpermute_unpad_backward_op.register_kernel("cuda")(launch_unpermute_unpad_backward)


@_unpermute_unpad_backward_op.register_fake
def _(grad_out, y, src_rows, dst_rows, probs, top_k):
    grad_y = grad_out.new_empty((src_rows.shape[0], grad_out.shape[1]))
    return grad_y, _empty_grad_probs(grad_out, y, top_k)


@define_op("unpermute_unpad")
def _unpermute_unpad_op(
    y: torch.Tensor, dst_rows: torch.Tensor, top_k: int, probs: torch.Tensor | None
) -> torch.Tensor:
    return unpermute_unpad_reference(y, dst_rows, top_k, probs)


_unpermute_unpad_op.register_kernel("cuda")(launch_unpermute_unpad)


@_unpermute_unpad_op.register_fake
def _(y, dst_rows, top_k, probs):
    return y.new_empty((dst_rows.shape[0] // top_k, y.shape[1]))


def _src_rows_from_dst_rows(dst_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Invert the row map: ``src_rows[dst_rows[i]] = i``, ``-1`` on pad rows (a scatter, no sync)."""
    src_rows = torch.full((num_rows,), -1, dtype=torch.int32, device=dst_rows.device)
    return src_rows.scatter_(
        0, dst_rows.long(), torch.arange(dst_rows.numel(), dtype=torch.int32, device=dst_rows.device)
    )


def _setup_context(ctx, inputs, output) -> None:
    y, dst_rows, top_k, probs = inputs
    ctx.top_k, ctx.num_rows = top_k, y.shape[0]
    # y is kept only for the probs' gradient; the unweighted combine's backward never reads it.
    keep_y = probs is not None and probs.requires_grad
    ctx.save_for_backward(dst_rows, probs, y if keep_y else None)


def _backward(ctx, grad_out: torch.Tensor):
    dst_rows, probs, y = ctx.saved_tensors
    src_rows = _src_rows_from_dst_rows(dst_rows, ctx.num_rows)
    grad_y, grad_probs = torch.ops.fp8flow.unpermute_unpad_backward(
        grad_out.contiguous(), y, src_rows, dst_rows, probs, ctx.top_k
    )
    return grad_y, None, None, (grad_probs.to(probs.dtype) if y is not None else None)


_unpermute_unpad_op.register_autograd(_backward, setup_context=_setup_context)


def _check_probs(probs: torch.Tensor | None, num_tokens: int, top_k: int) -> None:
    if probs is not None:
        check_tensor("probs", probs, dtypes=_PROBS_DTYPES, ndim=2)
        check_shape("probs", probs, (num_tokens, top_k))
        check_contiguous("probs", probs)


def unpermute_unpad(
    y: torch.Tensor, dst_rows: torch.Tensor, top_k: int, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather each token's ``top_k`` expert-output rows back and combine them: ``[M_pad, D]`` -> ``[T, D]``.

    ``out[t] = sum_j probs[t, j] * y[dst_rows[t * top_k + j]]``, accumulated in fp32 in slot order and
    stored in ``y``'s dtype (no atomics: deterministic). Pad rows of ``y`` are never read.
    Differentiable in ``y`` and ``probs`` (fused backward: :func:`unpermute_unpad_backward`).

    Args:
        y: ``[M_pad, D]`` bf16 (fp16/fp32 also accepted), expert outputs in padded expert-major order,
            row-major (last dim contiguous).
        dst_rows: int32 ``[T * top_k]`` contiguous, the padded row of (token t, slot j) at ``t * top_k + j``
            (from :func:`~fp8flow_ao.kernels.permute_pad.route_pad`).
        top_k: experts per token.
        probs: optional ``[T, top_k]`` fp32 or bf16 contiguous router probabilities; ``None`` sums the rows.

    Returns:
        ``[T, D]`` contiguous, ``y``'s dtype.
    """
    check_tensor("y", y, dtypes=_DTYPES, ndim=2)
    check_row_major("y", y)
    check_row_map("dst_rows", dst_rows)
    check_positive_int("top_k", top_k)
    if dst_rows.numel() % top_k:
        raise ValueError(f"dst_rows length {dst_rows.numel()} must be a multiple of top_k={top_k}")
    _check_probs(probs, dst_rows.numel() // top_k, top_k)
    check_same_device(y=y, dst_rows=dst_rows, probs=probs)
    if validation_enabled(dst_rows):
        validate_index_range("dst_rows", dst_rows, 0, y.shape[0])
    return _unpermute_unpad_op(y, dst_rows, top_k, probs)


def unpermute_unpad_backward(
    grad_out: torch.Tensor,
    y: torch.Tensor | None,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    probs: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of :func:`unpermute_unpad` in one kernel (what its autograd runs).

    Args:
        grad_out: ``[T, D]`` gradient of the combined output, row-major; its dtype is ``grad_y``'s.
        y: ``[M_pad, D]`` forward expert outputs, same dtype as ``grad_out``, or ``None`` when the
            probs' gradient is not wanted (then ``y`` is never read).
        src_rows: int32 ``[M_pad]``, flattened ``t * top_k + j`` of each padded row, ``-1`` on pad rows.
        dst_rows: int32 ``[T * top_k]``, the inverse map (padded row of each (t, j)).
        probs: ``[T, top_k]`` fp32/bf16 router probabilities of the forward, or ``None`` (plain sum).
        top_k: experts per token.

    Returns:
        ``(grad_y, grad_probs)``: ``grad_y`` ``[M_pad, D]`` in padded expert-major order,
        ``probs[t, j] * grad_out[t]`` (fp32 product, rounded once), pad rows 0; ``grad_probs`` fp32
        ``[T, top_k]``, ``dot(grad_out[t], y[dst_rows[t * top_k + j]])`` in fp32, or ``None`` when
        ``y`` is ``None``.
    """
    check_tensor("grad_out", grad_out, dtypes=_DTYPES, ndim=2)
    check_row_major("grad_out", grad_out)
    check_row_map("src_rows", src_rows)
    check_row_map("dst_rows", dst_rows)
    check_positive_int("top_k", top_k)
    num_tokens, cols = grad_out.shape
    check_shape("dst_rows", dst_rows, (num_tokens * top_k,))
    if y is not None:
        check_tensor("y", y, dtypes=grad_out.dtype, ndim=2)
        check_row_major("y", y)
        check_shape("y", y, (src_rows.shape[0], cols))
    _check_probs(probs, num_tokens, top_k)
    check_same_device(grad_out=grad_out, y=y, src_rows=src_rows, dst_rows=dst_rows, probs=probs)
    if validation_enabled(src_rows):
        validate_index_range("src_rows", src_rows, -1, num_tokens * top_k)
        validate_index_range("dst_rows", dst_rows, 0, src_rows.shape[0])
    check_no_grad("unpermute_unpad_backward", grad_out, y, probs)
    grad_y, grad_probs = torch.ops.fp8flow.unpermute_unpad_backward(grad_out, y, src_rows, dst_rows, probs, top_k)
    return grad_y, (grad_probs if y is not None else None)
