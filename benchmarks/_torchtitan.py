"""What the torchtitan benchmarks share: recipes as job-config flags, one in-process run, throughput.

``bench_torchtitan_e2e.py`` and ``bench_convergence.py`` both train torchtitan 0.2.2's ``Trainer`` in
their own process (one GPU, or the CPU runner of :mod:`fp8flow_ao.torchtitan.cpu`) and differ only
in what they vary and report.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BASE_TOML = REPO / "torchtitan_configs/deepseek_v3_debug_bf16.toml"
# The ways the routed experts run, as flags on top of a BF16 job config. "rowwise" is the
# torchao-style FP8 row-wise baseline (per-row scales, torch._scaled_grouped_mm on torchtitan's own
# expert path): torchtitan 0.2.2's quantize.grouped_mm.float8 converter cannot import torchao 0.18.
_FP8FLOW = ["--model.converters", "fp8flow", "--fp8flow.recipe", "blockwise"]
RECIPES: dict[str, list[str]] = {
    "bf16": [],
    "rowwise": ["--model.converters", "fp8flow", "--fp8flow.recipe", "rowwise"],
    "fp8flow": _FP8FLOW,
    # FP8-Flow with a torchtitan memory feature on (issue 10, item 3): values recomputed in backward, not stored.
    "fp8flow_recompute": [*_FP8FLOW, "--fp8flow.recompute_experts"],
    "fp8flow_ac_full": [*_FP8FLOW, "--activation_checkpoint.mode", "full"],
    "fp8flow_ac_selective": [
        *_FP8FLOW,
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    "fp8flow_bf16_fc1_dgrad": ["--model.converters", "fp8flow", "--fp8flow.backward", "bf16_fc1_dgrad"],
    # Ablations, not recipes to train with: FP8-Flow's forward with all its gradients in BF16, or
    # FP8-Flow with only its weight gradients in BF16.
    "fp8flow_bf16_backward": ["--model.converters", "fp8flow", "--fp8flow.backward", "bf16"],
    "fp8flow_bf16_wgrad": ["--model.converters", "fp8flow", "--fp8flow.backward", "bf16_wgrad"],
    # FP8-Flow with the routed experts eager (the default compiles them with torchtitan's compile.backend).
    "fp8flow_eager_experts": ["--model.converters", "fp8flow", "--fp8flow.compile_experts", "off"],
    # Emulations of a change to FC1's FP8 dgrad (compiled, FP8-Flow's speed less one FP8 GEMM).
    "fp8flow_emulated_fc1_dgrad": ["--model.converters", "fp8flow", "--fp8flow.backward", "emulated_fp8_fc1_dgrad"],
    "fp8flow_emulated_sr_fc1_dgrad": ["--model.converters", "fp8flow", "--fp8flow.backward", "emulated_sr_fc1_dgrad"],
}
SAME_NUMERICS = {"fp8flow_eager_experts": "fp8flow"}
"""Recipes that train bit for bit as another one (what the report pools them with): FP8-Flow's routed path
compiled (the default) and eager give identical outputs and gradients in torchtitan's one-GPU setting
(fp32 parameters, bf16 autocast; the fp8flow_gpu flavor's shapes, H200)."""
FEATURE_OF = {"fp8flow_recompute": "fp8flow", "fp8flow_ac_full": "fp8flow", "fp8flow_ac_selective": "fp8flow"}
"""Recipes that train another one with a torchtitan feature on that recomputes instead of storing. On the CPU
path ``recompute_experts`` trains bit for bit as FP8-Flow and activation checkpointing within float rounding
(as it does BF16); on the GPU run noise comes on top, and ``bench_convergence``'s features table compares each
run with its seed's runs of the recipe it recomputes."""
TRAINING_RECIPES = ("bf16", "rowwise", "fp8flow", "fp8flow_bf16_fc1_dgrad")
"""The recipes a user trains with (each with a convergence goal); the rest are ablations."""
E2E_RECIPES = ("bf16", "rowwise", "fp8flow")
"""The torchtitan end-to-end table's default columns."""
RECIPE_NAMES = {
    "bf16": "BF16",
    "rowwise": "FP8 row-wise (torchao-style)",
    "fp8flow": "FP8-Flow blockwise",
    "fp8flow_bf16_backward": "FP8-Flow forward, BF16 backward (ablation)",
    "fp8flow_bf16_wgrad": "FP8-Flow, BF16 weight gradients (ablation)",
    "fp8flow_bf16_fc1_dgrad": "FP8-Flow, BF16 FC1 dgrad",
    "fp8flow_eager_experts": "FP8-Flow, routed experts not compiled (ablation)",
    "fp8flow_recompute": "FP8-Flow, recompute_experts",
    "fp8flow_ac_full": "FP8-Flow, activation checkpointing full",
    "fp8flow_ac_selective": "FP8-Flow, activation checkpointing selective (op)",
    "fp8flow_emulated_fc1_dgrad": "FP8-Flow, FC1 dgrad emulated in BF16 (ablation)",
    "fp8flow_emulated_sr_fc1_dgrad": "FP8-Flow, FC1 dgrad on stochastically rounded dh, emulated (ablation)",
}


def recipe_args(recipe: str) -> list[str]:
    """The job-config flags of ``recipe`` (a key of :data:`RECIPES`)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    return list(RECIPES[recipe])


def common_args(config_file: Path, dump_folder: str | Path) -> list[str]:
    """``--job.config_file`` plus the paths a run from any working directory needs (the packaged tokenizer)."""
    from fp8flow_ao.data import PACKAGED_TOKENIZER_DIR

    return [
        "--job.config_file", str(config_file), "--model.hf_assets_path", str(PACKAGED_TOKENIZER_DIR),
        "--job.dump_folder", str(dump_folder),
    ]  # fmt: skip


def train(args: list[str], device: str, probe_every: int = 0):
    """Parse torchtitan ``args`` and train in this process on ``device`` ("cuda" or "cpu"); a ``RunRecord``.

    ``probe_every > 0`` records the expert probe's series (:mod:`fp8flow_ao.torchtitan.probe`).
    """
    import fp8flow_ao.torchtitan  # noqa: F401  (registers converter, datasets, the fp8flow_gpu flavor)
    from fp8flow_ao.torchtitan import cpu
    from fp8flow_ao.torchtitan.record import train_recorded

    if device == "cpu":
        return cpu.train_recorded_on_cpu(args, init_logging=False, probe_every=probe_every)
    if device != "cuda":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    from torchtitan.config import ConfigManager

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    # A free port, not a fixed one: runs sharing a GPU (`.ci/gpu OUT convergence`) start side by side.
    os.environ.setdefault("MASTER_PORT", str(cpu.free_port()))
    try:
        return train_recorded(ConfigManager().parse_args(args), probe_every)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def tokens_per_s(record, warmup: int) -> float:
    """Tokens per second from the median step time after ``warmup`` steps (compile, allocator)."""
    times = record.step_seconds[warmup:] or record.step_seconds
    return record.tokens_per_step / statistics.median(times)
