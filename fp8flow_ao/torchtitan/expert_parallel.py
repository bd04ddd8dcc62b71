"""torchtitan's ``expert_parallel_degree`` on FP8-Flow layers: FP8 dispatch instead of its BF16 ``ExpertParallel``.

torchtitan 0.2.2 parallelizes each MoE layer's ``experts`` with a ``ParallelStyle`` chosen in its
``apply_moe_ep_tp``: ``ExpertParallel`` (EP), ``ExpertTensorParallel`` (EP x TP), ``TensorParallel``
(TP without EP), ``DeepEPExpertParallel``, or any of them inside ``DualPipeExpertParallel``. Their hooks re-route ``(tokens, counts)`` in BF16, which
is not the FP8-Flow experts' interface ``(x, probs, indices)``: FP8-Flow dispatches FP8 rows itself.

:func:`install` wraps each style's ``_apply`` (the one place a style attaches to a module) so that,
for a converted experts module only, ``ExpertParallel`` becomes
:func:`fp8flow_ao.parallel.expert_parallel.shard_experts` (the same ``Shard(0)`` weight placement,
FP8 dispatch over the same EP group) and the other styles raise a ``ValueError`` naming the setting
that asked for them. Every other module -- a BF16 model in the same process included -- gets
torchtitan's style unchanged. Nothing in torchtitan's files is edited; importing
:mod:`fp8flow_ao.torchtitan` (the ``custom_import``) or converting a layer while torchtitan is loaded
installs it, once.
"""

from __future__ import annotations

import functools

from torch import nn

from fp8flow_ao.parallel.expert_parallel import shard_experts

# The styles torchtitan applies to ``moe.experts`` other than EP, and the setting that selects each.
_UNSUPPORTED = {
    "ExpertTensorParallel": "parallelism.expert_tensor_parallel_degree > 1",
    "TensorParallel": "parallelism.tensor_parallel_degree > 1",
    "DeepEPExpertParallel": 'parallelism.expert_parallel_comm_backend = "deepep"',
}
_DUAL_PIPE = 'parallelism.pipeline_parallel_schedule = "DualPipeV" with pipeline_parallel_expert_parallel_overlap'


def _is_fp8flow_experts(module: nn.Module) -> bool:
    return hasattr(module, "fp8flow_ep_group")


def unsupported_style_error(setting: str) -> ValueError:
    """The error for a torchtitan parallelism setting that FP8-Flow layers do not support."""
    return ValueError(
        f"fp8flow: {setting} is not supported for FP8-Flow MoE layers: their experts dispatch FP8 token "
        "rows over expert parallelism only (parallelism.expert_parallel_degree) with FSDP2 over the rest; "
        "use tensor_parallel_degree = 1, expert_tensor_parallel_degree = 1 and the default "
        "expert_parallel_comm_backend, or leave the layer in BF16 (fp8flow.filter_fqns)"
    )


def _wrap_apply(cls: type, replacement) -> None:
    original = cls.__dict__["_apply"]
    if getattr(original, "_fp8flow_wrapped", False):
        return

    @functools.wraps(original)
    def _apply(self, module: nn.Module, device_mesh):
        if _is_fp8flow_experts(module):
            return replacement(module, device_mesh)
        return original(self, module, device_mesh)

    _apply._fp8flow_wrapped = True
    cls._apply = _apply


def _refuse(setting: str):
    def replacement(module: nn.Module, device_mesh) -> nn.Module:
        raise unsupported_style_error(setting)

    return replacement


def install() -> None:
    """Make torchtitan's expert-parallel styles FP8-Flow-aware (idempotent; see the module docstring)."""
    from torchtitan.distributed import dual_pipe_v
    from torchtitan.distributed import expert_parallel as styles

    _wrap_apply(styles.ExpertParallel, shard_experts)
    for name, setting in _UNSUPPORTED.items():
        _wrap_apply(getattr(styles, name), _refuse(setting))
    _wrap_apply(dual_pipe_v.DualPipeExpertParallel, _refuse(_DUAL_PIPE))
