"""``python -m fp8flow_ao.demo``: BF16 and FP8-Flow trained side by side on the offline corpus.

On the CPU the demo runs the torch reference path with deterministic kernels, so besides "it runs,
learns and writes its files" the tests can ask for exact properties: the same seed gives the same
run, and ``--recompute`` (FC1 + SwiGLU recomputed in backward) gives bit-identical losses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from fp8flow_ao import demo  # noqa: E402

SMALL = ["--device", "cpu", "--steps", "6", "--seq-len", "64", "--batch-size", "2", "--eval-batches", "1", "--quiet"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("demo")
    return demo.run([*SMALL, "--out", str(out)]), out


def losses(log: dict, model: str) -> list[float]:
    return [r[f"loss_{model}"] for r in log["steps"]]


def test_demo_learns_and_fp8flow_tracks_bf16(cpu_run: tuple[dict, Path]) -> None:
    log, _ = cpu_run
    assert [r["step"] for r in log["steps"]] == list(range(1, 7))
    for model in demo.MODELS:
        curve = losses(log, model)
        assert all(map(math.isfinite, curve))
        assert curve[0] == pytest.approx(math.log(2048), abs=0.7), "starts near uniform over the 2048 tokens"
        assert sum(curve[-2:]) / 2 < curve[0] - 0.3, f"{model} learns"
    assert losses(log, "fp8flow")[0] == pytest.approx(losses(log, "bf16")[0], rel=1e-3), "same weights, same batch"
    assert losses(log, "fp8flow") != losses(log, "bf16"), "the converted copy runs FP8"
    s = log["summary"]
    assert s["max_rel_gap"] < 0.02 and s["eval_rel_gap"] < 0.02
    assert set(s["tokens_per_s"]) == set(demo.MODELS) and all(v > 0 for v in s["tokens_per_s"].values())
    assert log["deterministic"] is True and log["compile"] is False
    assert log["fp8flow_config"] == {"recompute_experts": False, "recipe": "blockwise"}


def test_demo_writes_png_and_json(cpu_run: tuple[dict, Path]) -> None:
    log, out = cpu_run
    png = (out / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert json.loads((out / "log.json").read_text()) == json.loads(json.dumps(log))


def test_demo_recompute_is_bit_identical_and_runs_reproduce(tmp_path: Path, cpu_run: tuple[dict, Path]) -> None:
    log, _ = cpu_run
    again = demo.run([*SMALL, "--out", str(tmp_path), "--recompute"])
    assert again["fp8flow_config"]["recompute_experts"] is True
    assert losses(again, "bf16") == losses(log, "bf16"), "same seed, same run"
    assert losses(again, "fp8flow") == losses(log, "fp8flow"), "recompute changes memory, not numbers"
    assert not torch.are_deterministic_algorithms_enabled(), "the demo restores the global setting"


def test_arguments_and_presets() -> None:
    args = demo.parse_args(["--device", "cpu", "--steps", "3", "--lr", "0.01"])
    preset = demo._resolve(args, torch.device("cpu"))
    assert preset == demo.PRESETS["cpu"].__class__(**{**demo.PRESETS["cpu"].__dict__, "steps": 3, "lr": 0.01})
    assert demo._resolve(demo.parse_args(["--preset", "gpu"]), torch.device("cpu")) == demo.PRESETS["gpu"]
    for preset in demo.PRESETS.values():  # FP8-Flow's blocks: every hidden dim a multiple of 128
        assert preset.dim % 128 == 0 and preset.moe_inter_dim % 128 == 0 and preset.inter_dim % 128 == 0
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            demo.run(["--device", "cuda", "--steps", "1"])


def test_compiled_run_sets_capture_scalar_outputs_for_its_training_only(tmp_path: Path, monkeypatch) -> None:
    """``--compile`` trains with torchtitan's ``capture_scalar_outputs`` and leaves the process's setting as it was
    (``compile_blocks`` once set it for good). Training is stubbed: the flag is read where the blocks compile."""
    seen = []

    def train(trainers, batches, steps, tokens_per_step, quiet):
        seen.append(torch._dynamo.config.capture_scalar_outputs)
        record = {"step": 1, "loss_bf16": 8.0, "loss_fp8flow": 8.0, "seconds_bf16": 1.0, "seconds_fp8flow": 1.0}
        return [record | {"rel_gap": 0.0}]

    monkeypatch.setattr(demo, "train_side_by_side", train)
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        log = demo.run([*SMALL[:-3], "--eval-batches", "0", "--compile", "--quiet", "--out", str(tmp_path)])
        assert log["compile"] is True and seen == [True]
        assert torch._dynamo.config.capture_scalar_outputs is False


def test_summary_statistics() -> None:
    records = [
        {
            "step": i + 1,
            "loss_bf16": 8.0 - i,
            "loss_fp8flow": 8.0 - i + 0.01 * i,
            "seconds_bf16": 1.0,
            "seconds_fp8flow": 0.5,
        }
        for i in range(6)
    ]
    for r in records:
        r["rel_gap"] = demo.relative_gap(r["loss_fp8flow"], r["loss_bf16"])
    s = demo.summarize(records, tokens_per_step=100, cuda=False)
    assert s["final_loss"] == {"bf16": 3.0, "fp8flow": 3.05}
    assert s["max_rel_gap"] == pytest.approx(0.05 / 3.0)
    assert s["tokens_per_s"] == {"bf16": 100.0, "fp8flow": 200.0} and s["speedup"] == 2.0


@pytest.mark.gpu
def test_demo_gpu_preset_compiled(tmp_path: Path) -> None:
    """The GPU path: Triton kernels, bf16 autocast, compiled blocks, a smaller batch of the gpu preset."""
    args = ["--preset", "gpu", "--steps", "4", "--seq-len", "512", "--batch-size", "2", "--eval-batches", "0"]
    log = demo.run([*args, "--out", str(tmp_path), "--quiet"])
    assert log["compile"] is True
    assert all(math.isfinite(x) for m in demo.MODELS for x in losses(log, m))
    assert log["summary"]["max_rel_gap"] < 0.02
    assert all(v > 0 for v in log["summary"]["peak_mem_gib"].values())
