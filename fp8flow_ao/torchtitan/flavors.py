"""Model flavors fp8flow_ao adds to torchtitan's DeepSeek-V3 table (``model.flavor`` in a job config).

``fp8flow_gpu``: the demo's ``gpu`` preset (:data:`fp8flow_ao.demo.PRESETS`): 4 layers (1 dense),
D=2048, 32 routed experts top-8 + 1 shared, expert ffn H=768 (Qwen3-30B-A3B-like expert dims), MLA
attention, about 0.6 B parameters; 8 x 2048 tokens a step on one H200.
"""

from __future__ import annotations

import torch

FP8FLOW_GPU = "fp8flow_gpu"


def register_flavors() -> None:
    """Add :data:`FP8FLOW_GPU` to ``torchtitan.models.deepseek_v3.deepseekv3_args`` (idempotent)."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from fp8flow_ao.demo import PRESETS, model_args

    if FP8FLOW_GPU in deepseekv3_args:
        return
    args = model_args(PRESETS["gpu"], torch.device("cpu"))
    # torchtitan's update_from_config turns grouped GEMMs off below sm90 (and on the CPU runner).
    args.moe_args.use_grouped_mm = True
    deepseekv3_args[FP8FLOW_GPU] = args
