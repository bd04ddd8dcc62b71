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
    compile_mode = "default"
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
    With ``weight_cache = "step"`` the cache lookup runs before the graph and hands it the FP8 tiles. With
    gradient accumulation (several micro-batches per optimizer step, no FSDP) the eager path adds the weight
    gradients into the existing ones in its wgrad epilogue and the compiled one does not (autograd adds them):
    on an H200 a DeepSeek-like layer's accumulating micro-batch took 12.5 ms eager against 13.8 compiled (10.7
    eager with ``weight_cache = "step"``), its first micro-batch 11.9 against 12.2
    (``benchmarks/results/grad_accumulation.md``); the accumulating micro-batch peaked 2.2 GiB above its start
    eager against 3.1 compiled (``grad_accumulation_s47.md``)."""

    compile_mode: Literal["default", "reduce-overhead"] = "default"
    """``torch.compile``'s ``mode`` for the routed path that ``compile_experts`` compiles: "default", or
    "reduce-overhead", which replays the path's forward and backward as CUDA graphs and so takes most of its
    host time away; it helps where the compiled path is host-bound (its kernels enqueued slower than the GPU
    runs them). On an H200, a Qwen3-30B-A3B-like layer (T=8192, D=2048, H=768, E=128, top-8) spent 4.8-6.1 ms
    of host time a step against 4.1 ms of device work and ran 0.88-1.56x BF16 depending on the host, and
    ~1 ms and 1.47-1.58x in every repetition under CUDA graphs; the device-bound DeepSeek-like layer ran
    1.38-1.40x either way. Refused where it would do nothing (the path runs eagerly: ``compile_experts``,
    torchtitan not compiling the model, expert parallelism, ``recipe = "rowwise"``, an ablation ``backward``),
    with a ``compile.backend`` other than "inductor" (CUDA graphs are an inductor mode), with
    activation checkpointing or pipeline parallelism (a layer's forward runs again, or for the next
    micro-batch, before its backward, and the graph's replay overwrites outputs that backward still reads:
    torch raised on the H200 with full checkpointing), and under FSDP (``data_parallel_shard_degree`` or
    ``context_parallel_degree`` > 1): CUDA graphs take each weight's address as fixed while FSDP2
    re-allocates the unsharded weights every step, not measured yet. The converter tests it on one GPU
    (``test_trainer_with_cuda_graph_experts_matches_the_compiled_path``: the same losses as "default"). With
    ``weight_cache = "step"`` the graphs read the cached FP8 tiles where they are: the cache re-quantizes into
    the same tensors after each optimizer step, so their addresses stay fixed (the Qwen3-like layer's cached
    micro-batch: 1.90-2.00x BF16, every repetition, against 1.53-1.63x with graphs alone)."""

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
