"""Every torchtitan 0.2.2 MoE family FP8-Flow runs, trained BF16 vs FP8-Flow: losses and their gap.

For each family (``--families``: DeepSeek-V3 ``debugmodel``, Llama 4 ``debugmodel`` with its
score-before-experts top-1 routing and shared expert, Qwen3 ``debugmodel_moe`` with 64 experts
top-8) the TOML pair ``torchtitan_configs/<family>_{bf16,fp8flow}.toml`` (identical but for
``model.converters``) is trained ``--steps`` steps with torchtitan's own ``Trainer`` in this process
on one GPU, from the same seed on the same offline batches. Reported per family: first and last
loss of each run, the relative gap ``(fp8flow - bf16) / bf16`` of the last loss, and the mean and
largest absolute relative gap over all steps. Target (issue 13): losses within 0.5% of BF16
(``meets_target``: the last loss's gap and the mean gap over all steps). ``ours_us``/``baseline_us`` are median step times after
5 steps, for information only: at D=256 FP8 does not pay (see ``torchtitan_e2e``).

Each family takes well under a minute on an H200 (two runs of 50 steps, mostly startup). Exits 0
with a message when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile

import torch
from _bench import row, write_results
from _torchtitan import REPO, common_args, train

FAMILIES = ("deepseek_v3_debug", "llama4_debug", "qwen3_moe_debug")
GAP_TARGET = 0.005  # issue 13: losses within 0.5% of BF16
TIMING_WARMUP = 5  # steps left out of the median step time (allocator, first Triton compiles)


def gap_row(family: str, runs: dict[str, dict], steps: int) -> dict:
    """One result row from the BF16 and FP8-Flow runs of ``family`` (losses per logged step)."""
    bf16, fp8 = runs["bf16"]["losses"], runs["fp8flow"]["losses"]
    gaps = [(f - b) / b for f, b in zip(fp8, bf16, strict=True)]
    step_us = {name: statistics.median(r["times"][TIMING_WARMUP:] or r["times"]) * 1e6 for name, r in runs.items()}
    return row(
        f"{family} {steps} steps",
        step_us["fp8flow"],
        "BF16 torchtitan (same TOML, no converter)",
        step_us["bf16"],
        first_loss=round(fp8[0], 4),
        baseline_first_loss=round(bf16[0], 4),
        last_loss=round(fp8[-1], 4),
        baseline_last_loss=round(bf16[-1], 4),
        last_rel_gap_pct=round(100 * gaps[-1], 3),
        mean_abs_rel_gap_pct=round(100 * statistics.fmean(map(abs, gaps)), 3),
        max_abs_rel_gap_pct=round(100 * max(map(abs, gaps)), 3),
        target=f"last and mean gap within {100 * GAP_TARGET}%",
        meets_target=abs(gaps[-1]) <= GAP_TARGET and statistics.fmean(map(abs, gaps)) <= GAP_TARGET,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_families: no CUDA device, nothing to measure.")
        return
    rows = []
    with tempfile.TemporaryDirectory() as dump:
        for family in args.families:
            runs = {}
            for recipe in ("bf16", "fp8flow"):
                config = REPO / f"torchtitan_configs/{family}_{recipe}.toml"
                record = train([*common_args(config, dump), "--training.steps", str(args.steps)], "cuda")
                runs[recipe] = {"losses": record.losses, "times": record.step_seconds}
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(gap_row(family, runs, args.steps))
    notes = (
        f"torchtitan Trainer, one GPU, {args.steps} steps per run, the TOMLs' settings (local batch 8 x 2048 "
        "tokens, AdamW lr 8e-4, seed 0, no compile); rel gap = (fp8flow - bf16) / bf16 of the logged loss."
    )
    write_results(
        "families" if set(args.families) == set(FAMILIES) else "families_" + "_".join(args.families), rows, notes
    )


if __name__ == "__main__":
    main()
