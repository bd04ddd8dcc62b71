"""The torchtitan model converter ``"fp8flow"``: ``quantize_(model, FP8FlowConfig(...))`` from the job config.

torchtitan builds the model on the meta device, runs the converters named in ``model.converters``,
then parallelizes, materializes (``to_empty``) and initializes it; so :meth:`FP8FlowConverter.convert`
sees a meta-device model and only rewires MoE layers, touching no weight data.

With ``parallelism.expert_parallel_degree > 1`` the converted layers dispatch FP8 token rows over
torchtitan's EP mesh (:mod:`fp8flow_ao.torchtitan.expert_parallel` replaces its BF16 ``ExpertParallel``
for them); settings FP8-Flow layers do not support (tensor parallelism, DeepEP, an EP degree that
does not divide the expert count) raise a ``ValueError`` naming the setting before any step runs.

torchtitan's ``apply_compile`` skips each MoE layer's ``experts`` module, so the converter compiles the
FP8-Flow routed path itself (``fp8flow.compile_experts``, by default whenever torchtitan compiles the
model): :attr:`~fp8flow_ao.moe.FP8FlowGroupedExperts.fp8flow_compile_backend` is set on every converted
layer, and its ``forward`` calls the routed path through ``torch.compile(fullgraph=True)``;
``fp8flow.compile_mode = "reduce-overhead"`` sets its ``mode`` (CUDA graphs) through
:attr:`~fp8flow_ao.moe.FP8FlowGroupedExperts.fp8flow_compile_mode`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn as nn
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import ModelConverter
from torchtitan.tools.logging import logger

from fp8flow_ao.torchtitan.expert_parallel import install as install_expert_parallel
from fp8flow_ao.torchtitan.expert_parallel import unsupported_style_error
from fp8flow_ao.torchtitan.job_config import FP8Flow
from fp8flow_ao.weight_cache import EXPERT_WEIGHT_CACHE

CONVERTER_NAME = "fp8flow"


def fqn_filter(filter_fqns: Sequence[str]) -> Callable[[nn.Module, str], bool] | None:
    """A module filter that keeps every module whose FQN contains none of ``filter_fqns`` (None: keep all)."""
    if isinstance(filter_fqns, str):  # torchtitan does not type-check TOML: "layers.1." would skip per character
        raise TypeError(f"fp8flow.filter_fqns must be a list of FQN substrings, got the string {filter_fqns!r}")
    if not filter_fqns:
        return None
    skip = tuple(filter_fqns)
    return lambda module, fqn: not any(s in fqn for s in skip)


def _check_parallelism(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Refuse, before the model is built, the parallelisms FP8-Flow layers do not support (ValueError)."""
    parallelism = job_config.parallelism
    if parallel_dims.tp > 1:
        raise unsupported_style_error("parallelism.tensor_parallel_degree > 1")
    if parallel_dims.ep > 1 and parallelism.expert_parallel_comm_backend != "standard":
        raise unsupported_style_error(
            f"parallelism.expert_parallel_comm_backend = {parallelism.expert_parallel_comm_backend!r}"
        )


def _experts_compile_backend(job_config: JobConfig, options: FP8Flow, ep_degree: int) -> str | None:
    """The ``torch.compile`` backend for the FP8-Flow routed experts, or None to run them eagerly.

    ``fp8flow.compile_experts``: "auto" follows torchtitan's own switch (``compile.enable`` and "model" in
    ``compile.components``), "on" compiles always, "off" never. Expert parallelism runs eagerly (its
    split sizes are host integers), and so do the ablation backwards; "on" with expert parallelism, an
    ablation backward or the rowwise recipe is a ``ValueError``.
    """
    mode = options.compile_experts
    if mode not in ("auto", "on", "off"):
        raise ValueError(f'fp8flow.compile_experts must be "auto", "on" or "off", got {mode!r}')
    if mode == "on" and options.recipe != "blockwise":
        raise ValueError(
            'fp8flow.compile_experts = "on" needs fp8flow.recipe = "blockwise" (the rowwise recipe runs '
            "torchtitan's own expert path, which torchtitan compiles itself)"
        )
    from fp8flow_ao.moe import ABLATIONS

    if mode == "on" and options.backward in ABLATIONS:
        raise ValueError(
            f'fp8flow.compile_experts = "on" is not supported with fp8flow.backward = "{options.backward}" (an '
            'ablation: its backward runs autograd on a BF16 graph); use "auto" (eager there) or "off"'
        )
    if mode == "on" and ep_degree > 1:
        raise ValueError(
            'fp8flow.compile_experts = "on" is not supported with parallelism.expert_parallel_degree > 1: '
            "the expert-parallel FP8 dispatch sizes its all-to-alls with host integers, which a fullgraph "
            'compile cannot hold; use "auto" (eager there) or "off"'
        )
    return None if _eager_reason(job_config, options, ep_degree) else job_config.compile.backend


def _eager_reason(job_config: JobConfig, options: FP8Flow, ep_degree: int) -> str | None:
    """The setting that runs the FP8-Flow routed experts eagerly, or None when they are compiled."""
    from fp8flow_ao.moe import ABLATIONS

    if options.recipe != "blockwise":
        return f'fp8flow.recipe = "{options.recipe}" (torchtitan\'s own expert path, which it compiles itself)'
    if ep_degree > 1:
        return "parallelism.expert_parallel_degree > 1 (its all-to-all split sizes are host integers)"
    if options.backward in ABLATIONS:
        return f'fp8flow.backward = "{options.backward}" (an ablation: its backward runs autograd on a BF16 graph)'
    if options.compile_experts == "off":
        return 'fp8flow.compile_experts = "off"'
    compile_ = job_config.compile
    if options.compile_experts == "auto" and not (compile_.enable and "model" in compile_.components):
        return (
            'fp8flow.compile_experts = "auto" while torchtitan does not compile the model '
            f"(compile.enable = {compile_.enable}, compile.components = {compile_.components})"
        )
    return None


def _experts_compile_mode(
    job_config: JobConfig, options: FP8Flow, parallel_dims: ParallelDims | None, ep_degree: int
) -> str | None:
    """``torch.compile``'s ``mode`` for the compiled routed experts (None: torch's default).

    ``fp8flow.compile_mode = "reduce-overhead"`` (CUDA graphs) is a ``ValueError`` wherever it would do
    nothing or has not been measured, so a run never reports a mode it did not use.
    """
    mode = options.compile_mode
    if mode not in ("default", "reduce-overhead"):
        raise ValueError(f'fp8flow.compile_mode must be "default" or "reduce-overhead", got {mode!r}')
    if mode == "default":
        return None
    reason = _eager_reason(job_config, options, ep_degree)
    if reason is not None:
        raise ValueError(
            f'fp8flow.compile_mode = "reduce-overhead" would do nothing: the routed experts run eagerly with {reason}'
        )
    if job_config.compile.backend != "inductor":
        raise ValueError(
            'fp8flow.compile_mode = "reduce-overhead" needs compile.backend = "inductor" (CUDA graphs are an '
            f"inductor mode), got {job_config.compile.backend!r}"
        )
    if job_config.activation_checkpoint.mode != "none":
        # Measured on an H200 (test_trainer_with_cuda_graph_experts_matches_the_compiled_path): torch raises
        # "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run".
        raise ValueError(
            'fp8flow.compile_mode = "reduce-overhead" needs activation_checkpoint.mode = "none", got '
            f"{job_config.activation_checkpoint.mode!r}: checkpointing runs each layer's forward again inside its "
            "backward, and that replay of the CUDA graph overwrites outputs the backward still reads"
        )
    if parallel_dims is not None and parallel_dims.pp_enabled:
        raise ValueError(
            'fp8flow.compile_mode = "reduce-overhead" is not supported with pipeline parallelism: a stage runs '
            "several micro-batches' forwards before their backwards, and each replay of the CUDA graph overwrites "
            "the previous one's outputs"
        )
    # torchtitan's parallelize applies FSDP2 exactly when fsdp_enabled (dp_shard > 1 or cp > 1).
    if parallel_dims is not None and parallel_dims.fsdp_enabled:
        raise ValueError(
            'fp8flow.compile_mode = "reduce-overhead" is not supported under FSDP (parallelism.'
            "data_parallel_shard_degree or context_parallel_degree > 1): CUDA graphs take each weight's address "
            "as fixed, FSDP2 re-allocates the unsharded expert weights every step, and the pair has not been measured"
        )
    return mode


def _check_expert_counts(model: nn.Module, ep_degree: int) -> None:
    """Every converted layer's expert count must split evenly over the EP ranks (ValueError naming the setting)."""
    from fp8flow_ao.moe import FP8FlowMoE

    for fqn, module in model.named_modules():
        if isinstance(module, FP8FlowMoE) and module.experts.w1.shape[0] % ep_degree:
            raise ValueError(
                f"fp8flow: parallelism.expert_parallel_degree = {ep_degree} must divide the number of experts "
                f"of MoE layer {fqn!r} ({module.experts.w1.shape[0]})"
            )


class FP8FlowConverter(ModelConverter):
    """Installs the FP8-Flow MoE path on every torchtitan ``MoE`` layer not filtered out.

    Options come from the ``[fp8flow]`` job-config section (:class:`~fp8flow_ao.torchtitan.job_config.FP8Flow`),
    present when ``job.custom_config_module = "fp8flow_ao.torchtitan.job_config"``; without it the
    defaults apply.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        options = getattr(job_config, "fp8flow", None)
        if options is None:
            logger.warning(
                "fp8flow: no [fp8flow] job-config section (set job.custom_config_module = "
                '"fp8flow_ao.torchtitan.job_config" to configure it); using the defaults'
            )
            options = FP8Flow()
        if options.recipe not in ("blockwise", "rowwise"):
            raise ValueError(f'fp8flow.recipe must be "blockwise" or "rowwise", got {options.recipe!r}')
        self.options = options
        # parallel_dims is None when the converter is built outside torchtitan's Trainer (one process).
        self.ep_degree = parallel_dims.ep if parallel_dims is not None else 1
        self.compile_backend = _experts_compile_backend(job_config, options, self.ep_degree)
        self.compile_mode = _experts_compile_mode(job_config, options, parallel_dims, self.ep_degree)
        if options.recipe == "blockwise":
            if parallel_dims is not None:
                _check_parallelism(job_config, parallel_dims)
            install_expert_parallel()

    def config(self):
        """The :class:`~fp8flow_ao.config.FP8FlowConfig` this converter applies."""
        from fp8flow_ao.config import FP8FlowConfig

        return FP8FlowConfig(
            recompute_experts=self.options.recompute_experts,
            recipe=self.options.recipe,
            module_filter=fqn_filter(self.options.filter_fqns),
            weight_cache=self.options.weight_cache,
            fsdp_fp8_all_gather=self.options.fsdp_fp8_all_gather,
            backward=self.options.backward,
        )

    def convert(self, model: nn.Module) -> None:
        """torchtitan's model-converter hook: ``quantize_`` every MoE layer of ``model`` in place with this
        job's options, check the expert counts against expert parallelism, set the experts' compile options."""
        from torchao.quantization import quantize_

        from fp8flow_ao.moe import FP8FlowMoE

        quantize_(model, self.config())
        if self.options.recipe == "blockwise":
            _check_expert_counts(model, self.ep_degree)
        for module in model.modules():
            if isinstance(module, FP8FlowMoE):
                module.experts.fp8flow_compile_backend = self.compile_backend
                module.experts.fp8flow_compile_mode = self.compile_mode
        logger.info(
            f"fp8flow: converted the MoE layers to FP8-Flow (recipe={self.options.recipe}, "
            f"recompute_experts={self.options.recompute_experts}, weight_cache={self.options.weight_cache}, "
            f"backward={self.options.backward}, "
            f"compiled experts={self.compile_backend or 'no'}, compile_mode={self.options.compile_mode}, "
            f"skipped fqns={self.options.filter_fqns})"
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Drop the cached FP8 weights (``weight_cache="step"``): the optimizer just changed them.

        Every ``torch.optim`` step already marks the cache stale (keeping its tensors until the next
        lookup replaces them); this drop frees the stale FP8 copies right away, before evaluation or the
        next forward allocates anything. Under CUDA graphs
        (``compile_mode = "reduce-overhead"``, never with FSDP2) the entries are marked stale instead: the
        next forward re-quantizes into the same tensors, whose addresses the graphs hold.
        """
        if self.options.weight_cache == "step":
            EXPERT_WEIGHT_CACHE.invalidate(keep_values=self.compile_mode == "reduce-overhead")
