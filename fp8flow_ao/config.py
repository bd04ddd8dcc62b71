"""``FP8FlowConfig``: turn on FP8-Flow for a model's MoE layers with torchao's ``quantize_``.

Usage::

    from torchao.quantization import quantize_
    from fp8flow_ao.config import FP8FlowConfig

    quantize_(model, FP8FlowConfig())                          # every torchtitan-style MoE layer
    quantize_(model, FP8FlowConfig(recompute_experts=True))   # keep only the FP8 expert input
    quantize_(model, FP8FlowConfig(weight_cache="forward"))    # FP8 weight transposes from the forward
    quantize_(model, FP8FlowConfig(module_filter=lambda m, fqn: fqn != "layers.0.moe"))

What gets converted: torchtitan-style MoE layers (a module with ``.router`` and ``.experts``
holding 3-D ``w1``, ``w2``, ``w3``; :func:`fp8flow_ao.moe.is_moe_layer`).

* ``recipe="blockwise"`` (default, FP8-Flow): the layer runs the fused FP8 expert path of
  :mod:`fp8flow_ao.moe`; its parameters stay plain.
* ``recipe="rowwise"`` (for comparison with torchao's FP8 row-wise MoE training): the layer keeps
  torchtitan's forward and its expert weights become :class:`~fp8flow_ao.tensor.FP8FlowExpertWeight`,
  so each ``torch._grouped_mm`` runs the row-wise FP8 grouped GEMM. That GEMM needs 128-aligned
  expert groups, so this recipe sets torchtitan's process-wide token group alignment to 128.

Either way ``model.state_dict()`` holds plain tensors under the original keys, so checkpoints move
freely between converted and unconverted models.

How the plain call ``quantize_(model, FP8FlowConfig())`` reaches the MoE layers: torchao 0.18's
``quantize_`` hands the handler only the modules its ``filter_fn`` accepts, and the default filter
accepts ``nn.Linear`` modules only (there is no per-config default filter). Every torchtitan MoE
layer holds one (``router.gate``), so the handler receives those; on the first one it looks up the
model ``quantize_`` was called on (the ``model`` argument of the ``quantize_`` call frames on the
stack: torchao keeps no other reference to it) and converts every MoE layer of that model at once,
raising if there is none; Linear modules are returned untouched. Passing
``filter_fn=fp8flow_ao.moe.is_moe_layer`` (or any filter that accepts MoE layers) instead hands the MoE
layers to the handler directly; the first one converts, the same way, every MoE layer that filter accepts.
The conversion itself is :func:`convert_to_fp8flow`, which needs no ``quantize_`` at all. (A filter that
accepts no module of the model never reaches the handler: ``quantize_`` then converts nothing.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization import quant_api
from torchao.quantization.transform_module import register_quantize_module_handler

from fp8flow_ao._checks import check_bool
from fp8flow_ao.grouped_mm import RECIPES
from fp8flow_ao.moe import check_backward, check_moe_layer, convert_moe_layer, is_moe_layer
from fp8flow_ao.tensor import wrap_expert_weights
from fp8flow_ao.weight_cache import check_weight_cache_mode

# FP8-Flow's token groups are 128-row aligned (1x128 / 128x128 blocks never straddle two experts).
TOKEN_GROUP_ALIGNMENT = 128


@dataclass
class FP8FlowConfig(AOBaseConfig):
    """Configuration of the FP8-Flow MoE training recipe for ``torchao.quantization.quantize_``.

    Attributes:
        recompute_experts: keep only the FP8 expert input (+ scales, probs, routing) for backward and
            recompute FC1 and SwiGLU there; gradients are bit-identical, activation memory lower.
            ``recipe="blockwise"`` only.
        recipe: ``"blockwise"`` (FP8-Flow: 1x128 activations, 128x128 weights, fused expert path) or
            ``"rowwise"`` (per-row scales and ``torch._scaled_grouped_mm`` on torchtitan's own
            expert path; a baseline for comparison with torchao's row-wise recipe).
        module_filter: ``(module, fqn) -> bool`` choosing which MoE layers to convert (all when
            ``None``). It is called on MoE layers only.
        weight_cache: how often the expert weights are quantized to FP8 and which FP8 copies stay
            alive (``recipe="blockwise"`` only; every mode gives bit-identical results; details in
            :mod:`fp8flow_ao.weight_cache`). Memory per MoE layer with ``E`` local experts, ffn ``H``,
            model dim ``D`` (BF16 weights are ``6*E*H*D`` bytes):

            * ``"off"`` (default): forward quantizes the forward orientation, backward the exact
              transposes again; no FP8 weight bytes outlive a GEMM, so peak memory stays below BF16's.
            * ``"forward"``: one pass writes both orientations; the transposes (``3*E*H*D`` bytes,
              + ``2*E*H*D`` for W13 with ``recompute_experts``) are held from each layer's forward to its
              backward. Saves a read of the BF16 weights and a launch per weight per micro-batch.
              Works compiled.
            * ``"step"``: both orientations (``6*E*H*D`` bytes) are cached across micro-batches and
              steps and re-quantized on the first use after the weights change (version counters, and
              every ``torch.optim`` optimizer's ``step()``, fused ones included, marks the cache stale):
              with gradient accumulation, micro-batches 2..n quantize no weights. Caches eagerly and with
              the layer's own compiled path (torchtitan's ``fp8flow.compile_experts``); where a
              ``torch.compile`` of the model traces the layer it runs as ``"forward"``. With FSDP2 outside
              torchtitan, or an optimizer outside ``torch.optim`` (apex, DeepSpeed), call
              ``fp8flow_ao.weight_cache.EXPERT_WEIGHT_CACHE.invalidate()`` after each optimizer step, and
              after any write through ``param.data`` that a training forward should see. Forwards under
              ``torch.no_grad()`` / ``torch.inference_mode()`` bypass the cache (quantize as ``"off"``).

            Measured figures: :mod:`fp8flow_ao.weight_cache` (H200, compiled layer: ``"forward"`` 1.02-1.05x
            faster than ``"off"`` at the DeepSeek-like shape, 1.02-1.07x at the Qwen-like one, holding
            99.5% / 83% of BF16's activation memory instead of 22% / 30%; ``"step"`` on a cached
            micro-batch 1.16-1.17x faster than ``"off"`` at the DeepSeek-like shape, slower at the
            host-bound Qwen-like one).
        fsdp_fp8_all_gather: under FSDP2, all-gather the expert weights as 128x128 FP8 tiles + scales
            (0.50x the BF16 bytes; each rank quantizes only its own shard, once per step) instead of in
            their own dtype; the layer then uses the gathered tiles directly, and the dgrads' exact
            transposes are byte transposes of them (:mod:`fp8flow_ao.parallel.fsdp`). Results are
            bit-identical either way. ``recipe="blockwise"`` only. Off by default until measured
            against BF16 all-gather on several GPUs (no such run yet).
        backward: ``"fp8"`` (FP8-Flow); ``"bf16_fc1_dgrad"``, FP8-Flow with FC1's dgrad (the gradient of the
            experts' input) in BF16: one BF16 GEMM in place of an FP8 one, for a loss curve nearer BF16's
            (2000-step torchtitan runs, training gap, mean +- 2 standard errors: +0.08% +- 0.40% over 7
            runs where FP8-Flow has +0.01% +- 0.19% over 54; one run's gap carries 0.38% of noise, so the
            difference is not resolved; ``convergence.md``, 2026-11-27); 0.89-0.92x FP8-Flow's tokens/s; works
            with every other option but ``fsdp_fp8_all_gather`` (it needs the BF16 weights). Or an
            ablation for locating a loss gap to BF16, not for speed:
            ``"bf16"``, the same FP8 forward with its gradients computed in BF16 as torchtitan does, at
            the FP8 forward's values (a gap that stays with it comes from the forward); ``"bf16_wgrad"``,
            FP8-Flow's backward with only the weight gradients in BF16 (splits a backward gap between
            dgrads and wgrads). Or an emulation (:data:`fp8flow_ao.moe.EMULATIONS`), which asks what a
            change to FC1's FP8 dgrad would do to the loss before a kernel is written:
            ``"emulated_fp8_fc1_dgrad"`` runs that dgrad in BF16 GEMMs on the very values FP8-Flow's FP8
            GEMM multiplies (dh on its 1x128 grid, the FP8 W13 tiles), ``"emulated_sr_fc1_dgrad"`` the same
            with dh rounded stochastically (unbiased) instead of to nearest. See
            :func:`fp8flow_ao.moe.fp8flow_routed_experts`. ``recipe="blockwise"`` only; the ablations
            without ``recompute_experts`` or expert parallelism, experts eager.
    """

    recompute_experts: bool = False
    recipe: Literal["blockwise", "rowwise"] = "blockwise"
    module_filter: Callable[[nn.Module, str], bool] | None = None
    weight_cache: Literal["off", "forward", "step"] = "off"
    fsdp_fp8_all_gather: bool = False
    backward: Literal[
        "fp8", "bf16", "bf16_wgrad", "bf16_fc1_dgrad", "emulated_fp8_fc1_dgrad", "emulated_sr_fc1_dgrad"
    ] = "fp8"

    def __post_init__(self) -> None:
        check_bool("recompute_experts", self.recompute_experts)
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {self.recipe!r}")
        if self.recompute_experts and self.recipe != "blockwise":
            raise ValueError("recompute_experts=True needs recipe='blockwise' (the fused FP8-Flow expert path)")
        check_weight_cache_mode(self.weight_cache)
        if self.weight_cache != "off" and self.recipe != "blockwise":
            raise ValueError(f"weight_cache={self.weight_cache!r} needs recipe='blockwise' (the fused FP8-Flow path)")
        check_bool("fsdp_fp8_all_gather", self.fsdp_fp8_all_gather)
        if self.fsdp_fp8_all_gather and self.recipe != "blockwise":
            raise ValueError("fsdp_fp8_all_gather=True needs recipe='blockwise' (the rowwise baseline gathers BF16)")
        if self.module_filter is not None and not callable(self.module_filter):
            raise TypeError(f"module_filter must be callable (module, fqn) -> bool, got {self.module_filter!r}")
        check_backward(self.backward, self.recompute_experts, False, self.fsdp_fp8_all_gather)
        if self.backward != "fp8" and self.recipe != "blockwise":
            raise ValueError(f"backward={self.backward!r} needs recipe='blockwise' (the fused FP8-Flow path)")


def _set_torchtitan_alignment() -> None:
    """torchtitan pads each expert's token group to this many rows before ``torch._grouped_mm``."""
    try:
        from torchtitan.models.moe import utils as moe_utils
    except ImportError as err:
        raise ValueError("recipe='rowwise' runs torchtitan's own expert path: it needs torchtitan installed") from err

    moe_utils.set_token_group_alignment_size_m(TOKEN_GROUP_ALIGNMENT)


def _convert_layer(module: nn.Module, config: FP8FlowConfig, fqn: str) -> None:
    if config.recipe == "blockwise":
        convert_moe_layer(
            module,
            recompute_experts=config.recompute_experts,
            fqn=fqn,
            weight_cache=config.weight_cache,
            fsdp_fp8_all_gather=config.fsdp_fp8_all_gather,
            backward=config.backward,
        )
        return
    check_moe_layer(module, fqn)
    _set_torchtitan_alignment()
    module.experts.use_grouped_mm = True  # the row-wise GEMM is reached through torch._grouped_mm
    module.experts.register_forward_pre_hook(_check_rowwise_can_pad)
    # torchtitan now pads every expert's group to 128 rows: the FP8 op need not pad again.
    wrap_expert_weights(module.experts, recipe="rowwise", offs_aligned=True)


def _check_rowwise_can_pad(experts: nn.Module, args: tuple) -> None:
    """Forward pre-hook of the row-wise recipe's experts: torchtitan's grouped-GEMM path pads each expert's
    rows with a Triton kernel (``generate_permute_indices``), which has no CPU backend unless Triton
    interprets or torchtitan is told ``use_cpu=True``; without this check a CPU model stopped in Triton's
    driver lookup ("0 active drivers")."""
    x = args[0] if args else None  # GroupedExperts.forward(x, num_tokens_per_expert)
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    from torchtitan.models.moe import utils as moe_utils

    if getattr(moe_utils.generate_permute_indices, "keywords", {}).get("use_cpu"):  # torchtitan_on_cpu()
        return
    raise ValueError(
        "recipe='rowwise' runs torchtitan's grouped-GEMM expert path, whose token padding "
        "(torchtitan.models.moe.utils.generate_permute_indices) is a Triton kernel with no CPU backend: run "
        "the model on a GPU, on the CPU inside fp8flow_ao.torchtitan.cpu.torchtitan_on_cpu() (use_cpu=True) "
        "or with TRITON_INTERPRET=1, or use recipe='blockwise' (its CPU path is the torch reference)"
    )


def _unsupported_moe_layer(module: nn.Module) -> str | None:
    """What a module with ``.router`` and ``.experts`` that is not a supported MoE layer lacks (None: not MoE-like)."""
    experts = getattr(module, "experts", None)
    if not isinstance(getattr(module, "router", None), nn.Module) or not isinstance(experts, nn.Module):
        return None
    if is_moe_layer(module):
        return None
    kind = type(experts).__name__
    w1 = getattr(experts, "mlp1_weight", None)
    if isinstance(w1, torch.Tensor) and w1.dim() == 3:  # torchtitan's gpt-oss (GptOssGroupedExperts)
        _, two_h, d = w1.shape
        missing = [
            "biases on both expert projections (mlp1_bias, mlp2_bias)",
            f"the interleaved clamped SwiGLU (gate and up interleaved in mlp1's {two_h} rows, clamped at "
            f"swiglu_limit={getattr(experts, 'swiglu_limit', '?')}, silu with alpha 1.702, up + 1)",
        ]
        if d % 128 or (two_h // 2) % 128:
            missing.append(f"D and H multiples of 128 (1x128 / 128x128 blocks; D={d}, H={two_h // 2})")
        return f"gpt-oss experts ({kind}) need what FP8-Flow does not implement yet: " + "; ".join(missing)
    names = sorted(n for n, _ in experts.named_parameters(recurse=False))
    return f".experts ({kind}) has no 3-D w1, w2, w3 (torchtitan GroupedExperts) but parameters {names}"


def convert_to_fp8flow(model: nn.Module, config: FP8FlowConfig | None = None) -> nn.Module:
    """Convert every MoE layer of ``model`` (``model`` itself included) that ``config.module_filter`` accepts.

    In place; returns ``model``. Raises ``ValueError`` when no MoE layer is found (or none passes
    the filter; MoE-like layers FP8-Flow cannot run, such as gpt-oss's, are named with what they
    need), when a layer is already converted, or when ``D`` or ``H`` is not a multiple of 128; ``TypeError``
    for a ``model`` that is not an ``nn.Module`` or a ``config`` that is not an :class:`FP8FlowConfig`.
    Every layer is checked before any is converted: a bad one leaves the model untouched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, FP8FlowConfig):
        raise TypeError(f"config must be an FP8FlowConfig or None, got {type(config).__name__}")
    return _convert_model(model, config or FP8FlowConfig(), None)


def _convert_model(
    model: nn.Module, config: FP8FlowConfig, filter_fn: Callable[[nn.Module, str], bool] | None
) -> nn.Module:
    """:func:`convert_to_fp8flow` over the MoE layers that ``filter_fn`` (a ``quantize_`` call's, ``None``: every
    one) accepts as well."""
    layers = [
        (fqn, m) for fqn, m in model.named_modules() if is_moe_layer(m) and (filter_fn is None or filter_fn(m, fqn))
    ]
    chosen = [(fqn, m) for fqn, m in layers if config.module_filter is None or config.module_filter(m, fqn)]
    if not layers:
        unsupported = [(fqn, why) for fqn, m in model.named_modules() if (why := _unsupported_moe_layer(m))]
        if unsupported:
            fqn, why = unsupported[0]
            raise ValueError(
                f"FP8FlowConfig found {len(unsupported)} MoE layer(s) in {type(model).__name__} it cannot "
                f"convert; the first, {fqn!r}: {why}"
            )
    if not chosen:
        found = f"{len(layers)} MoE layer(s), none accepted by module_filter" if layers else "no MoE layer"
        raise ValueError(
            f"FP8FlowConfig found {found} in {type(model).__name__}: it converts torchtitan-style MoE "
            "layers (a module with .router and .experts holding 3-D w1, w2, w3)"
        )
    for fqn, module in chosen:  # check every layer first: a bad one leaves the model untouched
        check_moe_layer(module, fqn)
    for fqn, module in chosen:
        _convert_layer(module, config, fqn)
    return model


# The handler runs once per nn.Linear of the model; the first run of a quantize_ call converts the model and
# marks that call's outermost recursion frame with this local (it dies with the call), so the later runs of the
# same call do nothing while a second quantize_ call converts again, and so raises "already converted".
_CONVERTED_MARK = "__fp8flow_converted__"


def _quantize_call_frames() -> list:
    """The frames of torchao's recursion (``_replace_with_custom_fn_if_matches_filter``), outermost first."""
    code = quant_api._replace_with_custom_fn_if_matches_filter.__code__
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


@register_quantize_module_handler(FP8FlowConfig)
def _fp8flow_transform(module: nn.Module, config: FP8FlowConfig) -> nn.Module:
    """``quantize_`` handler: a MoE layer (``filter_fn=is_moe_layer``) or, with the default filter, an ``nn.Linear``.

    Either way the first call of a ``quantize_`` call converts the whole model at once (every layer checked before
    any is converted, and no layer found or accepted is an error, as :func:`convert_to_fp8flow`); a MoE layer
    handed in means the call's own ``filter_fn`` chose the layers, so only those it accepts are converted."""
    frames = _quantize_call_frames()
    if not frames:
        if is_moe_layer(module):  # called outside quantize_'s recursion: this layer alone
            return convert_to_fp8flow(module, config)
        raise RuntimeError(
            "FP8FlowConfig's handler could not find the model quantize_ is converting; call "
            "fp8flow_ao.config.convert_to_fp8flow(model, config) or quantize_(model, config, "
            "filter_fn=fp8flow_ao.moe.is_moe_layer)"
        )
    call = frames[0].f_locals  # the frame's own locals mapping: a key set here stays for the frame's life
    if _CONVERTED_MARK not in call:
        _convert_model(call["model"], config, call["filter_fn"] if is_moe_layer(module) else None)
        call[_CONVERTED_MARK] = True
    return module
