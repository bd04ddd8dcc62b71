"""The FP8-Flow routed-expert path of a torchtitan-style MoE layer (DESIGN.md, "Dataflow").

One autograd Function, :class:`_FP8FlowRoutedExperts`, runs everything between the router and the
combined output, with exactly two explicit BF16->FP8 casts per step (``x`` in forward, ``dy`` in
backward; every other FP8 tensor comes out of a fused kernel)::

    forward   x -Q1+permute_pad-> x8 (data, scales, probs) -> FC1 (W13 = [w1; w3], 128x128)
              -> h -> swiglu_quant (x prob; also a8's scaling-aware transpose, from the same kernel)
              -> a8 -> FC2 (w2) -> y -> unpermute_unpad (sum over top-k)
    backward  dy -Q2+permute_pad_rows-> dy8 -> FC2 dgrad (exact FP8 w2^T) + FC2 wgrad
              (scaling-aware transpose of dy8; a8's from forward) -> swiglu_quant_backward (row- and column-wise
              dh, grad of the permuted probs) -> FC1 dgrad (exact FP8 W13^T) + FC1 wgrad
              (scaling-aware transpose of x8 that gathers its rows itself: the permuted x8 is not
              written again) -> unpermute_unpad (sum over top-k) -> dx

The router probability multiplies inside SwiGLU, so the combine is an unweighted sum: on SwiGLU's
output for torchtitan's ``score_before_experts=False``, on its inputs (FC1's output rows: FC1 is
linear, so ``expert(p * x)`` needs only ``p * h``) for ``score_before_experts=True`` (Llama 4), so
``x`` is still quantized once, unscaled, before dispatch.

With ``ep_group`` (expert parallelism, :mod:`fp8flow_ao.parallel.expert_parallel`) the FP8 rows
travel after Q1 to the ranks of their experts and the expert path runs there on the received rows
(one expert each); the BF16 outputs return and the top-k sum runs on the token's rank. Backward
sends dy after Q2 along the same routes. Still two explicit casts; one host sync (the split sizes).
Without EP, Q1 and Q2 run inside the permuting kernel (``permute_pad(quantize=True)``,
``permute_pad_rows(quantize=True)``: each token read once in BF16, its FP8 rows written where they go,
x8 also in token order for backward): two kernels and two op calls fewer per step than quantizing first.

Saved for backward: ``x8`` + scales ``[T, D]`` (under EP: the received rows ``[R, D]``) (FP8, never BF16; re-permuted in backward, k times
smaller than the permuted rows), the permuted probs, the routing maps and offsets, references to
the weight parameters (no copy: by default, ``weight_cache="off"``, the weights are re-quantized in
backward into the exact FP8 transposes the dgrads need, the same bits as forward's -- by the dgrad GEMMs
themselves where experts have few rows (``weight_cache.quantized_in_gemm``) -- since holding FP8
copies of every layer's weights from forward to backward costs more memory than the activations;
``"forward"``/``"step"`` keep the forward's transposes instead, :mod:`fp8flow_ao.weight_cache`), and either ``h``
(BF16 ``[M, 2H]``, which SwiGLU's backward needs exactly) + ``a8`` column-wise (FP8, FC2's wgrad operand), or,
with ``recompute_experts=True``, no FC1 output at all: FC1 and swiglu_quant run again in backward on
the same FP8 operands, so the gradients are bit-identical to the stored path.

:func:`convert_moe_layer` installs the path on a torchtitan ``MoE`` module in place (its class is
swapped for a subclass whose ``forward`` runs this path; parameters, buffers, submodules and
``state_dict`` keys stay what they are). The router, shared experts, ``expert_bias`` and the
``tokens_per_expert`` load-balance bookkeeping are the layer's own.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from fp8flow_ao._autograd import first_order_only
from fp8flow_ao._checks import (
    check_bool,
    check_multiple,
    check_row_major,
    check_same_device,
    check_tensor,
    validate_index_range,
    validation_enabled,
)
from fp8flow_ao._format import BLOCK, round_rows_to_fp8_grid
from fp8flow_ao._grad_accumulation import fused_grad_target, grad_leaf
from fp8flow_ao.kernels.dequantize import dequantize
from fp8flow_ao.kernels.grouped_gemm_fp8_blockwise import grouped_gemm_fp8_blockwise
from fp8flow_ao.kernels.grouped_gemm_fp8_wgrad import grouped_gemm_fp8_wgrad
from fp8flow_ao.kernels.permute_pad import permute_pad, permute_pad_rows
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose
from fp8flow_ao.kernels.swiglu_quant import (
    swiglu_backward_reference,
    swiglu_quant,
    swiglu_quant_backward,
    swiglu_reference,
)
from fp8flow_ao.kernels.unpermute_unpad import unpermute_unpad
from fp8flow_ao.parallel.expert_parallel import combine, combine_probs_grad, dispatch, plan_dispatch
from fp8flow_ao.weight_cache import (
    NOTHING,
    ExpertWeightsFP8,
    ExpertWeightsHP,
    WeightOperand,
    check_weight_cache_mode,
    kept_for_backward,
    split_kept,
    step_cached_weights,
    weights_for_backward,
    weights_for_forward,
)

_HP_DTYPES = (torch.bfloat16, torch.float32)
BACKWARDS = ("fp8", "bf16_fc1_dgrad", "bf16", "bf16_wgrad", "emulated_fp8_fc1_dgrad", "emulated_sr_fc1_dgrad")
"""How the routed experts' backward runs: FP8-Flow's FP8 backward; the same with FC1's dgrad in BF16
(:func:`_fc1_dgrad_bf16`); an ablation (:data:`ABLATIONS`); or an emulation (:data:`EMULATIONS`)."""
ABLATIONS = ("bf16", "bf16_wgrad")
"""Backwards for locating a loss gap, not for training: FP8 out of all of the backward, or out of its weight
gradients only (:func:`_grads_bf16`). Eager only, without recompute or expert parallelism."""
EMULATIONS = {"emulated_fp8_fc1_dgrad": "nearest", "emulated_sr_fc1_dgrad": "stochastic"}
"""Backwards that ask what a change to FC1's FP8 dgrad would do to the loss before a kernel is written: the
dgrad in BF16 GEMMs on the values an FP8 GEMM would multiply, dh rounded to the 1x128 FP8 grid (to nearest,
as FP8-Flow does, or stochastically, unbiased) and the forward's FP8 W13 tiles (:func:`_fc1_dgrad_bf16`).
Like ``"bf16_fc1_dgrad"`` they compile and work with every option but ``fsdp_fp8_all_gather``."""
# The backwards whose FC1 dgrad is not an FP8 GEMM (none in "bf16"; BF16 GEMMs in the others): their forward
# makes no W13 transpose for it.
_NO_FP8_FC1_DGRAD = ("bf16", "bf16_fc1_dgrad", *EMULATIONS)


def _fp8_wgrads(backward: str) -> bool:
    """Whether a backward computes the weight gradients in FP8 (every backward but the two ablations; ``"bf16"``
    runs none of the FP8 backward): forward then keeps a8 column-wise, the wgrad's operand."""
    return backward not in ABLATIONS


def _expert_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: WeightOperand, offs: torch.Tensor) -> torch.Tensor:
    """One of the layer's grouped GEMMs, BF16 out: ``a @ B_e^T`` per group, ``B`` FP8 tiles or a weight the
    GEMM quantizes as it loads it (:class:`~fp8flow_ao.weight_cache.WeightOperand`)."""
    return grouped_gemm_fp8_blockwise(
        a, a_scale, b.b, b.b_scale, offs, out_dtype=torch.bfloat16, b_tail=b.b_tail, transpose_b=b.transpose_b
    )


def _fc1_swiglu(
    xp: torch.Tensor,
    xp_scale: torch.Tensor,
    w13: WeightOperand,
    probs: torch.Tensor,
    offs: torch.Tensor,
    score_before: bool,
    transpose: bool,
) -> tuple[torch.Tensor, ...]:
    """FC1 + SwiGLU(x prob) + quant: ``h`` BF16 ``[M, 2H]`` and ``a8`` + scales ``[M, H]`` (forward and recompute);
    with ``transpose`` also ``a8``'s column-wise copy for FC2's wgrad, from the same kernel (its scaling-aware
    transpose: no launch of its own in backward, ``a8`` not read back)."""
    h = _expert_gemm(xp, xp_scale, w13, offs)
    return (h, *swiglu_quant(h, probs, offs, score_before, transpose))


def _autocast_off(fn):
    """Run ``fn(ctx, first, *args)`` with autocast disabled on ``first``'s device.

    The FP8-Flow path fixes its own precisions (FP8 operands, fp32 accumulation, BF16 outputs).
    Ambient autocast (torchtitan's one-GPU mixed precision) would otherwise re-type the torch ops
    inside it, such as the CPU references' matmuls, and differently in forward (under autocast) than
    in a backward recompute (autograd runs backward outside it): recompute would stop being
    bit-identical to the stored path.
    """

    @functools.wraps(fn)
    def wrapped(ctx, first, *args):
        with torch.autocast(first.device.type, enabled=False):
            return fn(ctx, first, *args)

    return wrapped


class _FP8FlowRoutedExperts(torch.autograd.Function):
    """Routed experts of one MoE layer, top-k combine included: ``[T, D]`` tokens -> ``[T, D]`` output."""

    @staticmethod
    @_autocast_off
    def forward(
        ctx,
        x,
        probs,
        expert_indices,
        w1,
        w2,
        w3,
        recompute,
        weight_cache,
        ep_group,
        score_before,
        backward,
        grad_mode,
        *cached,
    ):
        num_experts, top_k = w1.shape[0], expert_indices.shape[1]  # local experts under EP
        # Cast 1 of 2: x [T, D] -> 1x128 FP8 row-wise, before dispatch; everything after stays FP8.
        # The expert path's input rows: the tokens themselves (k experts each; quantized by the kernel
        # that permutes them, which also keeps x8 in token order for backward), or under expert
        # parallelism the FP8 rows this rank received for its local experts (one expert each).
        plan, rows_k = None, top_k
        if ep_group is None:
            routed = permute_pad(x, None, expert_indices, probs.detach(), num_experts, quantize=True)
            rows, rows_scale = routed.token_data, routed.token_scale_inv
        else:
            x_data, x_scale = quantize_1x128(x)
            plan = plan_dispatch(expert_indices, num_experts * dist.get_world_size(ep_group), ep_group)
            rows, rows_scale, rows_probs = dispatch(x_data, x_scale, plan, probs.detach())
            del x_data, x_scale  # sent: the received rows are what the experts read
            rows_k = 1
            routed = permute_pad(rows, rows_scale, plan.local_expert, rows_probs, num_experts)
        offs = routed.group_end_offsets
        # What backward will compute: the weight gradients only for weights that need one (frozen experts:
        # no wgrad operands kept, no wgrads), nothing at all without a gradient (no_grad, inference: the caller's
        # grad mode, since forward runs without it and needs_input_grad follows requires_grad alone).
        needs = [grad_mode and n for n in ctx.needs_input_grad[:6]]
        ctx.wgrads = (needs[4], needs[3] or needs[5])  # (w2, W13)
        # FC1's dgrad only for an x that needs a gradient (e.g. not the first MoE layer's input when everything
        # before it is frozen); under EP always: its rows are other ranks' tokens, returned by a collective.
        ctx.dgrad_x = needs[0] or ep_group is not None
        # FC2's dgrad (and SwiGLU's backward) only where something before it needs a gradient: not where w2 alone
        # trains (but for "bf16_wgrad", whose BF16 weight gradients start from it).
        ctx.dgrad_a = ctx.dgrad_x or needs[1] or ctx.wgrads[1] or not _fp8_wgrads(backward)
        # The dgrads that will run as FP8 GEMMs, each on its weight's exact transpose ("bf16" runs none; the
        # FC1 ablations and emulations run FC1's in BF16): only those transposes are made and kept.
        ctx.fp8_fc1_dgrad = ctx.dgrad_x and backward not in _NO_FP8_FC1_DGRAD
        fp8_fc2_dgrad = ctx.dgrad_a and backward != "bf16"
        # The weights whose existing gradient backward's wgrads may add into (gradient accumulation: whether
        # they do is decided there, see fused_grad_target).
        ctx.grad_leaves = tuple(grad_leaf(w) if needs[3 + i] else None for i, w in enumerate((w1, w2, w3)))
        # Weights: 128x128 tiles, made by the GEMMs themselves as they load the weights where experts have
        # few rows; else by quantize_128x128, with weight_cache "forward"/"step" also the FP8 dgrads' exact
        # transposes, kept for backward (memory for speed: weight_cache.py); "step"'s from its cache (``cached``).
        mode = weight_cache if any(needs) else "off"  # no backward: no transposes to keep
        transposes = (ctx.fp8_fc1_dgrad, fp8_fc2_dgrad)
        tiles = ExpertWeightsFP8(*cached) if cached else NOTHING
        qw = weights_for_forward(w1, w2, w3, mode, rows.shape[0] * rows_k, tiles, transposes)
        # Kept for backward unless recomputed: h and, where the FC2 wgrad runs in FP8, a8 column-wise (the
        # same bytes as a8, which FC2 then no longer needs).
        keep_a_t = not recompute and _fp8_wgrads(backward) and ctx.wgrads[0]
        # w1, w2, w3 are the parameters themselves (alive anyway): saving them costs no memory.
        kept = kept_for_backward(qw, recompute, mode)
        ctx.weights_in_gemm = isinstance(qw, ExpertWeightsHP)
        fc1_w, fc2_w = qw.fc1(), qw.fc2()
        probs_p, src_rows, dst_rows = routed.probs, routed.src_rows, routed.dst_rows
        xp, xp_scale = routed.data, routed.scale_inv
        # A name holds its tensor to the end of the function: released here, the permuted rows and W13's FP8
        # tiles (where backward does not keep them) are freed before FC2 allocates its output, as a compiled
        # graph frees them.
        del qw, routed
        h, a_data, a_scale, *a_t = _fc1_swiglu(xp, xp_scale, fc1_w, probs_p, offs, score_before, keep_a_t)
        del xp, xp_scale, fc1_w
        fc1_saved = () if recompute else (h, *a_t)
        del h, a_t  # recomputed: freed now; else held by fc1_saved
        y = _expert_gemm(a_data, a_scale, fc2_w, offs)
        del a_data, a_scale, fc2_w
        out = unpermute_unpad(y, dst_rows, rows_k)
        del y
        if plan is not None:
            out = combine(out, plan)

        ctx.save_for_backward(rows, rows_scale, probs_p, src_rows, dst_rows, offs, w1, w2, w3, *kept, *fc1_saved)
        ctx.recompute, ctx.top_k, ctx.rows_k, ctx.plan = recompute, top_k, rows_k, plan
        ctx.score_before, ctx.backward = score_before, backward
        ctx.dtypes = (x.dtype, probs.dtype, w1.dtype, w2.dtype, w3.dtype)
        # Return the op's result itself when the dtype already matches: a no-op ``.to`` would hand back an
        # alias of an intermediate, and torch 2.11's dynamo then routes the output's gradient to the
        # intermediate's slot (pytorch/pytorch#180642): compiled backward saw zeros instead of dy.
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        # Under create_graph autograd accumulates out of place: no fused accumulation (decided here, before
        # _backward runs without grad mode).
        leaves = ctx.grad_leaves if not torch.is_grad_enabled() else (None, None, None)
        return _FP8FlowRoutedExperts._backward(ctx, grad_out, leaves)

    @staticmethod
    @_autocast_off
    @first_order_only("fp8flow_routed_experts")  # the FP8 ops have no gradient formulas of their own
    def _backward(ctx, grad_out, leaves):
        rows, rows_scale, probs_p, src_rows, dst_rows, offs, w1, w2, w3, *saved = ctx.saved_tensors
        kept, fc1_saved = split_kept(saved)
        top_k, rows_k, plan = ctx.top_k, ctx.rows_k, ctx.plan
        x_dtype, probs_dtype, _, _, w3_dtype = ctx.dtypes
        # Back to tokens: dx[t] = sum over the token's k rows; grad probs[t, j] = its row's value. Under
        # EP the rows return to their tokens' ranks in BF16 first (the k-sum runs there, in fp32).
        if ctx.backward == "bf16":  # the ablation: no FP8 in backward
            h = fc1_saved[0]
            xp, xp_scale = _gather_again(rows, rows_scale, src_rows, dst_rows, rows_k)
            grad_xp, *grads = _grads_bf16(grad_out, xp, xp_scale, h, probs_p, src_rows, offs, w1, w2, w3, ctx)
            grad_x = unpermute_unpad(grad_xp, dst_rows, rows_k)
        else:
            grad_x, *grads = _grads_fp8(
                ctx, grad_out, rows, rows_scale, probs_p, src_rows, dst_rows, offs, w1, w2, w3, kept, fc1_saved,
                leaves,
            )  # fmt: skip
        grad_probs_p, grad_w2, (grad_w1, grad_w3) = grads
        if plan is not None:
            grad_x = combine(grad_x, plan)
        grad_probs = None
        if grad_probs_p is not None:  # None where w2 alone trains (never under EP: its dgrads always run)
            grad_probs = grad_probs_p.index_select(0, dst_rows)
            grad_probs = grad_probs.view(-1, top_k) if plan is None else combine_probs_grad(grad_probs, plan)
        return (
            None if grad_x is None else grad_x.to(x_dtype),
            None if grad_probs is None else grad_probs.to(probs_dtype),
            None,
            grad_w1,
            grad_w2,
            None if grad_w3 is None else grad_w3.to(w3_dtype),
            None,
            None,
            None,
            None,
            None,
            *(None,) * len(ctx.needs_input_grad[11:]),  # ``cached``: constants
        )


def _gather_again(rows, rows_scale, src_rows, dst_rows, rows_k):
    """The token rows again, in the forward's padded expert-major order (a gather, no cast), as an op
    torch.compile cannot merge with forward's gather (which would save the permuted rows, k x8's bytes)."""
    return permute_pad_rows(rows, rows_scale, src_rows, rows_k, recompute=True, dst_rows=dst_rows)


def _grads_fp8(
    ctx, grad_out, rows, rows_scale, probs_p, src_rows, dst_rows, offs, w1, w2, w3, kept, fc1_saved, leaves
):  # fmt: skip
    """FP8-Flow's backward from the FP8 token rows ``rows`` (permuted again by ``src_rows`` where needed) to
    (grad ``rows`` BF16, each row the sum of its ``rows_k`` permuted rows' gradients, ``None`` where x needs
    none (``ctx.dgrad_x``); grad probs_p ``[M]``, ``None`` where nothing before FC2 needs a gradient
    (``ctx.dgrad_a``); grad w2 ``[E, D, H]``; (grad w1, grad w3) ``[E, H, D]`` each); the weight gradients in the
    weights' dtypes, ``None`` for one not asked for or added into its existing gradient by the wgrad
    (``leaves``: the forward's ``grad_leaves``, see :func:`fused_grad_target`). Each operand is released after
    its last use (a name holds its tensor to the end of the function): the weight gradients are written with as
    little else alive as the order of the GEMMs allows."""
    rows_k, plan = ctx.rows_k, ctx.plan
    w1_dtype, w2_dtype = ctx.dtypes[2:4]
    fp8_wgrads = _fp8_wgrads(ctx.backward)  # "bf16_wgrad" computes them in BF16 instead
    # The weights' exact transposes for the dgrads (and W13 itself when recomputing FC1): kept from
    # forward, or quantized again from the same weights (the same bits), each right before its dgrad
    # and dropped after it, so no FP8 weight copy is alive while the weight gradients are written.
    fp8_fc1_dgrad, in_gemm = ctx.fp8_fc1_dgrad, ctx.weights_in_gemm
    qw13 = (
        weights_for_backward(kept, w1, w2, w3, True, "w13", transpose=fp8_fc1_dgrad, in_gemm=in_gemm)
        if ctx.recompute
        else None
    )
    # Which weight gradients run in FP8 here: none for a frozen weight; "bf16_wgrad" computes them in BF16.
    fp8_wgrad_w2, fp8_wgrad_w13 = (fp8_wgrads and wanted for wanted in ctx.wgrads)
    grad_w2, grad_w13 = None, (None, None)
    if ctx.recompute:
        xp, xp_scale = _gather_again(rows, rows_scale, src_rows, dst_rows, rows_k)
        h, _, _, *a_t = _fc1_swiglu(xp, xp_scale, qw13.fc1(), probs_p, offs, ctx.score_before, fp8_wgrad_w2)
        del xp, xp_scale
    else:
        h, *a_t = fc1_saved

    # Cast 2 of 2: dy [T, D] -> 1x128 FP8 row-wise, moved as x was (the combine's backward): quantized by
    # the kernel that permutes it, or under EP quantized, sent to the experts' ranks, then permuted.
    if plan is None:
        dyp, dyp_scale = permute_pad_rows(
            grad_out.contiguous(), None, src_rows, rows_k, dst_rows=dst_rows, quantize=True
        )
    else:
        dy_data, dy_scale, _ = dispatch(*quantize_1x128(grad_out.contiguous()), plan)
        dyp, dyp_scale = permute_pad_rows(dy_data, dy_scale, src_rows, rows_k, dst_rows=dst_rows)
        del dy_data, dy_scale

    # FC2 dgrad: da [M, H] = dy @ w2 per expert, RHS = exact FP8 w2^T [E, H, D].
    grad_a = None
    if ctx.dgrad_a:
        qw2 = weights_for_backward(kept, w1, w2, w3, ctx.recompute, "w2", in_gemm=in_gemm)
        grad_a = _expert_gemm(dyp, dyp_scale, qw2.fc2_dgrad(), offs)
        del qw2
    # FC2 wgrad: dw2_e [D, H] = dy_e^T a_e on column-wise operands re-encoded from the row-wise ones.
    dyp_t = scaling_aware_transpose(dyp, dyp_scale, offs) if fp8_wgrad_w2 else None
    del dyp, dyp_scale
    if fp8_wgrad_w2:
        a_t, a_t_scale = a_t  # made with a8 by swiglu_quant(transpose=True)
        # Weight gradients leave the GEMM in the weights' dtype: the kernel accumulates in fp32 and rounds
        # once (the same bits as rounding an fp32 result), without writing and re-reading an fp32 copy.
        # The transpose's scales are one per 128x128 tile (b_tile_scales: one FFMA an element to promote).
        # With gradient accumulation it adds into w2's existing gradient there instead (then returns none).
        grad_w2 = _wgrad(*dyp_t, a_t, a_t_scale, offs, w2_dtype, fused_grad_target(leaves[1], w2_dtype))
        del a_t_scale
    del dyp_t, a_t
    if grad_a is None:  # w2 alone trains
        return None, None, grad_w2, grad_w13

    # SwiGLU backward: dh [M, 2H] row-wise (FC1 dgrad) and, where FC1's wgrad runs in FP8, column-wise (its
    # operand; frozen W13: not written), grad of the probs.
    dh, dh_scale, dh_t, dh_t_scale, grad_probs_p = swiglu_quant_backward(
        grad_a, h, probs_p, offs, ctx.score_before, transpose=fp8_wgrad_w13
    )
    # FC1 dgrad: dx_perm [M, D] = dh @ W13 per expert, RHS = exact FP8 W13^T [E, D, 2H].
    if not ctx.dgrad_x:
        grad_xp = None
    elif not fp8_fc1_dgrad:
        dh_rounding = EMULATIONS.get(ctx.backward)
        grad_xp = _fc1_dgrad_bf16(grad_a, h, probs_p, offs, ctx.score_before, w1, w3, dh_rounding)
    else:
        if qw13 is None:
            qw13 = weights_for_backward(kept, w1, w2, w3, ctx.recompute, "w13", in_gemm=in_gemm)
        grad_xp = _expert_gemm(dh, dh_scale, qw13.fc1_dgrad(), offs)
    del qw13, dh, dh_scale  # (recompute's W13 too, in the BF16 mode) no FP8 weight copy alive in the wgrads
    # Back to token order before FC1's wgrad: its [M, D] rows are freed first.
    grad_x = None if grad_xp is None else unpermute_unpad(grad_xp, dst_rows, rows_k)
    del grad_xp
    # FC1 wgrad: dW13_e [2H, D] = dh_e^T x_e, x re-encoded column-wise from the saved x8, gathered by the
    # transpose itself (the permuted rows are never written in backward). w1's and w3's gradients come out
    # as contiguous tensors (_fc1_wgrad): halves of [E, 2H, D] would be strided views, which autograd copies
    # into the parameters' layout (2.2 ms of a 14.6 ms DeepSeek-like step).
    if fp8_wgrad_w13:
        del grad_a, h  # recomputed h: its only reference
        xp_t, xp_t_scale = scaling_aware_transpose(rows, rows_scale, offs, src_rows, rows_k)
        into = (fused_grad_target(leaves[0], w1_dtype), fused_grad_target(leaves[2], w1_dtype))
        grad_w13 = _fc1_wgrad(dh_t, dh_t_scale, xp_t, xp_t_scale, offs, w1_dtype, into)
    elif not fp8_wgrads:
        xp, xp_scale = _gather_again(rows, rows_scale, src_rows, dst_rows, rows_k)
        _, _, grad_w2, grad_w13 = _grads_bf16(
            grad_out, xp, xp_scale, h, probs_p, src_rows, offs, w1, w2, w3, ctx, grad_a
        )
    return grad_x, grad_probs_p, grad_w2, grad_w13


def _wgrad(a_t, a_t_scale, b_t, b_t_scale, offs, dtype, into):
    """One weight's FP8 gradient in ``dtype`` (``b_t``'s scales one per tile): returned, or added into ``into``
    (the weight's existing gradient) in the epilogue, and ``None`` returned."""
    args = (a_t, a_t_scale, b_t, b_t_scale, offs)
    grad = grouped_gemm_fp8_wgrad(*args, out_dtype=dtype, accumulate_into=into, b_tile_scales=True)
    return None if into is not None else grad


def _fc1_wgrad(dh_t, dh_t_scale, xp_t, xp_t_scale, offs, dtype, into):
    """FC1's weight gradients ``(w1's, w3's)``, each ``[E, H, D]`` contiguous in ``dtype``, from dh column-wise
    (``dh_t`` ``[2H, M]``: w1's rows, then w3's) and x column-wise; ``into``: per weight, its existing gradient
    to add into in the epilogue (gradient accumulation; that weight's entry is then ``None``), or ``None``."""
    if into[0] is None and into[1] is None:  # one launch writing both, as [2, E, H, D]
        return grouped_gemm_fp8_wgrad(
            dh_t, dh_t_scale, xp_t, xp_t_scale, offs, out_dtype=dtype, n_chunks=2, b_tile_scales=True
        ).unbind(0)
    # One launch per weight: each adds into its own tensor. The halves of dh_t are contiguous row ranges;
    # their scales, columns of [M/128, 2H], are copied (M/128 x H floats) for the kernels' flat scale loads.
    hidden = dh_t.shape[0] // 2
    halves = (slice(0, hidden), slice(hidden, 2 * hidden))
    return tuple(
        _wgrad(dh_t[rows], dh_t_scale[:, rows].contiguous(), xp_t, xp_t_scale, offs, dtype, target)
        for rows, target in zip(halves, into, strict=True)
    )


def _grads_bf16(grad_out, xp, xp_scale, h, probs_p, src_rows, offs, w1, w2, w3, ctx, grad_a=None):
    """The backward ablations: gradients in BF16 as torchtitan computes them (``torch._grouped_mm`` on BF16
    operands, the weights' own BF16 values, SwiGLU in fp32), at the FP8 forward's activations (the
    dequantized rows ``xp`` of x8 and FC1's saved output ``h``); every quantization of the forward
    counts as the identity (straight through).

    Without ``grad_a`` (``backward="bf16"``): every gradient, from the BF16 ``dy``; nothing in backward is
    FP8, so a loss gap left with it comes from the forward. Given the FP8 dgrad's ``grad_a``
    (``backward="bf16_wgrad"``): the weight gradients only, dh from SwiGLU's fp32 backward of it, so with
    ``"bf16"`` it splits a backward gap between dgrads and wgrads. Returns FP8-Flow's layout: grad xp
    ``[M, D]`` (None with ``grad_a``), grad probs_p ``[M]``, grad w2 ``[E, D, H]`` and (grad w1, grad w3)
    ``[E, H, D]`` each, the weight gradients in w2's and w1's dtypes."""
    every = grad_a is None
    dyp, _ = permute_pad_rows(grad_out.to(torch.bfloat16).contiguous(), None, src_rows, ctx.rows_k)
    a = swiglu_reference(h, probs_p, offs, ctx.score_before).to(torch.bfloat16)
    grad_a_bf16, grad_w2 = _grouped_mm_vjp(a, w2, offs, dyp, with_x=every)
    *dh_halves, grad_probs_p = swiglu_backward_reference(
        grad_a_bf16 if every else grad_a, h, probs_p, offs, ctx.score_before
    )
    dh = torch.cat(dh_halves, dim=1)
    x_bf16 = dequantize(xp, xp_scale, out_dtype=torch.bfloat16)
    grad_xp, grad_w13 = _grouped_mm_vjp(x_bf16, torch.cat([w1, w3], dim=1), offs, dh, with_x=every)
    # w1's and w3's gradients as contiguous tensors: autograd would copy strided halves of [E, 2H, D] anyway.
    grad_w1, grad_w3 = (g.contiguous() for g in grad_w13.to(w1.dtype).chunk(2, dim=1))
    return grad_xp, grad_probs_p, grad_w2.to(w2.dtype), (grad_w1, grad_w3)


def _fc1_dgrad_bf16(grad_a, h, probs_p, offs, score_before, w1, w3, dh_rounding=None):
    """``backward="bf16_fc1_dgrad"``: FC1's dgrad (grad xp ``[M, D]`` BF16) from unquantized operands, as
    torchtitan computes it: dh by SwiGLU's fp32 backward of FP8-Flow's ``grad_a``, rounded to BF16, times the
    BF16 weights (``dh_gate @ w1 + dh_up @ w3``: two GEMMs on dh's halves, so no ``[E, 2H, D]`` weight copy).
    With ``dh_rounding`` (:data:`EMULATIONS`): dh on its 1x128 FP8 grid instead, rounded ``"nearest"`` or
    ``"stochastic"``, times the forward's FP8 tiles of w1, w3 (both exact in BF16: an FP8 GEMM's operands).
    Rows past the last group are not defined (unpermute reads real rows only)."""
    dh_gate, dh_up, _ = swiglu_backward_reference(grad_a, h, probs_p, offs, score_before)
    if dh_rounding is not None:  # H is a multiple of 128: dh's blocks never straddle its halves
        dh_gate, dh_up = (round_rows_to_fp8_grid(d, BLOCK, dh_rounding) for d in (dh_gate, dh_up))
        w1, w3 = (
            dequantize(*quantize_128x128(w, with_transpose=False)[:2], "128x128", torch.bfloat16) for w in (w1, w3)
        )
    grad_xp = torch._grouped_mm(dh_gate.to(torch.bfloat16), w1.detach().to(torch.bfloat16), offs=offs)
    return grad_xp.add_(torch._grouped_mm(dh_up.to(torch.bfloat16), w3.detach().to(torch.bfloat16), offs=offs))


def _grouped_mm_vjp(x, w, offs, grad, with_x):
    """(grad of ``x`` or None, grad of ``w``) of BF16 ``torch._grouped_mm(x, w^T, offs)``, ``x`` ``[M, K]``,
    ``w`` ``[E, N, K]``, for the output gradient ``grad`` ``[M, N]``. By autograd, so torch lays out its
    own transposes (one more forward GEMM: the ablations buy simplicity with time)."""
    with torch.enable_grad():
        x_b = x.detach().to(torch.bfloat16).requires_grad_(with_x)
        w_b = w.detach().to(torch.bfloat16).requires_grad_()
        out = torch._grouped_mm(x_b, w_b.transpose(-2, -1), offs=offs)
        grads = torch.autograd.grad(out, (x_b, w_b) if with_x else (w_b,), grad.to(torch.bfloat16))
    return (grads[0], grads[1]) if with_x else (None, grads[0])


def fp8flow_routed_experts(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    recompute_experts: bool = False,
    weight_cache: str = "off",
    ep_group: dist.ProcessGroup | None = None,
    score_before_experts: bool = False,
    backward: str = "fp8",
    compile_backend: str | Callable | None = None,
    compile_mode: str | None = None,
) -> torch.Tensor:
    """FP8-Flow routed experts with the top-k combine: ``sum_j top_scores[t, j] * expert_j(x[t])``.

    Equal in function to torchtitan's routed path (the experts ``w2 @ (silu(w1 x) * w3 x)``),
    computed on FP8 operands (see the module docstring). With ``score_before_experts=True`` it is
    ``sum_j expert_j(top_scores[t, j] * x[t])``, torchtitan's ``score_before_experts=True`` (Llama 4).

    Args:
        x: ``[T, D]`` bf16 (or fp32) tokens, row-major; ``D`` a multiple of 128.
        top_scores: ``[T, k]`` fp32 (or bf16) router probabilities of the chosen experts; differentiable.
        selected_experts_indices: ``[T, k]`` int32/int64 expert ids in ``[0, E)``.
        w1, w3: ``[E, H, D]``; w2: ``[E, D, H]`` (torchtitan ``GroupedExperts``), bf16 or fp32;
            ``H`` a multiple of 128.
        recompute_experts: keep only the FP8 ``x`` (+ probs, routing) for backward and recompute
            FC1 + SwiGLU there (bit-identical gradients, less activation memory).
        weight_cache: ``"off"``, ``"forward"`` or ``"step"``: how often the weights are quantized and
            what FP8 copies stay alive (memory for speed; :mod:`fp8flow_ao.weight_cache`). Every mode
            gives bit-identical results.
        ep_group: expert parallelism: the process group over which the experts are split. Then
            ``w1``, ``w2``, ``w3`` are this rank's ``E_local`` experts (rank ``p`` owns global experts
            ``[p * E_local, (p + 1) * E_local)``), ``selected_experts_indices`` are global ids in
            ``[0, E_local * group size)``, and the FP8 rows travel to the experts' ranks and back
            (:mod:`fp8flow_ao.parallel.expert_parallel`; one host sync per call for the split sizes).
            Every rank of the group must call this together.
        score_before_experts: scale each expert's input by its score instead of its output
            (applied to FC1's output rows inside the fused SwiGLU; ``x`` is quantized unscaled).
        backward: ``"fp8"`` (FP8-Flow: every backward GEMM in FP8); ``"bf16_fc1_dgrad"`` -- the same with
            FC1's dgrad (the gradient of the experts' input, which flows back to the earlier layers) in BF16
            from the unquantized dh and the BF16 weights (:func:`_fc1_dgrad_bf16`): in 2000-step torchtitan
            runs its mean loss gap to BF16 is +0.08% +- 0.40% (7 runs) against FP8-Flow's +0.01% +- 0.19%
            (54 runs; mean +- 2 SE, one run's noise 0.38%: not resolved, ``convergence.md``, 2026-11-27), for
            one BF16 GEMM in place of an FP8 one (about 2/9 of the layer's GEMM FLOPs); it works with
            recompute, expert parallelism and compilation. Or an ablation for locating a loss gap, not
            for training speed: ``"bf16"`` -- the same FP8 forward, its gradients computed in BF16 with
            no FP8 in backward (:func:`_grads_bf16`; slower than BF16's own backward); ``"bf16_wgrad"``
            -- FP8-Flow's backward with the weight gradients computed again in BF16 from unquantized
            operands (the dgrads stay FP8). Each ablation needs ``recompute_experts=False`` (it reads
            FC1's saved output), no ``ep_group``, and eager mode (its backward runs autograd on a BF16
            graph, which dynamo cannot trace; the layer's ``fp8flow_compile_backend`` is ignored for it).
            Or an emulation (:data:`EMULATIONS`): ``"emulated_fp8_fc1_dgrad"`` / ``"emulated_sr_fc1_dgrad"``,
            FC1's dgrad in BF16 GEMMs on FP8-Flow's own FP8 operands, dh rounded to nearest / stochastically.
        compile_backend: run the path's autograd graph (everything after the argument checks and the
            ``weight_cache="step"`` lookup, which stay eager) under ``torch.compile(fullgraph=True,
            backend=compile_backend)``; ``None``: eagerly. Ignored while dynamo traces the caller (the path
            is then part of the caller's graph, and ``"step"`` quantizes in it as ``"forward"`` does).
            Needs no ``ep_group`` (its all-to-all split sizes are host integers) and no ablation ``backward``.
        compile_mode: ``torch.compile``'s ``mode`` for ``compile_backend="inductor"`` (``None``: its default).
            ``"reduce-overhead"`` replays the path's forward and backward as CUDA graphs (the path has no
            host sync and static shapes: routed rows are padded to a bound): the path's host time per
            forward + backward drops from 4.1 to 1.0 ms (Qwen3-30B-A3B-like, H200, the path alone; the
            whole layer went 4.43 / 4.46 -> 4.17 / 4.50 ms balanced / skewed, ``bench_moe_layer.py``). The
            inputs other than parameters are copied into the graphs' buffers each replay (``x``,
            ``top_scores``, the ids: small), except ``weight_cache="step"``'s cached tiles: the cache then
            re-quantizes into the same tensors after each weight update and marks them static
            (:func:`~fp8flow_ao.weight_cache.step_cached_weights`' ``static_addresses``), so the graphs read
            them in place (Qwen3-30B-A3B-like layer, a cached micro-batch: 1.90x / 2.00x BF16 against 1.53x /
            1.63x for the graphs without the cache, H200). As with any CUDA-graphed ``torch.compile``, an
            output is overwritten by the next replay: do not hold one across steps.

    Returns:
        ``[T, D]`` in ``x``'s dtype. Gradients flow to ``x``, ``top_scores``, ``w1``, ``w2``, ``w3``. Where a
        weight already holds a gradient and ``.backward()`` will accumulate into it (gradient accumulation), the
        eager path adds the weight's gradient into it in the wgrad epilogue instead of returning a fresh one for
        autograd to add (the rule: :func:`~fp8flow_ao._grad_accumulation.fused_grad_target`; expert
        parallelism's DTensor weights too); a compiled path (``compile_backend``) returns fresh gradients.
    """
    routed = _routed_experts
    compiling = torch.compiler.is_compiling()
    _check_compile_options(compile_backend, compile_mode, ep_group, backward)
    if compile_backend is not None and not compiling:
        routed = compiled_routed_experts(compile_backend, compile_mode)
    args = (x, top_scores, selected_experts_indices, w1, w2, w3, recompute_experts, weight_cache, ep_group)
    args += (score_before_experts, backward)
    cached = ()
    if routed is not _routed_experts and weight_cache == "step":  # a compiled graph gets the tiles as inputs
        _check_routed_experts(*args)  # before the lookup quantizes the weights
        cached = _step_tiles(w1, w2, w3, weight_cache, static_addresses=compile_mode == "reduce-overhead")
    return routed(*args, *cached)


def _step_tiles(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, weight_cache: str, static_addresses: bool = False
) -> tuple[torch.Tensor, ...]:
    """:func:`~fp8flow_ao.weight_cache.step_cached_weights` as the tensors alone (none outside ``"step"`` or
    while tracing): None arguments break dynamo's dynamic-shape recompiles of the Function (torch 2.11)."""
    return tuple(t for t in step_cached_weights(w1, w2, w3, weight_cache, static_addresses) if t is not None)


def _check_compile_options(backend: str | Callable | None, mode: str | None, ep_group: object, backward: str) -> None:
    """Raise on ``compile_backend`` / ``compile_mode`` values :func:`fp8flow_routed_experts` does not take."""
    if backend is not None and (ep_group is not None or backward in ABLATIONS):
        raise ValueError(
            "compile_backend needs ep_group=None (expert parallelism's split sizes are host integers) and "
            f"a backward other than the eager ablations {ABLATIONS}; got ep_group={ep_group}, backward={backward!r}"
        )
    if mode is not None and backend != "inductor":
        raise ValueError(f'compile_mode={mode!r} needs compile_backend="inductor", got {backend!r}')


def _routed_experts(
    x, top_scores, selected_experts_indices, w1, w2, w3, recompute_experts, weight_cache, ep_group,
    score_before_experts, backward, *cached
) -> torch.Tensor:  # fmt: skip
    """The argument checks and :class:`_FP8FlowRoutedExperts` on ``"step"``'s cached weights (``cached``: the
    tensors of an :class:`~fp8flow_ao.weight_cache.ExpertWeightsFP8`; none: looked up here when eager): the
    graph a compiled path (``compile_backend``) captures. The checks are in the graph: their guards tie the
    inputs' sizes together (a dynamic-shape recompile without them fails in dynamo's autograd.Function
    tracing, torch 2.11)."""
    _check_routed_experts(
        x, top_scores, selected_experts_indices, w1, w2, w3, recompute_experts, weight_cache, ep_group,
        score_before_experts, backward,
    )  # fmt: skip
    cached = cached or _step_tiles(w1, w2, w3, weight_cache)  # eager: looked up here, after the checks
    return _FP8FlowRoutedExperts.apply(
        x,
        top_scores,
        selected_experts_indices,
        w1,
        w2,
        w3,
        bool(recompute_experts),
        weight_cache,
        ep_group,
        bool(score_before_experts),
        backward,
        torch.is_grad_enabled(),
        *cached,
    )


def _check_routed_experts(
    x, top_scores, selected_experts_indices, w1, w2, w3, recompute_experts, weight_cache, ep_group,
    score_before_experts, backward,
) -> None:  # fmt: skip
    """Raise on arguments :func:`fp8flow_routed_experts` does not take (its docstring)."""
    check_tensor("x", x, dtypes=_HP_DTYPES, ndim=2)
    check_row_major("x", x)
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        check_tensor(name, w, dtypes=_HP_DTYPES, ndim=3)
    if not w1.dtype == w2.dtype == w3.dtype:
        raise TypeError(f"w1, w2, w3 must share one dtype, got {w1.dtype}, {w2.dtype}, {w3.dtype}")
    num_experts, hidden, dim = w1.shape
    if tuple(w3.shape) != (num_experts, hidden, dim) or tuple(w2.shape) != (num_experts, dim, hidden):
        raise ValueError(
            f"expert weights must be w1, w3 [E, H, D] and w2 [E, D, H]; got w1 {tuple(w1.shape)}, "
            f"w2 {tuple(w2.shape)}, w3 {tuple(w3.shape)}"
        )
    if x.shape[1] != dim:
        raise ValueError(f"x must be [T, D={dim}] (the experts' D), got shape {tuple(x.shape)}")
    check_multiple("x", dim, what="hidden dim D")
    check_multiple("w1", hidden, what="expert ffn dim H")
    if ep_group is not None and not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"ep_group must be a torch.distributed.ProcessGroup or None, got {type(ep_group).__name__}")
    check_tensor("top_scores", top_scores, dtypes=_HP_DTYPES, ndim=2)
    check_tensor("selected_experts_indices", selected_experts_indices, dtypes=(torch.int32, torch.int64), ndim=2)
    if top_scores.shape != selected_experts_indices.shape or top_scores.shape[0] != x.shape[0]:
        raise ValueError(
            f"top_scores {tuple(top_scores.shape)} and selected_experts_indices "
            f"{tuple(selected_experts_indices.shape)} must both be [T={x.shape[0]}, k]"
        )
    if validation_enabled(selected_experts_indices):  # the ids' values: free on CPU, opt-in on a GPU (a sync)
        experts = num_experts * (1 if ep_group is None else dist.get_world_size(ep_group))  # global ids under EP
        validate_index_range("selected_experts_indices", selected_experts_indices, 0, experts)
    check_same_device(
        x=x, top_scores=top_scores, selected_experts_indices=selected_experts_indices, w1=w1, w2=w2, w3=w3
    )
    check_bool("recompute_experts", recompute_experts)
    check_bool("score_before_experts", score_before_experts)
    check_weight_cache_mode(weight_cache)
    check_backward(backward, recompute_experts, ep_group is not None)


def check_backward(
    backward: object, recompute_experts: bool, expert_parallel: bool, fsdp_fp8_all_gather: bool = False
) -> None:
    """Raise ``ValueError`` unless ``backward`` is one of :data:`BACKWARDS` and fits the other options."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if backward != "fp8" and fsdp_fp8_all_gather:
        raise ValueError(
            f"backward={backward!r} multiplies by the BF16 expert weights, which fsdp_fp8_all_gather=True "
            "does not gather (it gathers FP8 tiles): use one or the other"
        )
    if backward in ABLATIONS and torch.compiler.is_compiling():
        raise ValueError(f"backward={backward!r} (an ablation) runs eagerly: its backward differentiates a BF16 graph")
    if backward in ABLATIONS and (recompute_experts or expert_parallel):
        raise ValueError(
            f"backward={backward!r} (an ablation) needs recompute_experts=False and no expert parallelism: "
            "it reads FC1's saved output and the BF16 output gradient of this rank's rows"
        )


# ---------------------------------------------------------------------------------------------------
# The layer: torchtitan MoE / GroupedExperts with the FP8-Flow forward
# ---------------------------------------------------------------------------------------------------


def _local(w: torch.Tensor) -> torch.Tensor:
    """A DTensor weight's local shard (torchtitan's ``GroupedExperts`` does the same), else ``w``."""
    return w.to_local() if hasattr(w, "to_local") else w


@functools.cache
def compiled_routed_experts(backend: str | Callable, mode: str | None = None) -> Callable[..., torch.Tensor]:
    """The routed path's checks and autograd graph (``_routed_experts``) under ``torch.compile(fullgraph=True,
    backend=backend, mode=mode)``, one per (backend, mode) (:func:`fp8flow_routed_experts`' ``compile_backend``
    and ``compile_mode``).

    One compiled function for every layer: dynamo caches graphs on the function's code and guards on
    its arguments (shapes, dtypes, the Python options), so same-shaped layers share one graph instead
    of recompiling per layer up to dynamo's recompile limit.
    """
    return torch.compile(_routed_experts, fullgraph=True, backend=backend, mode=mode)


class _SwappedClassMixin:
    """Pickling for the classes :func:`_swap_class` makes at run time (``torch.save(model)``, ``pickle``,
    ``copy.deepcopy``): pickle finds a class by its module and name, which a class made by ``type()`` does not
    have; the object is pickled as made from its original class and this mixin instead, which rebuild it."""

    def __reduce_ex__(self, protocol: int):
        mixin, original = type(self).__bases__
        reduced = super().__reduce_ex__(protocol)  # (constructor, its args, state, ...): the state is kept
        return (_new_swapped, (original, mixin), *reduced[2:])


def _new_swapped(original: type, mixin: type) -> nn.Module:
    """An uninitialized instance of ``(mixin, original)``'s swapped class (pickle then sets its state)."""
    cls = _swapped_class(original, mixin)
    return cls.__new__(cls)


class FP8FlowGroupedExperts(_SwappedClassMixin):
    """Mixin over torchtitan's ``GroupedExperts``: ``forward(x, top_scores, indices)`` = routed path + combine.

    Running the path inside the experts module keeps FSDP2's pre-forward hooks (which unshard
    ``w1/w2/w3`` when the experts are sharded on their own) in effect.

    With ``fp8flow_compile_backend`` set, the routed path runs compiled (:func:`fp8flow_routed_experts`'
    ``compile_backend``): the compiled region is the path's autograd graph inside ``forward``, not the
    module's ``__call__``, so the module's hooks (FSDP2's unshard), the DTensor ``to_local`` of the
    weights and ``weight_cache="step"``'s lookup stay outside the graph, and this module's attributes are
    read eagerly on every call and passed in as arguments: nothing set later (``fp8flow_ep_group``) can
    be frozen into a graph traced before. Under expert parallelism and the ablations the path runs
    eagerly: its all-to-all split sizes are host integers; their backward runs autograd.
    """

    fp8flow_recompute_experts: bool = False
    fp8flow_weight_cache: str = "off"
    # Set by fp8flow_ao.parallel.expert_parallel's apply (torchtitan's expert_parallel_degree > 1).
    fp8flow_ep_group: dist.ProcessGroup | None = None
    # The MoE layer's score_before_experts (Llama 4: True), set by convert_moe_layer.
    fp8flow_score_before_experts: bool = False
    # A torch.compile backend for the routed path (None: eager); set by the torchtitan converter
    # (fp8flow.compile_experts), since torchtitan's apply_compile skips the experts module.
    fp8flow_compile_backend: str | None = None
    # Its torch.compile mode (fp8flow_routed_experts' compile_mode), e.g. "reduce-overhead" (CUDA graphs).
    fp8flow_compile_mode: str | None = None
    # One of BACKWARDS (fp8flow_routed_experts' backward).
    fp8flow_backward: str = "fp8"

    def forward(self, x: torch.Tensor, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        """torchtitan's ``GroupedExperts.forward`` contract (``[T, D]`` tokens, ``[T, k]`` scores and ids ->
        ``[T, D]``, the top-k combine included) on :func:`fp8flow_routed_experts` with this module's options."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        compile_ = self.fp8flow_ep_group is None and self.fp8flow_backward not in ABLATIONS
        return fp8flow_routed_experts(
            x,
            top_scores,
            selected_experts_indices,
            w1,
            w2,
            w3,
            recompute_experts=self.fp8flow_recompute_experts,
            weight_cache=self.fp8flow_weight_cache,
            ep_group=self.fp8flow_ep_group,
            score_before_experts=self.fp8flow_score_before_experts,
            backward=self.fp8flow_backward,
            compile_backend=self.fp8flow_compile_backend if compile_ else None,
            compile_mode=self.fp8flow_compile_mode if compile_ else None,
        )


class FP8FlowMoE(_SwappedClassMixin):
    """Mixin over torchtitan's ``MoE``: its ``forward`` with the routed experts on the FP8-Flow path."""

    @property
    def score_before_experts(self) -> bool:
        """torchtitan's flag, kept where the routed path reads it (``experts.fp8flow_score_before_experts``):
        setting it on a converted layer changes where its scores multiply, as on torchtitan's own layer."""
        return self.experts.fp8flow_score_before_experts

    @score_before_experts.setter
    def score_before_experts(self, value: bool) -> None:
        check_bool("score_before_experts", value)
        self.experts.fp8flow_score_before_experts = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """torchtitan's ``MoE.forward`` (``[B, S, D]`` -> ``[B, S, D]``: router, load-balance counts, routed
        experts, shared experts) with the routed experts on the FP8-Flow path."""
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        # Load-balance bookkeeping exactly as torchtitan (read by its expert-bias update hook).
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        out = self.experts(x, top_scores, selected_experts_indices)
        if self.shared_experts is not None:
            out = self.shared_experts(x) + out
        return out.reshape(bs, slen, dim)


_SWAPPED_CLASSES: dict[tuple[type, type], type] = {}


def _swapped_class(cls: type, mixin: type) -> type:
    """The class ``(mixin, cls)``, made once per original class."""
    key = (cls, mixin)
    if key not in _SWAPPED_CLASSES:
        _SWAPPED_CLASSES[key] = type(f"FP8Flow{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _SWAPPED_CLASSES[key]


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Give ``module`` the class ``(mixin, type(module))``."""
    module.__class__ = _swapped_class(type(module), mixin)


def is_moe_layer(module: nn.Module, fqn: str = "") -> bool:
    """True for a torchtitan-style MoE layer: a ``router`` and ``experts`` holding 3-D ``w1``, ``w2``, ``w3``.

    Takes ``quantize_``'s ``filter_fn`` arguments (``fqn`` is unused), so it can serve as one.
    """
    experts = getattr(module, "experts", None)
    return (
        isinstance(module, nn.Module)
        and isinstance(getattr(module, "router", None), nn.Module)
        and isinstance(experts, nn.Module)
        and all(
            isinstance(getattr(experts, n, None), torch.Tensor) and getattr(experts, n).dim() == 3
            for n in ("w1", "w2", "w3")
        )
    )


def is_converted(module: nn.Module) -> bool:
    """True if :func:`convert_moe_layer` (either recipe) already ran on this MoE layer."""
    from fp8flow_ao.tensor import FP8FlowExpertWeight

    return isinstance(module, FP8FlowMoE) or isinstance(getattr(module.experts, "w1", None), FP8FlowExpertWeight)


def check_moe_layer(module: nn.Module, fqn: str = "") -> None:
    """Raise ``ValueError`` unless ``module`` is an unconverted MoE layer this path supports."""
    where = f"MoE layer {fqn!r}" if fqn else f"MoE layer {type(module).__name__}"
    if not is_moe_layer(module):
        raise ValueError(f"{where}: needs .router and .experts with 3-D w1, w2, w3 (torchtitan MoE / GroupedExperts)")
    if is_converted(module):
        raise ValueError(f"{where} is already converted to FP8-Flow; quantize_ must run once per model")
    missing = [n for n in ("expert_bias", "tokens_per_expert", "shared_experts") if not hasattr(module, n)]
    if missing or not hasattr(module.router, "top_k"):
        raise ValueError(f"{where}: missing torchtitan MoE attributes {missing or ['router.top_k']}")
    e, h, d = module.experts.w1.shape
    shapes = {n: tuple(getattr(module.experts, n).shape) for n in ("w1", "w2", "w3")}
    if shapes != {"w1": (e, h, d), "w2": (e, d, h), "w3": (e, h, d)}:
        raise ValueError(f"{where}: expert weights must be w1, w3 [E, H, D] and w2 [E, D, H], got {shapes}")
    if d % 128 or h % 128:
        raise ValueError(
            f"{where}: FP8-Flow needs the model dim D and the expert ffn dim H to be multiples of 128 "
            f"(1x128 / 128x128 blocks), got D={d}, H={h}"
        )
    dtypes = {n: getattr(module.experts, n).dtype for n in ("w1", "w2", "w3")}
    if any(dtype not in _HP_DTYPES for dtype in dtypes.values()):
        raise ValueError(f"{where}: FP8-Flow's expert path runs in {_HP_DTYPES}; the expert weights are {dtypes}")


def convert_moe_layer(
    module: nn.Module,
    recompute_experts: bool = False,
    fqn: str = "",
    weight_cache: str = "off",
    fsdp_fp8_all_gather: bool = False,
    backward: str = "fp8",
) -> nn.Module:
    """Install the FP8-Flow routed-expert path on a torchtitan-style MoE layer, in place.

    The layer's class becomes a subclass of its own (``isinstance(module, MoE)`` still holds) whose
    ``forward`` quantizes once before dispatch and runs :func:`fp8flow_routed_experts` in its
    ``experts`` module; parameters stay plain ``nn.Parameter`` s, so ``state_dict`` is unchanged.
    Raises ``ValueError`` (see :func:`check_moe_layer`) for unsupported layers or a second conversion.
    ``weight_cache`` and ``backward`` are :func:`fp8flow_routed_experts`'s. ``fsdp_fp8_all_gather`` wraps the expert
    weights so that FSDP2 all-gathers them as FP8 tiles (:mod:`fp8flow_ao.parallel.fsdp`; the
    parameters become :class:`~fp8flow_ao.tensor.FP8FlowExpertWeight` s, ``state_dict`` stays plain).
    """
    check_moe_layer(module, fqn)
    check_bool("recompute_experts", recompute_experts)
    check_bool("fsdp_fp8_all_gather", fsdp_fp8_all_gather)
    check_weight_cache_mode(weight_cache)
    check_backward(backward, recompute_experts, False, fsdp_fp8_all_gather)
    if "torchtitan" in sys.modules:  # its expert_parallel_degree must dispatch this layer in FP8
        from fp8flow_ao.torchtitan.expert_parallel import install

        install()
    _swap_class(module.experts, FP8FlowGroupedExperts)
    module.experts.fp8flow_recompute_experts = recompute_experts
    module.experts.fp8flow_weight_cache = weight_cache
    module.experts.fp8flow_backward = backward
    module.experts.fp8flow_score_before_experts = bool(getattr(module, "score_before_experts", False))
    if fsdp_fp8_all_gather:
        from fp8flow_ao.tensor import wrap_expert_weights

        wrap_expert_weights(module.experts, recipe="blockwise")
    _swap_class(module, FP8FlowMoE)
    return module
