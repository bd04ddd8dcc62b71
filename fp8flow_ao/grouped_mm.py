"""One differentiable FP8 grouped GEMM: ``out = A @ B_t`` per expert group (``torch._grouped_mm``).

:func:`fp8_grouped_mm` is what the expert-weight wrapper (:class:`fp8flow_ao.tensor.FP8FlowExpertWeight`)
routes ``torch._grouped_mm(A, B_t, offs=offs)`` to, with ``torch._grouped_mm``'s 2-D x 3-D
semantics: ``A [M, K]`` holds the rows of all experts one group after the other, ``B_t [E, K, N]``
is the transposed view of the expert weights ``W [E, N, K]`` (torchtitan passes
``w.transpose(-2, -1)``) and ``offs [E]`` int32 are the group END offsets.

Group alignment (decided here, see DESIGN.md): every group must START on a multiple of 128 rows,
i.e. every END offset is a multiple of 128, and ``M`` is a multiple of 128. That is the FP8-Flow
format (a 1x128 activation block never straddles two experts, and the wgrad's 128-row column
blocks neither). torchtitan 0.2.2 pads each expert's group to ``TOKEN_GROUP_ALIGN_SIZE_M`` rows in
``indices_padding_wrapper``; call ``torchtitan.models.moe.utils.set_token_group_alignment_size_m(128)``
(``FP8FlowConfig(recipe="rowwise")`` conversion does it). Offsets live on the device, so their
values are checked only where that costs no device sync: on CPU tensors, and on the GPU with
``FP8FLOW_VALIDATE=1``; a misaligned offset then raises a ``ValueError``.

Recipes:

* ``"blockwise"`` (FP8-Flow): ``A`` is quantized 1x128 (or arrives already in FP8 as a
  :class:`~fp8flow_ao.tensor.Float8BlockwiseActivation`), the weight 128x128 once per forward
  together with its exact FP8 transpose. Saved for backward: FP8 ``A`` + scales and the transposed
  FP8 weight, never a BF16 activation. Backward: ``dA`` on the exactly transposed FP8 weight,
  ``dW`` on the scaling-aware transpose of the saved FP8 ``A`` and the column-wise half of
  ``quantize_dual_1x128(dOut)``.
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

from fp8flow_ao._checks import (
    check_group_end_offsets,
    check_multiple,
    check_row_major,
    check_same_device,
    check_tensor,
    validate_group_end_offsets,
    validation_enabled,
)
from fp8flow_ao._format import BLOCK, cast_to_fp8, nan_free_abs, pow2_scale_inv
from fp8flow_ao.kernels.grouped_gemm_fp8_blockwise import grouped_gemm_fp8_blockwise
from fp8flow_ao.kernels.grouped_gemm_fp8_wgrad import grouped_gemm_fp8_wgrad
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128
from fp8flow_ao.kernels.quantize_dual_1x128 import quantize_dual_1x128
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose
from fp8flow_ao.tensor import Float8BlockwiseActivation

Recipe = Literal["blockwise", "rowwise"]
RECIPES: tuple[str, ...] = ("blockwise", "rowwise")
_HP_DTYPES = (torch.bfloat16, torch.float32)


def _check_offset_values(name: str, offs: torch.Tensor, rows: int) -> None:
    """Check offset values where it costs no device sync (CPU tensors, or ``FP8FLOW_VALIDATE=1``)."""
    if torch.compiler.is_compiling():
        return
    if offs.device.type == "cpu" or validation_enabled():
        validate_group_end_offsets(name, offs, rows)


def _weight_from_b_t(b_t: torch.Tensor) -> torch.Tensor:
    """``W [E, N, K]`` row-major from ``B_t [E, K, N]``: free for torchtitan's ``w.transpose(-2, -1)``."""
    w = b_t.transpose(-2, -1)
    return w if w.is_contiguous() else w.contiguous()


def _check_args(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if isinstance(a, Float8BlockwiseActivation):
        if recipe != "blockwise":
            raise TypeError("a Float8BlockwiseActivation input needs recipe='blockwise' (row-wise scales differ)")
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
    check_multiple("a", m, what="rows M")
    check_multiple("a", k, what="columns K")
    check_multiple("b_t", n, what="dim N (-1)")
    check_group_end_offsets("offs", offs)
    if offs.shape[0] != experts:
        raise ValueError(f"offs must hold one group end per expert ({experts}), got shape {tuple(offs.shape)}")
    check_same_device(a=a, b_t=b_t, offs=offs)
    _check_offset_values("offs", offs, m)


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
    """Row-wise FP8 grouped GEMM: ``torch._scaled_grouped_mm`` on CUDA, the reference elsewhere."""
    if a.is_cuda:
        # torch takes the dequantize multipliers directly; fast accumulation as torchao does.
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype, use_fast_accum=True)
    return _scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs).to(out_dtype)


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
    ) -> torch.Tensor:
        ctx.recipe = recipe
        ctx.a_dtype, ctx.b_dtype = a.dtype, b_t.dtype
        w = _weight_from_b_t(b_t)  # [E, N, K] row-major
        if recipe == "rowwise":
            return _rowwise_forward(ctx, a, w, offs, out_dtype)
        if isinstance(a, Float8BlockwiseActivation):
            a_data, a_scale = a.data_and_scale()
        else:
            # A: 1x128 blocks along K, row-major [M, K] + [M, K/128]: the forward GEMM's LHS.
            a_data, a_scale = quantize_1x128(a)
        # W: 128x128 tiles [E, N, K] (forward RHS, K-major) and its exact transpose [E, K, N] (dgrad RHS).
        w_data, w_scale, w_t_data, w_t_scale = quantize_128x128(w, with_transpose=True)
        ctx.save_for_backward(a_data, a_scale, w_t_data, w_t_scale, offs)
        return grouped_gemm_fp8_blockwise(a_data, a_scale, w_data, w_scale, offs, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_out = grad_out.contiguous()  # e.g. the expanded gradient of a .sum()
        if ctx.recipe == "rowwise":
            grad_a, grad_w = _rowwise_backward(ctx, grad_out)
        else:
            grad_a, grad_w = _blockwise_backward(ctx, grad_out)
        # grad_w is [E, N, K]; B_t is its transposed view.
        return grad_a.to(ctx.a_dtype), grad_w.to(ctx.b_dtype).transpose(-2, -1), None, None, None


def _blockwise_backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a_data, a_scale, w_t_data, w_t_scale, offs = ctx.saved_tensors
    # dOut [M, N]: row-wise 1x128 (dgrad LHS) and column-wise [N, M] (wgrad LHS) from one read.
    g_data, g_scale, g_t_data, g_t_scale = quantize_dual_1x128(grad_out, offs)
    # dA [M, K] = dOut @ W per group: RHS = the exact FP8 transpose W^T [E, K, N] (K-major for the GEMM).
    grad_a = grouped_gemm_fp8_blockwise(g_data, g_scale, w_t_data, w_t_scale, offs, out_dtype=torch.bfloat16)
    # dW_e [N, K] = dOut_e^T A_e: A re-encoded column-wise [K, M] by exponent shift, no re-quantization.
    a_t_data, a_t_scale = scaling_aware_transpose(a_data, a_scale, offs)
    grad_w = grouped_gemm_fp8_wgrad(g_t_data, g_t_scale, a_t_data, a_t_scale, offs, out_dtype=torch.float32)
    return grad_a, grad_w


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
) -> torch.Tensor:
    """Differentiable FP8 ``torch._grouped_mm(a, b_t, offs=offs)`` (2-D x 3-D, group END offsets).

    Args:
        a: ``[M, K]`` bf16/fp32, row-major, or a :class:`~fp8flow_ao.tensor.Float8BlockwiseActivation`
            (already quantized 1x128; ``recipe="blockwise"`` only). ``M`` and ``K`` multiples of 128.
        b_t: ``[E, K, N]`` bf16/fp32: the expert weights ``W [E, N, K]`` seen transposed (torchtitan's
            ``w.transpose(-2, -1)``; any other layout is copied to that one). ``N`` a multiple of 128.
        offs: int32 ``[E]`` group END offsets on ``a``'s device, each a multiple of 128 (groups start
            on 128-row boundaries; empty groups allowed). Rows at or past ``offs[-1]`` are not
            computed (``recipe="blockwise"``: zeros; ``"rowwise"``: what ``torch._scaled_grouped_mm``
            leaves there).
        recipe: ``"blockwise"`` (FP8-Flow: 1x128 activations, 128x128 weights) or ``"rowwise"``
            (per-row scales, ``torch._scaled_grouped_mm``; for comparison with torchao).
        out_dtype: output dtype (bf16).

    Returns:
        ``[M, N]`` ``out_dtype``. Gradients flow to ``a`` (its dtype) and ``b_t`` (its dtype).
    """
    _check_args(a, b_t, offs, recipe)
    return _Float8GroupedMM.apply(a, b_t, offs, recipe, out_dtype)
