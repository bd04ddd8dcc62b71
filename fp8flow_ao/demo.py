"""Side-by-side training demo: a small torchtitan DeepSeek-V3-style MoE model in BF16 and in FP8-Flow.

``python -m fp8flow_ao.demo`` builds one model (torchtitan's ``DeepSeekV3Model``: MLA attention,
a dense first layer, then MoE layers with shared experts and top-k routing; every dim a multiple of
128), copies it with the same weights, converts the copy with ``quantize_(model, FP8FlowConfig())``,
and trains both on identical batches of an offline English corpus (:mod:`fp8flow_ao.data`). Each
step prints both losses, their relative gap, tokens/s and (CUDA) peak memory; at the end it writes
``loss_curves.png`` and ``log.json`` to ``--out`` (default ``outputs/demo``).

Without a GPU it runs the torch reference path on the CPU (preset ``cpu``: 3 layers, 4 x 128
tokens, 30 steps, about a minute on 2 cores). On a GPU it runs the Triton kernels with bf16 autocast
and fp32 master weights, as torchtitan does on one GPU, on a larger model (preset ``gpu``), each
transformer block under ``torch.compile``.

The "bf16" model is the unconverted torchtitan model: on the CPU it computes in fp32 (the CPU has no
fast bf16 path), on a GPU in bf16 autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("bf16", "fp8flow")


@dataclass(frozen=True)
class Preset:
    """Model size and run length (DeepSeek-V3-style; every hidden dim a multiple of 128)."""

    n_layers: int
    n_dense_layers: int
    dim: int
    inter_dim: int  # dense FFN of the first layers
    moe_inter_dim: int  # per-expert FFN (H)
    n_heads: int
    num_experts: int
    num_shared_experts: int
    top_k: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int


PRESETS = {
    # torchtitan's deepseek_v3 "debugmodel" dims with 3 of its 6 layers: quick on 2 CPU cores.
    "cpu": Preset(
        n_layers=3, n_dense_layers=1, dim=256, inter_dim=1024, moe_inter_dim=256, n_heads=16, num_experts=8,
        num_shared_experts=2, top_k=3, seq_len=128, batch_size=4, steps=30, lr=1e-3, warmup_steps=3,
    ),
    # Expert dims like Qwen3-30B-A3B (D=2048, H=768, top-8), 32 experts: about 0.6 B parameters,
    # 16 K tokens per step; two copies with AdamW state take about 20 GB.
    "gpu": Preset(
        n_layers=4, n_dense_layers=1, dim=2048, inter_dim=6144, moe_inter_dim=768, n_heads=16, num_experts=32,
        num_shared_experts=1, top_k=8, seq_len=2048, batch_size=8, steps=100, lr=8e-4, warmup_steps=10,
    ),
}  # fmt: skip


def model_args(preset: Preset, device: torch.device):
    """torchtitan ``DeepSeekV3ModelArgs``: the ``debugmodel`` (MLA, softmax top-k routing) resized to ``preset``."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.n_layers, args.n_dense_layers = preset.n_layers, preset.n_dense_layers
    args.dim, args.inter_dim, args.moe_inter_dim, args.n_heads = (
        preset.dim,
        preset.inter_dim,
        preset.moe_inter_dim,
        preset.n_heads,
    )
    args.max_seq_len = preset.seq_len
    args.moe_impl = "standard"  # what update_from_config sets from the job config (no DeepEP)
    moe = args.moe_args
    moe.num_experts, moe.num_shared_experts, moe.top_k = preset.num_experts, preset.num_shared_experts, preset.top_k
    # torch._grouped_mm in bf16 needs sm90; elsewhere torchtitan uses its per-expert loop (as its
    # update_from_config does), which is also what the CPU runs.
    moe.use_grouped_mm = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    return args


def build_models(preset: Preset, device: torch.device, seed: int, fp8_config: Any) -> dict[str, nn.Module]:
    """The BF16 model and an identical copy converted with ``quantize_(copy, fp8_config)``."""
    from torchao.quantization import quantize_
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepSeekV3Model(model_args(preset, device))
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    converted = copy.deepcopy(model)
    quantize_(converted, fp8_config)
    return {"bf16": model, "fp8flow": converted}


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each transformer block, as torchtitan does (the repeated structure compiles once). The
    blocks compile at their first call, which :func:`run` makes with torchtitan's dynamo setting for token-choice
    MoE (``capture_scalar_outputs``: no graph breaks on data-dependent scalars) for the training only."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block))


def update_expert_bias(model: nn.Module) -> None:
    """Auxiliary-loss-free load balancing exactly as torchtitan's optimizer pre-step hook does it."""
    with torch.no_grad():
        for block in model.layers.values():
            moe = block.moe if block.moe_enabled else None
            if moe is None or moe.load_balance_coeff is None:
                continue
            counts = moe.tokens_per_expert.float()
            delta = moe.load_balance_coeff * torch.sign(counts.mean() - counts)
            moe.expert_bias.add_(delta - delta.mean())
            moe.tokens_per_expert.zero_()


class Trainer:
    """One model, its AdamW optimizer and warmup-then-cosine schedule; one call of :meth:`step` per batch."""

    def __init__(self, model: nn.Module, preset: Preset, device: torch.device, steps: int):
        self.model, self.device = model, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup = min(preset.warmup_steps, max(steps - 1, 1))

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)

    def autocast(self) -> contextlib.AbstractContextManager:
        """BF16 autocast on CUDA (as torchtitan's mixed precision), nothing on the CPU."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy (fp32) of ``inputs`` ``[B, S]`` against ``labels`` ``[B, S]``."""
        with self.autocast():
            logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Forward, backward, clip, balance, update; returns loss, seconds and peak memory of the step."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            resident = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(inputs, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        update_expert_bias(self.model)
        self.optimizer.step()
        self.scheduler.step()
        value = loss.item()  # synchronizes
        out = {"loss": value, "seconds": time.perf_counter() - start}
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            out["peak_mem_gib"] = peak / 2**30
            out["step_mem_gib"] = (peak - resident) / 2**30  # activations + gradients + temporaries of this step
        return out

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over held-out ``(inputs, labels)`` batches, in eval mode without gradients."""
        self.model.eval()
        try:
            losses = [self.loss(x.to(self.device), y.to(self.device)).item() for x, y in batches]
        finally:
            self.model.train()
        return sum(losses) / len(losses)


def relative_gap(loss: float, reference: float) -> float:
    """``|loss - reference| / |reference|``: FP8-Flow's loss against BF16's at one step."""
    return abs(loss - reference) / abs(reference)


def summarize(records: list[dict[str, Any]], tokens_per_step: int, cuda: bool) -> dict[str, Any]:
    """Final losses, gap statistics, median tokens/s (after the first two steps: compile, warm-up), peak memory."""
    tail = records[len(records) // 2 :]
    timed = records[2:] if len(records) > 4 else records
    out: dict[str, Any] = {
        "first_loss": {m: records[0][f"loss_{m}"] for m in MODELS},
        "final_loss": {m: records[-1][f"loss_{m}"] for m in MODELS},
        "mean_rel_gap_second_half": statistics.fmean(r["rel_gap"] for r in tail),
        "max_rel_gap": max(r["rel_gap"] for r in records),
        "tokens_per_s": {m: tokens_per_step / statistics.median(r[f"seconds_{m}"] for r in timed) for m in MODELS},
    }
    out["speedup"] = out["tokens_per_s"]["fp8flow"] / out["tokens_per_s"]["bf16"]
    if cuda:
        for key in ("peak_mem_gib", "step_mem_gib"):
            out[key] = {m: max(r[f"{key}_{m}"] for r in records) for m in MODELS}
    return out


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss of both models and their relative gap (%) per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_gap) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    for name, style in zip(MODELS, ("-", "--"), strict=True):
        ax_loss.plot(steps, [r[f"loss_{name}"] for r in records], style, label=name)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(title)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_gap.plot(steps, [100 * r["rel_gap"] for r in records], color="tab:red")
    ax_gap.set_ylabel("|gap| / bf16 (%)")
    ax_gap.set_xlabel("step")
    ax_gap.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _format_step(r: dict[str, Any], steps: int, tokens: int) -> str:
    line = (
        f"step {r['step']:>4}/{steps} | loss bf16 {r['loss_bf16']:.4f} fp8flow {r['loss_fp8flow']:.4f} "
        f"| gap {100 * r['rel_gap']:.2f}% | tok/s bf16 {tokens / r['seconds_bf16']:,.0f} "
        f"fp8flow {tokens / r['seconds_fp8flow']:,.0f}"
    )
    if "peak_mem_gib_bf16" in r:
        line += f" | peak GiB bf16 {r['peak_mem_gib_bf16']:.2f} fp8flow {r['peak_mem_gib_fp8flow']:.2f}"
    return line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's command line (``python -m fp8flow_ao.demo --help``)."""
    p = argparse.ArgumentParser(prog="python -m fp8flow_ao.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size and run length (default: by device)")
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recompute", action="store_true", help="FP8FlowConfig(recompute_experts=True)")
    p.add_argument("--recipe", choices=("blockwise", "rowwise"), default="blockwise")
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, help="torch.compile blocks (default: on for CUDA)"
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        help="torch.use_deterministic_algorithms (default: on for CPU)",
    )
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches evaluated at the end (0: none)")
    p.add_argument(
        "--assets", type=Path, help="corpus directory (default: $FP8FLOW_ASSETS or ~/.cache/fp8flow_ao/assets)"
    )
    p.add_argument("--out", type=Path, default=Path("outputs/demo"))
    p.add_argument("--quiet", action="store_true", help="no per-step lines (the progress bar stays)")
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace, device: torch.device) -> Preset:
    preset = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")]
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr}
    return dataclasses.replace(preset, **{k: v for k, v in overrides.items() if v is not None})


def _environment(device: torch.device) -> dict[str, str]:
    import torchao
    import torchtitan

    env = {"python": platform.python_version(), "torch": torch.__version__, "torchao": torchao.__version__}
    env["torchtitan"] = getattr(torchtitan, "__version__", "?")
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return env


@contextlib.contextmanager
def deterministic(enabled: bool):
    """Deterministic kernels within the block (then the previous setting again).

    The CPU's embedding and index-put backward add in a thread-dependent order; at a high learning
    rate 1e-10 differences grow to percent-level loss differences in ten steps, which would drown
    the FP8-vs-BF16 gap this demo shows.
    """
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def train_side_by_side(
    trainers: dict[str, Trainer], batches: Any, steps: int, tokens_per_step: int, quiet: bool
) -> list[dict[str, Any]]:
    """Train every model on the same batches; one record per step (loss, seconds, memory of each; gap)."""
    from tqdm import tqdm

    device = next(iter(trainers.values())).device
    records = []
    bar = tqdm(range(1, steps + 1), desc="training", unit="step", dynamic_ncols=True, file=sys.stdout)
    for step in bar:
        x, y = (t.to(device) for t in batches.next())
        r: dict[str, Any] = {"step": step}
        for name, trainer in trainers.items():
            r.update({f"{k}_{name}": v for k, v in trainer.step(x, y).items()})
        r["rel_gap"] = relative_gap(r["loss_fp8flow"], r["loss_bf16"])
        records.append(r)
        bar.set_postfix(
            bf16=f"{r['loss_bf16']:.3f}", fp8flow=f"{r['loss_fp8flow']:.3f}", gap=f"{100 * r['rel_gap']:.2f}%"
        )
        if not quiet:
            tqdm.write(_format_step(r, steps, tokens_per_step), file=sys.stdout)
    bar.close()
    return records


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo with command-line ``argv``; return the log it also writes to ``<out>/log.json``."""
    from fp8flow_ao.config import FP8FlowConfig
    from fp8flow_ao.data import TokenBatches, ensure_corpus, tokenize_corpus
    from fp8flow_ao.torchtitan.cpu import integer_histc

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    preset = _resolve(args, device)
    args.out.mkdir(parents=True, exist_ok=True)
    compile_ = device.type == "cuda" if args.compile is None else args.compile
    deterministic_ = device.type == "cpu" if args.deterministic is None else args.deterministic
    fp8_config = FP8FlowConfig(recompute_experts=args.recompute, recipe=args.recipe)

    tokens = tokenize_corpus(ensure_corpus(args.assets))
    batches = TokenBatches(tokens, preset.batch_size, preset.seq_len, seed=args.seed)
    tokens_per_step = preset.batch_size * preset.seq_len
    # torchtitan's router counts int64 expert ids with torch.histc, which only CUDA implements.
    # capture_scalar_outputs for the compiled blocks, set for this run only: the process's later compiles keep theirs.
    with integer_histc(), deterministic(deterministic_), torch._dynamo.config.patch(capture_scalar_outputs=True):
        models = build_models(preset, device, args.seed, fp8_config)
        if compile_:
            for m in models.values():
                compile_blocks(m)
        trainers = {name: Trainer(m, preset, device, preset.steps) for name, m in models.items()}
        n_params = sum(p.numel() for p in models["bf16"].parameters())
        print(
            f"fp8flow demo: {preset.n_layers}-layer DeepSeek-V3-style MoE ({preset.num_experts} experts, "
            f"top-{preset.top_k}, D={preset.dim}, H={preset.moe_inter_dim}), {n_params / 1e6:.1f} M parameters; "
            f"{tokens.numel():,} corpus tokens; device {device}; compile {compile_}; {fp8_config}"
        )
        records = train_side_by_side(trainers, batches, preset.steps, tokens_per_step, args.quiet)
        held_out = batches.eval_batches(args.eval_batches) if args.eval_batches else []
        evaluation = {name: t.evaluate(held_out) for name, t in trainers.items()} if held_out else {}

    summary = summarize(records, tokens_per_step, device.type == "cuda")
    if evaluation:
        summary["eval_loss"] = evaluation
        summary["eval_rel_gap"] = relative_gap(evaluation["fp8flow"], evaluation["bf16"])
    log = {
        "command": "python -m fp8flow_ao.demo " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": _environment(device),
        "preset": dataclasses.asdict(preset),
        "fp8flow_config": {"recompute_experts": args.recompute, "recipe": args.recipe},
        "compile": compile_,
        "deterministic": deterministic_,
        "seed": args.seed,
        "tokens_per_step": tokens_per_step,
        "summary": summary,
        "steps": records,
    }
    (args.out / "log.json").write_text(json.dumps(log, indent=1) + "\n")
    title = f"bf16 vs fp8flow ({device.type}, {preset.steps} steps, seed {args.seed})"
    plot(records, args.out / "loss_curves.png", title)
    print(_format_summary(summary, args.out))
    return log


def _format_summary(s: dict[str, Any], out: Path) -> str:
    lines = [
        f"final loss: bf16 {s['final_loss']['bf16']:.4f}, fp8flow {s['final_loss']['fp8flow']:.4f} "
        f"(from {s['first_loss']['bf16']:.4f})",
        f"relative loss gap: mean {100 * s['mean_rel_gap_second_half']:.3f}% over the second half, max {100 * s['max_rel_gap']:.3f}%",
        f"tokens/s (median): bf16 {s['tokens_per_s']['bf16']:,.0f}, fp8flow {s['tokens_per_s']['fp8flow']:,.0f} "
        f"({s['speedup']:.2f}x)",
    ]
    if "eval_loss" in s:
        lines.append(
            f"held-out loss: bf16 {s['eval_loss']['bf16']:.4f}, fp8flow {s['eval_loss']['fp8flow']:.4f} "
            f"(gap {100 * s['eval_rel_gap']:.3f}%)"
        )
    if "peak_mem_gib" in s:
        lines.append(
            f"peak memory (GiB, both models resident): bf16 {s['peak_mem_gib']['bf16']:.2f}, fp8flow {s['peak_mem_gib']['fp8flow']:.2f}; "
            f"per step above resident: bf16 {s['step_mem_gib']['bf16']:.2f}, fp8flow {s['step_mem_gib']['fp8flow']:.2f}"
        )
    lines.append(f"wrote {out / 'loss_curves.png'} and {out / 'log.json'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m fp8flow_ao.demo``: :func:`run`."""
    run(argv)


if __name__ == "__main__":
    main()
