"""benchmarks/bench_convergence.py on the CPU: 3 steps of torchtitan's debugmodel per recipe, then the report.

The runs train on a tiny source corpus (the standard library's ``email`` package) so nothing large
is built; what is checked is the plumbing: same data and seed give the same first loss, the held-out
loss is recorded at the validation steps, and the report's gaps, table and PNG come out of the runs.
Both recipes run with ``--probe-every 2``, FP8-Flow once more without it: the probe leaves the losses
bit-identical, its records land in the run JSON, and the report shows them (and works without them).
"""

from __future__ import annotations

import email
import json
import math
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("datasets")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_convergence as bc  # noqa: E402

from fp8flow_ao import corpus as C  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("convergence")
    spec = C.CorpusSpec(train_tokens=20_000, heldout_tokens=3_000, heldout_permille=250)
    C.build_source_corpus(tmp / "corpus", spec, {"stdlib": Path(email.__file__).parent}, with_pydoc=False)
    common = ["--device", "cpu", "--steps", "3", "--val-freq", "2", "--corpus", str(tmp / "corpus")]
    for recipe in ("bf16", "fp8flow"):
        bc.main(["--recipe", recipe, *common, "--probe-every", "2", "--runs-dir", str(tmp / "runs")])
    for recipe in ("fp8flow", *bc.FEATURE_OF):
        bc.main(["--recipe", recipe, *common, "--runs-dir", str(tmp / "unprobed")])
    bc.main(["--report", "--runs-dir", str(tmp / "runs"), "--results-dir", str(tmp / "results")])
    return tmp / "runs", tmp / "results"


def test_runs_record_losses_and_heldout_on_the_same_data(runs: tuple[Path, Path]) -> None:
    runs_dir, _ = runs
    bf16, fp8 = (json.loads((runs_dir / f"{n}.json").read_text()) for n in ("bf16", "fp8flow"))
    for r in (bf16, fp8):
        assert len(r["losses"]) == len(r["grad_norms"]) == len(r["step_seconds"]) == 3
        assert all(map(math.isfinite, r["losses"] + r["grad_norms"]))
        assert set(r["validation"]) == {"1", "2"}, "held-out loss at step 1 and every --val-freq steps"
    assert "--model.converters" in fp8["torchtitan_flags"] and "--model.converters" not in bf16["torchtitan_flags"]
    assert fp8["losses"][0] == pytest.approx(bf16["losses"][0], rel=1e-3), "same seed, same first batch"
    assert fp8["losses"] != bf16["losses"], "the fp8flow run ran the FP8 path"
    assert fp8["corpus"] == bf16["corpus"] and fp8["corpus"]["train_tokens"] >= 20_000


def test_probe_leaves_training_bit_identical(runs: tuple[Path, Path]) -> None:
    runs_dir, _ = runs
    probed, plain = (json.loads((d / "fp8flow.json").read_text()) for d in (runs_dir, runs_dir.parent / "unprobed"))
    assert probed["probe_every"] == 2 and plain["probe_every"] == 0 and plain["probes"] == []
    for key in ("losses", "grad_norms", "validation"):
        assert probed[key] == plain[key], key


@pytest.mark.parametrize("feature", sorted(bc.FEATURE_OF))
def test_a_feature_that_recomputes_trains_as_fp8flow_on_the_cpu(runs: tuple[Path, Path], feature: str) -> None:
    """recompute_experts recomputes the experts from their FP8 input: bit for bit the plain FP8-Flow run on the
    CPU's deterministic kernels. Activation checkpointing moves the losses by float rounding alone: torchtitan's
    own BF16 model under ``activation_checkpoint.mode = "full"`` moved step 3's loss by 4.5e-6 (relative) here."""
    unprobed = runs[0].parent / "unprobed"
    run, plain = (json.loads((unprobed / f"{n}.json").read_text()) for n in (feature, bc.FEATURE_OF[feature]))
    assert run["torchtitan_flags"] != plain["torchtitan_flags"], "the feature's flags reached torchtitan"
    rel = 0.0 if feature == "fp8flow_recompute" else 2e-5
    for key in ("losses", "grad_norms"):
        assert run[key] == pytest.approx(plain[key], rel=rel, abs=0.0), key
    assert run["validation"].keys() == plain["validation"].keys()
    assert list(run["validation"].values()) == pytest.approx(list(plain["validation"].values()), rel=rel, abs=0.0)
    assert run["losses"][0] == plain["losses"][0], "same seed, same first batch, same forward"


def test_probe_records_per_layer_sqnr_and_expert_grad_norms(runs: tuple[Path, Path]) -> None:
    runs_dir, _ = runs
    bf16, fp8 = (json.loads((runs_dir / f"{n}.json").read_text()) for n in ("bf16", "fp8flow"))
    assert [p["step"] for p in fp8["probes"]] == [1, 2], "step 1 and every --probe-every steps"
    layers = list(fp8["expert_grad_norms"])
    assert len(layers) >= 2 and all(fqn.endswith(".moe") for fqn in layers)
    for probe in fp8["probes"]:
        assert list(probe["layers"]) == layers, "every converted MoE layer"
        for fqn, sqnr in probe["layers"].items():
            assert list(sqnr) == ["out", "dx", "dscores", "dw1", "dw2", "dw3"]
            assert all(math.isfinite(v) and v > 15 for v in sqnr.values()), (probe["step"], fqn, sqnr)
    assert bf16["probes"] == [] and list(bf16["expert_grad_norms"]) == layers, "BF16: grad norms only"
    for r in (bf16, fp8):
        for norms in r["expert_grad_norms"].values():
            assert list(norms) == ["w1", "w2", "w3"]
            assert all(len(v) == 3 and all(math.isfinite(x) and x > 0 for x in v) for v in norms.values())


def test_report_without_probes(tmp_path: Path, runs: tuple[Path, Path]) -> None:
    """Runs recorded before --probe-every existed (the committed ones) have no probe fields."""
    runs_dir, _ = runs
    for name in ("bf16", "fp8flow"):
        r = json.loads((runs_dir / f"{name}.json").read_text())
        old = {k: v for k, v in r.items() if k not in ("probe_every", "probes", "expert_grad_norms")}
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / f"{name}.json").write_text(json.dumps(old))
    bc.report(tmp_path / "runs", tmp_path / "results")
    md = (tmp_path / "results" / "convergence.md").read_text()
    assert "| fp8flow | FP8-Flow blockwise |" in md and "Per-layer numerics" not in md
    assert not (tmp_path / "results" / bc.PROBE_PNG).exists()


def test_report_merges_runs_into_json_md_png(runs: tuple[Path, Path]) -> None:
    _, results = runs
    doc = json.loads((results / "convergence.json").read_text())
    assert set(doc["runs"]) == {"bf16", "fp8flow"}
    fp8 = doc["runs"]["fp8flow"]
    assert abs(fp8["train_gap_last_half"]) < 0.02 and abs(fp8["heldout_gap_final"]) < 0.02
    assert set(fp8["heldout_gap_by_step"]) == {"1", "2"} and isinstance(fp8["meets_goal"], bool)
    assert len(doc["curves"]["fp8flow"]["loss"]) == 3
    md = (results / "convergence.md").read_text()
    assert "| fp8flow | FP8-Flow blockwise |" in md and "convergence.png" in md
    assert (results / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    layers = list(doc["curves"]["fp8flow"]["expert_grad_norms"])
    for layer in layers:  # the probe's SQNR table: fp8flow's layers; the grad-norm table: both runs, fp8 vs bf16
        assert md.count(f"| fp8flow | {layer} |") == 2 and md.count(f"| bf16 | {layer} |") == 1
    assert doc["probes"]["fp8flow"]["sqnr"][layers[0]]["dx"]["min_step"] in (1, 2)
    assert (results / bc.PROBE_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and bc.PROBE_PNG in md


def test_report_refuses_runs_on_other_data_or_without_bf16(tmp_path: Path, runs: tuple[Path, Path]) -> None:
    runs_dir, _ = runs
    fp8 = json.loads((runs_dir / "fp8flow.json").read_text())
    (tmp_path / "fp8flow.json").write_text(json.dumps(fp8))
    with pytest.raises(ValueError, match="no bf16.json"):
        bc.load_runs(tmp_path)
    other = dict(fp8, name="bf16", corpus=dict(fp8["corpus"], fingerprint="0" * 16))
    (tmp_path / "bf16.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different corpora"):
        bc.load_runs(tmp_path)
    with pytest.raises(ValueError, match="same --steps"):
        bc.gaps(dict(fp8, losses=fp8["losses"][:2]), fp8)


def test_ema_and_gaps() -> None:
    assert bc.ema([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0]), "bias-corrected: no pull toward 0"
    base = {"name": "b", "losses": [4.0, 2.0, 2.0, 2.0], "validation": {"1": 4.0, "4": 2.0}}
    run = {"name": "r", "losses": [4.0, 2.0, 2.02, 1.98], "validation": {"1": 4.0, "4": 2.01}}
    g = bc.gaps(run, base)
    assert g["train_gap_last_half"] == pytest.approx(0.0) and g["mean_abs_step_gap_last_half"] == pytest.approx(0.01)
    assert g["heldout_gap_final"] == pytest.approx(0.005)
    with pytest.raises(SystemExit):
        bc.parse_args(["--recipe", "bf16", "--report"])


def _run(name: str, recipe: str, seed: int, last: float, val: float | None = None, date: str = "2026-11-23") -> dict:
    """A synthetic 4-step run record trained on ``date``: its last loss ``last``, its held-out loss at step 4
    ``val`` (or ``last``)."""
    return {
        "name": name, "recipe": recipe, "seed": seed, "date": date, "losses": [4.0, 2.0, 2.0, last],
        "validation": {"1": 4.0, "4": last if val is None else val}, "tokens_per_s": 100, "peak_mem_gib": None,
        "corpus": {"epochs": 1.0},
    }  # fmt: skip


def test_runs_pair_with_their_seeds_bf16_run_and_bf16_seeds_form_the_noise_floor() -> None:
    run = _run
    runs = {
        "bf16": run("bf16", "bf16", 0, 2.0, 2.0),
        "bf16_seed1": run("bf16_seed1", "bf16", 1, 2.2, 2.1),
        "fp8flow": run("fp8flow", "fp8flow", 0, 2.02, 2.02),
        "fp8flow_seed1": run("fp8flow_seed1", "fp8flow", 1, 2.2, 2.1),
        "fp8flow_seed2": run("fp8flow_seed2", "fp8flow", 2, 2.06, 2.0),
        "ablation": run("ablation", "fp8flow_bf16_backward", 0, 2.0, 2.0),
        "fc1": run("fc1", "fp8flow_bf16_fc1_dgrad", 0, 2.0, 2.0) | {"note": "an earlier implementation"},
        "shared": run("shared", "fp8flow_emulated_sr_fc1_dgrad", 0, 2.0, 2.0) | {"shared_gpu": 2},
    }
    summary = bc.summarize(runs)
    # an FP8 run against its own seed's BF16 run; without one, against bf16; BF16 seeds against bf16
    assert [summary[n]["baseline"] for n in runs] == [
        None,
        "bf16",
        "bf16",
        "bf16_seed1",
        "bf16",
        "bf16",
        "bf16",
        "bf16",
    ]
    # a run that shared its GPU keeps its gaps but reports no speed (its tokens/s measured the sharing)
    assert summary["shared"]["tokens_per_s"] is None and summary["shared"]["speedup_vs_bf16"] is None
    assert summary["shared"]["train_gap_last_half"] == pytest.approx(0.0) and "meets_goal" not in summary["shared"]
    assert summary["fp8flow"]["tokens_per_s"] == 100 and summary["fp8flow"]["speedup_vs_bf16"] == 1.0
    # the goal is for recipes to train with: an ablation is measured against BF16 but has none
    assert summary["fp8flow"]["meets_goal"] is False and "meets_goal" not in summary["ablation"]
    assert summary["fc1"]["meets_goal"] is True and summary["fc1"]["note"] == "an earlier implementation"
    assert summary["fp8flow_seed1"]["train_gap_last_half"] == pytest.approx(0.0)
    assert summary["fp8flow"]["train_gap_last_half"] == pytest.approx(0.01 / 2)
    by = bc.gaps_by_recipe(summary)
    assert (
        set(by)
        == {"bf16", "fp8flow", "fp8flow_bf16_backward", "fp8flow_bf16_fc1_dgrad", "fp8flow_emulated_sr_fc1_dgrad"}
        and by["fp8flow"]["runs"] == 3
        and by["fp8flow"]["seeds"] == [0, 1, 2]
    )
    assert by["fp8flow"]["train_gap_last_half"]["mean"] == pytest.approx((0.005 + 0.0 + 0.015) / 3)
    assert by["fp8flow"]["heldout_gap_final"]["max"] == pytest.approx(0.01)
    assert by["bf16"]["train_gap_last_half"]["min"] == pytest.approx(0.05)


def test_a_bf16_repeat_is_compared_with_the_runs_trained_before_it_not_named_before_it() -> None:
    runs = {
        "bf16": _run("bf16", "bf16", 0, 2.0),
        "bf16_r3": _run("bf16_r3", "bf16", 0, 2.03, date="2026-11-25"),  # sorts before bf16_repeat, ran after it
        "bf16_repeat": _run("bf16_repeat", "bf16", 0, 2.02),
    }
    s = bc.summarize(runs)
    assert s["bf16_repeat"]["baseline"] == "bf16"
    assert s["bf16_r3"]["baseline"] == "bf16+bf16_repeat"


def test_baselines_average_a_seeds_bf16_runs_and_repeats_measure_the_noise() -> None:
    """An FP8 run is compared with the mean of its seed's BF16 runs; a BF16 repeat with the earlier runs of
    its seed (its gap is noise). Repeats of a recipe and seed pool into one per-run noise ``sigma``; a
    recipe's standard error counts its runs and its baselines' runs; the goal's verdict reads mean +- 2 SE."""
    run = _run
    runs = {
        "bf16": run("bf16", "bf16", 0, 2.0),
        "bf16_repeat": run("bf16_repeat", "bf16", 0, 2.02),
        "bf16_seed1": run("bf16_seed1", "bf16", 1, 2.2),
        "fp8flow": run("fp8flow", "fp8flow", 0, 2.04),
        "fp8flow_repeat": run("fp8flow_repeat", "fp8flow", 0, 2.06),
        "eager": run("eager", "fp8flow_eager_experts", 1, 2.22),
    }
    s = bc.summarize(runs)
    assert [s[n]["baseline"] for n in runs] == [
        None,
        "bf16",
        "bf16",
        "bf16+bf16_repeat",
        "bf16+bf16_repeat",
        "bf16_seed1",
    ]
    assert s["fp8flow"]["train_gap_last_half"] == pytest.approx((2.0 + 2.04) / (2.0 + 2.01) - 1)  # vs the mean run
    assert s["fp8flow"]["heldout_gap_final"] == pytest.approx(2.04 / 2.01 - 1)
    assert s["eager"]["numerics"] == "fp8flow"  # bit-identical numerics: pooled with fp8flow
    noise = bc.run_noise(s)["heldout_gap_final"]
    # fp8flow seed 0: two gaps around their mean (1 dof); bf16_repeat: its gap / (1 + 1/1) (1 dof)
    gaps0 = [2.04 / 2.01 - 1, 2.06 / 2.01 - 1]
    squares = sum((g - sum(gaps0) / 2) ** 2 for g in gaps0) + (2.02 / 2.0 - 1) ** 2 / 2
    assert noise["dof"] == 2 and noise["sigma"] == pytest.approx(math.sqrt(squares / 2))
    by = bc.gaps_by_recipe(s)
    assert by["fp8flow"]["runs"] == 3 and by["fp8flow"]["seeds"] == [0, 1]
    se = by["fp8flow"]["heldout_gap_final"]["se"]  # n=3: 2 runs on 2 baseline runs, 1 run on 1
    assert se == pytest.approx(noise["sigma"] * math.sqrt(1 / 3 + (2 / 3) ** 2 / 2 + (1 / 3) ** 2 / 1))
    assert "se" not in by["bf16"]["heldout_gap_final"] and "goal" not in by["bf16"]
    assert bc._verdict([{"mean": 0.001, "se": 0.0005}] * 2) == "met"
    assert bc._verdict([{"mean": 0.001, "se": 0.0005}, {"mean": 0.004, "se": 0.0005}]) == "missed"
    assert bc._verdict([{"mean": 0.002, "se": 0.001}] * 2) == "undecided"
    assert bc._verdict([{"mean": 0.001}] * 2) == "undecided"  # no noise estimate: no verdict


def test_runs_to_decide_projects_the_standard_error() -> None:
    # mean 0.1%, 2 SE = 0.3% over 10 runs: the half-width must shrink to 0.15%, so 4x the runs
    assert bc._runs_to_decide([{"mean": 0.001, "se": 0.0015}] * 2, 10) == 40
    # the farther gap decides nothing on its own: the nearer one sets the count
    assert bc._runs_to_decide([{"mean": 0.001, "se": 0.0015}, {"mean": 0.0015, "se": 0.0015}], 10) == 90
    # above the goal: runs until the interval clears it (mean 0.4%, 2 SE 0.3% -> half-width 0.15%)
    assert bc._runs_to_decide([{"mean": -0.004, "se": 0.0015}] * 2, 10) == 40
    # one gap beyond the goal decides "missed" alone, however long the other would take to be "met"
    assert bc._runs_to_decide([{"mean": 0.0024, "se": 0.0015}, {"mean": 0.004, "se": 0.0015}], 10) == 40
    assert bc._runs_to_decide([{"mean": 0.0025, "se": 0.001}] * 2, 10) is None  # on the goal itself
    assert bc._runs_to_decide([{"mean": 0.001}] * 2, 10) is None  # no noise estimate


_FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python3 in .ci/gpu: a GPU count for its query, a log line per training run; a run named "slow"
# never ends, any other writes its result file.
case "$*" in
  *device_count*) echo "${FAKE_GPUS:-1}" ;;
  *"--name slow"*) exec sleep 60 ;;
  *bench_convergence.py*)
    echo "${CUDA_VISIBLE_DEVICES:-unset} $*" >>"$RUN_LOG"
    args="$*"; name=${args#*--name }; name=${name%% *}
    mkdir -p "$FP8FLOW_RESULTS_DIR/convergence_runs"; echo {} >"$FP8FLOW_RESULTS_DIR/convergence_runs/$name.json" ;;
esac
"""


def _run_ci_gpu_convergence(tmp_path: Path, env: dict, runs: list[str]) -> subprocess.CompletedProcess:
    """``.ci/gpu OUT convergence RUNS`` from a copy of it, with python3 faked (its log: ``tmp_path/runs.log``)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "gpu", tmp_path / ".ci" / "gpu")  # it runs from its checkout's root: no wheels there
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    run_env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "GPUS", "CONVERGENCE_TIMEOUT")}
    run_env.update(env, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RUN_LOG=str(tmp_path / "runs.log"))
    return subprocess.run(
        ["bash", str(tmp_path / ".ci" / "gpu"), str(tmp_path / "out"), "convergence", *runs],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # two GPUs, three runs: runs 1 and 3 share GPU 0, run 2 has GPU 1 to itself
        ({"FAKE_GPUS": "2"}, [("0", "2"), ("1", "1"), ("0", "2")]),
        # the GPUs the caller was given, by their names, not their positions
        ({"FAKE_GPUS": "2", "CUDA_VISIBLE_DEVICES": "4,5"}, [("4", "2"), ("5", "1"), ("4", "2")]),
        # GPUS=1 on a two-GPU machine: every run on the first, each told that three share it
        ({"FAKE_GPUS": "2", "GPUS": "1"}, [("0", "3"), ("0", "3"), ("0", "3")]),
    ],
)
def test_ci_gpu_spreads_convergence_runs_over_the_gpus(tmp_path: Path, env: dict, expected: list) -> None:
    """``.ci/gpu OUT convergence ...`` puts run I on GPU (I-1) mod N and tells each run how many share its GPU
    (``--shared-gpu``, which keeps a shared run's tokens/s out of the report); python3 is faked."""
    runs = [f"--recipe bf16 --name r{i} --seed {i}" for i in (1, 2, 3)]
    done = _run_ci_gpu_convergence(tmp_path, env, runs)
    assert done.returncode == 0, done.stderr
    lines = sorted((tmp_path / "runs.log").read_text().splitlines(), key=lambda line: line.split("--name ")[1])
    got = [(line.split()[0], line.split("--shared-gpu ")[1].split()[0]) for line in lines]
    assert got == expected, lines
    assert all(f"--name r{i} " in line for i, line in zip((1, 2, 3), lines, strict=True)), lines


def test_ci_gpu_convergence_stops_runs_at_the_call_deadline_and_keeps_what_finished(tmp_path: Path) -> None:
    """A run still going at ``CALL_DEADLINE`` seconds is stopped (the call fails), and the runs that finished
    are in ``results.tgz``: a device call cut off at its limit would otherwise lose every run."""
    runs = ["--recipe bf16 --name fast --seed 1", "--recipe bf16 --name slow --seed 2"]
    start = time.monotonic()
    done = _run_ci_gpu_convergence(tmp_path, {"CALL_DEADLINE": "3"}, runs)
    assert done.returncode == 1, done.stdout
    assert time.monotonic() - start < 30  # the slow run sleeps 60 s
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        assert tar.getnames() == ["results", "results/convergence_runs", "results/convergence_runs/fast.json"]


def test_the_standard_error_is_the_larger_of_run_noise_and_the_spread_of_seeds() -> None:
    rows = [{"seed": s, "gap": g} for s, g in [(0, 0.01), (0, 0.03), (1, -0.01), (2, 0.0), (3, 0.02), (4, 0.04)]]
    # seed 0's two runs count once, at their mean
    means = [0.02, -0.01, 0.0, 0.02, 0.04]
    assert bc._seed_standard_error(rows, "gap") == pytest.approx(statistics.stdev(means) / math.sqrt(5))
    assert bc._seed_standard_error(rows[:-1], "gap") is None  # 4 seeds: too few to estimate a spread
    # projected in seeds where the seeds' spread sets the error: 5 seeds in 6 runs need 20 seeds, i.e. 21 runs
    assert bc._runs_to_decide([{"mean": 0.001, "se": 0.0015, "units": 5}] * 2, 6) == 21


def test_a_seed_spread_wider_than_the_run_noise_widens_the_interval() -> None:
    # run noise from a same-seed FP8 repeat: tiny; the seeds' gaps spread 1%: the interval follows the seeds
    summary = {
        f"fp8flow_seed{s}": {
            "recipe": "fp8flow",
            "numerics": "fp8flow",
            "seed": s,
            "baseline": f"bf16_seed{s}",
            "baseline_runs": 1,
            "train_gap_last_half": g,
            "heldout_gap_final": g,
        }
        for s, g in enumerate([0.01, -0.01, 0.012, -0.008, 0.0])
    }
    summary["fp8flow_seed0_r2"] = {
        **summary["fp8flow_seed0"],
        "train_gap_last_half": 0.0101,
        "heldout_gap_final": 0.0101,
    }
    by = bc.gaps_by_recipe(summary)["fp8flow"]["train_gap_last_half"]
    assert by["se_seeds"] > 10 * by["se_model"] and by["se"] == by["se_seeds"] and by["units"] == 5
    assert bc.gaps_by_recipe(summary)["fp8flow"]["goal"] != "met"


def test_feature_runs_are_compared_with_their_seed_s_fp8flow_runs_and_pooled() -> None:
    runs = {
        "bf16": _run("bf16", "bf16", 0, 2.0),
        "bf16_repeat": _run("bf16_repeat", "bf16", 0, 2.02),  # run noise: sigma from this repeat
        "fp8flow": _run("fp8flow", "fp8flow", 0, 2.04, 2.04),
        "fp8flow_r2": _run("fp8flow_r2", "fp8flow", 0, 2.06, 2.02),
        "fp8flow_seed1": _run("fp8flow_seed1", "fp8flow", 1, 2.1),
        "rec": _run("rec", "fp8flow_recompute", 0, 2.05, 2.06),
        "rec_seed1": _run("rec_seed1", "fp8flow_recompute", 1, 2.08),
        "full": _run("full", "fp8flow_ac_full", 1, 2.12),
        "orphan": _run("orphan", "fp8flow_ac_selective", 7, 2.0),  # no FP8-Flow run of seed 7: left out
    }
    s = bc.summarize(runs)
    assert s["rec"]["baseline"] == "bf16+bf16_repeat", "against BF16 like every FP8 run"
    f = bc.feature_gaps(s, runs)
    assert set(f) == {"fp8flow_recompute", "fp8flow_ac_full", "pooled"}
    rec = f["fp8flow_recompute"]
    assert rec["runs"] == 2 and rec["seeds"] == [0, 1]
    # seed 0 against the mean of its two FP8-Flow runs; seed 1 against its one
    train = [(2.0 + 2.05) / (2.0 + 2.05) - 1, (2.0 + 2.08) / (2.0 + 2.1) - 1]
    assert rec["train_gap_last_half"]["mean"] == pytest.approx(statistics.fmean(train))
    assert rec["heldout_gap_final"]["min"] == pytest.approx(2.08 / 2.1 - 1)
    assert rec["heldout_gap_final"]["max"] == pytest.approx(2.06 / 2.03 - 1)
    sigma = bc.run_noise(s)["train_gap_last_half"]["sigma"]
    assert rec["train_gap_last_half"]["se"] == pytest.approx(sigma * math.sqrt((1 + 1 / 2) + (1 + 1 / 1)) / 2)
    assert f["pooled"]["runs"] == 3 and f["pooled"]["seeds"] == [0, 1]
    unscored = {**runs, "full": {**runs["full"], "validation": {}}}  # a run that never evaluated
    f = bc.feature_gaps(s, unscored)
    assert f["fp8flow_ac_full"]["heldout_gap_final"] == {"mean": None, "min": None, "max": None, "se": None}
    assert f["fp8flow_ac_full"]["train_gap_last_half"]["mean"] is not None and f["pooled"]["heldout_gap_final"]["se"]
    table = "\n".join(bc.feature_gaps_markdown(f))
    assert "| FP8-Flow, activation checkpointing full | 1 | [1] |" in table
    assert "| FP8-Flow, recompute_experts | 2 | [0, 1] |" in table and "| pooled | 3 |" in table
    assert bc.feature_gaps(s, {n: r for n, r in runs.items() if n not in ("full", "orphan")}).keys() == {
        "fp8flow_recompute"
    }, "one feature: nothing to pool"


def test_noise_by_step_pairs_each_seed_s_two_recipes_at_every_evaluation() -> None:
    bf16 = [2.0, 2.1, 1.9, 2.05, 1.95]
    fp8 = [2.02, 2.1, 1.92, 2.0, 1.96]
    summary, runs = {}, {}
    for seed, (b, f) in enumerate(zip(bf16, fp8, strict=True)):
        for recipe, loss in ((bc.BASELINE, b), ("fp8flow", f)):
            name = f"{recipe}_seed{seed}"
            summary[name] = {"numerics": recipe, "seed": seed}
            runs[name] = {"validation": {"1": 8.0, "250": loss}}
    # a second FP8-Flow run of seed 0 counts at the seed's mean; an ablation is left out
    summary["fp8flow_seed0_r2"] = {"numerics": "fp8flow", "seed": 0}
    runs["fp8flow_seed0_r2"] = {"validation": {"1": 8.0, "250": 2.04}}
    summary["ablation"] = {"numerics": "fp8flow_bf16_backward", "seed": 1}
    runs["ablation"] = {"validation": {"1": 8.0, "250": 9.9}}
    rows = bc.noise_by_step(summary, runs)
    assert [r["step"] for r in rows] == [1, 250] and rows[0]["gap_spread"] == 0.0 and rows[0]["correlation"] is None
    fp8[0] = 2.03
    gaps = [f / b - 1 for f, b in zip(fp8, bf16, strict=True)]
    last = rows[1]
    assert last["seeds"] == 5 and last["bf16_loss"] == pytest.approx(statistics.fmean(bf16))
    assert last["bf16_spread"] == pytest.approx(statistics.stdev(bf16) / statistics.fmean(bf16))
    assert last["gap_mean"] == pytest.approx(statistics.fmean(gaps))
    assert last["gap_spread"] == pytest.approx(statistics.stdev(gaps))
    assert last["correlation"] == pytest.approx(statistics.correlation(bf16, fp8))
    assert "| 250 | 2.0000 |" in "\n".join(bc.noise_by_step_markdown(rows))
    del summary["fp8flow_seed4"]  # 4 seeds with both recipes: too few
    assert bc.noise_by_step(summary, runs) == [] and bc.noise_by_step_markdown([]) == []
