"""Long-run convergence in torchtitan 0.2.2: BF16 vs FP8-Flow (and row-wise FP8) from the same seed and data.

One recipe per invocation, so each GPU command stays under 10 minutes; a final ``--report`` merges
the runs into ``benchmarks/results/convergence.{json,md,png}``::

    python3 benchmarks/bench_convergence.py --recipe bf16    --steps 2000   # ~5.5 min on one H200
    python3 benchmarks/bench_convergence.py --recipe fp8flow --steps 2000   # ~5 min
    python3 benchmarks/bench_convergence.py --recipe bf16 --name bf16_repeat --steps 2000  # noise floor, ~5.5 min
    python3 benchmarks/bench_convergence.py --report

Each run trains ``torchtitan_configs/deepseek_v3_fp8flow_gpu_convergence.toml`` (the ``fp8flow_gpu``
flavor, 8 x 2048 tokens a step, compiled, seed 0) with torchtitan's ``Trainer`` on the source corpus
of :mod:`fp8flow_ao.corpus` (``fp8flow_pysrc``: ~24 M training tokens, so 2000 steps are 1.36
epochs; the held-out split shares no file with it) and scores the held-out split every 250 steps
(16 batches, the same ones each time). Runs see the same batches in the same order: torchtitan reads
the corpus sequentially and the seed only sets the initial weights, which are the same for every
recipe. Wall time per run: 2000 x 16384 tokens at ~135 K tok/s (BF16) or ~162 K tok/s (FP8-Flow),
i.e. 243 s / 202 s, plus ~1-2 min for compile, the first-use corpus build and evaluation.

The noise floor: PERF.md's point is that a BF16-vs-FP8 gap means something only next to the gap
between two BF16 runs. ``--name bf16_repeat`` repeats BF16 with the same seed (differences come from
non-deterministic kernels alone); ``--seed 1`` instead gives a second initialization (a larger,
seed-to-seed floor). The report lists every extra run's gap to ``bf16`` beside FP8-Flow's.

Where a gap comes from (issue 10: look before touching thresholds): ``--probe-every N`` runs
:class:`fp8flow_ao.torchtitan.probe.ExpertProbe` along the run. At step 1 and every N steps it takes
each FP8-Flow MoE layer's last training input of the step (tokens, router scores, top-k ids; a
detached copy, held only on that step) and, after the step, measures the layer's FP8-Flow routed
experts against torchtitan's experts in fp32 on the same routing with the current weights: SQNR (dB)
of the output, dx, d(scores), dw1, dw2, dw3 against a fixed-seed random output gradient. Every step it
records the norm of each MoE layer's expert weight gradients (before clipping; BF16 runs too, to
compare). Training is unchanged bit for bit (no global RNG draw, no parameter gradient, data
untouched)::

    python3 benchmarks/bench_convergence.py --recipe fp8flow --steps 2000 --probe-every 250   # + ~5-10 s
    python3 benchmarks/bench_convergence.py --recipe bf16 --steps 2000 --probe-every 250      # grad norms only

Which half of the step a gap comes from: the ablation recipe ``fp8flow_bf16_backward`` runs FP8-Flow's
forward with its gradients computed in BF16 (``fp8flow.backward = "bf16"``; ~163 K tok/s, about BF16's
speed, ~4 min a run); ``fp8flow_bf16_wgrad`` keeps FP8-Flow's backward but computes the weight
gradients again in BF16 (``fp8flow.backward = "bf16_wgrad"``), splitting a backward gap between dgrads
and wgrads; ``fp8flow_bf16_fc1_dgrad`` computes only FC1's dgrad in BF16 (``"bf16_fc1_dgrad"``), splitting a
dgrad gap between FC1's dgrad and the rest. Ablations are paired with BF16 like the recipes but have no goal::

    python3 benchmarks/bench_convergence.py --recipe fp8flow_bf16_backward --steps 2000
    python3 benchmarks/bench_convergence.py --recipe fp8flow_bf16_wgrad --steps 2000
    python3 benchmarks/bench_convergence.py --recipe fp8flow_bf16_fc1_dgrad --steps 2000

torchtitan's features that recompute instead of storing (issue 10, item 3): ``fp8flow_recompute``
(``fp8flow.recompute_experts``), ``fp8flow_ac_full`` and ``fp8flow_ac_selective`` (``activation_checkpoint.mode``,
selective per op) train FP8-Flow with the feature on; the report's features table (:func:`feature_gaps`)
compares each run with its seed's FP8-Flow runs, where a feature that computes the same values leaves run
noise alone::

    python3 benchmarks/bench_convergence.py --recipe fp8flow_recompute --name fp8flow_recompute_seed41 --seed 41 --steps 2000

What a change to FC1's FP8 dgrad would do, before a kernel is written: ``fp8flow_emulated_fc1_dgrad`` runs
that dgrad in BF16 GEMMs on FP8-Flow's own FP8 operands (a control: it should train as ``fp8flow``),
``fp8flow_emulated_sr_fc1_dgrad`` the same with dh rounded stochastically to its FP8 grid (unbiased)
instead of to nearest (``fp8flow.backward = "emulated_*"``; compiled, about ``bf16_fc1_dgrad``'s speed).

Several runs can train at once (their loss curves do not depend on it): ``bash .ci/gpu OUT convergence
"--recipe A ..." "--recipe B ..."`` builds the corpus once and starts them together, spread over the
machine's GPUs; where runs share a GPU it gives them ``--shared-gpu N``, which keeps their tokens/s out
of the report.

Cost (fp8flow_gpu, estimated): a probe is ~0.1 s a MoE layer (the fp32 reference: ~3.7 TFLOP of fp32
matmuls), measured between the timed steps; the grad norms read the fp32 expert gradients once a
step (1.8 GB, ~0.5 ms, inside the timed step, <1% of it); a probed run's peak memory includes the
reference's few GiB. ``--report`` then adds per-layer tables (SQNR at the first and last probe and its
minimum; expert grad norm over the last half vs bf16) and ``convergence_probe.png`` (SQNR vs step,
expert grad norms vs step).

Each run writes ``<runs-dir>/<name>.json`` (every step's loss, grad norm and time; held-out losses;
peak memory; the corpus fingerprint, so the report refuses runs on different data; the probe's
series with ``--probe-every``). ``--device cpu``
runs a tiny model (torchtitan's ``debugmodel``, 2 x 64 tokens, 3 steps) through the CPU runner: a
smoke test of the whole path, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _bench import RESULTS_DIR, device_name, versions
from _torchtitan import (
    FEATURE_OF,
    RECIPE_NAMES,
    REPO,
    SAME_NUMERICS,
    TRAINING_RECIPES,
    common_args,
    recipe_args,
    tokens_per_s,
    train,
)

CONFIG = REPO / "torchtitan_configs/deepseek_v3_fp8flow_gpu_convergence.toml"
BASELINE = "bf16"
GOAL_GAP = 0.0025  # issue 10: relative gap <= 0.25% (training, last half; held-out), as published at scale
# Seeds needed before their spread estimates the mean gap's standard error (:func:`_seed_standard_error`):
# below it only the run-noise model gives one.
MIN_SEEDS_FOR_SPREAD = 5
EMA = 0.98  # smoothing of the plotted and compared curves: ~50-step memory, a few % of a 2000-step run
PROBE_PNG = "convergence_probe.png"  # the --probe-every runs' SQNR and expert grad norm panels
WARMUP_STEPS = 20  # left out of the median step time (compile, autotuning, allocator)
# The CPU smoke run: torchtitan's debugmodel, tiny batches, no compile; everything else as on the GPU.
CPU_ARGS = [
    "--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32", "--compile.no-enable", "--training.dataloader.num_workers", "0",
    "--validation.local_batch_size", "2", "--validation.seq_len", "64", "--validation.steps", "1",
]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------


def corpus_facts(corpus_dir: Path | None, tokens_per_step: int, steps: int) -> dict[str, Any]:
    """Where the run's data lives, how big it is, the epochs the run makes, and a fingerprint of its documents."""
    from fp8flow_ao.corpus import describe, ensure_source_corpus, epochs

    corpus = ensure_source_corpus(corpus_dir)
    print(describe(corpus, tokens_per_step, steps), file=sys.stderr)
    docs = json.dumps(corpus.manifest["documents"], sort_keys=True).encode()
    return {
        "directory": str(corpus.directory),
        "fingerprint": hashlib.sha256(docs).hexdigest()[:16],
        "train_tokens": corpus.tokens("train"),
        "heldout_tokens": corpus.tokens("heldout"),
        "epochs": round(epochs(corpus, tokens_per_step, steps), 3),
        "python": corpus.manifest["python"],
    }


def run_args(args: argparse.Namespace, corpus_dir: Path, dump: str) -> list[str]:
    """The torchtitan flags of one run."""
    out = [*common_args(CONFIG, dump), *recipe_args(args.recipe)]
    out += ["--training.steps", str(args.steps), "--debug.seed", str(args.seed), "--validation.enable"]
    out += ["--validation.freq", str(args.val_freq), "--training.dataset_path", str(corpus_dir)]
    out += ["--validation.dataset_path", str(corpus_dir)]
    if args.device == "cpu":
        out += CPU_ARGS
    return out + args.extra


def run_one(args: argparse.Namespace) -> Path:
    """Train one recipe; write ``<runs_dir>/<name>.json``; return its path."""
    from fp8flow_ao.corpus import default_source_corpus_dir

    corpus_dir = args.corpus or default_source_corpus_dir()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        flags = run_args(args, corpus_dir, dump)
        record = train(flags, args.device, args.probe_every)
    facts = corpus_facts(corpus_dir, record.tokens_per_step, args.steps)
    result = {
        "name": args.name or args.recipe,
        "recipe": args.recipe,
        "seed": args.seed,
        "steps": args.steps,
        "device": device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "versions": versions(),
        "command": "python " + " ".join([str(Path(sys.argv[0]).as_posix()), *sys.argv[1:]]),
        "torchtitan_flags": flags,
        "date": datetime.date.today().isoformat(),
        "corpus": facts,
        "tokens_per_s": round(tokens_per_s(record, min(WARMUP_STEPS, args.steps // 2))),
        "shared_gpu": args.shared_gpu,
        "wall_s": round(time.perf_counter() - start, 1),
        **record.to_json(),
    }
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    path = args.runs_dir / f"{result['name']}.json"
    path.write_text(json.dumps(result) + "\n")
    print(f"bench_convergence: wrote {path} ({result['wall_s']} s)")
    return path


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def ema(values: list[float], alpha: float = EMA) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled toward 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = alpha * avg + (1 - alpha) * v
        out.append(avg / (1 - alpha**i))
    return out


def gaps(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Relative gaps of ``run`` to ``base`` (positive: ``run`` has the higher loss)."""
    x, b = run["losses"], base["losses"]
    if len(x) != len(b):
        raise ValueError(
            f"runs {run['name']} and {base['name']} logged {len(x)} and {len(b)} steps: use the same --steps"
        )
    half = len(b) // 2
    held = {s: run["validation"][s] / base["validation"][s] - 1 for s in base["validation"] if s in run["validation"]}
    last = max(held, key=int) if held else None
    return {
        "train_gap_last_half": statistics.fmean(x[half:]) / statistics.fmean(b[half:]) - 1,
        "mean_abs_step_gap_last_half": statistics.fmean(
            abs(p / q - 1) for p, q in zip(x[half:], b[half:], strict=True)
        ),
        "heldout_gap_by_step": held,
        "heldout_gap_final": held[last] if last else None,
    }


def load_runs(runs_dir: Path) -> dict[str, dict[str, Any]]:
    """Every ``<name>.json`` of ``runs_dir``; ``ValueError`` without a ``bf16`` run or on mixed corpora."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))}
    if BASELINE not in runs:
        raise ValueError(
            f"--runs-dir {runs_dir}: no {BASELINE}.json (run --recipe {BASELINE} first); found {sorted(runs)}"
        )
    prints = {name: r["corpus"]["fingerprint"] for name, r in runs.items()}
    if len(set(prints.values())) != 1:
        raise ValueError(f"runs trained on different corpora (fingerprints {prints}): rerun them on one machine image")
    return runs


def paired_baselines(name: str, run: dict[str, Any], runs: dict[str, dict[str, Any]]) -> list[str]:
    """The BF16 runs ``name`` is compared with, as their mean curve (:func:`mean_run`): for an FP8 run every
    BF16 run of its seed (``bf16`` when no BF16 run has that seed); for a BF16 run the BF16 runs of its seed
    trained before it (a same-seed repeat: its gap is run-to-run noise; runs of one day in name order), else
    ``bf16`` (another seed: its gap is what the initialization alone moves); none for ``bf16``."""
    bf16 = sorted(n for n, r in runs.items() if r["recipe"] == BASELINE)
    same_seed = [n for n in bf16 if runs[n]["seed"] == run["seed"]]
    if run["recipe"] == BASELINE:
        order = (run["date"], name)
        earlier = [n for n in same_seed if (runs[n]["date"], n) < order]
        return [] if name == BASELINE else earlier or [BASELINE]
    return same_seed or [BASELINE]


def mean_run(names: list[str], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The step-by-step mean of runs ``names`` (losses; held-out losses at the steps all of them evaluated)."""
    chosen = [runs[n] for n in names]
    # in step order: a set's order would change the report file from one run of --report to the next
    steps = sorted(set.intersection(*(set(r["validation"]) for r in chosen)), key=int)
    return {
        "name": "+".join(names),
        "losses": [statistics.fmean(v) for v in zip(*(r["losses"] for r in chosen), strict=True)],
        "validation": {s: statistics.fmean(r["validation"][s] for r in chosen) for s in steps},
    }


def own_tokens_per_s(run: dict[str, Any]) -> int | None:
    """The run's tokens/s, or None where it shared its GPU with other runs (then it measures the sharing)."""
    return run["tokens_per_s"] if run.get("shared_gpu", 1) == 1 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-run figures and gaps to each run's paired BF16 run, with the goal check for FP8 recipes (not ablations)."""
    out = {}
    for name, r in runs.items():
        last_val = max(r["validation"], key=int) if r["validation"] else None
        base_names = paired_baselines(name, r, runs)
        row = {
            "recipe": r["recipe"],
            "numerics": SAME_NUMERICS.get(r["recipe"], r["recipe"]),  # what the report pools the run with
            "seed": r["seed"],
            "baseline": "+".join(base_names) or None,
            "baseline_runs": len(base_names),
            "steps": len(r["losses"]),
            "final_loss_smoothed": round(ema(r["losses"])[-1], 4),
            "final_heldout_loss": round(r["validation"][last_val], 4) if last_val else None,
            "tokens_per_s": own_tokens_per_s(r),
            "speedup_vs_bf16": _ratio(own_tokens_per_s(r), own_tokens_per_s(runs[BASELINE])),
            "peak_mem_gib": None if r["peak_mem_gib"] is None else round(r["peak_mem_gib"], 2),
            "epochs": r["corpus"]["epochs"],
        }
        if "note" in r:  # what a run's figures do not say (e.g. an implementation since replaced)
            row["note"] = r["note"]
        if base_names:
            g = gaps(r, mean_run(base_names, runs))
            row.update({k: v for k, v in g.items() if k != "heldout_gap_by_step"})
            row["heldout_gap_by_step"] = {s: round(v, 5) for s, v in g["heldout_gap_by_step"].items()}
            if r["recipe"] != BASELINE and r["recipe"] in TRAINING_RECIPES:  # ablations have no goal
                final = g["heldout_gap_final"]
                row["meets_goal"] = (
                    abs(g["train_gap_last_half"]) <= GOAL_GAP and final is not None and abs(final) <= GOAL_GAP
                )
        out[name] = row
    return out


GAP_KEYS = ("train_gap_last_half", "heldout_gap_final")


def run_noise(summary: dict[str, Any]) -> dict[str, Any]:
    """The noise of one run's gap, from the runs that repeat a recipe and seed: per gap, the pooled standard
    deviation ``sigma`` (FP8 runs: spread around their group's mean; a BF16 same-seed repeat: its gap to the
    mean of its ``k`` earlier runs, whose variance is ``sigma**2 * (1 + 1/k)``) and its degrees of freedom.
    Identical setups do not train identically here (non-deterministic kernels; the divergence grows over
    the run), so one run's gap is its recipe's effect plus this noise."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in summary.values():
        if r["recipe"] != BASELINE and r["baseline"] is not None:
            groups.setdefault((r["numerics"], r["seed"]), []).append(r)
    repeats = [r for r in summary.values() if r["recipe"] == BASELINE and r["baseline_runs"] and _same_seed(r, summary)]
    out = {}
    for key in GAP_KEYS:
        squares, dof = 0.0, 0
        for rows in groups.values():
            values = [r[key] for r in rows if r[key] is not None]
            if len(values) > 1:
                mean = statistics.fmean(values)
                squares += sum((v - mean) ** 2 for v in values)
                dof += len(values) - 1
        for r in repeats:
            if r[key] is not None:
                squares += r[key] ** 2 / (1 + 1 / r["baseline_runs"])
                dof += 1
        out[key] = {"sigma": math.sqrt(squares / dof) if dof else None, "dof": dof}
    return out


def _same_seed(row: dict[str, Any], summary: dict[str, Any]) -> bool:
    """Whether a BF16 row's baseline runs have its seed (a repeat, not another initialization)."""
    return all(summary[n]["seed"] == row["seed"] for n in row["baseline"].split("+"))


def _mean_min_max(values: list[float]) -> dict[str, Any]:
    """The gap stats every table starts from (``None`` each without values)."""
    return {
        "mean": statistics.fmean(values) if values else None,
        "min": min(values, default=None),
        "max": max(values, default=None),
    }


def gaps_by_recipe(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per recipe (runs of :data:`SAME_NUMERICS` recipes pooled with theirs), the gaps of its runs to their BF16 baselines: mean, min, max, count, and for FP8 recipes the
    mean's standard error ``se``, the larger of two estimates (both kept, ``se_model`` and ``se_seeds``):

    * from the per-run noise (:func:`run_noise`): ``sigma * sqrt(1/n + sum_s (n_s/n)**2 / m_s)`` for ``n``
      runs, ``n_s`` of them on seed ``s``, whose baseline averages ``m_s`` BF16 runs. It assumes a seed's
      gap is the recipe's one effect plus run noise;
    * from the seeds themselves (:func:`_seed_standard_error`, with :data:`MIN_SEEDS_FOR_SPREAD` seeds or
      more): the spread of the per-seed mean gaps over ``sqrt(seeds)``. It also holds where the recipe's
      effect differs from seed to seed, which the first cannot see (measured: 54 FP8-Flow runs spread
      0.66% against the 0.54% that run noise alone gives).

    A recipe to train with gets a verdict on the goal: "met" when ``mean +- 2 SE`` lies inside
    ``+-GOAL_GAP`` for both gaps, "missed" when it lies outside for either, else "undecided" (more runs
    would tell).

    For ``bf16`` the gaps are the noise itself: same-seed repeats and other seeds against seed 0.
    """
    noise = run_noise(summary)
    out = {}
    for recipe in dict.fromkeys(r["numerics"] for r in summary.values()):
        rows = [r for r in summary.values() if r["numerics"] == recipe and r["baseline"] is not None]
        if not rows:
            continue
        out[recipe] = {"runs": len(rows), "seeds": sorted({r["seed"] for r in rows})}
        for key in GAP_KEYS:
            kept = [r for r in rows if r[key] is not None]
            values = [r[key] for r in kept]
            stats = _mean_min_max(values)
            sigma = noise[key]["sigma"]
            if recipe != BASELINE and values and sigma is not None:
                n = len(kept)
                per_seed = {r["seed"]: (sum(q["seed"] == r["seed"] for q in kept), r["baseline_runs"]) for r in kept}
                stats["se_model"] = sigma * math.sqrt(1 / n + sum((ns / n) ** 2 / ms for ns, ms in per_seed.values()))
                stats["se_seeds"] = _seed_standard_error(kept, key)
                stats["se"] = max(stats["se_model"], stats["se_seeds"] or 0.0)
                # what the standard error shrinks with: seeds for the spread of seeds, runs for run noise
                stats["units"] = len(per_seed) if stats["se"] == stats["se_seeds"] else n
            out[recipe][key] = stats
        if recipe in TRAINING_RECIPES and recipe != BASELINE:
            stats = [out[recipe][k] for k in GAP_KEYS]
            out[recipe]["goal"] = _verdict(stats)
            if out[recipe]["goal"] == "undecided":
                out[recipe]["runs_to_decide"] = _runs_to_decide(stats, len(rows))
    return out


def noise_by_step(summary: dict[str, Any], runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """How the held-out comparison's noise evolves over the run, per evaluation step, over the seeds that have
    both a BF16 run and an FP8-Flow run (several runs of a recipe on a seed averaged first): the BF16 held-out
    loss (mean, and its spread across seeds relative to it), FP8-Flow's gap to its seed's BF16 (mean and
    spread), and the correlation of a seed's two losses (what pairing by seed removes: with correlation
    ``c`` the gap's spread is about ``sqrt(2 (1 - c))`` times the seeds' spread; ``None`` where it is
    undefined). Empty below :data:`MIN_SEEDS_FOR_SPREAD` such seeds."""
    by_seed: dict[int, dict[str, list[str]]] = {}
    for name, row in summary.items():
        if row["numerics"] in (BASELINE, "fp8flow"):
            by_seed.setdefault(row["seed"], {}).setdefault(row["numerics"], []).append(name)
    pairs = {seed: groups for seed, groups in by_seed.items() if len(groups) == 2}
    if len(pairs) < MIN_SEEDS_FOR_SPREAD:
        return []
    steps = sorted(
        set.intersection(*(set(runs[n]["validation"]) for g in pairs.values() for names in g.values() for n in names)),
        key=int,
    )
    out = []
    for step in steps:
        loss = {
            recipe: [statistics.fmean(runs[n]["validation"][step] for n in g[recipe]) for g in pairs.values()]
            for recipe in (BASELINE, "fp8flow")
        }
        bf16, fp8 = loss[BASELINE], loss["fp8flow"]
        gap = [f / b - 1 for f, b in zip(fp8, bf16, strict=True)]
        out.append(
            {
                "step": int(step),
                "seeds": len(pairs),
                "bf16_loss": statistics.fmean(bf16),
                "bf16_spread": statistics.stdev(bf16) / statistics.fmean(bf16),
                "gap_mean": statistics.fmean(gap),
                "gap_spread": statistics.stdev(gap),
                # undefined where one recipe's losses are all equal (e.g. the first step of one initialization)
                "correlation": statistics.correlation(bf16, fp8) if min(len(set(bf16)), len(set(fp8))) > 1 else None,
            }
        )
    return out


def feature_gaps(summary: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per :data:`FEATURE_OF` recipe with runs, and pooled over them all (``"pooled"``, from two such recipes
    on): the gaps of its runs to the mean of the same-seed runs of the recipe it recomputes (FP8-Flow, not
    BF16; a run with no such seed is left out), as ``GAP_KEYS`` stats: mean, min, max and ``se``, the larger of
    the run-noise model's (``sigma * sqrt(1 + 1/m)`` a run, ``m`` runs in its baseline) and, from
    :data:`MIN_SEEDS_FOR_SPREAD` runs on, the runs' spread over ``sqrt(runs)``. A feature that only moves where
    values are computed leaves these gaps at run noise: mean near 0 within ``2 se``."""
    sigma = {k: v["sigma"] for k, v in run_noise(summary).items()}
    by_feature: dict[str, list[dict[str, float]]] = {}
    for r in runs.values():
        base = FEATURE_OF.get(r["recipe"])
        same = sorted(n for n, q in runs.items() if q["recipe"] == base and q["seed"] == r["seed"])
        if base is not None and same:
            g = gaps(r, mean_run(same, runs))
            by_feature.setdefault(r["recipe"], []).append({"seed": r["seed"], "m": len(same), **g})
    if len(by_feature) > 1:
        by_feature["pooled"] = [g for rows in list(by_feature.values()) for g in rows]
    out = {}
    for feature, rows in by_feature.items():
        out[feature] = {"runs": len(rows), "seeds": sorted({g["seed"] for g in rows})}
        for key in GAP_KEYS:
            kept = [g for g in rows if g[key] is not None]
            values, n = [g[key] for g in kept], len(kept)
            stats = _mean_min_max(values)
            se = [sigma[key] * math.sqrt(sum(1 + 1 / g["m"] for g in kept)) / n] if sigma[key] and n else []
            se += [statistics.stdev(values) / math.sqrt(n)] if n >= MIN_SEEDS_FOR_SPREAD else []
            stats["se"] = max(se, default=None)
            out[feature][key] = stats
    return out


def _seed_standard_error(rows: list[dict[str, Any]], key: str) -> float | None:
    """Standard error of the mean gap with the seed as the unit: the sample standard deviation of the
    per-seed mean gaps over ``sqrt(seeds)``; ``None`` below :data:`MIN_SEEDS_FOR_SPREAD` seeds."""
    by_seed: dict[int, list[float]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], []).append(r[key])
    if len(by_seed) < MIN_SEEDS_FOR_SPREAD:
        return None
    means = [statistics.fmean(v) for v in by_seed.values()]
    return statistics.stdev(means) / math.sqrt(len(means))


def _runs_to_decide(stats: list[dict[str, Any]], runs: int) -> int | None:
    """How many runs in all would give a verdict if every gap's mean stayed where it is and its standard error
    shrank as ``1 / sqrt(units)``, ``units`` being the gap's ``"units"`` (seeds or runs; ``runs`` where it
    has none), with new runs like the old ones: a seed each, paired with a BF16 run. A gap
    decides once its 2 SE half-width falls below its mean's distance to ``GOAL_GAP``; "missed" needs one gap
    beyond the goal to decide (the first of them), "met" needs every gap inside it to. ``None`` without a
    noise estimate, or when a deciding mean sits on the goal itself (no number of runs decides it)."""
    if any(s.get("se") is None for s in stats):
        return None
    beyond = [s for s in stats if abs(s["mean"]) > GOAL_GAP]
    needed = []
    for s in beyond or stats:
        distance = abs(abs(s["mean"]) - GOAL_GAP)
        if distance == 0.0:
            return None
        units = s.get("units", runs)
        # rounded first: a ratio that is whole in decimal is not always whole in binary
        needed.append(runs - units + math.ceil(round(units * (2 * s["se"] / distance) ** 2, 6)))
    return max(runs, min(needed) if beyond else max(needed))


def _verdict(stats: list[dict[str, Any]]) -> str:
    """ "met" / "missed" / "undecided": where ``mean +- 2 SE`` of every gap lies against ``+-GOAL_GAP``."""
    if any(s.get("se") is None for s in stats):
        return "undecided"
    bounds = [(s["mean"] - 2 * s["se"], s["mean"] + 2 * s["se"]) for s in stats]
    if all(lo >= -GOAL_GAP and hi <= GOAL_GAP for lo, hi in bounds):
        return "met"
    if any(lo > GOAL_GAP or hi < -GOAL_GAP for lo, hi in bounds):
        return "missed"
    return "undecided"


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Loss curves (raw faint, smoothed bold), smoothed relative gap to BF16, held-out losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap, ax_val) = plt.subplots(3, 1, figsize=(9, 10), sharex=True, height_ratios=(3, 1.5, 1.5))
    by_recipe: dict[str, list[str]] = {}
    for name, r in runs.items():
        by_recipe.setdefault(SAME_NUMERICS.get(r["recipe"], r["recipe"]), []).append(name)
    for i, (recipe, names) in enumerate(by_recipe.items()):  # one curve per recipe: the mean of its runs
        color = f"C{i % 10}"
        mean = mean_run(names, runs)
        steps = range(1, len(mean["losses"]) + 1)
        ax_loss.plot(steps, mean["losses"], color=color, alpha=0.15, linewidth=0.5)
        ax_loss.plot(
            steps,
            ema(mean["losses"]),
            color=color,
            label=f"{RECIPE_NAMES[recipe]} ({len(names)} run{'s' * (len(names) > 1)})",
        )
        curves = [
            [
                100 * (a / b - 1)
                for a, b in zip(ema(runs[n]["losses"]), ema(mean_run(base, runs)["losses"]), strict=True)
            ]
            for n in names
            if (base := paired_baselines(n, runs[n], runs))
        ]
        if curves:
            ax_gap.plot(
                steps, [statistics.fmean(v) for v in zip(*curves, strict=True)], color=color, label=RECIPE_NAMES[recipe]
            )
            ax_gap.fill_between(
                steps,
                [min(v) for v in zip(*curves, strict=True)],
                [max(v) for v in zip(*curves, strict=True)],
                color=color,
                alpha=0.1,
            )
        val = sorted((int(s), v) for s, v in mean["validation"].items())
        ax_val.plot([s for s, _ in val], [v for _, v in val], "o-", color=color, label=RECIPE_NAMES[recipe])
    ax_loss.set_ylabel("training loss")
    seeds = sorted({r["seed"] for r in runs.values()})
    ax_loss.set_title(f"torchtitan convergence ({runs[BASELINE]['device']}, seeds {seeds}; mean of each recipe's runs)")
    ax_loss.legend()
    ax_gap.axhspan(-100 * GOAL_GAP, 100 * GOAL_GAP, color="tab:green", alpha=0.1, label="goal +-0.25%")
    ax_gap.set_ylabel("smoothed gap to the\nsame-seed bf16 (%):\nmean, min-max of runs")
    ax_gap.legend(fontsize="x-small", loc="upper left", ncols=2)
    ax_val.set_ylabel("held-out loss")
    ax_val.set_xlabel("step")
    for ax in (ax_loss, ax_gap, ax_val):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def probe_summary(run: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per converted layer and quantity: SQNR (dB) at the first and last probe, the minimum and its step."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for probe in run.get("probes", []):
        for layer, sqnr in probe["layers"].items():
            for q, db in sqnr.items():
                s = out.setdefault(layer, {}).setdefault(q, {"first": db, "min": db, "min_step": probe["step"]})
                s["last"] = db
                if db < s["min"]:
                    s["min"], s["min_step"] = db, probe["step"]
    return out


def probe_quantities(probes: list[dict[str, Any]]) -> list[str]:
    """What a run's probes measured, in their order (``out``, ``dx``, ``dscores``, ``dw1``...)."""
    return next((list(sqnr) for p in probes for sqnr in p["layers"].values()), [])


def expert_grad_norm(norms: dict[str, list[float]]) -> list[float]:
    """One layer's expert gradient norm per step: the norm of (dw1, dw2, dw3) together."""
    return [math.sqrt(sum(v * v for v in step)) for step in zip(*norms.values(), strict=True)]


def probe_markdown(doc: dict[str, Any]) -> list[str]:
    """The probe's tables (per-layer SQNR; expert grad norms vs bf16), empty when no run was probed."""
    lines = []
    sqnr = {name: s for name, s in doc["probes"].items() if s["sqnr"]}
    if sqnr:
        quantities = probe_quantities(doc["curves"][next(iter(sqnr))]["probes"])
        lines += [
            "",
            "Per-layer numerics (`--probe-every`): SQNR in dB of the FP8-Flow routed experts against torchtitan's "
            "experts in fp32 (same routing, same current weights, a fixed random output gradient) on each MoE "
            "layer's last training input of the probe step. Each cell: first probe / last probe / min (its step).",
            "",
            "| run | layer | " + " | ".join(quantities) + " |",
            "|" + "---|" * (2 + len(quantities)),
        ]
        for name, s in sqnr.items():
            for layer, by_q in s["sqnr"].items():
                cells = [
                    f"{by_q[q]['first']:.1f} / {by_q[q]['last']:.1f} / {by_q[q]['min']:.1f} ({by_q[q]['min_step']})"
                    for q in quantities
                ]
                lines.append(f"| {name} | {layer} | " + " | ".join(cells) + " |")
    norms = {
        name: s["expert_grad_norm_last_half"] for name, s in doc["probes"].items() if s["expert_grad_norm_last_half"]
    }
    if norms:
        base = norms.get(BASELINE, {})
        lines += [
            "",
            "Expert gradient norm (w1, w2, w3 of a layer together, before clipping), mean over the last half; "
            "`vs bf16`: ratio to the bf16 run's (probed too).",
            "",
            "| run | layer | grad norm | vs bf16 |",
            "|---|---|---|---|",
        ]
        for name, by_layer in norms.items():
            for layer, v in by_layer.items():
                ratio = f"{v / base[layer]:.3f}" if layer in base and name != BASELINE else ""
                lines.append(f"| {name} | {layer} | {v:.4g} | {ratio} |")
    return lines


def plot_probes(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """SQNR vs step per quantity (one line per probed run and layer); expert grad norms per layer (EMA)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probed = {name: r for name, r in runs.items() if probe_quantities(r.get("probes", []))}
    quantities = probe_quantities(next(iter(probed.values()))["probes"]) if probed else []
    rows = math.ceil(len(quantities) / 3) + 1  # three SQNR panels a row, then the grad norms
    fig = plt.figure(figsize=(12, 3.3 * rows))
    grid = fig.add_gridspec(rows, 3)
    # color: the layer; line style: the run
    styles = ("-", "--", ":", "-.")
    for i, q in enumerate(quantities):
        ax = fig.add_subplot(grid[i // 3, i % 3])
        for j, (name, r) in enumerate(probed.items()):
            layers = sorted({layer for p in r["probes"] for layer in p["layers"]})
            for k, layer in enumerate(layers):
                points = [(p["step"], p["layers"][layer][q]) for p in r["probes"] if layer in p["layers"]]
                label = layer if len(probed) == 1 else f"{name} {layer}"
                ax.plot(*zip(*points, strict=True), marker="o", color=f"C{k}", linestyle=styles[j % 4], label=label)
        ax.set_title(f"SQNR of {q} (dB)")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize="x-small")
    ax = fig.add_subplot(grid[rows - 1, :])
    for j, (name, r) in enumerate(runs.items()):
        for k, (layer, norms) in enumerate(r.get("expert_grad_norms", {}).items()):
            smooth = ema(expert_grad_norm(norms))
            ax.plot(
                range(1, len(smooth) + 1),
                smooth,
                color=f"C{k}",
                linestyle=styles[j % 4],
                label=f"{name} {layer}",
            )
    ax.set_ylabel("expert grad norm (EMA)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interval(stats: dict[str, Any]) -> str:
    spread = f" +- {_pct(2 * stats['se']).lstrip('+')}" if stats.get("se") is not None else ""
    return f"{_pct(stats['mean'])}{spread} [{_pct(stats['min'])}, {_pct(stats['max'])}]"


def _tok_s(v: int | None) -> str:
    return "shared GPU" if v is None else f"{v:,}"


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:+.3f}%"


def noise_by_step_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The table of :func:`noise_by_step` (nothing without rows)."""
    if not rows:
        return []
    lines = [
        "",
        f"Held-out noise by step ({rows[0]['seeds']} seeds with both a BF16 and an FP8-Flow run): the BF16 loss's "
        "spread across seeds, FP8-Flow's gap to its seed's BF16 (mean, spread) and the correlation of a seed's two "
        "losses. Where the gap's spread grows with the step, a longer run decides no sooner.",
        "",
        "| step | BF16 held-out loss | BF16 spread across seeds | FP8-Flow gap | gap spread | correlation |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        corr = "" if r["correlation"] is None else f"{r['correlation']:.2f}"
        lines.append(
            f"| {r['step']} | {r['bf16_loss']:.4f} | {_pct(r['bf16_spread']).lstrip('+')} | {_pct(r['gap_mean'])} | "
            f"{_pct(r['gap_spread']).lstrip('+')} | {corr} |"
        )
    return lines


def feature_gaps_markdown(features: dict[str, dict[str, Any]]) -> list[str]:
    """The table of :func:`feature_gaps` (nothing without feature runs)."""
    if not features:
        return []
    lines = [
        "",
        "torchtitan features (recompute instead of store): each run's gap to the mean of its seed's runs of the "
        "recipe it recomputes (not BF16), mean +- 2 standard errors [min, max]; the standard error is the larger of "
        "the run-noise model's and, from "
        f"{MIN_SEEDS_FOR_SPREAD} runs on, the runs' own spread. A feature that computes the same values leaves "
        "these gaps at run noise.",
        "",
        "| feature | runs | seeds | train gap, last half | held-out gap |",
        "|---|---|---|---|---|",
    ]
    for feature, g in features.items():
        label = "pooled" if feature == "pooled" else RECIPE_NAMES[feature]
        cells = [_interval(g[k]) for k in GAP_KEYS]
        lines.append(f"| {label} | {g['runs']} | {g['seeds']} | {cells[0]} | {cells[1]} |")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    """The report's markdown: one row per run, gaps to BF16 as signed percentages."""
    lines = [
        "# convergence",
        "",
        f"{doc['device']}; {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}; {doc['date']}",
        f"Commands: {'; '.join(f'`{c}`' for c in doc['commands'])}.",
        "",
        doc["notes"],
        "",
        "| run | recipe | seed | vs | final loss (EMA) | held-out | train gap, last half | mean abs step gap | "
        "held-out gap | tok/s | tok/s vs bf16 | peak GiB | epochs | goal |",
        "|" + "---|" * 14,
    ]
    for name, r in doc["runs"].items():
        goal = {True: "met", False: "missed"}.get(r.get("meets_goal"), "")
        lines.append(
            f"| {name} | {RECIPE_NAMES[r['recipe']]} | {r['seed']} | {r['baseline'] or ''} | "
            f"{r['final_loss_smoothed']} | {r['final_heldout_loss']} | "
            f"{_pct(r.get('train_gap_last_half'))} | {_pct(r.get('mean_abs_step_gap_last_half'))} | "
            f"{_pct(r.get('heldout_gap_final'))} | {_tok_s(r['tokens_per_s'])} | {r['speedup_vs_bf16'] or ''} | "
            f"{r['peak_mem_gib']} | {r['epochs']} | {goal} |"
        )
    noted = [f"- {name}: {r['note']}" for name, r in doc["runs"].items() if "note" in r]
    lines += ["", "Notes on runs:", "", *noted] if noted else []
    noise = doc["run_noise"]
    sigmas = ", ".join(
        f"{label} {_pct(noise[k]['sigma']).lstrip('+')} ({noise[k]['dof']} degrees of freedom)"
        for k, label in zip(GAP_KEYS, ("training", "held-out"), strict=True)
    )
    lines += [
        "",
        "Gaps by recipe: mean +- 2 standard errors [min, max of the runs]. The standard error is the larger of "
        "two estimates: from the noise of one run's gap, pooled over the runs that repeat a recipe and seed "
        f"({sigmas}), and, from {MIN_SEEDS_FOR_SPREAD} seeds on, from the spread of the per-seed mean gaps over "
        "sqrt(seeds), which also holds where the recipe's effect varies from seed to seed. Goal: the "
        f"+-2 SE interval inside +-{100 * GOAL_GAP}% for both gaps (met), outside it for either (missed), or "
        "neither (undecided: more runs). The bf16 row is the noise itself (same-seed repeats, other seeds). "
        "Runs to decide: for an undecided recipe, the runs in all at which the verdict would come if both means "
        "stayed put and the standard errors shrank as 1/sqrt(runs) or 1/sqrt(seeds) (each new run on a seed of its own with a "
        "BF16 run beside it).",
        "",
        "| recipe | runs | seeds | train gap, last half | held-out gap | goal | runs to decide |",
        "|---|---|---|---|---|---|---|",
    ]
    for recipe, g in doc["gaps_by_recipe"].items():
        cells = [_interval(g[k]) for k in GAP_KEYS]
        decide = g.get("runs_to_decide", "")
        lines.append(
            f"| {RECIPE_NAMES[recipe]} | {g['runs']} | {g['seeds']} | {cells[0]} | {cells[1]} | {g.get('goal', '')} "
            f"| {'' if decide is None else decide} |"
        )
    lines += feature_gaps_markdown(doc.get("feature_gaps", {}))
    lines += noise_by_step_markdown(doc.get("noise_by_step", []))
    lines += ["", "![loss curves](convergence.png)"]
    if any(s["sqnr"] or s["expert_grad_norm_last_half"] for s in doc["probes"].values()):
        lines += probe_markdown(doc) + ["", f"![per-layer numerics]({PROBE_PNG})"]
    return "\n".join(lines) + "\n"


def report(runs_dir: Path, results_dir: Path) -> dict[str, Any]:
    """Merge the runs of ``runs_dir`` into ``results_dir/convergence.{json,md,png}``; return the JSON document."""
    runs = load_runs(runs_dir)
    base = runs[BASELINE]
    corpus = base["corpus"]
    notes = (
        f"torchtitan Trainer, fp8flow_gpu flavor unless the flags say otherwise, {len(base['losses'])} steps of "
        f"{base['tokens_per_step']:,} tokens; source corpus {corpus['train_tokens'] / 1e6:.1f} M training tokens "
        f"({corpus['epochs']} epochs), held-out {corpus['heldout_tokens'] / 1e6:.2f} M tokens (no shared file), "
        f"fingerprint {corpus['fingerprint']}. Gaps are relative to the mean of the BF16 runs of the same seed "
        f"(column vs), signed (+: higher loss): the training gap compares last-half mean losses, the held-out gap "
        f"the last evaluation. A BF16 run is compared with the BF16 runs of its seed before it (a repeat: run-to-run "
        f"noise), else with `bf16` (seed 0: what the initialization alone moves). Goal: |gap| <= {100 * GOAL_GAP}% "
        f"for both, judged per recipe over its runs (the goal column of a single run says only where that run "
        f"fell). tok/s: median step after {WARMUP_STEPS} steps; 'shared GPU': the run trained beside others."
    )
    summary = summarize(runs)
    doc = {
        "benchmark": "convergence",
        "device": base["device"],
        "versions": base["versions"],
        "commands": [r["command"] for r in runs.values()],
        "date": max(r["date"] for r in runs.values()),
        "notes": notes,
        "corpus": corpus,
        "runs": summary,
        "gaps_by_recipe": gaps_by_recipe(summary),
        "run_noise": run_noise(summary),
        "noise_by_step": noise_by_step(summary, runs),
        "feature_gaps": feature_gaps(summary, runs),
        "curves": {
            name: {
                "loss": r["losses"],
                "grad_norm": r["grad_norms"],
                "heldout": r["validation"],
                "probes": r.get("probes", []),
                "expert_grad_norms": r.get("expert_grad_norms", {}),
            }
            for name, r in runs.items()
        },
        "probes": {
            name: {
                "every": r.get("probe_every", 0),
                "sqnr": probe_summary(r),
                "expert_grad_norm_last_half": {
                    layer: statistics.fmean(v[len(v) // 2 :])
                    for layer, v in (
                        (layer, expert_grad_norm(n)) for layer, n in r.get("expert_grad_norms", {}).items()
                    )
                },
            }
            for name, r in runs.items()
        },
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "convergence.json").write_text(json.dumps(doc, indent=1) + "\n")
    (results_dir / "convergence.md").write_text(markdown(doc))
    plot(runs, results_dir / "convergence.png")
    if any(r.get("probes") or r.get("expert_grad_norms") for r in runs.values()):
        plot_probes(runs, results_dir / PROBE_PNG)
    print(markdown(doc))
    return doc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", choices=sorted(RECIPE_NAMES), help="train one recipe (writes <runs-dir>/<name>.json)")
    p.add_argument("--report", action="store_true", help="merge the runs into convergence.{json,md,png}")
    p.add_argument("--name", help="run name (default: the recipe); e.g. bf16_repeat for the noise floor")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-freq", type=int, default=250, help="held-out loss every this many steps (and at step 1)")
    p.add_argument(
        "--probe-every",
        type=int,
        default=0,
        metavar="N",
        help="every N steps (and at step 1) measure each FP8-Flow MoE layer's SQNR vs fp32 on its last training "
        "input; record the expert grad norms every step (0: off)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--corpus", type=Path, help="source corpus directory (default: $FP8FLOW_ASSETS/pysrc, built if missing)"
    )
    p.add_argument(
        "--shared-gpu",
        type=int,
        default=1,
        metavar="N",
        help="this run shares its GPU with N - 1 others started beside it (`.ci/gpu OUT convergence`): its loss "
        "curve is unaffected, its tokens/s measures the sharing and is left out of the report",
    )
    p.add_argument("--runs-dir", type=Path, default=RESULTS_DIR / "convergence_runs")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "extra", nargs=argparse.REMAINDER, help="after --: more torchtitan flags (e.g. -- --compile.no-enable)"
    )
    args = p.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    if args.recipe is not None and args.report:
        p.error("give one of --recipe or --report, not both")
    if args.steps < 2:
        p.error(f"--steps must be at least 2, got {args.steps}")
    if args.shared_gpu < 1:
        p.error(f"--shared-gpu must be at least 1, got {args.shared_gpu}")
    if args.probe_every < 0:
        p.error(f"--probe-every must be 0 (off) or a number of steps, got {args.probe_every}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run one recipe or write the report (see the module docstring)."""
    args = parse_args(argv)
    if args.report:
        report(args.runs_dir, args.results_dir)
    elif args.recipe is not None:
        run_one(args)
    else:  # e.g. `.ci/gpu OUT bench` running every script with no arguments: a long run must be asked for
        print("bench_convergence: nothing run; give --recipe NAME (one ~5-minute run) or --report (see --help)")


if __name__ == "__main__":
    main()
