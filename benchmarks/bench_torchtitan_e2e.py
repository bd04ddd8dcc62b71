"""End to end in torchtitan 0.2.2: tokens/s and peak memory of BF16, FP8 row-wise and FP8-Flow under torchtitan's features.

Trains ``torchtitan_configs/deepseek_v3_debug_bf16.toml`` with torchtitan's own ``Trainer``, each run in
a process of its own (memory, peak and compile caches start clean), on one GPU, for ``--steps`` steps
on the offline corpus, once per selected combination of

* ``--compile on off``: ``compile.enable`` (torchtitan compiles each block's submodules; in 0.2.2
  ``apply_compile`` skips the MoE's ``experts`` child and compiles only BF16's expert function
  ``_run_experts_grouped_mm``; the FP8-Flow converter compiles its own routed path, see next);
* ``--compile-experts on off``: ``fp8flow.compile_experts`` (FP8-Flow runs with compile on only; runs
  with compile off ignore it): "on" compiles the FP8-Flow routed path (quantize, permute, GEMMs,
  SwiGLU, combine and their backward) as one graph, "off" runs it eagerly (its Triton kernels as
  launched, the glue ops uncompiled). Default: the converter's default "auto" only, which compiles
  it whenever ``compile.enable`` is on. Run names and report rows say "experts compiled" or "eager";
* ``--ac none selective full``: ``activation_checkpoint.mode`` (``selective`` with
  ``--selective-ac-option``, default ``op``: torchtitan's per-op policy that its DeepSeek-V3 configs use);
* ``--recompute off on``: ``fp8flow.recompute_experts`` (FP8-Flow only: BF16 and row-wise have no
  such option, so ``on`` adds one FP8-Flow run and compares it with the same BF16 run);
* ``--recipes bf16 rowwise fp8flow``: BF16 experts; the torchao-style FP8 row-wise baseline
  (``fp8flow.recipe = "rowwise"``: per-row scales and ``torch._scaled_grouped_mm``, since torchtitan
  0.2.2's own ``quantize.grouped_mm.float8`` converter cannot import torchao 0.18); FP8-Flow blockwise
  (and, when named, ``fp8flow_bf16_fc1_dgrad``: FP8-Flow with FC1's dgrad in BF16, its own rows).

Each run's median step time after ``--warmup`` steps gives tokens/s (local batch x sequence length /
step time); peak = ``max_memory_allocated`` of the run. Runs are written one file each under
``--runs-dir`` as they finish, so a selection that fits one 10-minute GPU command can be run per
invocation; ``--report`` merges every run found into ``torchtitan_e2e.{json,md}`` (one row per flavor,
compile, experts, AC and recompute setting; the same-settings BF16 run is the baseline). A run whose
loss becomes NaN or inf is written and reported as failed (exit status 1 after the other runs). Wall
time on an H200: about 20-40 s per ``fp8flow_gpu`` run of 25 steps (startup, compile, steps).

``--device cpu`` runs the same path on torchtitan's ``debugmodel`` through the CPU runner with tiny
batches (a smoke test; its timings mean nothing). Exits 0 with a message when ``--device cuda`` has
no CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _bench import RESULTS_DIR, device_name, row, versions, write_results
from _torchtitan import (
    BASE_TOML,
    E2E_RECIPES,
    RECIPE_NAMES,
    TRAINING_RECIPES,
    common_args,
    recipe_args,
    tokens_per_s,
    train,
)

FLAVORS = ("debugmodel", "fp8flow_gpu")
AC_MODES = ("none", "selective", "full")
CPU_ARGS = [
    "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
]  # fmt: skip


def experts_mode(recipe: str, compile_: bool, compile_experts: str) -> str | None:
    """How an FP8-Flow run with compile on runs its routed experts ("compiled" or "eager") under
    ``fp8flow.compile_experts``; None where the option does not apply (other recipes, compile off)."""
    if not _is_fp8flow(recipe) or not compile_:
        return None
    return "eager" if compile_experts == "off" else "compiled"  # "auto" compiles under compile.enable


def _is_fp8flow(recipe: str) -> bool:
    """An FP8-Flow recipe (its own routed path: recompute_experts and compile_experts apply)."""
    return recipe.startswith("fp8flow")


def run_name(flavor: str, compile_: bool, ac: str, recipe: str, recompute: bool, experts: str | None) -> str:
    """The file stem of one run: every setting that tells runs apart."""
    stem = f"{flavor}_compile-{'on' if compile_ else 'off'}_ac-{ac}_{recipe}{'_recompute' if recompute else ''}"
    return stem + (f"_experts-{experts}" if experts else "")


def run_flags(
    args: argparse.Namespace,
    flavor: str,
    compile_: bool,
    ac: str,
    recipe: str,
    recompute: bool,
    experts: str | None,
    dump: str,
):
    """torchtitan flags of one run (experts "compiled" is the converter's default under compile.enable)."""
    flags = [*common_args(BASE_TOML, dump), *recipe_args(recipe), "--model.flavor", flavor]
    flags += ["--training.steps", str(args.steps), "--compile.enable" if compile_ else "--compile.no-enable"]
    flags += [
        "--activation_checkpoint.mode",
        ac,
        "--activation_checkpoint.selective_ac_option",
        args.selective_ac_option,
    ]
    flags += ["--fp8flow.recompute_experts"] if recompute else []
    flags += ["--fp8flow.compile_experts", "off"] if experts == "eager" else []
    return flags + (CPU_ARGS if args.device == "cpu" else [])


def selected_runs(args: argparse.Namespace) -> list[tuple[str, bool, str, str, bool, str | None]]:
    """(flavor, compile, ac, recipe, recompute, experts mode) of every run the arguments select."""
    out = []
    for flavor, c, ac, recipe, r, ce in itertools.product(
        args.flavors, args.compile, args.ac, args.recipes, args.recompute, args.compile_experts
    ):
        if r == "on" and not _is_fp8flow(recipe):
            continue  # only FP8-Flow has recompute_experts; its baseline is the same BF16 run
        run = (flavor, c == "on", ac, recipe, r == "on", experts_mode(recipe, c == "on", ce))
        if run not in out:  # compile_experts leaves other recipes and compile-off runs as they are
            out.append(run)
    return out


def child_argv(args: argparse.Namespace, run: tuple[str, bool, str, str, bool, str | None]) -> list[str]:
    """This script's arguments that select exactly ``run`` and train it in the process they start."""
    flavor, compile_, ac, recipe, recompute, experts = run
    argv = ["--in-process", "--no-report", "--flavors", flavor, "--compile", "on" if compile_ else "off"]
    argv += ["--ac", ac, "--selective-ac-option", args.selective_ac_option, "--recipes", recipe]
    argv += ["--recompute", "on" if recompute else "off", "--compile-experts", "off" if experts == "eager" else "auto"]
    return argv + ["--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
                   "--runs-dir", str(args.runs_dir)]  # fmt: skip


def measure(args: argparse.Namespace) -> list[Path]:
    """Train every selected run; write each as ``<runs_dir>/<run_name>.json`` as soon as it finishes.

    Each run trains in a process of its own (this script with ``--in-process``): in one process the
    previous runs' trainers stay allocated (their memory entered the next run's peak) and dynamo's
    caches and recompile counters carry over. A run that fails is reported and the others go on; the
    call raises at the end.
    """
    if not args.in_process:
        failed = []
        for run in selected_runs(args):
            done = subprocess.run([sys.executable, __file__, *child_argv(args, run)], check=False)
            if done.returncode:
                failed.append(f"{run_name(*run)} (exit {done.returncode})")
        if failed:
            raise RuntimeError(f"bench_torchtitan_e2e: runs failed: {', '.join(failed)}")
        return sorted(args.runs_dir.glob("*.json"))
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for run in selected_runs(args):
        flavor, compile_, ac, recipe, recompute, experts = run
        name = run_name(*run)
        print(f"=== {name}", flush=True)
        with tempfile.TemporaryDirectory() as dump:
            record = train(run_flags(args, *run, dump), args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        result = {
            "flavor": flavor, "compile": compile_, "ac": ac, "recipe": recipe, "recompute": recompute, "experts": experts,
            "steps": args.steps, "warmup": args.warmup, "tokens_per_step": record.tokens_per_step,
            "step_us": 1e6 * record.tokens_per_step / tokens_per_s(record, args.warmup),
            "tokens_per_s": round(tokens_per_s(record, args.warmup)), "peak_mem_gib": record.peak_mem_gib,
            "first_loss": record.losses[0], "last_loss": record.losses[-1],
            "losses": record.losses, "grad_norms": record.grad_norms,
            "device": device_name(), "versions": versions(),
        }  # fmt: skip
        path = args.runs_dir / f"{name}.json"
        path.write_text(json.dumps(result) + "\n")
        written.append(path)
        if not math.isfinite(result["last_loss"]):
            raise RuntimeError(f"{name}: the loss became {result['last_loss']} (written to {path}; the run failed)")
    return written


def _gib(run: dict[str, Any] | None) -> float | None:
    return None if run is None or run["peak_mem_gib"] is None else round(run["peak_mem_gib"], 2)


def _experts(run: dict[str, Any]) -> str | None:
    """A run's experts mode; runs written before ``--compile-experts`` existed ran the FP8-Flow experts eagerly."""
    if "experts" in run:
        return run["experts"]
    return experts_mode(run["recipe"], run["compile"], "off")


def _losses(run: dict[str, Any] | None) -> str | None:
    """First and last loss of a run, with its step count (runs of a table may differ in length)."""
    return None if run is None else f"{run['first_loss']:.3f}->{run['last_loss']:.3f} ({run['steps']} steps)"


def report_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One PERF.md row per (flavor, compile, ac, recompute, experts mode) that has an FP8-Flow run: FP8-Flow
    vs same-settings BF16."""
    # experts mode "" where it does not apply (None would not sort beside the strings)
    by_key = {(r["flavor"], r["compile"], r["ac"], r["recipe"], r["recompute"], _experts(r) or ""): r for r in runs}
    rows = []
    for (flavor, compile_, ac, recipe, recompute, experts), ours in sorted(by_key.items()):
        if not _is_fp8flow(recipe):
            continue
        bf16, rowwise = (by_key.get((flavor, compile_, ac, name, False, "")) for name in ("bf16", "rowwise"))
        case = "" if recipe == "fp8flow" else f"{RECIPE_NAMES[recipe]}: "
        case += f"{flavor}, compile {'on' if compile_ else 'off'}{f', experts {experts}' if experts else ''}, AC {ac}"
        case += ", recompute_experts" if recompute else ""
        rows.append(
            row(
                f"{case}, {ours['tokens_per_step']} tokens/step",
                ours["step_us"],
                f"{RECIPE_NAMES['bf16']} torchtitan, same settings",
                None if bf16 is None else bf16["step_us"],
                bf16_tokens_per_s=None if bf16 is None else bf16["tokens_per_s"],
                rowwise_tokens_per_s=None if rowwise is None else rowwise["tokens_per_s"],
                fp8flow_tokens_per_s=ours["tokens_per_s"],
                speedup_vs_rowwise=None if rowwise is None else round(rowwise["step_us"] / ours["step_us"], 3),
                bf16_peak_gib=_gib(bf16),
                rowwise_peak_gib=_gib(rowwise),
                fp8flow_peak_gib=_gib(ours),
                bf16_loss=_losses(bf16),
                fp8flow_loss=_losses(ours),
            )
        )
    return rows


def report(runs_dir: Path) -> Path:
    """Merge every run under ``runs_dir`` into ``torchtitan_e2e.{json,md}``."""
    runs = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]
    if not any(r["recipe"] == "fp8flow" for r in runs):
        raise ValueError(f"--runs-dir {runs_dir}: no fp8flow run to report (found {len(runs)} runs)")
    machines = {(r["device"], json.dumps(r["versions"], sort_keys=True)) for r in runs}
    if len(machines) != 1:
        raise ValueError(f"--runs-dir {runs_dir}: runs measured on different devices/versions {sorted(machines)}")
    device, versions_ = next(iter(machines))
    steps = sorted({(r["steps"], r["warmup"]) for r in runs})
    notes = (
        "torchtitan Trainer, one GPU; (steps, warm-up steps left out of the median) "
        f"{steps}; ours = FP8-Flow blockwise, baseline = BF16 with the same compile/AC settings; rowwise = "
        "torchao-style FP8 row-wise (fp8flow.recipe=rowwise); speedup = step-time ratio; peak = max "
        "memory_allocated of the run. torchtitan 0.2.2's apply_compile skips each MoE's `experts` child (it "
        "compiles BF16's expert function _run_experts_grouped_mm); with compile on, 'experts compiled' = "
        "FP8-Flow's routed path compiled by fp8flow.compile_experts (its default), 'experts eager' = "
        "compile_experts off."
    )
    return write_results("torchtitan_e2e", report_rows(runs), notes=notes, measured_on=(device, json.loads(versions_)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--flavors", nargs="+", choices=FLAVORS, default=["fp8flow_gpu"])
    p.add_argument("--compile", nargs="+", choices=("on", "off"), default=["on"])
    p.add_argument("--ac", nargs="+", choices=AC_MODES, default=["none"])
    p.add_argument("--selective-ac-option", default="op", help="activation_checkpoint.selective_ac_option")
    p.add_argument("--recompute", nargs="+", choices=("off", "on"), default=["off"], help="fp8flow.recompute_experts")
    p.add_argument(
        "--compile-experts",
        nargs="+",
        choices=("auto", "on", "off"),
        default=["auto"],
        help="fp8flow.compile_experts (FP8-Flow runs with compile on; auto = on there)",
    )
    p.add_argument("--recipes", nargs="+", choices=TRAINING_RECIPES, default=list(E2E_RECIPES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median (compile, allocator)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--runs-dir", type=Path, default=RESULTS_DIR / "torchtitan_e2e_runs")
    p.add_argument("--report", action="store_true", help="only merge the runs in --runs-dir (no training)")
    p.add_argument("--no-report", action="store_true", help="only train (merge later with --report)")
    p.add_argument(
        "--in-process", action="store_true", help="train the selected runs in this process (tests, children)"
    )
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def main(argv: list[str] | None = None) -> None:
    """Train the selected runs, then merge every run found into the result files (see the module docstring)."""
    args = parse_args(argv)
    if not args.report:
        if args.device == "cuda" and not torch.cuda.is_available():
            print("bench_torchtitan_e2e: no CUDA device, nothing to measure.")
            return
        measure(args)
    if not args.no_report:
        report(args.runs_dir)


if __name__ == "__main__":
    main()
