"""Argument handling and run plans of benchmarks/bench_distributed_torchtitan.py (the multi-GPU runner), on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_distributed_torchtitan as bench  # noqa: E402


def _flag(args: tuple[str, ...], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_plan_uses_every_gpu_for_fsdp_and_ep(tmp_path, gpus):
    runs = bench.plan_runs(list(bench.RUN_GROUPS), gpus, tmp_path)
    names = [r.name for r in runs]
    assert len(names) == len(set(names)), "run names must be unique (they name the records)"
    for run in runs:
        assert _flag(run.args, "--parallelism.data_parallel_shard_degree") == str(gpus)
        ep = _flag(run.args, "--parallelism.expert_parallel_degree")
        assert ep == (None if run.name.startswith("fsdp") else str(gpus)), run.name
        assert _flag(run.args, "--job.dump_folder").startswith(str(tmp_path))
    scale = [r for r in runs if r.name.startswith("scale")]
    assert {r.recipe for r in scale} == {"bf16", "fp8flow"}
    assert all(_flag(r.args, "--model.flavor") == "fp8flow_dsv3_experts" for r in scale)
    resume = next(r for r in runs if r.name == "resume-fp8flow")
    assert resume.needs == "ep-fp8flow" and names.index("ep-fp8flow") < names.index("resume-fp8flow")
    assert bench._degrees(resume.args) == f"EP={gpus} x FSDP={gpus}"
    for mode in ("fsdp", "ep"):  # each beside its BF16-gather FP8-Flow run, same arguments but the option
        gather, plain = (next(r for r in runs if r.name == f"{mode}-{k}") for k in ("fp8gather", "fp8flow"))
        strip = lambda args: [a for i, a in enumerate(args) if "--job.dump_folder" not in (a, args[i - 1])]  # noqa: E731
        assert gather.recipe == "fp8flow" and "--fp8flow.fsdp_fp8_all_gather" in gather.args
        assert strip(gather.args) == [*strip(plain.args), "--fp8flow.fsdp_fp8_all_gather"], mode


def test_only_throughput_runs_leave_out_the_part_norms(tmp_path):
    runs = bench.plan_runs(list(bench.RUN_GROUPS), 2, tmp_path)
    assert {r.name for r in runs if r.timed} == {"perf-bf16", "perf-fp8flow", "scale-bf16", "scale-fp8flow"}


def test_gradient_spikes_name_the_parts_with_the_largest_norms():
    norms = [0.5] * 15 + [30.0] + [0.5] * 4
    parts = {
        "tok_embeddings": [0.3] * 20,
        "layers.1.moe.experts": [0.4] * 15 + [29.9] + [0.4] * 4,
        "layers.1.moe.router": [0.1] * 15 + [2.0] + [0.1] * 4,
    }
    record = {"grad_norms": norms, "grad_norm_parts": parts, "losses": [6.0] * 20, "max_losses": [6.5] * 20}
    (spike,) = bench.gradient_spikes(record, top=2)
    assert spike.startswith("step 16: norm 30 (median before 0.5), loss 6.0000 (largest rank's 6.5)")
    assert spike.endswith("largest parts: layers.1.moe.experts 29.9, layers.1.moe.router 2")
    assert bench.gradient_spikes({"grad_norms": norms, "losses": [6.0] * 20})[0].endswith("parts not recorded")
    assert bench.gradient_spikes({"grad_norms": [0.5] * 20, "losses": [6.0] * 20}) == []


def test_plan_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="--gpus must be >= 2"):
        bench.plan_runs(["ep"], 1, tmp_path)
    with pytest.raises(ValueError, match="unknown run groups"):
        bench.plan_runs(["ep", "warp"], 2, tmp_path)
    with pytest.raises(SystemExit):
        bench.parse_args(["--runs", "warp"])
    args = bench.parse_args(["--runs", "scale", "--gpus", "8", "--scale-steps", "100"])
    assert (args.runs, args.gpus, args.scale_steps) == (["scale"], 8, 100)
    assert "scale" not in bench.parse_args([]).runs, "the scale-out run is asked for explicitly"
    assert "spikes" not in bench.parse_args([]).runs and bench.parse_args(["--spike-repeats", "5"]).spike_repeats == 5


def test_spike_launches_go_round_by_round_and_are_tallied(tmp_path, monkeypatch):
    """Each round launches every variant once (a call cut short keeps the counts even), the BF16-FC1-dgrad variant
    with its flag; the report counts each variant's runs with a spike and gives each run's gap to its round's BF16."""
    runs = bench.plan_runs(["spikes"], 2, tmp_path, spike_repeats=2)
    names = [r.name for r in runs]
    assert names == [f"spikes-{v}-{i}" for i in (1, 2) for v in bench.SPIKE_VARIANTS]
    dgrad = next(r for r in runs if r.name == "spikes-fp8flow_bf16_fc1_dgrad-1")
    assert dgrad.recipe == "fp8flow" and _flag(dgrad.args, "--fp8flow.backward") == "bf16_fc1_dgrad"
    assert all(_flag(r.args, "--parallelism.expert_parallel_degree") == "2" and not r.timed for r in runs)
    smooth = {"grad_norms": [0.5] * 20, "losses": [6.0] * 20}
    spiky = {"grad_norms": [0.5] * 15 + [30.0] + [0.5] * 4, "losses": [6.0] * 19 + [6.6]}
    records = {name: smooth for name in names} | {"spikes-fp8flow-2": spiky}
    notes = bench._spike_counts(records)
    assert notes[0].startswith("Spike launches, bf16: 0 of 2 runs with a gradient spike (none)")
    assert notes[1].startswith("Spike launches, fp8flow: 1 of 2 runs with a gradient spike (spikes-fp8flow-2)")
    assert notes[1].endswith("gap to the round's BF16 run: 0.00%, 1.00%.")


def test_skipped_dependency_is_recorded_not_launched(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(bench, "launch", lambda spec, gpus, work, records: launched.append(spec.name))
    runs = [bench.RunSpec("resume-fp8flow", "fp8flow", (), needs="ep-fp8flow")]
    records = bench.run_plan(runs, 2, tmp_path)
    assert launched == [] and records["resume-fp8flow"]["failed"]


def test_scale_flavor_has_deepseek_v3_expert_dims():
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    import fp8flow_ao.torchtitan  # noqa: F401  (registers the flavors)

    args = deepseekv3_args["fp8flow_dsv3_experts"]
    assert (args.dim, args.moe_inter_dim, args.moe_args.num_experts, args.moe_args.top_k) == (7168, 2048, 256, 8)


def test_budget_skips_runs_that_would_end_past_it_and_saves_after_each(tmp_path, monkeypatch):
    clock = iter(range(0, 1000, 10))  # every monotonic() call advances 10 s
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    launched, saved = [], []

    def fake_launch(spec, gpus, work, records):
        launched.append(spec.name)
        records[spec.name] = {"losses": [1.0]}

    monkeypatch.setattr(bench, "launch", fake_launch)
    runs = [bench.RunSpec(name, "bf16", ()) for name in ("a", "b", "c", "d")]
    records = bench.run_plan(runs, 2, tmp_path, budget_s=45, on_record=lambda r: saved.append(sorted(r)))
    # each launch takes 10 s: a starts at 10 s, b at 30 s (30 + 10 <= 45), c at 50 s is past the budget, d too
    assert launched == ["a", "b"]
    assert records["c"]["skipped_because"] == records["d"]["skipped_because"] == "over --budget-s"
    assert saved == [["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]]


def test_report_gives_each_mode_its_step_spread_and_stalls(monkeypatch):
    """The perf row shows the timed steps' quartiles and names the one-off stalls (a step above 3x the median,
    e.g. a recompile): a single run's median hides both."""
    written = []
    monkeypatch.setattr(bench, "write_results", lambda name, rows, notes: written.append(rows))

    def record(seconds: list[float]) -> dict:
        return {"step_seconds": seconds, "losses": [1.0] * len(seconds), "tokens_per_step": 1000, "peak_mem_gib": 1.0}

    warmup = [9.0] * 5  # compile: left out of every statistic
    fp8 = warmup + [0.10, 0.12, 2.0, 0.11, 0.13, 0.10, 0.12, 0.11]  # a stall at step 8
    bf16 = warmup + [0.15] * 8
    bench.report({"perf-fp8flow": record(fp8) | {"args": ["--x"]}, "perf-bf16": record(bf16)}, "name")
    (row,) = written[0]
    assert row["ours_us"] == pytest.approx(115_000) and row["baseline_us"] == pytest.approx(150_000)
    assert row["timed_steps"] == 8 and row["slow_steps"] == [8] and row["baseline_slow_steps"] == []
    assert row["step_ms_p25_p75"] == "102.5-127.5" and row["baseline_step_ms_p25_p75"] == "150.0-150.0"
