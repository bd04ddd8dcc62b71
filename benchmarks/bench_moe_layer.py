"""One MoE expert block, forward + backward, side by side under torch.compile (issue 4's benchmark).

Cases (PERF.md): DeepSeek-V3-like T=4096 tokens, D=7168, H=2048, E=32, top-8, Qwen3-30B-A3B-like
T=8192, D=2048, H=768, E=128, top-8 and Llama 4 Scout-like T=16384, D=5120, H=8192, E=16, top-1
(``score_before_experts=True``); each with forced balanced routing (round robin, as torchtitan's
``moe_force_load_balance``) and skewed routing (Zipf-like expert loads, some experts empty). The
layer is torchtitan 0.2.2's ``MoE`` with routed experts only (no shared expert), bf16 parameters,
the shape's ``score_before_experts``; the router's gate still runs, only its top-k choice is replaced.

Variants, each ``torch.compile``-d (default mode, graph breaks allowed so every baseline runs):
* ``bf16``: the unconverted torchtitan layer (``torch._grouped_mm``);
* ``torchao_rowwise``: ``quantize_(layer, torchao Float8TrainingOpConfig())`` on the experts:
  torchao 0.18's FP8 row-wise ``_scaled_grouped_mm`` MoE training path (what torchtitan's
  ``quantize.grouped_mm.float8`` converter applies; torchtitan 0.2.2 still imports it under its old
  name ``MoETrainingConfig``, which torchao 0.18 no longer has);
* ``torchao_blockwise``: the experts' three grouped GEMMs through torchao 0.18's
  ``_to_fp8_blockwise_then_scaled_grouped_mm`` (1x128 activations, 128x128 weights; DeepGEMM
  kernels when the optional ``deep_gemm`` package is installed, else torchao's emulated Triton
  path: the ``notes`` say which). torchao 0.18 has no config/converter for it, so its experts'
  forward is swapped here, as torchtitan's expert function calls the GEMMs: w1 and w3 apart, so x is
  quantized twice (a joined ``[w1; w3]`` GEMM would be torchao's best case; not measured);
* ``fp8flow`` / ``fp8flow_recompute``: ``quantize_(layer, FP8FlowConfig(recompute_experts=...))``;
* ``fp8flow_wt_forward``: ``FP8FlowConfig(weight_cache="forward")``: the forward writes the weights'
  exact transposes in the same pass and keeps them for backward (memory for speed; where the block's
  compile traces the experts, ``weight_cache="step"`` runs as this);
* ``fp8flow_wt_step``: ``FP8FlowConfig(weight_cache="step")`` with the experts run as torchtitan runs them
  (its ``apply_compile`` leaves the ``experts`` module out of the block's graph, here a graph break at the
  experts' ``forward``, and the converter compiles the routed path itself, ``fp8flow_compile_backend``):
  the weights are unchanged between timed steps, so this is a gradient-accumulation micro-batch after the
  first of a step -- the FP8 weights come from the cache (``weight_cache_mib``: the bytes it holds,
  outside ``act_mem`` and ``peak_mem``); the first micro-batch after an optimizer step costs about what
  ``fp8flow_wt_forward`` does;
* ``fp8flow_cudagraph``: ``fp8flow`` with the experts run as in ``fp8flow_wt_step`` and their path compiled
  with ``mode="reduce-overhead"`` (CUDA graphs: the layer's ``fp8flow_compile_mode``), against
  ``bf16_cudagraph``: the BF16 block under ``torch.compile(mode="reduce-overhead")``. No stage table for
  these: kernels replayed from a graph have no op to name them by;
* ``fp8flow_wt_step_cudagraph``: the two together, ``fp8flow_wt_step``'s cached micro-batch replayed as CUDA
  graphs that read the cached tiles in place (the cache keeps them at fixed addresses for that);
* ``fp8flow_bf16_fc1_dgrad``: ``FP8FlowConfig(backward="bf16_fc1_dgrad")``: FC1's dgrad in BF16 (the
  loss-gap fix of ``convergence.md``), what it costs.

Timing: per case, every selected variant is converted and compiled first, all of them kept alive, and
each warmed up by one untimed repetition under each routing (the first measured repetition ran up to 15%
slow in earlier runs -- clocks and the allocator settling after compilation -- and set the spread). Then
``--repeats`` rounds, each one timed repetition of every variant under each routing, routing by routing and
the variants in the order above: repetition i of a baseline and of FP8-Flow run back to back under the same
machine state (one variant's repetitions spread 10-17% with slow ones at fixed positions,
``results/moe_layer_spread_notes.md``, a drift that a speed-up between blocks timed apart would carry). A
repetition is the median of do_bench's timed runs (200 ms of forward + backward steps: 5 to 50 of them,
at 40 to 4 ms a step; after warm-up steps). ``--gc torchtitan`` (the
default) runs the rounds under torchtitan's garbage collection: its trainer turns Python's automatic collector
off and collects the young generations (``gc.collect(1)``) every ``gc_freq`` steps (50), here before each
repetition, outside its timing; ``--gc python`` leaves the automatic collector on, free to collect inside a
timed step. Memory, the host's and the device's time per step (measured apart, every variant: whether a
case is host-bound, for BF16 as for FP8-Flow) and the stage table are taken per variant after the rounds.

Reported per case: median ms of forward + backward (input and output gradients, weight
gradients) over the repetitions, with their min and max and their spread (``(max - min) / median``); the
speed-up is the ratio of the medians, ``speedup_range`` the worst and best pairing of any two repetitions,
``paired_speedups`` baseline over ours repetition by repetition (the same round), with their min and median;
per repetition its time, do_bench's runs in it (``ours_iters``/``baseline_iters``: count, min, median, 90th
percentile and max, us), the caching allocator's cudaMalloc/cudaFree calls, the median SM clock during it and
the clock event reasons NVML gave (``_bench.GpuClockLog``: one ``nvidia-smi -lms 50`` for the run; issue 11
asks whether the FP8 variants' wider spread follows the clock); the ``gc`` policy; speed-up of FP8-Flow over
each baseline; TFLOP/s at 18*T*k*D*H model FLOPs; the
activation memory held for backward (``memory_allocated`` after the forward minus before, less the
output itself; weights allocated before are not counted, FP8 weight copies made in the forward are,
and their estimated size is reported beside it: at the DeepSeek-like shape they are about 1.4 GB)
and its ratio to BF16's, with and without those copies; peak memory of forward + backward above
the resident state. A second table (``moe_layer_stages``) splits FP8-Flow's device time by op from a torch.profiler trace (balanced
routing; ``--stage-routings balanced skewed`` adds skewed): GEMMs
are named by their shapes (FC1/FC2, forward/dgrad/wgrad); every kernel that no ``fp8flow::`` op launched
(router, top-k, gathers, inductor-fused elementwise) is an "other: <kernel> [<launching op>]" row, the
largest ones by name. What the kernels do not account for is split in two: "gaps" is the device time
of steps run back to back (right after a GPU sleep, the host excluded) less every kernel of the profiled
steps (the device idle between kernels); "sustained" is the timed step less that back-to-back device time:
where the step is device-bound, the slower clocks of many steps in a row under the power cap (a sleep
leaves the GPU headroom; ``moe_layer_spread_notes.md``), where it is host-bound, the device waiting for the
host. The same table gives the host's time to enqueue one step and the device's time to run one, each
measured apart with the GPU held busy ("host enqueue", "device, steps back to back": host above device means
host-bound, the step then follows the host CPU's speed) and, from cProfile, the Python functions the host's
time goes to
("host: <function> (<file>:<line>)", own time, shares).

Targets (issue 4): >= 1.6x BF16 (DeepSeek-like), >= 1.4x BF16 (Qwen-like), >= 1.3x torchao
row-wise; activation memory <= 50% of BF16's, <= 20% with recompute. Rows carry ``target`` and
``meets_target`` (the medians' speed-up and the memory), and where a speed-up target exists
``every_rep_meets_target``: every paired speed-up at or above it (the Qwen-like goal is >= 1.4x in every
repetition).

Meant to run in under 5 minutes on an H100 (most of it compiling). Cases run one after the other, each
with an equal share of what is left of ``--budget-s``: variants whose build would start after the case's
share are skipped (BF16 and FP8-Flow are built first), and so are the rounds after the first that would
start after it; ``--cases`` / ``--variants`` select (a subset of cases writes
``moe_layer_<cases>.json``, so cases run one at a time keep their files).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import pstats
import re
import statistics
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from _bench import (
    ClockInterval,
    GpuClockLog,
    bench_us_all,
    host_and_device_us,
    n_rotations,
    nvidia_smi_id,
    row,
    skewed_counts,
    write_results,
)
from torch import nn

from fp8flow_ao.shapes import DEEPSEEK_V3, LLAMA4_SCOUT, QWEN3_30B_A3B, MoEShape

CASES = {
    "deepseek": (DEEPSEEK_V3, 4096),
    "deepseek_t16k": (DEEPSEEK_V3, 16384),  # the weights' per-step work amortized over 4x the tokens
    "qwen": (QWEN3_30B_A3B, 8192),
    "llama4": (LLAMA4_SCOUT, 16384),
}
ROUTINGS = ("balanced", "skewed")
OURS = (
    "fp8flow",
    "fp8flow_recompute",
    "fp8flow_wt_forward",
    "fp8flow_wt_step",
    "fp8flow_cudagraph",
    "fp8flow_wt_step_cudagraph",
    "fp8flow_bf16_fc1_dgrad",
)
VARIANTS = ("bf16", "bf16_cudagraph", *OURS, "torchao_rowwise", "torchao_blockwise")
CUDA_GRAPHED = ("bf16_cudagraph", "fp8flow_cudagraph", "fp8flow_wt_step_cudagraph")
WEIGHT_CACHE = {"fp8flow_wt_forward": "forward", "fp8flow_wt_step": "step", "fp8flow_wt_step_cudagraph": "step"}
# the experts run as torchtitan's converter runs them: their forward outside the block's graph, the path compiled
PATH_COMPILED = ("fp8flow_wt_step", "fp8flow_cudagraph", "fp8flow_wt_step_cudagraph")
BASELINES = {
    "bf16": "BF16 torchtitan MoE (torch.compile)",
    "bf16_cudagraph": "BF16 torchtitan MoE (torch.compile, CUDA graphs)",
    "torchao_rowwise": "torchao 0.18 FP8 row-wise MoE (torch.compile)",
    "torchao_blockwise": "torchao 0.18 FP8 blockwise grouped GEMM (torch.compile)",
}
SPEEDUP_TARGETS = {
    ("deepseek", "bf16"): 1.6,
    ("deepseek_t16k", "bf16"): 1.7,
    ("qwen", "bf16"): 1.4,
    ("deepseek", "torchao_rowwise"): 1.3,
    ("qwen", "torchao_rowwise"): 1.3,
}
# activation memory / BF16's; fp8flow_wt_forward trades memory (its FP8 weight transposes) for speed
MEMORY_TARGETS = {"fp8flow": 0.5, "fp8flow_recompute": 0.2}
# --gc: what the notes say of each policy (gc_policy runs them)
GC_NOTES = {
    "torchtitan": "as torchtitan's trainer (automatic collector off, gc.collect(1) before each repetition, "
    "outside its timing)",
    "python": "Python's automatic collector, as it runs (it may collect inside a timed step)",
}
PROFILE_ITERS = 5
OTHER_NAMED = 12  # kernels outside our ops named one by one in the stage table
HOST_NAMED = 15  # Python functions named in the host profile


class Block(nn.Module):
    """Holds the MoE layer as a child, so ``quantize_`` can swap or rewire it like any submodule."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class FixedRouting:
    """Stands in for the router's top-k choice (``_debug_force_load_balance_routing``) with set expert ids.

    The gate and its softmax still run; the ids live in one device tensor that :meth:`set` overwrites
    in place, so a compiled layer sees new routing without recompiling.
    """

    def __init__(self, tokens: int, top_k: int):
        self.indices = torch.zeros(tokens, top_k, dtype=torch.int64, device="cuda")

    def set(self, indices: torch.Tensor) -> None:
        self.indices.copy_(indices)

    def __call__(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.indices, scores.gather(dim=1, index=self.indices)


def routing(kind: str, tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Expert ids [tokens, top_k]: round robin (balanced) or Zipf-like loads in random order (skewed).

    Skewed loads exceed ``tokens`` on the biggest experts, so a token may pick one expert twice;
    the expert path does not care, and the loads are what the benchmark is about.
    """
    if kind == "balanced":
        return (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    counts = torch.tensor(skewed_counts(tokens * top_k, experts))
    ids = torch.repeat_interleave(torch.arange(experts), counts)
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))].view(tokens, top_k)


def build_bf16(shape: MoEShape) -> Block:
    """torchtitan's MoE at ``shape``: routed experts only, grouped GEMMs, bf16 parameters, seeded init."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.moe.moe import MoE

    args = MoEArgs(
        num_experts=shape.experts, num_shared_experts=0, top_k=shape.top_k, score_func="softmax",
        route_norm=True, score_before_experts=shape.score_before_experts, load_balance_coeff=None, use_grouped_mm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(args, dim=shape.dim, hidden_dim=shape.hidden)
    with torch.no_grad():
        moe.init_weights(init_std=0.02, buffer_device=torch.device("cuda"))
    return Block(moe).to(torch.bfloat16)


def _blockwise_experts(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """torchtitan's ``_run_experts_grouped_mm`` with each grouped GEMM in torchao's FP8 blockwise recipe."""
    import torch.nn.functional as F
    from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_scaled_grouped_mm as mm

    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    x = x.bfloat16()
    h = F.silu(mm(x, w1.bfloat16().transpose(-2, -1), offs)) * mm(x, w3.bfloat16().transpose(-2, -1), offs)
    return mm(h, w2.bfloat16().transpose(-2, -1), offs).type_as(x)


def _blockwise_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    from torchtitan.models.moe.utils import indices_padding_wrapper

    return indices_padding_wrapper(_blockwise_experts)(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


def convert(block: Block, variant: str) -> Block:
    """A deep copy of ``block`` (same weights) converted to ``variant``."""
    from torchao.quantization import quantize_
    from torchtitan.models.moe.moe import GroupedExperts

    block = copy.deepcopy(block)
    if variant == "torchao_rowwise":
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig

        quantize_(block, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, GroupedExperts))
    elif variant == "torchao_blockwise":
        experts = block.moe.experts
        experts.forward = _blockwise_forward.__get__(experts)
    elif variant in OURS:
        from fp8flow_ao.config import FP8FlowConfig

        quantize_(
            block,
            FP8FlowConfig(
                recompute_experts=variant == "fp8flow_recompute",
                weight_cache=WEIGHT_CACHE.get(variant, "off"),
                backward="bf16_fc1_dgrad" if variant == "fp8flow_bf16_fc1_dgrad" else "fp8",
            ),
        )
        if variant in PATH_COMPILED:
            experts = block.moe.experts
            experts.fp8flow_compile_backend = "inductor"
            experts.fp8flow_compile_mode = "reduce-overhead" if variant in CUDA_GRAPHED else None
            experts.forward = torch.compiler.disable(experts.forward)
    return block


def install_routing(block: Block, fixed: FixedRouting) -> None:
    """Make every torchtitan router in ``block`` (after any conversion) take its top-k from ``fixed``."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    routers = [m for m in block.modules() if isinstance(m, TokenChoiceTopKRouter)]
    if not routers:
        raise RuntimeError("no torchtitan TokenChoiceTopKRouter left in the converted layer")
    for router in routers:
        router._debug_force_load_balance = True
        router._debug_force_load_balance_routing = fixed


def make_step(block: nn.Module, keep_weight_grads: bool = False) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One forward + backward from fresh gradients (parameter and input gradients); ``keep_weight_grads``: the
    parameters keep theirs, as in a gradient-accumulation micro-batch after the first."""
    params = [] if keep_weight_grads else [p for p in block.parameters() if p.requires_grad]

    def step(x: torch.Tensor, dy: torch.Tensor) -> None:
        for p in params:
            p.grad = None
        x.grad = None
        block(x).backward(dy)

    return step


def make_inputs(tokens: int, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rotating (x, dy) sets, x a leaf that requires grad, [1, T, D] as torchtitan's MoE takes it."""
    per_set = 2 * tokens * dim * 2
    return [
        (
            torch.randn(1, tokens, dim, device="cuda", dtype=torch.bfloat16).requires_grad_(),
            torch.randn(1, tokens, dim, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(n_rotations(per_set))
    ]


@dataclass
class Measured:
    reps_us: list[float]  # one median per repetition
    act_mib: float  # held for backward: allocated after forward - before - the output
    weight_cache_mib: float  # held across steps by weight_cache="step" (allocated before, in neither figure)
    peak_mib: float  # forward + backward peak above the state before the forward
    reps_clock: list[dict]  # per repetition: the GPU's clocks while it ran (_bench.summarize_clocks)
    reps_cuda_mallocs: list[int]  # per repetition: the caching allocator's cudaMalloc + cudaFree calls (each syncs)
    reps_iters: list[dict] = field(default_factory=list)  # per repetition: iteration_summary ([]: not recorded)
    host_us: float | None = None  # host time to enqueue one step, measured apart (host_and_device_us)
    device_us: float | None = None  # device time of one step, steps back to back (host_and_device_us)

    @property
    def us(self) -> float:
        return statistics.median(self.reps_us)

    @property
    def spread_pct(self) -> float:
        return 100 * (max(self.reps_us) - min(self.reps_us)) / self.us


def iteration_summary(iters_us: Sequence[float]) -> dict[str, int]:
    """One repetition's do_bench runs in whole microseconds: their count, min, median, 90th percentile (linear
    between the closest ranks, as numpy's default) and max; the median is the repetition's figure."""
    ordered = sorted(iters_us)
    p90 = statistics.quantiles(ordered, n=10, method="inclusive")[-1] if len(ordered) > 1 else ordered[0]
    return {
        "n": len(ordered),
        "min": round(ordered[0]),
        "median": round(statistics.median(ordered)),
        "p90": round(p90),
        "max": round(ordered[-1]),
    }


def cuda_mallocs() -> int:
    """cudaMalloc + cudaFree calls of the caching allocator so far (and its retries after a failed malloc,
    which free the cache): each stalls the host and can serialize the device; a warm step makes none."""
    stats = torch.cuda.memory_stats()
    return sum(stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries"))


def drop_grads(block: nn.Module, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Free the gradients the last step left. Every variant of a case is alive during its timed repetitions:
    left in place, each variant's weight gradients (as large as its BF16 weights) would be held at once."""
    for p in block.parameters():
        p.grad = None
    for x, _ in inputs:
        x.grad = None


@dataclass
class Repetitions:
    """The timed repetitions of one (variant, routing) so far."""

    us: list[float] = field(default_factory=list)  # each repetition's median
    iters: list[dict] = field(default_factory=list)  # iteration_summary of each repetition's runs
    intervals: list[ClockInterval] = field(default_factory=list)  # when each ran, for the clocks
    cuda_mallocs: list[int] = field(default_factory=list)

    def run(
        self,
        step: Callable[[torch.Tensor, torch.Tensor], None],
        inputs: list[tuple[torch.Tensor, torch.Tensor]],
        clocks: GpuClockLog,
    ) -> None:
        """Time one more repetition of ``step`` over ``inputs`` (the routing set now), with the clocks logged."""
        before = cuda_mallocs()
        with clocks.interval() as iv:
            iters_us = bench_us_all(step, inputs)
        self.intervals.append(iv)
        self.cuda_mallocs.append(cuda_mallocs() - before)
        self.us.append(statistics.median(iters_us))
        self.iters.append(iteration_summary(iters_us))


def memory_mib(block: nn.Module, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, float]:
    """MiB held for backward, held by the FP8 weight cache, and at the peak of forward + backward above the
    state before it (the ``Measured`` fields), for one step under the routing set now."""
    from fp8flow_ao.weight_cache import EXPERT_WEIGHT_CACHE

    # weight_cache_mib counts this variant's entries only: the case's other variants are alive, and
    # fp8flow_wt_step's entries would show in every later variant's figure. Emptied here, once all timed
    # repetitions have run (fp8flow_wt_step's time a cached micro-batch and need its entries); this step refills
    # this variant's.
    EXPERT_WEIGHT_CACHE.invalidate()
    step = make_step(block)
    x, dy = inputs[0]
    step(x, dy)
    drop_grads(block, inputs)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = block(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    drop_grads(block, inputs)
    return held / 2**20, EXPERT_WEIGHT_CACHE.nbytes() / 2**20, peak / 2**20


def _gemm_label(name: str, shapes: list, shape: MoEShape) -> str:
    """Name an FP8 grouped GEMM by its operand shapes: FC1/FC2, forward/dgrad (N, K of b) or wgrad (N, K of the output)."""
    d, h = shape.dim, shape.hidden
    try:
        if name.endswith("grouped_gemm_fp8_blockwise"):
            n, k = shapes[2][-2], shapes[2][-1]  # b [E, N, K]
            labels = {(2 * h, d): "FC1 fwd", (d, h): "FC2 fwd", (h, d): "FC2 dgrad", (d, 2 * h): "FC1 dgrad"}
            return f"GEMM {labels.get((n, k), f'N={n} K={k}')}"
        n, k = shapes[0][0], shapes[2][0]  # a_t [N, M], b_t [K, M] -> dW [E, N, K]
        labels = {(d, h): "FC2 wgrad", (2 * h, d): "FC1 wgrad"}
        return f"GEMM {labels.get((n, k), f'wgrad N={n} K={k}')}"
    except (IndexError, TypeError):
        return name.removeprefix("fp8flow::")


def stage_breakdown(
    block: nn.Module, inputs: list[tuple[torch.Tensor, torch.Tensor]], shape: MoEShape, step_us: float, device_us: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Device microseconds per forward + backward by ``fp8flow::`` op (outermost calls only), by kernel
    for the rest ("other: ..."), and what no kernel accounts for (each device event counted once,
    deduplicated by name and start time): "gaps", the device time of steps back to back (``device_us``,
    :func:`host_and_device_us`) less every kernel, and "sustained", the timed step (``step_us``, CUDA
    events) less that device time (see the module docstring); and the host's time by Python function
    (:func:`host_profile`). Run right after ``device_us`` was measured on the same block: no warm-up of its own.

    Kernels are charged to the op that launched them (the profiler's correlation). Should the trace
    link no kernel to an op, Triton kernels are named by their function instead (``_<op>_kernel``).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = make_step(block)
    x, dy = inputs[0]  # warm: the caller has just run steps (host_and_device_us)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(PROFILE_ITERS):
            step(x, dy)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = _device_kernels(events)
    stages: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("fp8flow::") and not _has_fp8flow_ancestor(e):
            label = e.name.removeprefix("fp8flow::")
            stages[_gemm_label(e.name, e.input_shapes, shape) if "grouped_gemm" in e.name else label] += (
                e.device_time_total
            )
    if not any(stages.values()):
        stages.clear()
        for k in kernels:
            if match := re.fullmatch(r"_(\w+)_kernel", k.name):
                stages[match.group(1)] += k.device_time_total
    per_step = {k: v / PROFILE_ITERS for k, v in stages.items()}
    other = _other_kernels(events, kernels)
    per_step.update({f"other: {name}": us / PROFILE_ITERS for name, us in other.items()})
    kernel_us = sum(k.device_time_total for k in kernels) / PROFILE_ITERS
    per_step["gaps (device time of steps back to back less every kernel)"] = device_us - kernel_us
    per_step["sustained (timed step less the device time of steps back to back)"] = step_us - device_us
    return dict(sorted(per_step.items(), key=lambda kv: -kv[1])), host_profile(step, x, dy)


def _short_path(file: str) -> str:
    """A source path from its package root (``torch/...``, ``fp8flow_ao/...``); builtins keep their ``~``."""
    return re.sub(r".*/(?:site-packages|site)/|.*/(?=fp8flow_ao/)", "", file)


def host_profile(
    step: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor, dy: torch.Tensor
) -> dict[str, float]:
    """Where the host's time to enqueue a step goes: cProfile's own time (``tottime``) per step of the
    ``HOST_NAMED`` costliest functions, in microseconds, and the rest as one entry. The profiler slows every
    Python call, so these add up to more than the unprofiled enqueue time: read them as shares."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(PROFILE_ITERS):
        step(x, dy)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, primitive calls, tottime, cumtime, ...)
    by_fn = sorted(((v[2], k) for k, v in stats.items()), reverse=True)
    named = {
        f"{fn} ({_short_path(file)}:{line})": 1e6 * t / PROFILE_ITERS for t, (file, line, fn) in by_fn[:HOST_NAMED]
    }
    rest = sum(t for t, _ in by_fn[HOST_NAMED:])
    return named | {f"{len(by_fn) - HOST_NAMED} other functions": 1e6 * rest / PROFILE_ITERS}


def _device_kernels(events) -> list:
    """The trace's kernels, each once (deduplicated by name and start time), without the device-side
    copies of annotations (``## Call CompiledFxGraph ... ##`` spans the kernels of a whole graph)."""
    from torch.autograd import DeviceType

    found = {(e.name, e.time_range.start): e for e in events if e.device_type == DeviceType.CUDA}
    return [e for e in found.values() if not e.name.startswith("## ")]


def _other_kernels(events, kernels: list, named: int = OTHER_NAMED) -> dict[str, float]:
    """Device microseconds (all profiled steps) of the kernels no ``fp8flow::`` op launched, by kernel.

    Per kernel name: its time in the trace less the time the profiler links to ``fp8flow::`` ops
    (their launches and their children's; the same links that time the ops' rows). Each row names
    the op that launched the kernel most often (e.g. ``aten::copy_``). The ``named`` largest keep
    their names, the rest are summed in one row that says how many.
    """
    from torch.autograd import DeviceType

    total: dict[str, float] = defaultdict(float)
    for k in kernels:
        total[k.name] += k.device_time_total
    ours: dict[str, float] = defaultdict(float)
    launchers: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in events:
        if e.device_type != DeviceType.CPU or not e.kernels:
            continue
        mine = e.name.startswith("fp8flow::") or _has_fp8flow_ancestor(e)
        for k in e.kernels:
            if mine:
                ours[k.name] += k.duration
            elif not e.name.startswith("Activity Buffer"):  # profiler bookkeeping sharing an id
                launchers[k.name][e.name] += 1
    rest = {name: us - ours.get(name, 0.0) for name, us in total.items()}
    ranked = sorted(((n, us) for n, us in rest.items() if us > 0.5), key=lambda kv: -kv[1])

    def label(name: str) -> str:
        by = launchers.get(name)
        via = max(by, key=by.get) if by else "launcher unknown"
        functor = re.findall(r"at::native::(?:\w+::)*(\w+)", name)
        short = f"{name[:60]} .. {functor[-1]}" if len(name) > 80 and functor else name[:80]
        return f"{short} [{via[:40]}]"

    out = {label(n): us for n, us in ranked[:named]}
    if ranked[named:]:
        out[f"{len(ranked) - named} smaller kernels"] = sum(us for _, us in ranked[named:])
    return out


def _has_fp8flow_ancestor(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("fp8flow::"):
            return True
        parent = parent.cpu_parent
    return False


def blockwise_backend() -> str:
    """Which grouped GEMM torchao's blockwise path uses here: DeepGEMM or its emulated Triton kernels."""
    from torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels import can_use_deepgemm_grouped_training

    probe = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
    return (
        "DeepGEMM"
        if can_use_deepgemm_grouped_training(probe, torch.bfloat16, 128)
        else "emulated (no DeepGEMM installed)"
    )


@dataclass
class Case:
    """One shape with its BF16 layer, rotating inputs and the routing all its variants share."""

    name: str
    shape: MoEShape
    tokens: int
    base: Block
    inputs: list[tuple[torch.Tensor, torch.Tensor]]
    fixed: FixedRouting
    routes: dict[str, torch.Tensor]  # routing kind -> expert ids, on the device
    results: dict[tuple[str, str], Measured]  # (routing, variant) -> measured

    def route(self, kind: str) -> None:
        """Make every variant's router pick the experts of routing ``kind`` (:func:`routing`)."""
        self.fixed.set(self.routes[kind])


def prepare(name: str) -> Case:
    shape, tokens = CASES[name]
    inputs = make_inputs(tokens, shape.dim)
    routes = {kind: routing(kind, tokens, shape.top_k, shape.experts).cuda() for kind in ROUTINGS}
    return Case(name, shape, tokens, build_bf16(shape), inputs, FixedRouting(tokens, shape.top_k), routes, {})


@dataclass
class Built:
    """One variant of a case, converted and compiled, with its timed repetitions per routing."""

    variant: str
    block: nn.Module  # the compiled block
    step: Callable[[torch.Tensor, torch.Tensor], None]
    reps: dict[str, Repetitions] = field(default_factory=lambda: {kind: Repetitions() for kind in ROUTINGS})


def note_failure(notes: list[str], what: str, exc: Exception) -> None:
    """A variant failed: one line in the notes, the traceback in the log (the other variants go on)."""
    first_line = str(exc).splitlines()[0][:300].rstrip(".") if str(exc) else ""
    notes.append(f"{what}: failed: {type(exc).__name__}: {first_line}.")
    traceback.print_exc()


def build_variant(case: Case, variant: str) -> Built:
    """``variant`` of ``case`` converted, compiled and warmed up by one untimed repetition under each routing
    (the module docstring says why; it also records the CUDA graphs and fills fp8flow_wt_step's weight cache)."""
    block = convert(case.base, variant)
    install_routing(block, case.fixed)
    compiled = torch.compile(block, mode="reduce-overhead" if variant == "bf16_cudagraph" else None)
    built = Built(variant, compiled, make_step(compiled))
    for kind in ROUTINGS:
        case.route(kind)
        bench_us_all(built.step, case.inputs)
    drop_grads(compiled, case.inputs)
    return built


def build_all(case: Case, variants: tuple[str, ...], deadline: float, notes: list[str]) -> tuple[list[Built], bool]:
    """The ``variants`` of ``case`` (in that order) that start building before ``deadline``; and whether an
    FP8-Flow variant failed."""
    built, ours_failed = [], False
    for variant in variants:
        if time.monotonic() > deadline:
            notes.append(f"{case.name}/{variant}: skipped, over the time budget.")
            continue
        start = time.monotonic()
        try:
            built.append(build_variant(case, variant))
        except Exception as exc:  # one variant failing must not hide the others' numbers
            note_failure(notes, f"{case.name}/{variant}", exc)
            ours_failed |= variant in OURS
        print(f"{case.name}/{variant}: built and warmed up in {time.monotonic() - start:.0f} s", flush=True)
    return built, ours_failed


@contextlib.contextmanager
def gc_policy(mode: str) -> Iterator[Callable[[], None]]:
    """Python's garbage collection inside the block: ``"torchtitan"`` as torchtitan's trainer runs it
    (``torchtitan.tools.utils.GarbageCollection``: the automatic collector off, ``gc.collect(1)`` every
    ``training.gc_freq`` steps, 50 by default), ``"python"`` left as it is (automatic collections at allocation
    counts, inside a timed step or not). Yields what to call before each timed repetition: with
    ``"torchtitan"`` that collection, outside the timing (a repetition is 10 to 60 steps, warm-up included).
    The collector's state from before is restored after."""
    if mode not in GC_NOTES:
        raise ValueError(f"gc mode must be one of {', '.join(GC_NOTES)}, got {mode!r}")
    enabled = gc.isenabled()
    if mode == "torchtitan":
        gc.disable()
    try:
        yield (lambda: gc.collect(1)) if mode == "torchtitan" else (lambda: None)
    finally:
        if enabled:
            gc.enable()


@dataclass
class Rounds:
    """How the timed repetitions run: ``repeats`` rounds under the ``gc_mode`` policy (:func:`gc_policy`), the
    clocks logged by ``clocks``; what was skipped or failed goes to ``notes``; after them, FP8-Flow's stage
    table is profiled under each of ``stage_routings``."""

    repeats: int
    gc_mode: str
    clocks: GpuClockLog
    notes: list[str]
    stage_routings: tuple[str, ...] = ("balanced",)


def time_interleaved(case: Case, built: list[Built], deadline: float, rounds: Rounds) -> bool:
    """``rounds.repeats`` rounds, each one timed repetition of every variant in ``built`` under each routing (routing
    by routing, the variants in ``built``'s order), so repetition r of a baseline and of FP8-Flow run back to
    back under the same machine state. A round that would start after ``deadline`` is skipped with those after
    it (the first always runs), so every variant has as many repetitions. A variant that fails is dropped from
    ``built``; returns whether an FP8-Flow variant failed."""
    ours_failed, repeats, notes = False, rounds.repeats, rounds.notes
    if not built:  # every variant skipped or failed: no rounds to report
        return ours_failed
    with gc_policy(rounds.gc_mode) as before_repetition:
        for r in range(repeats):
            if r and time.monotonic() > deadline:
                notes.append(f"{case.name}: timed repetitions {r + 1}-{repeats} skipped, over the time budget.")
                break
            start = time.monotonic()
            for kind in ROUTINGS:
                for b in list(built):
                    case.route(kind)
                    before_repetition()
                    try:
                        b.reps[kind].run(b.step, case.inputs, rounds.clocks)
                        drop_grads(b.block, case.inputs)
                    except Exception as exc:  # one variant failing must not hide the others' numbers
                        note_failure(notes, f"{case.name}/{b.variant} (repetition {r + 1}, {kind})", exc)
                        ours_failed |= b.variant in OURS
                        built.remove(b)
            print(f"{case.name}: repetition {r + 1} of {repeats}: {time.monotonic() - start:.0f} s", flush=True)
    return ours_failed


def variant_stage_rows(
    case: Case, kind: str, variant: str, block: nn.Module, m: Measured, notes: list[str]
) -> list[dict]:
    """The ``moe_layer_stages`` rows of one variant under routing ``kind`` (set now; ``m``: its timings): device
    time by op, the host's and the device's time per step, the host's time by Python function; none when the
    profile fails."""
    try:
        stages, host_fns = stage_breakdown(block, case.inputs, case.shape, m.us, m.device_us)
    except Exception:  # the profile is diagnostic: its failure must not drop the timings
        traceback.print_exc()
        notes.append(f"{case.name}/{variant}: stage breakdown failed (traceback in the log).")
        return []
    label = f"{case.shape.name} T={case.tokens} {kind} {variant}"
    total = sum(stages.values())
    rows = [
        row(
            label, us, "share of device time", None, stage=name, share_pct=round(100 * us / total, 1) if total else None
        )
        for name, us in stages.items()
    ]
    rows += [
        row(
            label,
            us,
            f"per step, measured apart with the GPU held busy: {_bound(m)}",
            None,
            stage=stage,
            share_pct=None,
        )
        for stage, us in (("host enqueue", m.host_us), ("device, steps back to back", m.device_us))
    ]
    host_total = sum(host_fns.values())
    rows += [
        row(
            label,
            us,
            "host time per step by Python function (cProfile tottime; profiled, so read as shares)",
            None,
            stage=f"host: {fn}",
            share_pct=round(100 * us / host_total, 1),
        )
        for fn, us in host_fns.items()
    ]
    return rows


def finish_variant(case: Case, b: Built, notes: list[str], stage_routings: tuple[str, ...]) -> list[dict]:
    """After the timed repetitions: ``b``'s memory and its host's and device's time per step (measured apart:
    :func:`host_and_device_us`) under each routing, its :class:`Measured` into ``case.results``, and
    FP8-Flow's stage rows under each of ``stage_routings`` (none for CUDA graphs: kernels replayed from a graph
    have no op to name them by)."""
    rows = []
    x, dy = case.inputs[0]
    for kind in ROUTINGS:
        case.route(kind)
        reps = b.reps[kind]
        act, cache, peak = memory_mib(b.block, case.inputs)
        host_us, device_us = host_and_device_us(lambda: b.step(x, dy), PROFILE_ITERS)
        drop_grads(b.block, case.inputs)
        # summarized last: by now nvidia-smi has delivered the last repetition's samples too
        clock = [iv.summary() for iv in reps.intervals]
        m = Measured(reps.us, act, cache, peak, clock, reps.cuda_mallocs, reps.iters, host_us, device_us)
        case.results[kind, b.variant] = m
        if b.variant in OURS and kind in stage_routings and b.variant not in CUDA_GRAPHED:
            rows += variant_stage_rows(case, kind, b.variant, b.block, m, notes)
    return rows


def run_case(case: Case, variants: tuple[str, ...], deadline: float, rounds: Rounds) -> tuple[list[dict], bool]:
    """Build every variant of ``case``, time them interleaved, then take their memory and stage rows; the
    compiled variants are freed when this returns. Returns the stage rows and whether an FP8-Flow variant
    failed."""
    notes = rounds.notes
    built, ours_failed = build_all(case, variants, deadline, notes)
    ours_failed |= time_interleaved(case, built, deadline, rounds)
    rows = []
    for b in built:
        try:
            rows += finish_variant(case, b, notes, rounds.stage_routings)
        except Exception as exc:  # one variant failing must not hide the others' numbers
            note_failure(notes, f"{case.name}/{b.variant}", exc)
            ours_failed |= b.variant in OURS
    return rows, ours_failed


def run_all(cases: list[Case], variants: tuple[str, ...], deadline: float, rounds: Rounds) -> tuple[list[dict], bool]:
    """Case after case, each with all its variants compiled at once (freed before the next case) and an equal
    share of the time left before ``deadline``: a tight budget still measures BF16 and FP8-Flow (built first)
    in every case and skips the slow baselines. Returns the stage rows and whether an FP8-Flow variant failed."""
    stage_rows, ours_failed = [], False
    for i, case in enumerate(cases):
        start = time.monotonic()
        rows, failed = run_case(case, variants, start + (deadline - start) / (len(cases) - i), rounds)
        stage_rows += rows
        ours_failed |= failed
        gc.collect()
        torch.cuda.empty_cache()
        print(f"{case.name}: {time.monotonic() - start:.0f} s", flush=True)
    return stage_rows, ours_failed


def _sm_mhz(m: Measured) -> list[int | None] | None:
    """Each repetition's median SM clock; None when no repetition has a clock sample."""
    mhz = [c["sm_mhz_median"] for c in m.reps_clock]
    return mhz if any(x is not None for x in mhz) else None


def _throttle(m: Measured) -> str | None:
    """The clock event reasons active in any sample of any repetition, "+"-joined ("none" when none was);
    None when no repetition has a sample with reasons."""
    seen = [c["throttle_reasons"] for c in m.reps_clock if c["throttle_reasons"] is not None]
    return ("+".join(sorted(set().union(*seen))) or "none") if seen else None


def _rounded(us: float | None) -> float | None:
    return None if us is None else round(us, 1)


def _bound(m: Measured) -> str | None:
    """Host-bound where enqueueing a step took the host longer than the device took to run it, else
    device-bound (the labels returned); None when not measured."""
    if m.host_us is None or m.device_us is None:
        return None
    return "host-bound" if m.host_us > m.device_us else "device-bound"


def paired_speedups(baseline_us: Sequence[float], ours_us: Sequence[float]) -> list[float] | None:
    """Baseline time over ours repetition by repetition (repetition i of both ran in round i, back to back),
    to 3 decimals; None when their counts differ (they were not measured in the same rounds)."""
    if len(baseline_us) != len(ours_us):
        return None
    return [round(b / o, 3) for b, o in zip(baseline_us, ours_us, strict=True)]


def result_rows(
    case: str, shape: MoEShape, tokens: int, results: dict[tuple[str, str], Measured], *, gc_mode: str | None = None
) -> list[dict]:
    """One row per (case, routing, ours, baseline) with speed-up, memory and target checks; ``gc_mode``: the
    ``--gc`` policy the repetitions ran under (the rows' ``gc``)."""
    flops = 18 * tokens * shape.top_k * shape.dim * shape.hidden
    rows = []
    for (kind, variant), ours in results.items():
        if variant not in OURS:
            continue
        bf16 = results.get((kind, "bf16"))
        for baseline, label in BASELINES.items():
            if (kind, baseline) not in results:
                continue
            base = results[kind, baseline]
            target = SPEEDUP_TARGETS.get((case, baseline)) if variant == "fp8flow" else None
            paired = paired_speedups(base.reps_us, ours.reps_us)
            r = row(
                f"{shape.name} T={tokens} D={shape.dim} H={shape.hidden} E={shape.experts} top{shape.top_k} {kind} [{variant}]",
                ours.us, label, base.us, flops=flops,
                ours_ms=round(ours.us / 1e3, 3), baseline_ms=round(base.us / 1e3, 3),
                act_mem_mib=round(ours.act_mib, 1), baseline_act_mem_mib=round(base.act_mib, 1),
                weight_cache_mib=round(ours.weight_cache_mib, 1),
                peak_mem_mib=round(ours.peak_mib, 1), baseline_peak_mem_mib=round(base.peak_mib, 1),
                baseline_tflops=round(flops / base.us / 1e6, 1),
                repeats=len(ours.reps_us), ours_us_min=round(min(ours.reps_us), 2),
                ours_us_max=round(max(ours.reps_us), 2), ours_spread_pct=round(ours.spread_pct, 1),
                baseline_spread_pct=round(base.spread_pct, 1),
                speedup_range=[round(min(base.reps_us) / max(ours.reps_us), 3),
                               round(max(base.reps_us) / min(ours.reps_us), 3)],
                ours_reps_us=[round(u) for u in ours.reps_us], baseline_reps_us=[round(u) for u in base.reps_us],
                ours_sm_mhz=_sm_mhz(ours), baseline_sm_mhz=_sm_mhz(base),
                ours_throttle=_throttle(ours), baseline_throttle=_throttle(base),
                ours_cuda_mallocs=ours.reps_cuda_mallocs, baseline_cuda_mallocs=base.reps_cuda_mallocs,
                paired_speedups=paired, paired_speedup_min=min(paired) if paired else None,
                paired_speedup_median=round(statistics.median(paired), 3) if paired else None,
                ours_iters=ours.reps_iters, baseline_iters=base.reps_iters, gc=gc_mode,
                ours_host_us=_rounded(ours.host_us), ours_device_us=_rounded(ours.device_us),
                baseline_host_us=_rounded(base.host_us), baseline_device_us=_rounded(base.device_us),
                ours_bound=_bound(ours), baseline_bound=_bound(base),
            )  # fmt: skip
            if variant in CUDA_GRAPHED or baseline in CUDA_GRAPHED:
                # a CUDA graph's buffers live in its private pool, which the allocator's counters leave out
                for key in ("act_mem_mib", "peak_mem_mib") if variant in CUDA_GRAPHED else ():
                    r[key] = None
                for key in ("baseline_act_mem_mib", "baseline_peak_mem_mib") if baseline in CUDA_GRAPHED else ():
                    r[key] = None
            elif bf16 is not None:
                r["act_mem_ratio_vs_bf16"] = round(ours.act_mib / bf16.act_mib, 3)
            checks = []
            if target is not None:
                r["target"] = f">= {target}x"
                checks.append(r["speedup"] >= target)
                r["every_rep_meets_target"] = None if paired is None else min(paired) >= target
            if baseline == "bf16" and variant in MEMORY_TARGETS:
                r["memory_target"] = f"<= {MEMORY_TARGETS[variant]:.0%} of bf16"
                checks.append(r["act_mem_ratio_vs_bf16"] <= MEMORY_TARGETS[variant])
            if checks:
                r["meets_target"] = all(checks)
            rows.append(r)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repetitions per variant and routing, in interleaved rounds (median, spread, paired speed-ups)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=270,
        help="skip the variants (builds) and timed repetitions that would start after this many seconds, "
        "each case getting an equal share of the time left",
    )
    parser.add_argument(
        "--gc",
        choices=tuple(GC_NOTES),
        default="torchtitan",
        help="garbage collection during the timed repetitions: torchtitan's (automatic collector off, a "
        "collection before each repetition) or Python's automatic one",
    )
    parser.add_argument(
        "--stage-routings",
        nargs="+",
        choices=ROUTINGS,
        default=["balanced"],
        help="the routings FP8-Flow's stage table (moe_layer_stages) is profiled under (each adds ~10-20 s a variant)",
    )
    parser.add_argument("--tag", default="", help="appended to the result files' names (keeps another run's files)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not torch.cuda.is_available():
        print("bench_moe_layer: no CUDA device, nothing to measure.")
        return
    from torchtitan.models.moe.utils import set_token_group_alignment_size_m

    # torchao's FP8 row-wise grouped GEMM needs 16-row aligned groups (torchtitan's float8 converter
    # sets this too); it applies to every torchtitan-padded variant alike.
    set_token_group_alignment_size_m(16)
    torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan sets for token-choice MoE
    torch._dynamo.config.cache_size_limit = 64
    deadline = time.monotonic() + args.budget_s
    variants = tuple(v for v in VARIANTS if v in args.variants)
    if "torchao_blockwise" in variants:
        notes = [f"torchao blockwise grouped GEMM backend: {blockwise_backend()}"]
    else:
        notes = []
    cases = [prepare(name) for name in args.cases]
    with GpuClockLog(nvidia_smi_id()) as clocks:  # one nvidia-smi for the whole run
        stage_rows, ours_failed = run_all(
            cases, variants, deadline, Rounds(args.repeats, args.gc, clocks, notes, tuple(args.stage_routings))
        )
    rows = [r for c in cases for r in result_rows(c.name, c.shape, c.tokens, c.results, gc_mode=args.gc)]
    notes.append(
        f"ours_us/baseline_us: median over the repetitions (repeats: how many; --repeats {args.repeats}) of the "
        "median forward + backward (torch.compile, bf16 params), spread = (max - min) / median of the repetitions. "
        "Repetitions interleaved: in round i, repetition i of every variant under each routing, back to back "
        f"(variants in the order {', '.join(variants)}); garbage collection: {GC_NOTES[args.gc]}. "
        "paired_speedups: baseline / ours of the same round, paired_speedup_min/_median their min and median, "
        "every_rep_meets_target: all of them at or above the target; gc: the garbage collection policy; "
        "ours_iters/baseline_iters: per repetition, do_bench's timed runs (n, and min, median, p90, max in us); "
        "act_mem: memory held "
        "for backward after the forward (output excluded; FP8-Flow keeps no weight copies: it re-quantizes the "
        "weights' transposes in backward, except fp8flow_wt_forward, which keeps the forward's, and "
        "fp8flow_wt_step, which takes both from its cache: weight_cache_mib, held across steps); tflops at 18*T*k*D*H. "
        "ours_reps_us/baseline_reps_us: each repetition's median; ours_sm_mhz/baseline_sm_mhz: the median SM clock "
        f"(MHz, nvidia-smi every {clocks.period_ms} ms) during each repetition; ours_throttle/baseline_throttle: "
        "the NVML clock event reasons active in any sample of the repetitions (sw_power_cap: power limit, "
        "*_thermal_slowdown: temperature, gpu_idle: the GPU waited on the host; none: no reason); "
        "ours_cuda_mallocs/baseline_cuda_mallocs: the caching allocator's cudaMalloc + cudaFree calls (+ retries) "
        "in each repetition (0 once the allocator is warm). ours_host_us/ours_device_us, baseline_host_us/"
        "baseline_device_us: the host's time to enqueue one step and the device's time to run one, measured apart "
        "after the repetitions (a GPU sleep queued first keeps the device busy while the host enqueues "
        f"{PROFILE_ITERS} steps, which then run back to back); ours_bound/baseline_bound: host-bound where the "
        "host's is the larger (the timed step then follows the host CPU's speed)."
    )
    if clocks.error:
        notes.append(f"No GPU clock samples ({clocks.error}): the clock columns are empty.")
    # A subset of the cases gets its own files, so running the cases one at a time keeps both.
    name = "moe_layer" if set(args.cases) == set(CASES) else "moe_layer_" + "_".join(sorted(args.cases))
    name += f"_{args.tag}" if args.tag else ""
    write_results(name, rows, notes=" ".join(notes))
    if stage_rows:
        note = "FP8-Flow device time per forward + backward by op (torch.profiler)."
        write_results(name.replace("moe_layer", "moe_layer_stages"), stage_rows, notes=note)
    if ours_failed:
        sys.exit("bench_moe_layer: an FP8-Flow variant failed (see the notes and the traceback above)")


if __name__ == "__main__":
    main()
