"""torchtitan on several GPUs: FSDP2, expert parallelism (FP8 dispatch), compile, recompute and DCP, BF16 vs FP8-Flow.

Each run is one ``torchrun --nproc_per_node G`` launch (``--gpus G``, default every visible GPU) of
torchtitan's ``Trainer`` on the DeepSeek-V3 debug TOML with the recipe's flags
(``benchmarks/_torchtitan.py``: BF16, or the ``fp8flow`` converter), recording every step's loss (the
exact float), step times and peak memory (``RunRecord``). FSDP spans all G GPUs; with EP the experts
are split over all G (torchtitan's EP borrows the FSDP ranks: EP=G x FSDP=G for the rest). Groups
(``--runs``; ``bash .ci/gpu OUT multigpu`` runs them):

* ``fsdp`` / ``ep``: 50 steps of the debug model without / with ``expert_parallel_degree G``;
  deterministic kernels; ``ep`` saves a DCP checkpoint at step 25. Goal: FP8-Flow's losses within
  0.5% of BF16's. Each also runs FP8-Flow with ``fp8flow.fsdp_fp8_all_gather`` (expert weights
  gathered as FP8 tiles; under ``ep`` the experts' shard mesh has one rank, where FSDP2 gathers nothing, and
  the checkpoint holds the FP8-gathered weights): under ``fsdp`` its losses must equal the BF16-gather run's
  bit for bit; under ``ep`` two launches of one configuration already part after a few steps (H200 x2,
  session 51: ``ep-bf16`` from step 8, ``ep-fp8flow`` from step 9, at ~1e-5), so there the goal is the loss gap
  (the layer-level bit identity is ``test_fsdp_fp8_all_gather_on_a_one_rank_mesh``'s).
* ``resume``: FP8-Flow EP restarted from the ``ep`` run's step-25 checkpoint: steps 26-50 must
  reproduce the uninterrupted run's losses bit for bit.
* ``cross``: the BF16 step-25 checkpoint loaded (model only, same keys) into an FP8-Flow run, and the
  FP8-Flow one into a BF16 run.
* ``compile``: EP with ``compile.enable`` and ``fp8flow.recompute_experts`` (against BF16 EP with compile).
* ``perf``: the ``fp8flow_gpu`` flavor (0.57 B parameters), EP x FSDP with compile: tokens/s per GPU
  and peak memory, BF16 vs FP8-Flow.
* ``scale`` (not in the default set): the ``fp8flow_dsv3_experts`` flavor (DeepSeek-V3's D=7168,
  256 experts top-8, H=2048) with compile for ``--scale-steps`` steps: the scale-out run for 4-8 GPUs.
* ``spikes`` (not in the default set): ``--spike-repeats`` launches each of the ``ep`` run (no checkpoint) as
  BF16, FP8-Flow and FP8-Flow with ``fp8flow.backward = "bf16_fc1_dgrad"`` (the gradient into the layers below
  leaves each MoE layer from a BF16 GEMM), round by round: how often each has gradient spikes
  (:func:`gradient_spikes`; session 54 saw them in 6 of 18 FP8-Flow runs and 2 of 10 BF16 ones).

Every run but the throughput ones (perf, scale) records each part's gradient norm (``RunRecord.grad_norm_parts``),
and the report lists every gradient spike with the parts of the model it is largest in.

Results: ``benchmarks/results/<--name>.{json,md}`` (default ``distributed_torchtitan``) and every
run's record (losses, step times, peak memory) in ``<--name>_runs.json``. A device command runs at
most 10 minutes, so split the groups over invocations with different ``--name`` s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _bench import RESULTS_DIR, row, write_results
from _torchtitan import BASE_TOML, common_args, recipe_args

HERE = Path(__file__).resolve().parent
RECIPES = ("bf16", "fp8flow")
DETERMINISTIC = ["--debug.deterministic", "--debug.deterministic_warn_only"]
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "25", "--checkpoint.folder", "checkpoint"]
RUN_GROUPS = ("fsdp", "ep", "resume", "cross", "compile", "perf", "scale", "spikes")
OPT_IN_GROUPS = ("scale", "spikes")
"""Run only when named: the scale-out run (4-8 GPUs) and the repeated spike launches."""
SPIKE_VARIANTS = {"bf16": ("bf16", ()), "fp8flow": ("fp8flow", ()),
                  "fp8flow_bf16_fc1_dgrad": ("fp8flow", ("--fp8flow.backward", "bf16_fc1_dgrad"))}  # fmt: skip
"""The spikes group's runs: name -> (recipe, extra torchtitan flags)."""


def worker(out: Path, recipe: str, args: list[str], part_norms: bool = False) -> None:
    """Under torchrun: one torchtitan training; rank 0 writes its record to ``out`` (``part_norms``: with every
    part's gradient norm, ``RunRecord.grad_norm_parts``)."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    import fp8flow_ao.torchtitan  # noqa: F401  (converter, datasets, the fp8flow_gpu flavor)
    from fp8flow_ao.torchtitan.record import train_recorded

    init_logger()
    if "--debug.deterministic" in args:
        # torchtitan's deterministic mode is warn_only, under which SDPA's fused backwards stay
        # nondeterministic: cuDNN's (torch warns), and flash's dQ (deterministic in strict mode only). On
        # 2 H200 (torch 2.11) two runs of one config parted after 8 steps with cuDNN, and a resumed run
        # left the uninterrupted one 10 steps after the checkpoint with flash, so no run-to-run bit-for-bit
        # comparison (FP8 vs BF16 all-gather, resume) can hold. The math backend is deterministic, and
        # the debug model's attention is small.
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    config = ConfigManager().parse_args([*common_args(BASE_TOML, "unused"), *recipe_args(recipe), *args])
    record = train_recorded(config, grad_norm_parts=part_norms)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(record.to_json()))


@dataclass(frozen=True)
class RunSpec:
    """One planned torchrun launch: ``prepare`` (e.g. place a checkpoint) runs first; skipped if ``needs`` failed."""

    name: str
    recipe: str
    args: tuple[str, ...]
    prepare: Callable[[], object] | None = None
    needs: str | None = None
    timed: bool = False
    """A throughput run (perf, scale): no per-part gradient norms, whose all-reduce and host read a step would
    count in its step time."""


def parallelism(gpus: int, ep: bool) -> list[str]:
    """FSDP over all ``gpus`` (and, with ``ep``, experts split over all of them: EP borrows the FSDP ranks)."""
    flags = ["--parallelism.data_parallel_shard_degree", str(gpus)]
    return flags + (["--parallelism.expert_parallel_degree", str(gpus)] if ep else [])


def _degrees(args: list[str]) -> str:
    """ "EP=e x FSDP=f" as a run's arguments set them (``parallelism``)."""
    value = {a: args[i + 1] for i, a in enumerate(args[:-1])}
    ep, fsdp = (value.get(f"--parallelism.{k}_degree", "1") for k in ("expert_parallel", "data_parallel_shard"))
    return f"EP={ep} x FSDP={fsdp}"


def plan_runs(
    groups: list[str], gpus: int, work: Path, scale_steps: int = 100, spike_repeats: int = 3
) -> list[RunSpec]:
    """The launches of ``groups`` on ``gpus`` GPUs, in order (see the module docstring)."""
    unknown = sorted(set(groups) - set(RUN_GROUPS))
    if unknown:
        raise ValueError(f"unknown run groups {unknown}; choose from {RUN_GROUPS}")
    if gpus < 2:
        raise ValueError(f"--gpus must be >= 2 (one process per GPU), got {gpus}")
    fsdp, ep = parallelism(gpus, ep=False), parallelism(gpus, ep=True)
    debug = ["--training.steps", "50"]

    def dump(name: str) -> list[str]:
        return ["--job.dump_folder", str(work / name)]

    def fp8_gather(mode: str, *args: str) -> RunSpec:
        """FP8-Flow with the expert weights all-gathered as FP8 tiles, beside the mode's BF16-gather run."""
        return RunSpec(
            f"{mode}-fp8gather", "fp8flow", (*args, "--fp8flow.fsdp_fp8_all_gather", *dump(f"{mode}-fp8gather"))
        )

    runs: list[RunSpec] = []
    if "fsdp" in groups:
        runs += [RunSpec(f"fsdp-{r}", r, (*debug, *fsdp, *DETERMINISTIC, *dump(f"fsdp-{r}"))) for r in RECIPES]
        runs.append(fp8_gather("fsdp", *debug, *fsdp, *DETERMINISTIC))
    if {"ep", "resume", "cross"} & set(groups):
        runs += [RunSpec(f"ep-{r}", r, (*debug, *ep, *DETERMINISTIC, *CHECKPOINT, *dump(f"ep-{r}"))) for r in RECIPES]
    if "ep" in groups:
        runs.append(fp8_gather("ep", *debug, *ep, *DETERMINISTIC, *CHECKPOINT))
    if "resume" in groups:
        place = functools.partial(copy_step, work / "ep-fp8flow", 25, work / "resume-fp8flow")
        resume = (*debug, *ep, *DETERMINISTIC, *CHECKPOINT, *dump("resume-fp8flow"))
        runs.append(RunSpec("resume-fp8flow", "fp8flow", resume, prepare=place, needs="ep-fp8flow"))
    if "cross" in groups:
        for src, dst in (("bf16", "fp8flow"), ("fp8flow", "bf16")):
            load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(work / f"ep-{src}/checkpoint/step-25")]
            args = ("--training.steps", "5", *ep, *load, *dump(f"cross-{src}"))
            runs.append(RunSpec(f"cross-{src}-to-{dst}", dst, args, needs=f"ep-{src}"))
    if "compile" in groups:
        for r in RECIPES:
            extra = ["--fp8flow.recompute_experts"] if r == "fp8flow" else []
            runs.append(RunSpec(f"compile-{r}", r, (*debug, *ep, "--compile.enable", *extra, *dump(f"compile-{r}"))))
    if "perf" in groups:
        # 60 steps: one 30-step run resolved this ~0.13 s step to about +-10% (session 48: 1.06-1.27x over four)
        perf = ("--model.flavor", "fp8flow_gpu", "--training.steps", "60", *ep, "--compile.enable")
        runs += [RunSpec(f"perf-{r}", r, (*perf, *dump(f"perf-{r}")), timed=True) for r in RECIPES]
    if "scale" in groups:
        scale = (
            "--model.flavor",
            "fp8flow_dsv3_experts",
            "--training.steps",
            str(scale_steps),
            *ep,
            "--compile.enable",
        )
        runs += [RunSpec(f"scale-{r}", r, (*scale, *dump(f"scale-{r}")), timed=True) for r in RECIPES]
    if "spikes" in groups:
        for i in range(1, spike_repeats + 1):  # round by round: a call cut short keeps every variant's count even
            for variant, (recipe, extra) in SPIKE_VARIANTS.items():
                name = f"spikes-{variant}-{i}"
                runs.append(RunSpec(name, recipe, (*debug, *ep, *DETERMINISTIC, *extra, *dump(name))))
    return runs


def launch(spec: RunSpec, gpus: int, work: Path, records: dict) -> dict:
    """One torchrun launch of :func:`worker`; its record (or failure) goes into ``records[spec.name]``."""
    out = work / f"{spec.name}.json"
    # A fresh port per launch: the previous run's rendezvous port may still be in TIME_WAIT.
    port = str(29531 + len(records))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), "--master_port", port]
    cmd += [str(Path(__file__)), "--worker", str(out), "--recipe", spec.recipe]
    cmd += [*([] if spec.timed else ["--part-norms"]), "--", *spec.args]
    print(f"=== {spec.name}: {' '.join(spec.args)}", flush=True)
    proc = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True)
    base = {"args": list(spec.args), "recipe": spec.recipe, "gpus": gpus}
    if proc.returncode != 0 or not out.exists():
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", flush=True)
        records[spec.name] = {"failed": True, "returncode": proc.returncode} | base
    else:
        records[spec.name] = json.loads(out.read_text()) | base
        print(f"    losses {records[spec.name]['losses'][:2]} ... {records[spec.name]['losses'][-2:]}", flush=True)
    return records[spec.name]


def copy_step(src_dump: Path, step: int, dst_dump: Path) -> Path:
    """Put only ``step``'s DCP checkpoint of one run into a fresh dump folder (so a run resumes there)."""
    src = src_dump / "checkpoint" / f"step-{step}"
    shutil.copytree(src, dst_dump / "checkpoint" / f"step-{step}")
    return src


def run_plan(
    runs: list[RunSpec],
    gpus: int,
    work: Path,
    budget_s: float = float("inf"),
    on_record: Callable[[dict], object] | None = None,
) -> dict:
    """Launch ``runs`` in order; ``on_record(records)`` after each, so a killed command keeps what ran.

    A run whose dependency failed is recorded as skipped. Once ``budget_s`` seconds have passed, or the
    longest launch so far would end past it, the remaining runs are recorded as skipped, not launched.
    """
    records: dict = {}
    start, longest = time.monotonic(), 0.0
    for spec in runs:
        elapsed = time.monotonic() - start
        if spec.needs is not None and records.get(spec.needs, {}).get("failed", spec.needs not in records):
            records[spec.name] = {"failed": True, "returncode": None, "skipped_because": f"{spec.needs} failed"}
        elif elapsed + longest > budget_s:
            records[spec.name] = {"failed": True, "returncode": None, "skipped_because": "over --budget-s"}
            print(f"=== {spec.name}: skipped, {elapsed:.0f} s of the {budget_s:.0f} s budget spent", flush=True)
        else:
            if spec.prepare is not None:
                spec.prepare()
            launch(spec, gpus, work, records)
            longest = max(longest, time.monotonic() - start - elapsed)
        if on_record is not None:
            on_record(records)
    return records


def _gap(ours: list[float], base: list[float]) -> float:
    """Mean relative loss gap over the second half of the run, in percent."""
    half = len(base) // 2
    return 100 * statistics.mean(abs(a - b) / b for a, b in zip(ours[half:], base[half:], strict=True))


def _quartiles_ms(seconds: list[float]) -> str:
    """The timed steps' spread: first and third quartile of the step times, in ms."""
    q1, _, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else seconds * 3
    return f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}"


def _slow_steps(seconds: list[float], warm: int) -> list[int]:
    """Timed steps (1-based step numbers) above 3x the median: one-off stalls such as a recompile."""
    median = statistics.median(seconds[warm:])
    return [warm + 1 + i for i, t in enumerate(seconds[warm:]) if t > 3 * median]


SPIKE_RATIO = 5.0
"""A step's pre-clip gradient norm above this many times the median of the 10 steps before it is a spike."""


def gradient_spikes(record: dict, top: int = 3) -> list[str]:
    """The spikes of one run's gradient norm (:data:`SPIKE_RATIO`), each with its step's loss, the largest
    rank loss, and the ``top`` parts of the model with the largest gradient norms (where the run recorded them)."""
    norms, parts = record.get("grad_norms", []), record.get("grad_norm_parts") or {}
    found = []
    for i in range(10, len(norms)):
        median = statistics.median(norms[i - 10 : i])
        if norms[i] <= SPIKE_RATIO * median:
            continue
        largest = sorted(parts, key=lambda p: parts[p][i], reverse=True)[:top]
        where = ", ".join(f"{p} {parts[p][i]:.3g}" for p in largest) or "parts not recorded"
        max_loss = record.get("max_losses", [None] * len(norms))[i]
        found.append(
            f"step {i + 1}: norm {norms[i]:.3g} (median before {median:.3g}), loss {record['losses'][i]:.4f}"
            f" (largest rank's {max_loss if max_loss is None else round(max_loss, 4)}); largest parts: {where}"
        )
    return found


def _spike_counts(records: dict) -> list[str]:
    """The spikes group's tally per variant: runs with a gradient spike, and each run's second-half loss gap to
    the BF16 run of its round."""
    notes = []
    for variant in SPIKE_VARIANTS:
        runs = sorted(k for k in records if k.rsplit("-", 1)[0] == f"spikes-{variant}")
        if not runs:
            continue
        spiked = [k for k in runs if gradient_spikes(records[k])]
        gaps = []
        for k in runs:
            base = records.get(f"spikes-bf16-{k.rsplit('-', 1)[1]}")
            gaps.append("n/a" if base is None else f"{_gap(records[k]['losses'], base['losses']):.2f}%")
        notes.append(
            f"Spike launches, {variant}: {len(spiked)} of {len(runs)} runs with a gradient spike "
            f"({', '.join(spiked) or 'none'}); second-half loss gap to the round's BF16 run: {', '.join(gaps)}."
        )
    return notes


def report(records: dict, name: str) -> None:
    rows, notes = [], []
    ok = {k: v for k, v in records.items() if not v.get("failed")}
    for run in sorted(k for k in records if records[k].get("failed")):
        why = records[run].get("skipped_because")
        notes.append(f"NOT RUN {run}: {why}." if why else f"FAILED run {run} (exit {records[run]['returncode']}).")
    for mode in ("fsdp", "ep", "compile", "perf", "scale"):
        bf16, fp8 = ok.get(f"{mode}-bf16"), ok.get(f"{mode}-fp8flow")
        if not (bf16 and fp8):
            continue
        warm = 5 if mode in ("perf", "scale") else 3
        timed = {k: r["step_seconds"][warm:] for k, r in (("bf16", bf16), ("fp8", fp8))}
        step_us = {k: statistics.median(t) * 1e6 for k, t in timed.items()}
        tokens = fp8["tokens_per_step"]
        args = fp8["args"]
        shown = [a for i, a in enumerate(args) if "--job.dump_folder" not in (a, args[i - 1] if i else "")]
        rows.append(
            row(
                f"{mode}: {' '.join(shown)}",
                step_us["fp8"],
                "BF16 torchtitan, same settings",
                step_us["bf16"],
                tokens_per_s_per_gpu=round(tokens / step_us["fp8"] * 1e6),
                baseline_tokens_per_s_per_gpu=round(tokens / step_us["bf16"] * 1e6),
                peak_gib=round(fp8["peak_mem_gib"], 2),
                baseline_peak_gib=round(bf16["peak_mem_gib"], 2),
                last_loss=round(fp8["losses"][-1], 4),
                baseline_last_loss=round(bf16["losses"][-1], 4),
                loss_gap_pct_second_half=round(_gap(fp8["losses"], bf16["losses"]), 3),
                timed_steps=len(timed["fp8"]),
                step_ms_p25_p75=_quartiles_ms(timed["fp8"]),
                baseline_step_ms_p25_p75=_quartiles_ms(timed["bf16"]),
                slow_steps=_slow_steps(fp8["step_seconds"], warm),
                baseline_slow_steps=_slow_steps(bf16["step_seconds"], warm),
            )
        )
    for mode, where in (("fsdp", "FSDP2"), ("ep", "EP x FSDP2 (the experts' shard mesh: one rank)")):
        gathered, plain = ok.get(f"{mode}-fp8gather"), ok.get(f"{mode}-fp8flow")
        if not (gathered and plain):
            continue
        step = {k: statistics.median(r["step_seconds"][3:]) * 1e3 for k, r in (("fp8", gathered), ("bf16", plain))}
        same = gathered["losses"] == plain["losses"]
        notes.append(
            f"{where} with fsdp_fp8_all_gather (expert weights gathered as FP8 tiles): losses "
            f"{'bit-identical to' if same else 'DIFFER from'} the BF16-gather FP8-Flow run; median step "
            f"{step['fp8']:.2f} ms vs {step['bf16']:.2f} ms; peak {gathered['peak_mem_gib']:.2f} vs "
            f"{plain['peak_mem_gib']:.2f} GiB (debug model: a functional check, its weights are tiny)."
        )
    full, resumed = ok.get("ep-fp8flow"), ok.get("resume-fp8flow")
    if full and resumed:
        same = resumed["losses"] == full["losses"][25:]
        parted = next(
            (26 + i for i, (a, b) in enumerate(zip(resumed["losses"], full["losses"][25:], strict=False)) if a != b),
            None,
        )
        notes.append(
            f"DCP resume (FP8-Flow, {_degrees(resumed['args'])}, deterministic): steps 26-50 after loading step 25 "
            f"{'reproduce the uninterrupted losses bit for bit' if same else f'DIFFER from the uninterrupted run from step {parted}'} "
            f"(resumed {resumed['losses'][:3]}..., uninterrupted {full['losses'][25:28]}...)."
        )
    for src, dst in (("bf16", "fp8flow"), ("fp8flow", "bf16")):
        cross = ok.get(f"cross-{src}-to-{dst}")
        if cross and ok.get(f"ep-{src}"):
            notes.append(
                f"Cross-recipe load: the {src} step-25 checkpoint (model only) trains on as {dst}: first losses "
                f"{[round(v, 4) for v in cross['losses'][:3]]} vs the {src} run's step 25-26 "
                f"{[round(v, 4) for v in ok[f'ep-{src}']['losses'][24:26]]} and step 1 {round(ok[f'ep-{src}']['losses'][0], 4)}."
            )
    notes += _spike_counts(ok)
    spikes = {run: gradient_spikes(r) for run, r in sorted(ok.items())}
    notes.append(
        f"Gradient spikes (pre-clip norm above {SPIKE_RATIO:g}x the median of the 10 steps before): "
        + ("; ".join(f"{run}: {' | '.join(s)}" for run, s in spikes.items() if s) or f"none in {len(ok)} runs")
        + "."
    )
    notes.append(
        "Step time = median after the first steps (3, or 5 with compile for perf); tokens per GPU per step. "
        "step_ms_p25_p75: the quartiles of the timed steps; slow_steps: timed steps above 3x the median (one-off "
        "stalls, e.g. a recompile)."
    )
    write_results(name, rows, "\n\n".join(notes))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", nargs="+", choices=RUN_GROUPS, default=[g for g in RUN_GROUPS if g not in OPT_IN_GROUPS]
    )
    parser.add_argument("--gpus", type=int, default=None, help="processes/GPUs per run (default: every visible GPU)")
    parser.add_argument("--scale-steps", type=int, default=100, help="steps of the scale group's runs")
    parser.add_argument("--spike-repeats", type=int, default=3, help="rounds of the spikes group's launches")
    parser.add_argument("--name", default="distributed_torchtitan", help="result file name (without suffix)")
    parser.add_argument(
        "--budget-s", type=float, default=float("inf"), help="launch no run that would end after this many seconds"
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--recipe", choices=RECIPES, help=argparse.SUPPRESS)
    parser.add_argument("--part-norms", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("torchtitan_args", nargs="*")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.recipe, args.torchtitan_args, args.part_norms)
    visible = torch.cuda.device_count()
    gpus = args.gpus or visible
    if visible < 2 or gpus > visible:
        print(f"bench_distributed_torchtitan: needs >= 2 GPUs and --gpus <= {visible} visible; skipped")
        return None
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    def save(records: dict) -> None:
        (RESULTS_DIR / f"{args.name}_runs.json").write_text(json.dumps(records))
        report(records, args.name)

    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_runs(args.runs, gpus, Path(tmp), args.scale_steps, args.spike_repeats)
        run_plan(plan, gpus, Path(tmp), args.budget_s, on_record=save)
    return None


if __name__ == "__main__":
    main()
