"""Gradient accumulation: one MoE layer's forward + backward on a micro-batch whose expert weights already hold
gradients (every micro-batch after the first of an optimizer step), against the first micro-batch.

On such a micro-batch autograd adds each fresh weight gradient into the existing one (``AccumulateGrad``: the
wgrad writes ``dW``, then an add reads ``w.grad`` and ``dW`` and writes the sum: at the DeepSeek-like shape
2.8 GB of bf16 gradients, ~8.5 GB moved). FP8-Flow's eager layer adds into ``w.grad`` in its wgrad epilogue
instead (:mod:`fp8flow_ao._grad_accumulation`). Variants (torchtitan 0.2.2's ``MoE``, routed experts only, bf16
parameters, the layer benchmark's fixed balanced routing, ``bench_moe_layer.py``'s builders):

* ``bf16``: the unconverted layer, eager (``torch._grouped_mm``: fresh gradients + ``AccumulateGrad``'s add);
* ``fp8flow``: ``quantize_(layer, FP8FlowConfig())``, eager (the default: the wgrads add into ``w.grad``);
* ``fp8flow_unfused``: the same layer with a no-op tensor hook on each expert weight, which keeps the plain
  path (a hook must see the gradient): fresh gradients + ``AccumulateGrad``'s add, what the layer did before
  the fusion;
* ``fp8flow_wt_step``: ``FP8FlowConfig(weight_cache="step")``, eager: what gradient accumulation is for -- the
  FP8 weights cached since the last weight update (unchanged here between steps) and the gradients added in the
  epilogue. Only its accumulating micro-batch is measured: the first micro-batch after an optimizer step
  re-quantizes the changed weights (about what ``fp8flow``'s first micro-batch costs, plus the transposes kept
  for backward); the cache's FP8 copy is allocated before the step, outside ``peak_gib``;
* ``bf16_compiled`` / ``fp8flow_compiled``: the block under ``torch.compile``: a traced backward cannot depend
  on whether ``.grad`` exists, so the compiled FP8-Flow path writes fresh gradients too (not fused).

Per (case, variant, micro-batch): the median over ``--repeats`` interleaved repetitions of do_bench's median
step time (the first micro-batch sets the parameters' gradients to ``None`` before each step; the accumulating
one leaves them), the repetitions' spread, and the peak memory of one step above what was allocated before it
(the accumulating micro-batch's resident gradients are in "before"; the first micro-batch starts from none). ``speedup``: the same mode's BF16 step over
this variant's. Writes ``benchmarks/results/grad_accumulation.{json,md}``.

    python benchmarks/bench_grad_accumulation.py [--cases deepseek qwen] [--repeats 3] [--tag NAME]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable

import torch
from _bench import bench_us_all, row, write_results
from bench_moe_layer import (
    CASES,
    FixedRouting,
    build_bf16,
    convert,
    drop_grads,
    install_routing,
    make_step,
    routing,
)

VARIANTS = ("bf16", "fp8flow", "fp8flow_unfused", "fp8flow_wt_step", "bf16_compiled", "fp8flow_compiled")
MICRO_BATCHES = ("first", "accumulating")
ONLY_ACCUMULATING = ("fp8flow_wt_step",)  # its cache holds unchanged weights: no first micro-batch to time


def build(base: torch.nn.Module, variant: str, fixed: FixedRouting) -> torch.nn.Module:
    """``variant`` of the BF16 block ``base`` (a deep copy, same weights), its router taking ``fixed``'s ids."""
    block = convert(base, variant.split("_")[0])  # "bf16" or "fp8flow": the layer benchmark's builders
    install_routing(block, fixed)
    if variant == "fp8flow_wt_step":  # eager, as quantize_ leaves it (the layer benchmark's variant compiles)
        block.moe.experts.fp8flow_weight_cache = "step"
    if variant == "fp8flow_unfused":
        for w in (block.moe.experts.w1, block.moe.experts.w2, block.moe.experts.w3):
            w.register_hook(lambda grad: grad)
    if variant.endswith("_compiled"):
        block.compile()
    return block


def peak_gib(
    step: Callable[[torch.Tensor, torch.Tensor], None],
    x: torch.Tensor,
    dy: torch.Tensor,
    block: torch.nn.Module,
    keep_weight_grads: bool,
) -> float:
    """Peak memory of one step above what was allocated before it, GiB. The gradients the step itself drops
    first (``x``'s, and on a first micro-batch the weights') are dropped before "before" is read: left there
    (from the timed steps), their bytes freed inside the step hid as much of the step's own peak -- the first
    micro-batch's peaks of sessions 46-50 were low by the weight gradients' size (2.6 GiB DeepSeek-like)."""
    if keep_weight_grads:
        x.grad = None
    else:
        drop_grads(block, [(x, dy)])
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(x, dy)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def run_case(name: str, repeats: int) -> list[dict]:
    shape, tokens = CASES[name]
    fixed = FixedRouting(tokens, shape.top_k)
    fixed.set(routing("balanced", tokens, shape.top_k, shape.experts).cuda())
    base = build_bf16(shape)
    x = torch.randn(1, tokens, shape.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    blocks = {v: build(base, v, fixed) for v in VARIANTS}
    del base
    steps = {
        (v, mb): make_step(blocks[v], keep_weight_grads=mb == "accumulating")
        for v in VARIANTS
        for mb in MICRO_BATCHES
        if not (v in ONLY_ACCUMULATING and mb == "first")
    }
    times: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    for rep in range(repeats):
        for key, step in steps.items():
            times[key].append(statistics.median(bench_us_all(step, [(x, dy)])))
            print(f"{name} rep {rep} {key}: {times[key][-1]:.1f} us", flush=True)
    peaks = {(v, mb): peak_gib(step, x, dy, blocks[v], mb == "accumulating") for (v, mb), step in steps.items()}
    rows = []
    for variant, mb in steps:
        baseline = "bf16_compiled" if variant.endswith("_compiled") else "bf16"
        ours, base_t = times[(variant, mb)], times[(baseline, mb)]
        median = statistics.median(ours)
        first = times.get((variant, "first"))
        rows.append(
            row(
                f"{name} T={tokens} D={shape.dim} H={shape.hidden} E={shape.experts} top-{shape.top_k} "
                f"{variant} {mb} micro-batch",
                median,
                baseline,
                statistics.median(base_t),
                spread=round((max(ours) - min(ours)) / median, 3),
                reps_us=[round(t, 1) for t in ours],
                peak_gib=round(peaks[(variant, mb)], 3),
                baseline_peak_gib=round(peaks[(baseline, mb)], 3),
                accumulating_over_first=round(median / statistics.median(first), 3)
                if mb == "accumulating" and first
                else None,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=("deepseek", "qwen"), default=["deepseek", "qwen"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="", help="appended to the result files' names (keeps another run's files)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_grad_accumulation: needs a CUDA GPU; skipped")
        return
    rows = [r for name in args.cases for r in run_case(name, args.repeats)]
    notes = (
        "Forward + backward of one MoE layer (torchtitan 0.2.2 MoE, routed experts only, bf16 parameters, balanced "
        "routing). 'accumulating': the expert weights already hold gradients (a micro-batch after the first of an "
        "optimizer step); 'first': they hold none. fp8flow adds its weight gradients into them in the wgrad "
        "epilogue; fp8flow_unfused (a no-op tensor hook on each expert weight) and the compiled variants write "
        'fresh gradients that autograd\'s AccumulateGrad adds; fp8flow_wt_step is fp8flow with weight_cache="step" '
        "(the FP8 weights cached across the micro-batches; its cache is allocated before the step, outside "
        "peak_gib). ours_us: median of the repetitions (each do_bench's "
        "median); baseline: BF16 in the same mode (eager or compiled). peak_gib: one step's peak above the memory "
        "allocated before it."
    )
    write_results("grad_accumulation" + (f"_{args.tag}" if args.tag else ""), rows, notes)


if __name__ == "__main__":
    sys.exit(main())
