"""benchmarks/bench_torchtitan_e2e.py without training: which runs a selection makes and how runs merge into rows.

(That the converted model trains under each activation-checkpointing mode on the CPU is tested in
test_torchtitan.py; the GPU timings are the benchmark itself.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_torchtitan_e2e as e2e  # noqa: E402


def fake_run(
    recipe: str,
    step_us: float,
    ac: str = "none",
    recompute: bool = False,
    peak: float = 10.0,
    experts: str = "compiled",
) -> dict:
    return {
        "flavor": "fp8flow_gpu", "compile": True, "ac": ac, "recipe": recipe, "recompute": recompute, "steps": 30,
        "experts": experts if recipe == "fp8flow" else None,
        "warmup": 5, "tokens_per_step": 16384, "step_us": step_us, "tokens_per_s": round(16384 / step_us * 1e6),
        "peak_mem_gib": peak, "first_loss": 7.6, "last_loss": 5.0, "device": "NVIDIA H200", "versions": {"torch": "x"},
    }  # fmt: skip


def test_selection_runs_recompute_for_fp8flow_only() -> None:
    args = e2e.parse_args(["--ac", "none", "full", "--recompute", "off", "on", "--compile", "on"])
    runs = e2e.selected_runs(args)
    assert len(runs) == 2 * (3 + 1), "per AC mode: bf16, rowwise, fp8flow, fp8flow + recompute"
    assert all(recipe == "fp8flow" for _, _, _, recipe, recompute, _ in runs if recompute)
    names = {e2e.run_name(*r) for r in runs}
    assert len(names) == len(runs) and "fp8flow_gpu_compile-on_ac-full_fp8flow_recompute_experts-compiled" in names
    flags = e2e.run_flags(args, "fp8flow_gpu", True, "full", "rowwise", False, None, "/tmp/x")
    assert flags[flags.index("--activation_checkpoint.mode") + 1] == "full" and "rowwise" in flags
    with pytest.raises(SystemExit):
        e2e.parse_args(["--steps", "3", "--warmup", "5"])


def test_compile_experts_selects_fp8flow_runs_with_compile_on_only() -> None:
    args = e2e.parse_args(["--compile", "on", "off", "--compile-experts", "on", "off", "--recipes", "bf16", "fp8flow"])
    runs = e2e.selected_runs(args)
    assert {(r[1], r[3], r[5]) for r in runs} == {
        (True, "bf16", None), (False, "bf16", None), (False, "fp8flow", None),
        (True, "fp8flow", "compiled"), (True, "fp8flow", "eager"),
    }  # fmt: skip
    assert len(runs) == 5
    eager = e2e.run_flags(args, "fp8flow_gpu", True, "none", "fp8flow", False, "eager", "/tmp/x")
    assert eager[eager.index("--fp8flow.compile_experts") + 1] == "off"
    compiled = e2e.run_flags(args, "fp8flow_gpu", True, "none", "fp8flow", False, "compiled", "/tmp/x")
    assert "--fp8flow.compile_experts" not in compiled, "the converter's default compiles them"
    assert e2e.run_name("fp8flow_gpu", True, "none", "fp8flow", False, "eager").endswith("_fp8flow_experts-eager")
    default = e2e.selected_runs(e2e.parse_args(["--recipes", "fp8flow"]))
    assert [r[5] for r in default] == ["compiled"]
    rows = e2e.report_rows([
        fake_run("bf16", 120_000.0), fake_run("fp8flow", 100_000.0), fake_run("fp8flow", 110_000.0, experts="eager"),
    ])  # fmt: skip
    assert [(r["case"].split(", AC")[0], r["baseline_us"]) for r in rows] == [
        ("fp8flow_gpu, compile on, experts compiled", 120_000.0),
        ("fp8flow_gpu, compile on, experts eager", 120_000.0),
    ]
    old = {k: v for k, v in fake_run("fp8flow", 100_000.0).items() if k != "experts"}
    assert "experts eager" in e2e.report_rows([old])[0]["case"], "runs from before the option ran the experts eagerly"


def test_rows_compare_fp8flow_with_same_settings_baselines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [
        fake_run("bf16", 120_000.0), fake_run("rowwise", 130_000.0), fake_run("fp8flow", 100_000.0, peak=8.0),
        fake_run("fp8flow", 110_000.0, recompute=True, peak=6.0), fake_run("bf16", 150_000.0, ac="full"),
        fake_run("fp8flow", 125_000.0, ac="full"),
    ]  # fmt: skip
    rows = {r["case"].split(", 16384")[0]: r for r in e2e.report_rows(runs)}
    assert set(rows) == {
        "fp8flow_gpu, compile on, experts compiled, AC none",
        "fp8flow_gpu, compile on, experts compiled, AC none, recompute_experts",
        "fp8flow_gpu, compile on, experts compiled, AC full",
    }
    plain = rows["fp8flow_gpu, compile on, experts compiled, AC none"]
    assert plain["speedup"] == 1.2 and plain["speedup_vs_rowwise"] == 1.3
    assert (plain["bf16_peak_gib"], plain["fp8flow_peak_gib"]) == (10.0, 8.0)
    assert rows["fp8flow_gpu, compile on, experts compiled, AC none, recompute_experts"]["baseline_us"] == 120_000.0
    full = rows["fp8flow_gpu, compile on, experts compiled, AC full"]
    assert full["baseline_us"] == 150_000.0 and full["rowwise_tokens_per_s"] is None, "no row-wise run with full AC"
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    for i, r in enumerate(runs):
        (runs_dir / f"{i}.json").write_text(json.dumps(r))
    monkeypatch.setattr(e2e, "write_results", lambda name, rows, notes, measured_on: (name, rows, notes, measured_on))
    name, merged, notes, measured_on = e2e.report(runs_dir)
    assert name == "torchtitan_e2e" and len(merged) == 3 and "skips each MoE's `experts`" in notes
    assert measured_on == ("NVIDIA H200", {"torch": "x"}), "the measuring machine, not the one merging"
    (runs_dir / "other.json").write_text(json.dumps(dict(runs[0], device="NVIDIA H100")))
    with pytest.raises(ValueError, match="different devices"):
        e2e.report(runs_dir)
    with pytest.raises(ValueError, match="no fp8flow run"):
        e2e.report(tmp_path)
