"""The ``[fp8flow]`` section of a torchtitan job config.

torchtitan 0.2.2 merges a custom ``JobConfig`` dataclass into its own when given
``--job.custom_config_module fp8flow_ao.torchtitan.job_config`` (or ``custom_config_module`` under
``[job]`` in the TOML file); its fields become TOML keys and ``--fp8flow.<key>`` command-line flags::

    [fp8flow]
    recompute_experts = false
    recipe = "blockwise"
    filter_fqns = ["layers.1."]
    weight_cache = "off"
    compile_experts = "auto"
    backward = "fp8"
"""

# No ``from __future__ import annotations`` here: torchtitan merges these dataclasses into a class of
# another module, and tyro must resolve the field types there, which string annotations break.
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class FP8Flow:
    recompute_experts: bool = False
    """Keep only the FP8 expert input for backward and recompute FC1 and SwiGLU there (less memory)."""

    recipe: Literal["blockwise", "rowwise"] = "blockwise"
    """FP8 scaling: "blockwise" (1x128 activations, 128x128 weights; the FP8-Flow recipe) or "rowwise"."""

    filter_fqns: list[str] = field(default_factory=list)
    """MoE layers to leave in BF16: a layer is skipped if its fully qualified name contains any of these
    strings (the meaning torchtitan gives ``filter_fqns`` for float8 linears)."""

    weight_cache: Literal["off", "forward", "step"] = "off"
    """FP8 expert weights: "off" (quantized in forward and again, transposed, in backward; least memory),
    "forward" (one pass makes both, transposes held until backward) or "step" (cached until the weights
    change: with gradient accumulation micro-batches 2..n quantize none). See fp8flow_ao.config.FP8FlowConfig."""

    fsdp_fp8_all_gather: bool = False
    """Under FSDP2 all-gather the expert weights as 128x128 FP8 tiles + scales (half the bytes; each rank
    quantizes its own shard once per step) instead of BF16. Bit-identical results. See FP8FlowConfig."""

    compile_experts: Literal["auto", "on", "off"] = "auto"
    """torch.compile the FP8-Flow routed experts (``fp8flow_routed_experts``: quantize, permute, FC1, SwiGLU,
    FC2, combine, and its backward) as one ``fullgraph=True`` graph with ``compile.backend``. torchtitan
    0.2.2's ``apply_compile`` compiles every other child of a MoE layer but skips ``experts``, so without
    this the routed path runs eagerly. "auto": when torchtitan compiles the model (``compile.enable`` and
    "model" in ``compile.components``); "on": always; "off": never. Expert parallelism
    (``parallelism.expert_parallel_degree > 1``) runs the path eagerly whatever this says ("on" is refused
    there): its all-to-all split sizes are host integers, which no full graph holds. ``recipe = "blockwise"``
    only ("on" is refused with "rowwise", which runs torchtitan's own expert path, compiled by torchtitan).
    With ``weight_cache = "step"`` the cache lookup runs before the graph and hands it the FP8 tiles."""

    backward: Literal[
        "fp8", "bf16", "bf16_wgrad", "bf16_fc1_dgrad", "emulated_fp8_fc1_dgrad", "emulated_sr_fc1_dgrad"
    ] = "fp8"
    """"fp8" (FP8-Flow); "bf16_fc1_dgrad", FP8-Flow with FC1's dgrad in BF16 (a loss curve nearer BF16's for one
    BF16 GEMM; works with every other option but fsdp_fp8_all_gather); or an ablation that tells where a loss
    gap to BF16 comes from:
    "bf16" computes the gradients of the same FP8 forward in BF16 (forward or backward?), "bf16_wgrad" only
    the weight gradients (dgrads or wgrads?); ablations are slower than BF16, run the experts eagerly, and
    refuse ``recompute_experts`` and expert parallelism; or an emulation of a change to FC1's FP8 dgrad
    ("emulated_fp8_fc1_dgrad": its exact FP8 operands in BF16 GEMMs; "emulated_sr_fc1_dgrad": dh rounded
    stochastically), compiled like "bf16_fc1_dgrad". See fp8flow_ao.config.FP8FlowConfig."""


@dataclass
class JobConfig:
    fp8flow: FP8Flow = field(default_factory=FP8Flow)
