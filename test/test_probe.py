"""fp8flow_ao.torchtitan.probe: the fp32 reference is torchtitan's routed experts; the probe measures without side effects.

The probe's whole-run behaviour (bit-identical losses with and without it, records in the run JSON,
the report) is tested through the benchmark in ``test_bench_convergence.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import DEVICE
from test_moe import ROUTINGS, make_moe

from fp8flow_ao.moe import convert_moe_layer
from fp8flow_ao.torchtitan.cpu import integer_histc
from fp8flow_ao.torchtitan.probe import QUANTITIES, ExpertProbe, measure_routed_experts, routed_experts_reference

WEIGHTS = ("w1", "w2", "w3")


def _tokens(tokens: int = 128, dim: int = 256, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(3)
    return torch.randn(2, tokens // 2, dim, device=DEVICE, generator=g).to(dtype)


def _routing(moe: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad(), integer_histc():
        top_scores, ids, _ = moe.router(x.view(-1, x.shape[-1]), moe.expert_bias)
    return top_scores, ids


@pytest.mark.parametrize("routing", ["skewed", "llama4_skewed"])
def test_reference_is_torchtitans_routed_path(routing):
    """torchtitan's own fp32 MoE layer minus its shared expert = the reference on the layer's routing."""
    moe = make_moe(**ROUTINGS[routing], dtype=torch.float32)
    # torchtitan's grouped experts (make_moe's choice on a GPU) multiply in bf16 (_run_experts_grouped_mm casts):
    # its fp32 layer is the for-loop one on every device.
    moe.experts.use_grouped_mm = False
    x = _tokens(dtype=torch.float32)
    top_scores, ids = _routing(moe, x)
    with torch.no_grad(), integer_histc():
        want = (moe(x) - moe.shared_experts(x)).view(-1, x.shape[-1])
    got = routed_experts_reference(
        x.view(-1, x.shape[-1]), top_scores, ids, *(getattr(moe.experts, n) for n in WEIGHTS),
        score_before_experts=moe.score_before_experts,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("routing", ["skewed", "llama4_balanced"])
def test_measure_gives_sane_sqnr_and_touches_nothing(routing):
    moe = convert_moe_layer(make_moe(**ROUTINGS[routing]))
    x = _tokens().view(-1, 256)
    top_scores, ids = _routing(moe, x)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    rng = torch.get_rng_state()
    weights = (getattr(moe.experts, n) for n in WEIGHTS)
    sqnr = measure_routed_experts(x, top_scores, ids, *weights, score_before_experts=moe.score_before_experts)
    assert list(sqnr) == list(QUANTITIES)
    # the CPU path is the kernels' torch references: FP8 1x128 / 128x128 blocks give ~24 dB here
    assert all(math.isfinite(v) and v > 15 for v in sqnr.values()), sqnr
    assert torch.equal(torch.get_rng_state(), rng), "the probe drew from the global RNG"
    for name, p in moe.named_parameters():
        assert p.grad is None and torch.equal(p, before[name]), name


def test_probe_captures_on_probe_steps_only_and_records_grad_norms():
    moe = make_moe(**ROUTINGS["balanced"])
    bf16 = copy.deepcopy(moe)
    model = torch.nn.ModuleDict({"dense": torch.nn.Identity(), "moe": convert_moe_layer(moe), "bf16": bf16})
    probe = ExpertProbe(model, every=3)
    assert [s for s in range(1, 8) if probe.is_probe_step(s)] == [1, 3, 6]
    assert list(probe.layers) == ["moe", "bf16"] and probe.converted == ["moe"]
    x = _tokens()
    norms = []
    for step in (1, 2):
        for p in model.parameters():
            p.grad = None
        probe.before_step(step)
        with integer_histc():
            (model["moe"](x).float().square().mean() + model["bf16"](x).float().square().mean()).backward()
        assert bool(probe._samples) == (step == 1), "inputs are held on probe steps only"
        norms.append(
            [torch.linalg.vector_norm(getattr(m.experts, n).grad.float()).item() for m in (moe, bf16) for n in WEIGHTS]
        )
        probe.after_step(step)
        assert not probe._samples, "the captured input is dropped after the step"
    assert [p["step"] for p in probe.probes] == [1] and list(probe.probes[0]["layers"]) == ["moe"]
    assert all(v > 15 for v in probe.probes[0]["layers"]["moe"].values())
    got = probe.grad_norms()
    for step in (0, 1):
        assert [got[fqn][n][step] for fqn in ("moe", "bf16") for n in WEIGHTS] == pytest.approx(norms[step])
    probe.remove()
    probe.before_step(3)
    with integer_histc():
        model["moe"](x).float().sum().backward()
    probe.after_step(3)
    assert len(probe.probes) == 1 and math.isnan(probe.grad_norms()["moe"]["w1"][2]), "hooks removed"


def test_probe_needs_a_moe_layer_and_a_period():
    with pytest.raises(ValueError, match="no MoE layer"):
        ExpertProbe(torch.nn.Linear(2, 2), every=1)
    with pytest.raises(ValueError, match="positive"):
        ExpertProbe(make_moe(), every=0)
