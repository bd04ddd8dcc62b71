"""Expert parallelism on several GPUs: FP8 dispatch vs torchtitan's BF16 EP, per MoE layer.

Run with one process per GPU (``bash .ci/gpu OUT multigpu`` does)::

    torchrun --nproc_per_node 2 benchmarks/bench_distributed_ep.py [--cases deepseek qwen] [--iters 10]

Per case (``T`` tokens per rank, experts split evenly over the ranks, balanced or skewed routing):

* **all-to-all**: the dispatch payload of one layer, each (token, slot) pair one row as in
  torchtitan: BF16 rows ``2 * D`` bytes vs FP8 rows ``D`` bytes + fp32 scales and prob
  ``4 * (D / 128 + 1)`` bytes, timed on the real routing plan (median of ``--iters``, the slowest
  rank's time);
* **EP layer, forward + backward**: torchtitan 0.2.2's ``MoE`` (routed experts only, router
  included) with its experts parallelized by torchtitan's own ``ExpertParallel`` style, BF16 vs
  the same layer converted to FP8-Flow (FP8 dispatch); eager, as torchtitan runs its experts
  (it leaves them out of ``torch.compile``). Peak memory per rank.

Writes ``benchmarks/results/distributed_ep.{json,md}`` (rank 0), with a labelled projection of the
measured bytes to larger EP degrees in the notes. Exits 0 with a message without 2 GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _bench import row, write_results

from fp8flow_ao.shapes import DEEPSEEK_V3, QWEN3_30B_A3B, MoEShape


@dataclass(frozen=True)
class Case:
    shape: MoEShape
    tokens: int  # per rank


CASES = {"deepseek": Case(DEEPSEEK_V3, 4096), "qwen": Case(QWEN3_30B_A3B, 8192)}
ROUTINGS = ("balanced", "skewed")


def timed_ms(fn: Callable[[], object], iters: int) -> float:
    """Median wall time of ``fn`` in ms over ``iters`` runs, the slowest rank's (events, synchronized)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def make_routing(case: Case, kind: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router output for this rank's tokens: ``(probs [T, k] fp32, expert ids [T, k])``, distinct experts per token."""
    shape, g = case.shape, torch.Generator(device="cuda").manual_seed(100 + rank)
    scores = torch.rand(case.tokens, shape.experts, device="cuda", generator=g)
    if kind == "skewed":  # Zipf-like popularity; the least popular experts rarely or never win
        popularity = 1.0 / torch.arange(1, shape.experts + 1, device="cuda", dtype=torch.float32) ** 1.2
        scores = scores * popularity[torch.randperm(shape.experts, device="cuda", generator=g)]
    probs, ids = scores.topk(shape.top_k, dim=1)
    return probs / probs.sum(1, keepdim=True), ids


class FixedRouter(torch.nn.Module):
    """A stand-in for torchtitan's router that returns a fixed top-k (same for both recipes)."""

    def __init__(self, probs: torch.Tensor, ids: torch.Tensor, num_experts: int):
        super().__init__()
        self.probs, self.ids = probs, ids
        self.counts = torch.bincount(ids.flatten(), minlength=num_experts).float()
        self.top_k = ids.shape[1]

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        return self.probs, self.ids, self.counts


def build_layer(case: Case, recipe: str, probs: torch.Tensor, ids: torch.Tensor, mesh) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from fp8flow_ao.moe import convert_moe_layer

    shape = case.shape
    args = MoEArgs(num_experts=shape.experts, num_shared_experts=0, top_k=shape.top_k, score_before_experts=False)
    torch.manual_seed(0)
    # init_weights writes the parameters in place: under no_grad, as torchtitan's trainer runs it
    with torch.device("cuda"), torch.no_grad():
        moe = MoE(args, dim=shape.dim, hidden_dim=shape.hidden)
        moe.init_weights(0.02, torch.device("cuda"))
    moe.to(torch.bfloat16)
    moe.router = FixedRouter(probs, ids, shape.experts)
    moe.expert_bias = None
    if recipe == "fp8flow":
        convert_moe_layer(moe)
    parallelize_module(moe.experts, mesh, ExpertParallel())
    return moe


def dispatch_payloads(case: Case, ids: torch.Tensor, group) -> dict[str, float]:
    """Bytes this rank sends and the all-to-all time of one layer's dispatch, BF16 vs FP8 rows."""
    from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128
    from fp8flow_ao.parallel.expert_parallel import _all_to_all_rows, dispatch, plan_dispatch

    d = case.shape.dim
    plan = plan_dispatch(ids, case.shape.experts, group)
    rows = ids.numel()
    x = torch.randn(case.tokens, d, device="cuda", dtype=torch.bfloat16)
    data, scale = quantize_1x128(x)
    probs = torch.rand(ids.shape, device="cuda")
    bf16_rows = x.repeat_interleave(case.shape.top_k, dim=0)
    splits = (plan.output_splits, plan.input_splits, group)
    bf16_ms = timed_ms(lambda: _all_to_all_rows(bf16_rows, *splits), iters=20)
    send = {"data": data.new_empty((rows, d)), "meta": scale.new_empty((rows, d // 128 + 1))}
    fp8_wire_ms = timed_ms(lambda: [_all_to_all_rows(t, *splits) for t in send.values()], iters=20)
    fp8_dispatch_ms = timed_ms(lambda: dispatch(data, scale, plan, probs), iters=20)
    return {
        "bf16_bytes": rows * 2 * d,
        "fp8_bytes": rows * (d + 4 * (d // 128 + 1)),
        "bf16_a2a_ms": bf16_ms,
        "fp8_a2a_ms": fp8_wire_ms,
        "fp8_dispatch_ms": fp8_dispatch_ms,
    }


def layer_step_ms(moe: torch.nn.Module, case: Case, iters: int) -> tuple[float, float]:
    """Forward + backward of the layer: (median ms of the slowest rank, peak GiB on this rank). The steps keep the
    weights' gradients: every step after the first is a gradient-accumulation micro-batch (for both recipes)."""
    x = torch.randn(1, case.tokens, case.shape.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step() -> None:
        moe(x).backward(dy)

    torch.cuda.reset_peak_memory_stats()
    ms = timed_ms(step, iters)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def projection_notes(results: dict[str, dict[str, float]], world: int) -> str:
    """A labelled projection of the measured per-row bytes to larger EP degrees."""
    lines = [
        "Projection (not measured): DeepSeek-V3-like layer, 256 experts top-8, 4096 tokens per rank, D=7168;",
        "a rank sends the rows whose expert lives elsewhere, (P-1)/P of its 32768 (token, slot) rows on",
        "average; FP8 row 7396 B vs BF16 14336 B. Time = bytes / link rate x (measured 2-GPU efficiency).",
    ]
    measured = [r for k, r in results.items() if k.startswith("deepseek")]
    eff = statistics.mean(r["fp8_bytes"] * (world - 1) / world / (r["fp8_a2a_ms"] * 1e-3) for r in measured) / 1e9
    lines.append(f"Measured FP8 all-to-all goodput over NVLink at EP={world}: {eff:.0f} GB/s per rank.")
    lines += [
        "",
        "| EP | FP8 MB/rank | BF16 MB/rank | NVLink FP8 ms | NVLink BF16 ms | 400 Gb/s FP8 ms | 400 Gb/s BF16 ms |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for ep in (8, 32, 64):
        remote = 32768 * (ep - 1) / ep
        fp8, bf16 = remote * 7396, remote * 14336
        link = 50e9  # 400 Gb/s
        lines.append(
            f"| {ep} | {fp8 / 1e6:.0f} | {bf16 / 1e6:.0f} | {fp8 / (eff * 1e9) * 1e3:.2f} | {bf16 / (eff * 1e9) * 1e3:.2f} "
            f"| {fp8 / link * 1e3:.2f} | {bf16 / link * 1e3:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--routings", nargs="+", choices=ROUTINGS, default=list(ROUTINGS))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2 or "WORLD_SIZE" not in os.environ:
        print("bench_distributed_ep: needs >= 2 GPUs under torchrun (torchrun --nproc_per_node 2 ...); skipped")
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    # torchtitan's GroupedExperts leaves the token padding to EP only on a mesh dim named "ep".
    mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    rows, raw = [], {}
    for name in args.cases:
        case = CASES[name]
        for routing in args.routings:
            probs, ids = make_routing(case, routing, rank)
            label = f"{name} T={case.tokens}/rank D={case.shape.dim} H={case.shape.hidden} E={case.shape.experts} top-{case.shape.top_k} {routing} EP={world}"
            wire = dispatch_payloads(case, ids, mesh.get_group())
            step = {}
            for recipe in ("bf16", "fp8flow"):
                moe = build_layer(case, recipe, probs, ids, mesh)
                step[recipe] = layer_step_ms(moe, case, args.iters)
                del moe
                torch.cuda.empty_cache()
            raw[f"{name}-{routing}"] = wire
            extra = {
                "bytes_ratio": round(wire["fp8_bytes"] / wire["bf16_bytes"], 3),
                "a2a_time_ratio": round(wire["fp8_a2a_ms"] / wire["bf16_a2a_ms"], 3),
                "peak_gib_bf16": round(step["bf16"][1], 2),
                "peak_gib_fp8flow": round(step["fp8flow"][1], 2),
            }
            rows.append(
                row(
                    f"{label}: layer fwd+bwd",
                    step["fp8flow"][0] * 1e3,
                    "BF16 torchtitan EP (eager)",
                    step["bf16"][0] * 1e3,
                    **extra,
                )
            )
            rows.append(
                row(
                    f"{label}: dispatch all-to-all",
                    wire["fp8_a2a_ms"] * 1e3,
                    "BF16 rows all-to-all",
                    wire["bf16_a2a_ms"] * 1e3,
                    bytes_moved=wire["fp8_bytes"],
                    fp8_dispatch_us=round(wire["fp8_dispatch_ms"] * 1e3, 1),
                    **extra,
                )
            )
            if rank == 0:
                print(rows[-2], rows[-1], flush=True)
    if rank == 0:
        notes = (
            "Layer: torchtitan 0.2.2 MoE (routed experts only, fixed router output) with torchtitan's "
            "ExpertParallel on the BF16 layer and FP8 dispatch on the converted one; the steps keep the weights' "
            "gradients (gradient-accumulation micro-batches: BF16's autograd adds fresh ones, FP8-Flow's wgrads add "
            "into them in their epilogue); median of the slowest "
            "rank. all-to-all: ours = FP8 data + fp32 scales/prob as two byte payloads (wire only); "
            "fp8_dispatch_us adds the FP8 row gather. gbps counts bytes sent by one rank.\n\n"
            + projection_notes(raw, world)
        )
        write_results("distributed_ep", rows, notes)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
