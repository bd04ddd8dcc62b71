"""benchmarks/bench_fp8_grouped_mm.py's command line on the CPU: which cases and modes a run times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_fp8_grouped_mm as bench  # noqa: E402


def test_default_run_times_every_case_in_the_eager_modes():
    args = bench.parse_args([])
    assert args.cases == bench.CASES and tuple(args.modes) == bench.DEFAULT_MODES and args.tag == ""
    assert bench.GRAPHED_MODE not in args.modes  # the graphed mode runs only when asked for


def test_cases_are_chosen_by_any_part_of_their_name():
    args = bench.parse_args(["--cases", "E=64", "unaligned", "--modes", "fwd+bwd", bench.GRAPHED_MODE, "--tag", "_x"])
    names = [bench.case_name(*c) for c in args.cases]
    assert names == [n for n in (bench.case_name(*c) for c in bench.CASES) if "E=64" in n or "unaligned" in n]
    assert len(names) == 3 and args.modes == ["fwd+bwd", bench.GRAPHED_MODE] and args.tag == "_x"
    assert bench.FLOPS_PER_MODE[bench.GRAPHED_MODE] == bench.FLOPS_PER_MODE["fwd+bwd"]


@pytest.mark.parametrize("argv", [["--cases", "E=5 "], ["--modes", "bwd"]], ids=["no_case", "unknown_mode"])
def test_a_selection_that_times_nothing_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_graphed_mode_times_ours_and_bf16_only(monkeypatch):
    """torchao's ops are compared eagerly: the graphed mode leaves them out, the eager modes keep them."""
    monkeypatch.setattr(bench, "timed", lambda fn, p, mode: (1.0, 1.0, 1.0))
    found = {"ours": None, bench.GRAPHED_BASELINE: None, "torchao rowwise fp8": None}
    assert list(bench.timed_methods(found, {}, bench.GRAPHED_MODE)) == ["ours", bench.GRAPHED_BASELINE]
    assert list(bench.timed_methods(found, {}, "fwd+bwd")) == list(found)


def test_baselines_are_chosen_by_any_part_of_their_name_and_ours_always_runs():
    found = {"ours": 0, bench.GRAPHED_BASELINE: 1, "torchao blockwise fp8 (DeepGEMM)": 2, "torchao rowwise fp8": 3}
    assert bench.chosen(found, None) == found
    assert list(bench.chosen(found, ["DeepGEMM"])) == ["ours", "torchao blockwise fp8 (DeepGEMM)"]
    assert list(bench.chosen(found, ["bf16", "rowwise"])) == ["ours", bench.GRAPHED_BASELINE, "torchao rowwise fp8"]
    assert bench.parse_args(["--baselines", "DeepGEMM", "bf16"]).baselines == ["DeepGEMM", "bf16"]
    assert bench.parse_args([]).baselines is None


def _refuses(*args):
    raise RuntimeError("this shape is not supported\nsecond line")


def test_a_baseline_that_raises_is_left_out_of_the_case_and_ours_raising_stops_the_run(monkeypatch, capsys):
    monkeypatch.setattr(bench, "accuracy", lambda fn, p, ref: fn())
    sqnr = bench.accuracies({"ours": lambda: {"out": 30.0}, "torchao blockwise fp8 (DeepGEMM)": _refuses}, {}, ())
    assert sqnr == {"ours": {"out": 30.0}}
    assert "skipping torchao blockwise fp8 (DeepGEMM) on this case: RuntimeError: this shape is not supported\n" in (
        capsys.readouterr().out
    )
    with pytest.raises(RuntimeError, match="not supported"):
        bench.accuracies({"ours": _refuses}, {}, ())
