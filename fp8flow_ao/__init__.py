"""fp8flow_ao: FP8-Flow-MoE training for PyTorch MoE models on Hopper GPUs.

``quantize_(model, FP8FlowConfig())`` (torchao) installs the FP8-Flow routed-expert path on every
torchtitan-style MoE layer. The kernels are ``torch.ops.fp8flow.*`` (see :mod:`fp8flow_ao.kernels`).
Public names are imported lazily so that ``import fp8flow_ao`` does not import torchao.
"""

from __future__ import annotations

import importlib
from typing import Any

from fp8flow_ao._format import AMAX_EPS, BLOCK, FP8_DTYPE, FP8_MAX

_LAZY = {
    "FP8FlowConfig": "fp8flow_ao.config",
    "convert_to_fp8flow": "fp8flow_ao.config",
    "fp8_grouped_mm": "fp8flow_ao.grouped_mm",
    "fp8flow_routed_experts": "fp8flow_ao.moe",
    "convert_moe_layer": "fp8flow_ao.moe",
    "is_moe_layer": "fp8flow_ao.moe",
    "Float8BlockwiseActivation": "fp8flow_ao.tensor",
    "FP8FlowExpertWeight": "fp8flow_ao.tensor",
    "to_fp8_blockwise": "fp8flow_ao.tensor",
    "wrap_expert_weights": "fp8flow_ao.tensor",
    "FP8FlowOpCounter": "fp8flow_ao.debug",
}

__all__ = ["AMAX_EPS", "BLOCK", "FP8_DTYPE", "FP8_MAX", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fp8flow_ao' has no attribute {name!r}")
