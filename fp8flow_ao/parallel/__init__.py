"""Several GPUs: expert parallelism with FP8 dispatch (:mod:`fp8flow_ao.parallel.expert_parallel`)."""

from fp8flow_ao.parallel.expert_parallel import DispatchPlan, combine, dispatch, plan_dispatch, shard_experts

__all__ = ["DispatchPlan", "combine", "dispatch", "plan_dispatch", "shard_experts"]
