"""One differentiable FP8 grouped GEMM: ``out = A @ B_t`` per expert group (``torch._grouped_mm``).

:func:`fp8_grouped_mm` is what the expert-weight wrapper (:class:`fp8flow_ao.tensor.FP8FlowExpertWeight`)
routes ``torch._grouped_mm(A, B_t, offs=offs)`` to, with ``torch._grouped_mm``'s 2-D x 3-D
semantics: ``A [M, K]`` holds the rows of all experts one group after the other, ``B_t [E, K, N]``
is the transposed view of the expert weights ``W [E, N, K]`` (torchtitan passes
``w.transpose(-2, -1)``) and ``offs [E]`` int32 are the group END offsets.

Group sizes: any non-decreasing END offsets, as ``torch._grouped_mm`` takes them (empty groups,
groups of one row, ``M`` not a multiple of 128). The FP8-Flow format needs every group to START on
a multiple of 128 rows (a wgrad 128-row column block must not straddle two experts), so by default
the op pads on the device, with no host sync and static shapes: :func:`pad_group_offsets` turns the
offsets into row maps and 128-aligned padded offsets in one launch (the rows at or past the last end
form one more group, so they stay out of every expert). The blockwise recipe gathers as it quantizes:
``quantize_1x128`` writes ``A``'s FP8 rows straight into the padded layout (``[M_pad, K]``, ``M_pad =
padded_rows_bound(M, E + 1)``; pad rows data 0, scale 0) and backward's ``quantize_dual_1x128`` reads
``dOut``'s rows into it the same way, so no high-precision padded copy is written; only the output and
``dA`` are gathered back (:func:`unpermute_unpad`). The row-wise recipe pads ``A`` itself first
(:class:`_PadRows`). Callers whose offsets are already multiples of 128 (the FP8-Flow layout, e.g. from
``route_pad`` or torchtitan's ``set_token_group_alignment_size_m(128)``) pass ``offs_aligned=True``
and skip those gathers: the GEMMs then run on ``A`` as it is. Offsets live on the device, so
their values are checked only where that costs no device sync: on CPU tensors, and on the GPU with
``FP8FLOW_VALIDATE=1``; a bad offset (or, with ``offs_aligned=True``, a misaligned one) then raises
a ``ValueError``.

Host time: a forward + backward makes five op calls and one Python autograd node, about 1-1.5 ms of a
GPU machine's host against ``torch._grouped_mm``'s 0.3-0.4 ms, so where a call has under ~1 ms of device
work (many experts with few rows each) it runs at the host's pace. With no host sync anywhere, forward and
backward (accumulating gradients too) can be captured in a CUDA graph and replayed bit for bit with new
values of every input (``torch.cuda.graph``, or ``torch.compile(mode="reduce-overhead")``): measured on an
H200 (``benchmarks/results/fp8_grouped_mm_cuda_graph.md``), E=128 experts of 128 rows went from 0.54-0.78x
BF16 ``torch._grouped_mm`` eagerly to 1.09-1.12x, both captured.

Weight gradient: written in the weight's dtype by the wgrad kernel's epilogue (no fp32 output and
cast). Where the weight already holds a gradient, the blockwise recipe adds into it in that
epilogue and returns no gradient for ``b_t`` (see :func:`~fp8flow_ao._grad_accumulation.fused_grad_target`
for when that is safe; elsewhere the gradient is returned and autograd accumulates it as usual).

Recipes:

* ``"blockwise"`` (FP8-Flow): ``A`` is quantized 1x128 (or arrives already in FP8 as a
  :class:`~fp8flow_ao.tensor.Float8BlockwiseActivation`), the weight 128x128 once per forward
  together with its exact FP8 transpose (only where a backward will need ``dA``: not under
  ``torch.no_grad()``). Saved for backward: ``A``'s column-wise FP8 copy (only where the weight needs
  a gradient; written by the forward's quantizer from the rows it quantizes,
  ``quantize_1x128(transpose=True)``: the scaling-aware transpose, so backward reads no rows back)
  and the transposed FP8 weight, never a BF16 activation. Backward: ``dA`` on the exactly transposed
  FP8 weight, ``dW`` on ``A``'s column-wise copy and the column-wise half of
  ``quantize_dual_1x128(dOut)``. An ``A`` that arrives in FP8 keeps its rows, transposed in backward.
  Where groups have few rows
  (:func:`~fp8flow_ao.kernels.grouped_gemm_fp8_blockwise.quantize_in_gemm_pays`) and ``B_t`` is a view of
  a bf16 ``W`` (torchtitan's call), no separate pass quantizes the weight: the forward GEMM takes ``W``,
  quantizes each 128x128 tile as it loads it (the same bits) and, where a backward will need ``dA``,
  writes those tiles out once (``keep_b``) for the dgrad GEMM, which transposes them as it loads them.
  With a few more rows (:func:`~fp8flow_ao.kernels.grouped_gemm_fp8_blockwise.transpose_in_gemm_pays`)
  no transposed copy is made: backward keeps the forward's FP8 tiles and the dgrad GEMM transposes
  each one as it loads it (the same bits).
* ``"rowwise"`` (comparison with torchao's FP8 row-wise path, same math as torchao 0.18's
  ``_Float8GroupedMM``): per-row power-of-two scales (``quantize_1x128(x, block_k=None)``) and
  ``torch._scaled_grouped_mm`` on CUDA; on the CPU a reference (dequantize, then
  ``torch._grouped_mm`` in fp32). Like torchao it saves the high-precision ``A``: its wgrad needs
  per-expert column scales of ``A``, which a row-wise FP8 copy cannot provide without a second
  rounding.
"""

from __future__ import annotations

from typing import Literal

import torch

# Importing the kernel modules registers the ops that _Float8GroupedMM calls through torch.ops.
import fp8flow_ao.kernels.grouped_gemm_fp8_wgrad
import fp8flow_ao.kernels.pad_group_offsets
import fp8flow_ao.kernels.quantize_128x128
import fp8flow_ao.kernels.quantize_dual_1x128
import fp8flow_ao.kernels.scaling_aware_transpose  # noqa: F401
from fp8flow_ao._autograd import first_order_only
from fp8flow_ao._checks import (
    check_bool,
    check_group_end_offsets,
    check_multiple,
    check_row_major,
    check_same_device,
    check_tensor,
    validate_group_end_offsets,
    validation_enabled,
)
from fp8flow_ao._format import BLOCK, cast_to_fp8, nan_free_abs, pow2_scale_inv
from fp8flow_ao._grad_accumulation import fused_grad_target, grad_leaf
from fp8flow_ao.kernels.grouped_gemm_fp8_blockwise import OUT_DTYPES, quantize_in_gemm_pays, transpose_in_gemm_pays
from fp8flow_ao.kernels.permute_pad import permute_pad_rows
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128
from fp8flow_ao.kernels.unpermute_unpad import unpermute_unpad
from fp8flow_ao.tensor import Float8BlockwiseActivation

_OPS = torch.ops.fp8flow
Recipe = Literal["blockwise", "rowwise"]
RECIPES: tuple[str, ...] = ("blockwise", "rowwise")
_HP_DTYPES = (torch.bfloat16, torch.float32)


def _check_offset_values(name: str, offs: torch.Tensor, rows: int, aligned: bool) -> None:
    """Check offset values where it costs no device sync (CPU tensors, or ``FP8FLOW_VALIDATE=1``)."""
    if torch.compiler.is_compiling():
        return
    if validation_enabled(offs):
        validate_group_end_offsets(name, offs, rows, align=BLOCK if aligned else 1)


def _weight_from_b_t(b_t: torch.Tensor) -> torch.Tensor:
    """``W [E, N, K]`` row-major from ``B_t [E, K, N]``: free for torchtitan's ``w.transpose(-2, -1)``."""
    w = b_t.transpose(-2, -1)
    return w if w.is_contiguous() else w.contiguous()


def _check_args(
    a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, recipe: str, out_dtype: torch.dtype, offs_aligned: bool
) -> None:
    """Everything the op's kernels need of the caller's arguments: checked here once (see forward)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if isinstance(a, Float8BlockwiseActivation):
        if recipe != "blockwise":
            raise TypeError("a Float8BlockwiseActivation input needs recipe='blockwise' (row-wise scales differ)")
        data, scale = a.data_and_scale()
        check_row_major("a's FP8 data", data)
        check_row_major("a's scales", scale)
    else:
        check_tensor("a", a, dtypes=_HP_DTYPES, ndim=2)
        check_row_major("a", a)
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D [M, K], got shape {tuple(a.shape)}")
    check_tensor("b_t", b_t, dtypes=_HP_DTYPES, ndim=3)
    m, k = a.shape
    experts, k_b, n = b_t.shape
    if k_b != k:
        raise ValueError(f"b_t must be [E, K={k}, N] to match a [M, K], got shape {tuple(b_t.shape)}")
    check_bool("offs_aligned", offs_aligned)
    if offs_aligned:
        check_multiple("a", m, what="rows M (offs_aligned=True)")
    check_multiple("a", k, what="columns K")
    check_multiple("b_t", n, what="dim N (-1)")
    check_group_end_offsets("offs", offs)
    if offs.shape[0] != experts:
        raise ValueError(f"offs must hold one group end per expert ({experts}), got shape {tuple(offs.shape)}")
    check_same_device(a=a, b_t=b_t, offs=offs)
    _check_offset_values("offs", offs, m, offs_aligned)


def _quantize_rows_of_3d(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scales of a 3-D ``[E, R, C]``: data ``[E, R, C]``, scales ``[E, R]`` (row-wise recipe)."""
    e, r, c = w.shape
    data, scale = quantize_1x128(w.reshape(e * r, c), block_k=None)
    return data.view(e, r, c), scale.view(e, r)


def _group_of_blocks(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert of each 128-row block (``E`` for blocks past the last group end); no host sync."""
    starts = torch.arange(0, rows, BLOCK, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, starts, right=True)


def _quantize_columns_per_group(x: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise recipe wgrad operand: ``x [M, C]`` with one power-of-two scale per (expert, column).

    Returns ``data_t`` E4M3 ``[C, M]`` (``x`` transposed, tokens contiguous) and ``scale`` fp32
    ``[E * C]`` (expert-major, the layout ``torch._scaled_grouped_mm`` takes for 2-D x 2-D).
    Groups start on 128-row boundaries, so a group's column amax is the max over its 128-row
    blocks' amaxes (a ``[M/128, C]`` segment max): no per-row scale tensor, no host sync.
    Rows past the last group end get scale 0 (data 0).
    """
    m, c = x.shape
    experts = offs.shape[0]
    block_amax = nan_free_abs(x).view(m // BLOCK, BLOCK, c).amax(dim=1)
    group = _group_of_blocks(offs, m).long()
    amax = torch.zeros(experts + 1, c, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, group[:, None].expand(-1, c), block_amax, reduce="amax")
    scale_inv, scale = pow2_scale_inv(amax)
    scale = torch.where(torch.arange(experts + 1, device=x.device)[:, None] < experts, scale, 0.0)
    data = cast_to_fp8(x.float().view(m // BLOCK, BLOCK, c) * scale[group][:, None, :]).view(m, c)
    return data.t().contiguous(), scale_inv[:experts].reshape(-1).contiguous()


def _scaled_grouped_mm_reference(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` semantics (scales = dequantize multipliers), fp32 output, for the CPU."""
    if b.dim() == 3:  # 2-D x 3-D: scale_a [M], scale_b [E, N]
        return torch._grouped_mm(a.float() * scale_a[:, None], b.float() * scale_b[:, None, :], offs=offs)
    # 2-D x 2-D: a [N, M], b [M, K]; scale_a [E * N], scale_b [E * K] per group of the M rows
    experts = offs.shape[0]
    grp = torch.repeat_interleave(_group_of_blocks(offs, a.shape[1]).clamp(max=experts - 1).long(), BLOCK)
    sa = scale_a.view(experts, -1)[grp].t()
    sb = scale_b.view(experts, -1)[grp]
    return torch._grouped_mm(a.float() * sa, b.float() * sb, offs=offs)


def _scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Row-wise FP8 grouped GEMM: ``torch._scaled_grouped_mm`` on CUDA, the reference elsewhere. 2-D x 3-D:
    rows at or past the last group end are zeros (no group computes them: both leave them uninitialized)."""
    if a.is_cuda:
        # torch takes the dequantize multipliers directly; fast accumulation as torchao does.
        out = torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype, use_fast_accum=True)
    else:
        out = _scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs).to(out_dtype)
    if b.dim() == 2:
        return out
    # One masked pass, no host sync (the last end stays on the device): garbage there would reach A's gradient.
    return out.masked_fill(torch.arange(out.shape[0], device=out.device)[:, None] >= offs[-1], 0)


def _grad_leaf(b_t: torch.Tensor) -> torch.Tensor | None:
    """The weight whose gradient the wgrad epilogue may add into: the plain leaf ``W`` with ``b_t =
    W.transpose(-2, -1)`` (torchtitan's call), whose ``[E, N, K]`` gradient is the wgrad output's layout
    (``W`` its own :func:`~fp8flow_ao._grad_accumulation.grad_leaf`); ``None`` without grad mode and for
    anything else, e.g. a leaf ``b_t`` (autograd keeps its gradient in ``b_t``'s ``[E, K, N]`` layout, which
    the epilogue's rows do not match), another view, a DTensor's local shard."""
    if not torch.is_grad_enabled() or not b_t.requires_grad:
        return None
    w = b_t._base
    if w is None or w.dim() != 3 or grad_leaf(w) is not w or b_t.storage_offset() != w.storage_offset():
        return None
    e, n, k = w.shape
    if b_t.shape != (e, k, n) or b_t.stride() != (w.stride(0), w.stride(2), w.stride(1)):
        return None
    return w


class _PadRows(torch.autograd.Function):
    """``A [M, K]`` -> ``[M_pad, K]`` in the 128-aligned padded group layout (row ``r`` = ``A[src_rows[r]]``,
    pad rows 0); for a :class:`Float8BlockwiseActivation` its FP8 data and scales move together.
    Backward gathers the gradient's rows back (``dA[i] = grad[dst_rows[i]]``)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(dst_rows)
        if isinstance(a, Float8BlockwiseActivation):
            return a.permute_pad_rows(src_rows, 1)
        return permute_pad_rows(a, None, src_rows, 1)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dst_rows,) = ctx.saved_tensors
        return unpermute_unpad(grad.contiguous(), dst_rows, 1), None, None


class _Float8GroupedMM(torch.autograd.Function):
    """Differentiable FP8 grouped GEMM ``out[rows of e] = A[rows of e] @ B_t[e]`` (see module docstring)."""

    @staticmethod
    def forward(
        ctx,
        a: torch.Tensor,
        b_t: torch.Tensor,
        offs: torch.Tensor,
        recipe: str,
        out_dtype: torch.dtype,
        grad_leaf: torch.Tensor | None,
        w_in_gemm: bool,
        dgrad: bool,
        wgrad: bool,
        w_t_copy: bool,
        src_rows: torch.Tensor | None,
        dst_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.recipe, ctx.grad_leaf = recipe, grad_leaf
        ctx.a_dtype, ctx.b_dtype = a.dtype, b_t.dtype
        w = _weight_from_b_t(b_t)  # [E, N, K] row-major
        if recipe == "rowwise":
            return _rowwise_forward(ctx, a, w, offs, out_dtype)
        # Checked once by fp8_grouped_mm (_check_args); the tensors made here go straight to the ops
        # (torch.ops.fp8flow), without their public functions' checks again: the host time matters at
        # fine-grained shapes, where the op is host-bound.
        # Unaligned groups (src_rows/dst_rows given): the GEMMs run on the padded rows; out and dA are
        # gathered back to the caller's rows.
        # A: 1x128 blocks along K, row-major [M, K] + [M, K/128] (padded as it is read): the forward LHS. What
        # backward keeps of it: nothing without a wgrad; else its column-wise copy [K, M] (the wgrad's RHS),
        # written by the quantizing kernel itself from the rows it quantizes (the scaling-aware transpose, bit
        # for bit, the same bytes as the rows), or for an A that arrives in FP8 its rows, transposed in backward.
        ctx.a_transposed = wgrad and not isinstance(a, Float8BlockwiseActivation)
        if isinstance(a, Float8BlockwiseActivation):
            a_data, a_scale = (a if src_rows is None else a.permute_pad_rows(src_rows, 1)).data_and_scale()
            a_saved = (a_data, a_scale) if wgrad else (None, None)
        elif wgrad:
            a_data, a_scale, *a_saved = _OPS.quantize_1x128_transpose(a, src_rows, offs)
        else:
            a_data, a_scale = _OPS.quantize_1x128(a, BLOCK, src_rows)
            a_saved = (None, None)
        # The dgrad's B operand is W^T: its own FP8 tiles (transpose_b False), or W's, which the dgrad GEMM
        # transposes (and for the high-precision W quantizes) as it loads them.
        ctx.transpose_b = not w_t_copy
        out, w_saved = _blockwise_forward(a_data, a_scale, w, offs, out_dtype, w_in_gemm, dgrad, w_t_copy)
        ctx.save_for_backward(*a_saved, *w_saved, offs, src_rows, dst_rows)
        return out if dst_rows is None else _OPS.unpermute_unpad(out, dst_rows, 1, None)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # Under create_graph the fused accumulation is not what autograd would do (it adds out of place):
        # decided here, before _backward runs without grad mode.
        fuse_into = ctx.grad_leaf if not torch.is_grad_enabled() else None
        return _Float8GroupedMM._backward(ctx, grad_out, fuse_into)

    @staticmethod
    @first_order_only("fp8_grouped_mm")  # the FP8 ops have no gradient formulas of their own
    def _backward(ctx, grad_out: torch.Tensor, fuse_into: torch.Tensor | None):
        grad_out = grad_out.contiguous()  # e.g. the expanded gradient of a .sum()
        if ctx.recipe == "rowwise":
            grad_a, grad_w = _rowwise_backward(ctx, grad_out)
        else:
            grad_a, grad_w = _blockwise_backward(ctx, grad_out, fuse_into)
        # grad_w is [E, N, K] (None: not asked for, or already added to the weight's gradient); B_t is its
        # transposed view.
        grad_a = None if grad_a is None else grad_a.to(ctx.a_dtype)
        grad_b_t = None if grad_w is None else grad_w.to(ctx.b_dtype).transpose(-2, -1)
        return grad_a, grad_b_t, *(None,) * 10


def _quantize_w_in_gemm(rows: int, b_t: torch.Tensor, recipe: str, aligned: bool, dgrad: bool) -> bool:
    """Whether the blockwise forward GEMM over ``rows`` (unpadded) rows takes ``W`` as it is and quantizes
    it as it loads it: few rows per group (``quantize_in_gemm_pays``; ``aligned``: the caller's groups are
    128-aligned, else the op pads each one; more rows where no ``dgrad`` will read tiles it keeps) and ``W``
    the caller's own contiguous tensor, not a copy (``B_t`` a transposed view of it); not FSDP2's FP8
    all-gathered tiles."""
    from fp8flow_ao.tensor import Float8BlockwiseWeight

    return (
        recipe == "blockwise"
        and not isinstance(b_t, Float8BlockwiseWeight)
        and b_t.transpose(-2, -1).is_contiguous()  # W is B_t's own storage (_weight_from_b_t copied nothing)
        and quantize_in_gemm_pays(rows, b_t.shape[0], b_t.dtype, aligned, forward_only=not dgrad)
    )


def _blockwise_forward(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    w_in_gemm: bool,
    dgrad: bool,
    w_t_copy: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The forward GEMM on the padded FP8 rows and the weight operand backward's dgrad reads (``(None,
    None)`` without one to come): ``(out [M_pad, N], (data, scale))``."""
    if w_in_gemm and dgrad:
        # The forward GEMM quantizes W's 128x128 tiles as it loads them and keeps them (the experts with
        # rows) for the dgrad, which transposes them as it loads them: one pass over the bf16 weight.
        out, w_data, w_scale = _OPS.grouped_gemm_fp8_blockwise_keep_b(a_data, a_scale, w, offs, out_dtype, None)
        return out, (w_data, w_scale)
    if w_in_gemm:
        return _OPS.grouped_gemm_fp8_blockwise(a_data, a_scale, w, None, offs, out_dtype), (None, None)
    # W: 128x128 tiles [E, N, K] (forward RHS, K-major) and, where a backward will need dA and its GEMM is
    # to read a transposed copy, that copy [E, K, N], written by the same pass.
    w_data, w_scale, w_t_data, w_t_scale = _OPS.quantize_128x128(w, dgrad and w_t_copy, True, None)
    kept = (w_t_data, w_t_scale) if w_t_copy else (w_data, w_scale)
    out = _OPS.grouped_gemm_fp8_blockwise(a_data, a_scale, w_data, w_scale, offs, out_dtype)
    return out, (kept if dgrad else (None, None))


def _blockwise_backward(
    ctx, grad_out: torch.Tensor, fuse_into: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    a_saved, a_saved_scale, w, w_scale, offs, src_rows, dst_rows = ctx.saved_tensors
    needs_a, needs_w = ctx.needs_input_grad[:2]
    # dOut [M, N] (padded as it is read): row-wise 1x128 (dgrad LHS) and column-wise [N, M] (wgrad LHS).
    g_data, g_scale, g_t_data, g_t_scale = _OPS.quantize_dual_1x128(grad_out, offs, src_rows)
    grad_a = None
    if needs_a:
        # dA [M, K] = dOut @ W per group: RHS = the exact FP8 transpose W^T [E, K, N] (K-major for the GEMM),
        # or W's tiles [E, N, K] (FP8, or the high-precision W saved without scales) that the GEMM transposes
        # (and quantizes) as it loads them.
        grad_a = _OPS.grouped_gemm_fp8_blockwise(
            g_data, g_scale, w, w_scale, offs, torch.bfloat16, None, ctx.transpose_b
        )
        if dst_rows is not None:
            grad_a = _OPS.unpermute_unpad(grad_a, dst_rows, 1, None)
    del g_data, g_scale  # not alive while the wgrad writes dW (a name holds its tensor to the function's end)
    if not needs_w:
        return grad_a, None
    # dW_e [N, K] = dOut_e^T A_e: A re-encoded column-wise [K, M] by exponent shift, no re-quantization (by the
    # forward's quantizer, or here for an A that arrived in FP8).
    if ctx.a_transposed:
        a_t_data, a_t_scale = a_saved, a_saved_scale
    else:
        a_t_data, a_t_scale = _OPS.scaling_aware_transpose(a_saved, a_saved_scale, offs, None, 1)
    # Written in the weight's dtype by the epilogue, or added there into the gradient it already holds.
    # The transpose's scales are one per 128x128 tile (b_tile_scales: one FFMA an element to promote). Straight
    # to the ops, as above: their operands are this op's own outputs, and grouped_gemm_fp8_wgrad's checks
    # cost 7.4 us a call on the CPU machine the code is written on (the GPU machines' hosts run Python 4-5x slower).
    target = fused_grad_target(fuse_into, ctx.b_dtype)
    args = (g_t_data, g_t_scale, a_t_data, a_t_scale, offs)
    if target is None:
        return grad_a, _OPS.grouped_gemm_fp8_wgrad(*args, ctx.b_dtype, 1, True)
    _OPS.grouped_gemm_fp8_wgrad_accumulate(*args, target, True)
    return grad_a, None


def _rowwise_forward(ctx, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype):
    # A: one scale per row [M, 1] (LHS, row-major). W [E, N, K]: one scale per (expert, n) row along K,
    # viewed as B_t [E, K, N] column-major with scales [E, N] (RHS).
    a_data, a_scale = quantize_1x128(a, block_k=None)
    w_data, w_scale = _quantize_rows_of_3d(w)
    ctx.save_for_backward(a, w, offs)
    return _scaled_grouped_mm(a_data, w_data.transpose(-2, -1), a_scale.view(-1), w_scale, offs, out_dtype)


def _rowwise_backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, w, offs = ctx.saved_tensors
    # dA = dOut @ W: dOut per row [M, N] (LHS); W^T [E, K, N] per (expert, k) row along N, viewed
    # as [E, N, K] column-major (RHS). The weight transpose is a high-precision copy, as in torchao.
    g_data, g_scale = quantize_1x128(grad_out, block_k=None)
    w_t_data, w_t_scale = _quantize_rows_of_3d(w.transpose(-2, -1).contiguous())
    grad_a = _scaled_grouped_mm(
        g_data, w_t_data.transpose(-2, -1), g_scale.view(-1), w_t_scale, offs, out_dtype=torch.bfloat16
    )
    # dW_e = dOut_e^T A_e: both operands scaled per (expert, column) along M.
    g_t_data, g_t_scale = _quantize_columns_per_group(grad_out, offs)  # [N, M] row-major (LHS)
    a_t_data, a_t_scale = _quantize_columns_per_group(a, offs)  # [K, M] -> [M, K] column-major (RHS)
    grad_w = _scaled_grouped_mm(g_t_data, a_t_data.t(), g_t_scale, a_t_scale, offs, out_dtype=torch.bfloat16)
    return grad_a, grad_w


def fp8_grouped_mm(
    a: torch.Tensor,
    b_t: torch.Tensor,
    offs: torch.Tensor,
    recipe: Recipe = "blockwise",
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    offs_aligned: bool = False,
) -> torch.Tensor:
    """Differentiable FP8 ``torch._grouped_mm(a, b_t, offs=offs)`` (2-D x 3-D, group END offsets).

    Args:
        a: ``[M, K]`` bf16/fp32, row-major, or a :class:`~fp8flow_ao.tensor.Float8BlockwiseActivation`
            (already quantized 1x128; ``recipe="blockwise"`` only). ``K`` a multiple of 128.
        b_t: ``[E, K, N]`` bf16/fp32: the expert weights ``W [E, N, K]`` seen transposed (torchtitan's
            ``w.transpose(-2, -1)``; any other layout is copied to that one). ``N`` a multiple of 128.
        offs: int32 ``[E]`` group END offsets on ``a``'s device: non-decreasing, last ``<= M``
            (empty groups allowed). Rows at or past ``offs[-1]`` belong to no group: their output and
            gradient rows are zeros.
        recipe: ``"blockwise"`` (FP8-Flow: 1x128 activations, 128x128 weights) or ``"rowwise"``
            (per-row scales, ``torch._scaled_grouped_mm``; for comparison with torchao).
        out_dtype: output dtype (bf16).
        offs_aligned: the caller's promise that every offset and ``M`` are multiples of 128 (the
            FP8-Flow layout): the GEMMs run on ``a`` as it is. ``False`` (default): any offsets;
            the op pads the groups to 128 rows on the device, no sync (one launch for the row maps; the
            quantizers read ``A`` and ``dOut`` into the padded layout; out and ``dA`` are gathered back).

    Returns:
        ``[M, N]`` ``out_dtype``. Gradients flow to ``a`` (its dtype) and ``b_t`` (its dtype,
        written so by the wgrad epilogue). Blockwise: where ``b_t``'s leaf weight already holds a
        gradient and ``.backward()`` will accumulate into it, the epilogue adds into that gradient
        in place instead (see :func:`~fp8flow_ao._grad_accumulation.fused_grad_target` for the exact rule).
    """
    _check_args(a, b_t, offs, recipe, out_dtype, offs_aligned)
    leaf = _grad_leaf(b_t) if recipe == "blockwise" else None
    # Whether a backward will ask for dA: else the forward writes no transposed FP8 weight (inference, no_grad);
    # for dW: else it keeps nothing of A.
    dgrad = torch.is_grad_enabled() and a.requires_grad
    wgrad = torch.is_grad_enabled() and b_t.requires_grad
    w_in_gemm = _quantize_w_in_gemm(a.shape[0], b_t, recipe, offs_aligned, dgrad)
    # Whether the dgrad reads a transposed FP8 copy rather than transposing W's tiles in its GEMM.
    w_t_copy = not w_in_gemm and not transpose_in_gemm_pays(a.shape[0], b_t.shape[0], offs_aligned)
    args = (recipe, out_dtype, leaf, w_in_gemm, dgrad, wgrad, w_t_copy)
    if offs_aligned:
        return _Float8GroupedMM.apply(a, b_t, offs, *args, None, None)
    src_rows, dst_rows, padded_offs = _OPS.pad_group_offsets(offs, a.shape[0])
    if recipe == "blockwise":
        return _Float8GroupedMM.apply(a, b_t, padded_offs, *args, src_rows, dst_rows)
    out = _Float8GroupedMM.apply(_PadRows.apply(a, src_rows, dst_rows), b_t, padded_offs, *args, None, None)
    return unpermute_unpad(out, dst_rows, 1)
