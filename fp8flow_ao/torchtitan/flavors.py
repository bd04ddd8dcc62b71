"""Model flavors fp8flow_ao adds to torchtitan's DeepSeek-V3 table (``model.flavor`` in a job config).

``fp8flow_gpu``: the demo's ``gpu`` preset (:data:`fp8flow_ao.demo.PRESETS`): 4 layers (1 dense),
D=2048, 32 routed experts top-8 + 1 shared, expert ffn H=768 (Qwen3-30B-A3B-like expert dims), MLA
attention, about 0.6 B parameters; 8 x 2048 tokens a step on one H200.

``fp8flow_dsv3_experts``: DeepSeek-V3's routed-expert dims -- D=7168, 256 experts top-8, expert ffn
H=2048, 1 shared expert -- in 3 layers (1 dense), with the debug model's small MLA attention and
vocabulary: the expert-parallel scale-out flavor (``benchmarks/bench_distributed_torchtitan.py
--runs scale``). Its experts are 22.5 GB of BF16 weights per MoE layer: it needs EP >= 4 on H200s.
"""

from __future__ import annotations

import torch

FP8FLOW_GPU = "fp8flow_gpu"
FP8FLOW_DSV3_EXPERTS = "fp8flow_dsv3_experts"


def register_flavors() -> None:
    """Add :data:`FP8FLOW_GPU` and :data:`FP8FLOW_DSV3_EXPERTS` to torchtitan's DeepSeek-V3 flavors (idempotent)."""
    import copy

    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from fp8flow_ao.demo import PRESETS, model_args

    if FP8FLOW_GPU not in deepseekv3_args:
        args = model_args(PRESETS["gpu"], torch.device("cpu"))
        # torchtitan's update_from_config turns grouped GEMMs off below sm90 (and on the CPU runner).
        args.moe_args.use_grouped_mm = True
        deepseekv3_args[FP8FLOW_GPU] = args
    if FP8FLOW_DSV3_EXPERTS not in deepseekv3_args:
        args = copy.deepcopy(deepseekv3_args["debugmodel"])
        args.dim, args.inter_dim, args.moe_inter_dim = 7168, 18432, 2048
        args.n_layers, args.n_dense_layers = 3, 1
        moe = args.moe_args
        moe.num_experts, moe.top_k, moe.num_shared_experts = 256, 8, 1
        moe.score_func, moe.route_norm = "sigmoid", True
        deepseekv3_args[FP8FLOW_DSV3_EXPERTS] = args
