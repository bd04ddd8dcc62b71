"""End to end in torchtitan 0.2.2: training tokens/s and peak memory, BF16 vs the "fp8flow" converter.

Trains the two TOML configs of ``torchtitan_configs/`` (identical but for ``model.converters``) with
torchtitan's own ``Trainer`` in this process on one GPU, each for ``--steps`` steps on the offline
corpus, and reports the median step time after ``--warmup`` steps (tokens/s = local batch x sequence
length / step time), the peak ``memory_allocated`` of the run, and the first and last loss.

Two model sizes (``--flavors``):
* ``debugmodel``: torchtitan's DeepSeek-V3 debug model (D=256, 8 experts top-3, expert ffn 256), so
  small that fixed per-op costs dominate: a functional check more than a speed test;
* ``fp8flow_gpu``: the demo's ``gpu`` preset (4 layers, D=2048, 32 experts top-8, H=768, about
  0.6 B parameters), added to torchtitan's DeepSeek-V3 flavor table by this script.

``--compile`` turns on ``compile.enable`` (torchtitan compiles each block's submodules, not the
routed experts). Exits 0 with a message when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _bench import row, write_results

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"bf16": REPO / "torchtitan_configs/deepseek_v3_debug_bf16.toml"}
CONFIGS["fp8flow"] = REPO / "torchtitan_configs/deepseek_v3_debug_fp8flow.toml"
FLAVORS = ("debugmodel", "fp8flow_gpu")


def add_flavor() -> None:
    """Register ``fp8flow_gpu`` (the demo's gpu preset) in torchtitan's DeepSeek-V3 flavor table."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from fp8flow_ao.demo import PRESETS, model_args

    deepseekv3_args.setdefault("fp8flow_gpu", model_args(PRESETS["gpu"], torch.device("cuda")))


def init_one_process(port: str) -> None:
    """torchtitan's logger and the environment of a one-process (one-GPU) group on ``port``."""
    from torchtitan.tools.logging import init_logger

    init_logger()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)


def train(config_file: Path, args: list[str]) -> dict[str, float | list[float]]:
    """Run torchtitan's Trainer on ``config_file`` + ``args``; time each step (synchronized)."""
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    from fp8flow_ao.data import PACKAGED_TOKENIZER_DIR

    # The TOML's tokenizer path is relative to the repository root; this script may run from elsewhere.
    tokenizer = ["--model.hf_assets_path", str(PACKAGED_TOKENIZER_DIR)]
    config = ConfigManager().parse_args(["--job.config_file", str(config_file), *tokenizer, *args])
    trainer = Trainer(config)
    times: list[float] = []
    losses: list[float] = []
    train_step, log = trainer.train_step, trainer.metrics_processor.log

    def timed_step(data_iterator) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(data_iterator)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    def record(step: int, loss: float, *rest, **kwargs) -> None:
        losses.append(float(loss))
        log(step, loss, *rest, **kwargs)

    trainer.train_step, trainer.metrics_processor.log = timed_step, record
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    finally:
        trainer.close()
    tokens = config.training.local_batch_size * config.training.seq_len
    return {"times": times, "losses": losses, "tokens": tokens, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", choices=FLAVORS, default=list(FLAVORS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median (compile, allocator)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--recompute", action="store_true", help="fp8flow.recompute_experts = true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_torchtitan_e2e: no CUDA device, nothing to measure.")
        return
    init_one_process("29517")
    add_flavor()
    rows = []
    with tempfile.TemporaryDirectory() as dump:
        for flavor in args.flavors:
            common = ["--model.flavor", flavor, "--training.steps", str(args.steps), "--job.dump_folder", dump]
            common += ["--compile.enable"] if args.compile else []
            runs = {}
            for name, config_file in CONFIGS.items():
                extra = ["--fp8flow.recompute_experts"] if name == "fp8flow" and args.recompute else []
                runs[name] = train(config_file, [*common, *extra])
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(result_row(flavor, runs, args.warmup))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    notes = (
        f"torchtitan Trainer, one GPU, {args.steps} steps, median step time after {args.warmup}; "
        f"compile={args.compile}, recompute_experts={args.recompute}; peak = max memory_allocated of the run."
    )
    write_results("torchtitan_e2e", rows, notes=notes)


def result_row(flavor: str, runs: dict, warmup: int) -> dict:
    step_us = {name: statistics.median(r["times"][warmup:] or r["times"]) * 1e6 for name, r in runs.items()}
    tokens = runs["bf16"]["tokens"]
    return row(
        f"deepseek_v3 {flavor}, {tokens} tokens/step",
        step_us["fp8flow"],
        "BF16 torchtitan (same config, no converter)",
        step_us["bf16"],
        tokens_per_s=round(tokens / step_us["fp8flow"] * 1e6),
        baseline_tokens_per_s=round(tokens / step_us["bf16"] * 1e6),
        peak_mem_gib=round(runs["fp8flow"]["peak_gib"], 2),
        baseline_peak_mem_gib=round(runs["bf16"]["peak_gib"], 2),
        first_loss=round(runs["fp8flow"]["losses"][0], 4),
        baseline_first_loss=round(runs["bf16"]["losses"][0], 4),
        last_loss=round(runs["fp8flow"]["losses"][-1], 4),
        baseline_last_loss=round(runs["bf16"]["losses"][-1], 4),
    )


if __name__ == "__main__":
    main()
