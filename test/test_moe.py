"""The FP8-Flow MoE layer against torchtitan's BF16 MoE layer (same weights, same inputs).

Numerics (SQNR vs the BF16 layer: output >= 25 dB, every gradient >= 22 dB) for balanced and skewed
routing (empty experts included), DeepSeek-V3 style (top-2, score after the experts) and Llama 4
style (top-1, score before the experts), recompute on and off; recompute on/off bit-identical; two runs
bit-identical; exactly 2 explicit BF16->FP8 casts per layer per step; what backward keeps;
torch.compile(fullgraph=True); on a GPU the same with the Triton kernels and no device sync.
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from collections.abc import Iterator

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import (
    GEMM_TOLERANCE,
    assert_accumulated,
    assert_fp8_close,
    assert_sizes_compile_nothing_new,
    int_drawer,
    make_routing,
    rel_error,
    sqnr_db,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from fp8flow_ao.debug import QUANTIZING_GEMMS, FP8FlowOpCounter
from fp8flow_ao.demo import deterministic
from fp8flow_ao.moe import FP8FlowMoE, _routed_experts, convert_moe_layer, fp8flow_routed_experts
from fp8flow_ao.torchtitan.cpu import integer_histc
from fp8flow_ao.weight_cache import step_cached_weights

moe_mod = pytest.importorskip("torchtitan.models.moe.moe")

FP8 = torch.float8_e4m3fn
PARAMS = ("experts.w1", "experts.w2", "experts.w3", "router.gate.weight")
# expert 0 takes every token, experts 5..7 never win: skewed groups, three empty experts
SKEWED_BIAS = [2.0, 0.3, 0.2, 0.1, 0.0, -5.0, -5.0, -5.0]
# Llama 4's MoEArgs defaults (torchtitan 0.2.2): top-1, sigmoid scores without route norm (with it a
# top-1 score would always be 1), the score multiplying the expert's input, one shared expert.
LLAMA4 = {"top_k": 1, "route_norm": False, "score_before_experts": True}
# make_moe arguments per routing; expert_bias None is torchtitan's forced round-robin balance
ROUTINGS = {
    "balanced": {"experts": 4, "top_k": 2, "expert_bias": None},
    "skewed": {"experts": 8, "top_k": 2, "expert_bias": SKEWED_BIAS},
    "llama4_balanced": {"experts": 4, "expert_bias": None, **LLAMA4},
    "llama4_skewed": {"experts": 8, "expert_bias": SKEWED_BIAS, **LLAMA4},
}


def make_moe(
    dim: int = 256,
    hidden: int = 128,
    experts: int = 4,
    top_k: int = 2,
    expert_bias: list[float] | None = None,
    score_before_experts: bool = False,
    device: str = DEVICE,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    route_norm: bool = True,
) -> torch.nn.Module:
    """A torchtitan 0.2.2 MoE layer (DeepSeek-V3 style: sigmoid router, route norm, one shared expert)."""
    args = moe_mod.MoEArgs(
        num_experts=experts,
        num_shared_experts=1,
        top_k=top_k,
        score_func="sigmoid",
        route_norm=route_norm,
        score_before_experts=score_before_experts,
        # the for-loop experts on the CPU (the grouped path pads through a Triton kernel)
        use_grouped_mm=device != "cpu",
        _debug_force_load_balance=expert_bias is None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        moe = moe_mod.MoE(args, dim=dim, hidden_dim=hidden)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device(device))
    moe.to(dtype)
    moe.expert_bias = torch.tensor(expert_bias or [0.0] * experts, device=device)  # fp32 routing bias
    moe.tokens_per_expert = torch.zeros(experts, device=device)
    return moe


@contextlib.contextmanager
def nan_filled_allocations() -> Iterator[None]:
    """Every fresh allocation filled (NaN; the integer maximum): ``fill_uninitialized_memory``, which acts under
    deterministic algorithms (the demo's :func:`~fp8flow_ao.demo.deterministic`); both settings restored after."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with deterministic(True):
            yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill


def run_step(moe: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward + backward; returns the output and every gradient of interest."""
    x = x.detach().clone().requires_grad_()
    with integer_histc():
        out = moe(x)
        out.backward(grad)
    params = dict(moe.named_parameters())
    return {"out": out.detach(), "x": x.grad} | {name: params[name].grad for name in PARAMS}


def _inputs(dim: int, tokens: int, device: str = DEVICE, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(2, tokens // 2, dim, device=device, generator=g).to(torch.bfloat16)
    grad = torch.randn(2, tokens // 2, dim, device=device, generator=g).to(torch.bfloat16)
    return x, grad


@pytest.fixture(scope="module")
def runs() -> dict:
    """Per routing: the BF16 reference and the FP8-Flow layer with recompute off and on (+ op counts)."""
    results = {}
    for name, kwargs in ROUTINGS.items():
        ref = make_moe(**kwargs)
        x, grad = _inputs(256, 128)
        results[name] = {"ref": run_step(ref, x, grad), "inputs": (x, grad), "model": ref}
        for recompute in (False, True):
            moe = convert_moe_layer(copy.deepcopy(ref), recompute_experts=recompute)
            with FP8FlowOpCounter() as counter:
                results[name][recompute] = run_step(moe, x, grad)
            results[name][recompute]["counts"] = counter.counts
            # the copy started from the reference's count: the difference is this step's
            results[name][recompute]["tokens_per_expert"] = moe.tokens_per_expert - ref.tokens_per_expert
    return results


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_matches_bf16_layer(runs, routing, recompute):
    ref, ours = runs[routing]["ref"], runs[routing][recompute]
    assert ours["out"].dtype == torch.bfloat16 and ours["out"].shape == ref["out"].shape
    assert sqnr_db(ref["out"], ours["out"]) >= 25
    assert sqnr_db(ref["x"], ours["x"]) >= 22
    assert sqnr_db(ref["router.gate.weight"], ours["router.gate.weight"]) >= 22
    for name in PARAMS[:3]:
        assert ours[name].dtype == ref[name].dtype and ours[name].shape == ref[name].shape
        for e in range(ref[name].shape[0]):
            if torch.count_nonzero(ref[name][e]) == 0:  # an empty expert gets an exactly zero gradient
                assert torch.count_nonzero(ours[name][e]) == 0
            else:
                assert sqnr_db(ref[name][e], ours[name][e]) >= 22, (name, e)


@pytest.mark.parametrize("backward", ["bf16", "bf16_wgrad", "bf16_fc1_dgrad"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_backward_ablations_keep_the_forward_and_take_fp8_out_of_their_part(runs, routing, backward):
    """The ablations run FP8-Flow's forward bit for bit. ``"bf16"``: no FP8 in backward, so every
    gradient is nearer the BF16 layer's than FP8-Flow's own (x's, whose error is mostly backward's, by
    >= 3 dB). ``"bf16_wgrad"``: the dgrads are FP8-Flow's bit for bit, the weight gradients nearer the
    BF16 layer's. ``"bf16_fc1_dgrad"``: the weight and router gradients are FP8-Flow's bit for bit, x's
    nearer the BF16 layer's. An empty expert still gets an exactly zero gradient. Both score placements."""
    run = runs[routing]
    ours = run_step(convert_moe_layer(copy.deepcopy(run["model"]), backward=backward), *run["inputs"])
    ref, fp8 = run["ref"], run[False]
    fp8_part = {"bf16": (), "bf16_wgrad": ("x", "router.gate.weight"), "bf16_fc1_dgrad": PARAMS}[backward]
    assert torch.equal(ours["out"], fp8["out"])
    for name in ("x", *PARAMS):
        assert ours[name].dtype == ref[name].dtype and torch.isfinite(ours[name]).all(), name
        if name in fp8_part:
            assert torch.equal(ours[name], fp8[name]), name
        else:
            margin = 3 if name == "x" and backward == "bf16" else 0
            assert sqnr_db(ref[name], ours[name]) > sqnr_db(ref[name], fp8[name]) + margin, name
    for name in PARAMS[:3]:
        for e in range(ref[name].shape[0]):
            assert (torch.count_nonzero(ref[name][e]) == 0) == (torch.count_nonzero(ours[name][e]) == 0), (name, e)


@pytest.mark.parametrize("backward", ["emulated_fp8_fc1_dgrad", "emulated_sr_fc1_dgrad"])
@pytest.mark.parametrize("routing", ["skewed", "llama4_skewed"])
def test_emulated_fc1_dgrads_change_only_x_grad(runs, routing, backward):
    """The emulations change FC1's dgrad only: the output and every weight and router gradient are
    FP8-Flow's bit for bit. To nearest, x's gradient is FP8-Flow's up to BF16 GEMM roundings (the same
    operands); stochastically rounded, it differs from it, and is as near the BF16 layer's (unbiased
    rounding: more variance, no bias). Recompute gives the same bits to nearest."""
    run = runs[routing]
    torch.manual_seed(0)
    ours = run_step(convert_moe_layer(copy.deepcopy(run["model"]), backward=backward), *run["inputs"])
    ref, fp8 = run["ref"], run[False]
    for name in ("out", *PARAMS):
        assert torch.equal(ours[name], fp8[name]), name
    agreement = sqnr_db(fp8["x"], ours["x"])
    if backward == "emulated_fp8_fc1_dgrad":
        assert agreement >= 45
        recomputed = convert_moe_layer(copy.deepcopy(run["model"]), recompute_experts=True, backward=backward)
        assert torch.equal(run_step(recomputed, *run["inputs"])["x"], ours["x"])
    else:
        assert agreement < 40
        assert abs(sqnr_db(ref["x"], ours["x"]) - sqnr_db(ref["x"], fp8["x"])) < 2


def test_bf16_backward_ablation_refuses_recompute():
    x, w = torch.randn(128, 256, dtype=torch.bfloat16), torch.randn(4, 128, 256, dtype=torch.bfloat16)
    probs, ids = torch.rand(128, 2), torch.randint(0, 4, (128, 2))
    with pytest.raises(ValueError, match="needs recompute_experts=False"):
        fp8flow_routed_experts(x, probs, ids, w, w.transpose(1, 2), w, recompute_experts=True, backward="bf16")
    with pytest.raises(ValueError, match="backward must be one of"):
        fp8flow_routed_experts(x, probs, ids, w, w.transpose(1, 2), w, backward="fp16")


@pytest.mark.parametrize("routing", ["skewed", "llama4_skewed"])
def test_skewed_routing_has_empty_experts(runs, routing):
    """The skewed cases really exercise empty experts and the load-balance bookkeeping."""
    counts = runs[routing][False]["tokens_per_expert"]
    assert torch.equal(counts, runs[routing]["model"].tokens_per_expert)
    assert counts[0] == 128 and bool((counts[5:] == 0).all())


def test_llama4_layer_is_converted_with_its_score_placement(runs):
    """Llama 4's layer keeps score_before_experts=True and its shared expert; FP8-Flow runs it."""
    ref = runs["llama4_balanced"]["model"]
    assert ref.score_before_experts and ref.router.top_k == 1 and ref.shared_experts is not None
    moe = convert_moe_layer(copy.deepcopy(ref))
    assert isinstance(moe, FP8FlowMoE) and moe.experts.fp8flow_score_before_experts
    # the score's placement matters: the same layer run with the score after the experts is another function;
    # the layer's own flag, set after conversion, reaches the routed path as on torchtitan's layer
    moe.score_before_experts = False
    assert not moe.experts.fp8flow_score_before_experts
    x, grad = runs["llama4_balanced"]["inputs"]
    assert sqnr_db(runs["llama4_balanced"]["ref"]["out"], run_step(moe, x, grad)["out"]) < 20
    ref_after = copy.deepcopy(ref)
    ref_after.score_before_experts = False
    assert sqnr_db(run_step(ref_after, x, grad)["out"], run_step(moe, x, grad)["out"]) >= 25
    with pytest.raises(TypeError, match="score_before_experts must be a bool"):
        moe.score_before_experts = 1


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_recompute_gives_bit_identical_gradients(runs, routing):
    stored, recomputed = runs[routing][False], runs[routing][True]
    for key in ("out", "x", *PARAMS):
        assert torch.equal(stored[key], recomputed[key]), key


@pytest.mark.parametrize("routing", ["skewed", "llama4_skewed"])
def test_bf16_fc1_dgrad_recomputes_bit_identically(runs, routing):
    """FC1's dgrad in BF16 is a training mode, not an ablation: with recompute_experts the same bits."""
    run = runs[routing]
    stored, recomputed = (
        run_step(
            convert_moe_layer(copy.deepcopy(run["model"]), recompute_experts=r, backward="bf16_fc1_dgrad"),
            *run["inputs"],
        )
        for r in (False, True)
    )
    for key in ("out", "x", *PARAMS):
        assert torch.equal(stored[key], recomputed[key]), key


def test_two_runs_are_bit_identical(runs):
    x, grad = runs["balanced"]["inputs"]
    again = run_step(convert_moe_layer(copy.deepcopy(runs["balanced"]["model"])), x, grad)
    for key in ("out", "x", *PARAMS):
        assert torch.equal(again[key], runs["balanced"][False][key]), key


@pytest.mark.parametrize("routing", ["balanced", "llama4_balanced"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_two_activation_casts_per_step(runs, recompute, routing):
    """Forward x and backward dy are the only explicit BF16->FP8 casts, each inside the kernel that permutes
    it (no quantize_1x128 launch of its own); weights quantized once each."""
    counts = runs[routing][recompute]["counts"]
    assert counts["quantize_permute_pad_rows"] == 2
    assert counts["quantize_1x128"] == 0 and counts["quantize_dual_1x128"] == 0
    assert counts["permute_pad_rows"] == 0  # the forward's and dy's gathers are the quantizing ones
    # Few rows per expert here: each GEMM quantizes its weight tiles as it loads them (FC1, FC2, the two
    # dgrads, FC1 again when recomputed); no quantize_128x128 pass (test_weights_quantized_in_the_gemms...).
    assert counts["quantize_128x128"] == 0 and counts[QUANTIZING_GEMMS] == 4 + recompute
    assert counts["dequantize"] == 0
    assert counts["grouped_gemm_fp8_blockwise"] == 4 + recompute  # FC1, FC2, 2 dgrads (+ FC1 again)
    assert counts["swiglu_quant"] == 1 + recompute


@pytest.mark.parametrize("routing", ["skewed", "llama4_skewed"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_weights_quantized_in_the_gemms_or_before_give_the_same_bits(runs, routing, recompute, weight_quantization):
    """The layer's GEMMs quantizing the BF16 weights themselves ("in_gemm") or reading quantize_128x128's
    tiles ("separate": W13 = [w1; w3] and w2 in forward, their exact transposes in backward, 4 passes):
    output and every gradient bit-identical, stored and recomputed, both score placements."""
    run = runs[routing]
    with FP8FlowOpCounter() as counter:
        ours = run_step(convert_moe_layer(copy.deepcopy(run["model"]), recompute_experts=recompute), *run["inputs"])
    for key in ("out", "x", *PARAMS):
        assert torch.equal(ours[key], run[recompute][key]), key
    in_gemm = weight_quantization == "in_gemm"
    assert counter.weight_quantizations == (4 + recompute if in_gemm else 4)
    assert counter.counts[QUANTIZING_GEMMS] == (4 + recompute if in_gemm else 0)
    # separate: the forward's W13 and w2 in one launch, backward's transposes one launch each
    assert (counter.counts["quantize_128x128_pair"], counter.counts["quantize_128x128"]) == (
        (0, 0) if in_gemm else (1, 2)
    )


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_backward_keeps_fp8_not_bf16_activations(recompute):
    """Saved: FP8 x (never BF16), scales, probs, routing, h + a8 column-wise unless recomputing; no weight
    copies."""
    tokens, dim, hidden, experts, top_k = 128, 384, 128, 4, 2  # D != 2H: shapes tell the tensors apart
    x = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, top_k, device=DEVICE, requires_grad=True)
    ids = torch.stack([torch.randperm(experts, device=DEVICE)[:top_k] for _ in range(tokens)])
    w1, w3 = (torch.randn(experts, hidden, dim, device=DEVICE, dtype=torch.bfloat16) * 0.05 for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, device=DEVICE, dtype=torch.bfloat16) * 0.05
    for w in (w1, w2, w3):
        w.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8flow_routed_experts(x, probs, ids, w1, w2, w3, recompute_experts=recompute)
    # the weight parameters themselves are saved by reference (no copy, no memory): leave them out
    saved = [t for t in saved if not any(t.data_ptr() == w.data_ptr() for w in (w1, w2, w3))]
    bf16 = [tuple(t.shape) for t in saved if t.dtype == torch.bfloat16]
    assert not any(t.dim() == 3 for t in saved)  # no FP8 weight copies held from forward to backward
    assert {t.dtype for t in saved} <= {FP8, torch.float32, torch.int32, torch.bfloat16}
    assert any(t.dtype == FP8 and t.shape == (tokens, dim) for t in saved)  # x8, not the permuted rows
    assert not any(t.shape[-1] == dim and t.dtype != FP8 and t.dim() == 2 and t.shape[0] >= tokens for t in saved)
    a8_either_way = [t for t in saved if t.dtype == FP8 and t.dim() == 2 and hidden in t.shape and dim not in t.shape]
    if recompute:
        assert bf16 == [] and a8_either_way == []
    else:  # FC1's output h (SwiGLU's backward needs it exactly) and a8 column-wise [H, M] (FC2's wgrad operand)
        assert len(bf16) == 1 and bf16[0][1] == 2 * hidden
        assert [tuple(t.shape)[0] for t in a8_either_way] == [hidden]  # not also a8 row-wise [M, H]


class _Calls(FP8FlowOpCounter):
    """The op counter, plus each swiglu_quant(_backward) call's ``transpose`` and each quantize_128x128_pair
    call's ``with_transpose``."""

    # (index, default) of the flag in each op's schema
    FLAGS = {
        "swiglu_quant": (4, False),
        "swiglu_quant_backward": (5, True),
        "quantize_128x128_pair": (3, False),
        "quantize_128x128": (1, False),
    }

    def __init__(self) -> None:
        super().__init__()
        self.transposes: list[tuple[str, bool]] = []

    @property
    def gemms(self) -> int:
        """Forward and dgrad grouped GEMM calls (the wgrad's are counted apart)."""
        return self.counts["grouped_gemm_fp8_blockwise"] + self.counts["grouped_gemm_fp8_blockwise_keep_b"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fp8flow" and func._opname in self.FLAGS:
            index, default = self.FLAGS[func._opname]
            # the dispatcher leaves out trailing arguments that have their default
            self.transposes.append((func._opname, args[index] if len(args) > index else default))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _experts_inputs(tokens: int = 128, dim: int = 256, hidden: int = 128, experts: int = 4, top_k: int = 2):
    x = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, top_k, device=DEVICE, requires_grad=True)
    ids = torch.stack([torch.randperm(experts, device=DEVICE)[:top_k] for _ in range(tokens)])
    shapes = ((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))
    weights = [(torch.randn(s, device=DEVICE, dtype=torch.bfloat16) * 0.05).requires_grad_() for s in shapes]
    return x, probs, ids, weights


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("frozen", [(0, 1, 2), (1,), (0, 2)], ids=["experts", "w2", "w13"])
def test_frozen_weights_get_no_weight_gradient_work(frozen, recompute):
    """Frozen expert weights (fine-tuning): no wgrad GEMM and no column-wise operand for it, neither kept by
    forward nor made in backward (a8's, x's, dy's, dh's); every gradient asked for is the same bits as a full
    backward's."""
    x, probs, ids, weights = _experts_inputs()
    grad = torch.randn_like(x)
    kwargs = {"recompute_experts": recompute, "weight_cache": "forward"}
    full = torch.autograd.grad(fp8flow_routed_experts(x, probs, ids, *weights, **kwargs), (x, probs, *weights), grad)
    for i in frozen:
        weights[i].requires_grad_(False)
    trainable = [w for w in weights if w.requires_grad]
    with _Calls() as calls:
        out = fp8flow_routed_experts(x, probs, ids, *weights, **kwargs)
        got = torch.autograd.grad(out, (x, probs, *trainable), grad)
    expected = [*full[:2], *(g for i, g in enumerate(full[2:]) if i not in frozen)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    wgrads = (1 not in frozen) + (0 not in frozen or 2 not in frozen)  # FC2's (w2), FC1's (W13)
    assert calls.counts["grouped_gemm_fp8_wgrad"] == wgrads
    assert calls.counts["scaling_aware_transpose"] == wgrads  # dy's for FC2, x's for FC1
    # a8's column-wise copy (FC2's wgrad operand) only where w2 trains: by forward, or by backward's recompute
    w2_trains = 1 not in frozen
    expected = [w2_trains and not recompute, *([w2_trains] if recompute else [])]
    assert [t for name, t in calls.transposes if name == "swiglu_quant"] == expected
    # dh's column-wise copy (FC1's wgrad operand) only where W13 trains
    assert [t for name, t in calls.transposes if name == "swiglu_quant_backward"] == [
        0 not in frozen or 2 not in frozen
    ]


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("weight_quantization", ["in_gemm", "separate"], indirect=True)
def test_input_that_needs_no_gradient_gets_no_fc1_dgrad(recompute, weight_quantization):
    """x without ``requires_grad`` (the first MoE layer's input when everything before it is frozen): no FC1 dgrad
    GEMM and no W13 transpose for it; the gradients asked for are the same bits as a full backward's."""
    x, probs, ids, weights = _experts_inputs()
    grad = torch.randn_like(x)
    kwargs = {"recompute_experts": recompute}
    with _Calls() as full_calls:
        full = torch.autograd.grad(fp8flow_routed_experts(x, probs, ids, *weights, **kwargs), (probs, *weights), grad)
    with _Calls() as calls:
        out = fp8flow_routed_experts(x.detach(), probs, ids, *weights, **kwargs)
        got = torch.autograd.grad(out, (probs, *weights), grad)
    assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True))
    assert calls.gemms == full_calls.gemms - 1
    # and no W13 transpose for it: written by quantize_128x128 ("separate"), or made by the dgrad GEMM as it loads
    # W13 ("in_gemm")
    if weight_quantization == "separate":
        transposes = [sum(t for name, t in c.transposes if name == "quantize_128x128") for c in (calls, full_calls)]
        assert transposes[0] == transposes[1] - 1
    else:
        assert calls.counts[QUANTIZING_GEMMS] == full_calls.counts[QUANTIZING_GEMMS] - 1


_TRANSPOSE_CASES = {  # (frozen, backward, (W13^T, w2^T) made)
    "full": ((), "fp8", (True, True)),
    "x_frozen": (("x",), "fp8", (False, True)),
    "w2_alone": (("x", "probs", "w1", "w3"), "fp8", (False, False)),
    "bf16_fc1_dgrad": ((), "bf16_fc1_dgrad", (False, True)),
    "bf16": ((), "bf16", (False, False)),
}


@pytest.mark.parametrize(
    ("frozen", "backward", "transposes", "recompute"),
    [
        pytest.param(*case, recompute, id=f"{name}-{'recompute' if recompute else 'stored'}")
        for name, case in _TRANSPOSE_CASES.items()
        for recompute in (False, True)
        if not (recompute and case[1] == "bf16")  # the BF16 ablation reads FC1's saved output
    ],
)
def test_forward_weight_cache_makes_only_the_transposes_backward_reads(frozen, backward, transposes, recompute):
    """``weight_cache="forward"`` writes beside the forward tiles only the transposes of the dgrads that run in
    FP8, (W13^T, w2^T) = ``transposes``: none for FC1's when x needs no gradient or FC1's dgrad runs in BF16, none
    at all where w2 alone trains or backward is BF16. Backward quantizes no weight again, and every gradient is
    the same bits as with ``"off"``."""
    x, probs, ids, weights = _experts_inputs()
    grad = torch.randn_like(x)
    leaves = dict(zip(("x", "probs", "w1", "w2", "w3"), (x, probs, *weights), strict=True))
    leaves.update({name: leaves[name].detach() for name in frozen})
    wanted = [t for t in leaves.values() if t.requires_grad]
    kwargs = {"recompute_experts": recompute, "backward": backward}
    args = (leaves["x"], leaves["probs"], ids, leaves["w1"], leaves["w2"], leaves["w3"])
    with _Calls() as forward:
        out = fp8flow_routed_experts(*args, weight_cache="forward", **kwargs)
    with _Calls() as backward_calls:
        got = torch.autograd.grad(out, wanted, grad)
    off = torch.autograd.grad(fp8flow_routed_experts(*args, **kwargs), wanted, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, off, strict=True))
    # W13 and w2 in one launch where they take the same orientations, else one each (W13 first)
    pair = transposes[0] == transposes[1]
    made = [("quantize_128x128_pair", transposes[0])] if pair else [("quantize_128x128", t) for t in transposes]
    assert [c for c in forward.transposes if c[0].startswith("quantize_128x128")] == made
    assert backward_calls.counts["quantize_128x128"] == backward_calls.counts["quantize_128x128_pair"] == 0


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_w2_alone_training_runs_only_its_weight_gradient(recompute):
    """Only w2 needs a gradient (x, the probs, w1 and w3 frozen): backward runs FC2's wgrad and nothing before it
    (no FC2 dgrad, no SwiGLU backward, no FC1 GEMM), and w2's gradient is the same bits as a full backward's."""
    x, probs, ids, weights = _experts_inputs()
    grad = torch.randn_like(x)
    kwargs = {"recompute_experts": recompute}
    (full,) = torch.autograd.grad(fp8flow_routed_experts(x, probs, ids, *weights, **kwargs), weights[1], grad)
    for i in (0, 2):
        weights[i].requires_grad_(False)
    with _Calls() as calls:
        out = fp8flow_routed_experts(x.detach(), probs.detach(), ids, *weights, **kwargs)
        (got,) = torch.autograd.grad(out, weights[1], grad)
    assert torch.equal(got, full)
    assert calls.gemms == 2 + recompute  # forward's FC1 and FC2, and FC1 again to recompute a8
    assert calls.counts["grouped_gemm_fp8_wgrad"] == 1 and calls.counts["swiglu_quant_backward"] == 0


def test_inference_makes_no_backward_operands():
    """Without a gradient to come (no_grad): no column-wise a8, and weight_cache="forward" quantizes the forward
    orientation only (as "off" does); the output is the same bits."""
    x, probs, ids, weights = _experts_inputs()
    expected = fp8flow_routed_experts(x, probs, ids, *weights, weight_cache="forward").detach()
    with torch.no_grad(), _Calls() as calls:
        out = fp8flow_routed_experts(x, probs, ids, *weights, weight_cache="forward")
    assert torch.equal(out, expected)
    assert ("swiglu_quant", False) in calls.transposes and not any(t for _, t in calls.transposes)
    assert calls.weight_quantizations == 2  # W13 and w2, forward orientation only (by the GEMMs here)


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("weight_quantization", ["separate"], indirect=True)  # FP8 tiles made before the GEMMs
def test_eager_layer_frees_each_operand_after_its_last_use(recompute, weight_quantization, monkeypatch):
    """Run eagerly (``quantize_``'s default), the layer frees each intermediate after its last use, as a compiled
    graph does: when FC2's forward GEMM runs, FC1's operands (the permuted rows, W13's FP8 tiles) and, when
    recomputing, h are gone; when FC1's weight gradients are written, so are dy's FP8 rows, FC1's dgrad output
    ``[M, D]`` and a recomputed h. (Python holds a local to the end of its function unless told otherwise.)"""
    from fp8flow_ao import moe as moe_module

    gemms, alive = [], {}  # per _expert_gemm call: weak references to its A operand, B tiles and output
    expert_gemm, fc1_wgrad = moe_module._expert_gemm, moe_module._fc1_wgrad

    def is_alive(refs):
        return [ref() is not None for ref in refs]

    def watched_gemm(a, a_scale, b, offs):
        if len(gemms) == 1:  # FC2's forward: FC1's rows, tiles, output h
            alive["fc2 forward"] = is_alive(gemms[0])
        out = expert_gemm(a, a_scale, b, offs)
        gemms.append(tuple(weakref.ref(t) for t in (a, b.b, out)))
        return out

    def watched_fc1_wgrad(*args):
        # the last two GEMMs: FC2's dgrad (A = dy's rows), FC1's dgrad (its output); backward's first: FC1
        # again when recomputing (its output h), else FC2's dgrad (its output, SwiGLU backward's input)
        alive["fc1 wgrad"] = is_alive((gemms[-2][0], gemms[-1][2], gemms[2][2]))
        return fc1_wgrad(*args)

    monkeypatch.setattr(moe_module, "_expert_gemm", watched_gemm)
    monkeypatch.setattr(moe_module, "_fc1_wgrad", watched_fc1_wgrad)
    x, probs, ids, weights = _experts_inputs()
    out = fp8flow_routed_experts(x, probs, ids, *weights, recompute_experts=recompute)
    out.backward(torch.randn_like(out))
    assert len(gemms) == 4 + recompute
    assert alive["fc2 forward"] == [False, False, not recompute]
    assert alive["fc1 wgrad"] == [False, False, False]


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_zero_tokens_with_an_expanded_output_gradient(recompute):
    """A batch of no tokens (a rank whose batch routed nothing) under the usual ``out.sum()`` loss: the output
    gradient autograd passes back is an expanded, stride-0 empty tensor. Its gradients are empty, the weights'
    exactly zero."""
    x, probs, ids, weights = _experts_inputs(tokens=8)
    x, probs = (t[:0].detach().requires_grad_() for t in (x, probs))
    out = fp8flow_routed_experts(x, probs, ids[:0], *weights, recompute_experts=recompute)
    out.float().sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape and probs.grad.shape == probs.shape
    assert all(w.grad is not None and not w.grad.any() for w in weights)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "inductor"], ids=["eager", "inductor"])
def test_gpu_recompute_trains_as_stored_in_torchtitan_s_setting(backend):
    """The convergence runs' setting at one layer: the fp8flow_gpu flavor's MoE shape with learned routing,
    fp32 parameters, bf16 autocast, the routed experts eager or compiled by inductor (the converter's
    ``compile_experts``), three AdamW steps. ``recompute_experts`` must give the stored path's outputs and
    gradients bit for bit at every step. (In 2000-step torchtitan runs, recompute_experts ended +0.54% +- 0.49%
    above its seeds' FP8-Flow runs, 5 runs from -0.30% to +1.02%, ``convergence.md``: this says whether the
    layer differs or the runs' noise does.)"""
    torch._dynamo.reset()
    ref = make_moe(2048, 768, experts=32, top_k=8, expert_bias=[0.0] * 32, device="cuda", dtype=torch.float32)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [[torch.randn(2, 2048, 2048, device="cuda", generator=g) for _ in range(2)] for _ in range(3)]
    results = []
    for recompute in (False, True):
        moe = convert_moe_layer(copy.deepcopy(ref), recompute_experts=recompute)
        moe.experts.fp8flow_compile_backend = backend
        opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
        steps = []
        for x, grad in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                steps.append(run_step(moe, x, grad))
            opt.step()
            opt.zero_grad()
        results.append(steps)
    for i, (stored, recomputed) in enumerate(zip(*results, strict=True)):
        for key in ("out", "x", *PARAMS):
            assert torch.isfinite(stored[key]).all(), (i, key)
            assert torch.equal(stored[key], recomputed[key]), (i, key)


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_gpu_new_token_counts_compile_no_kernel(recompute):
    """The layer forward + backward at a new token count (skewed routing) compiles no kernel: the counts
    reach the kernels as arguments Triton does not specialize on, every padded count is a multiple of 128, and
    no tile is sized to a count (the sizes span 32, 16 and 8 row blocks of route_pad's scan; each keeps more than
    128 rows per expert, so the GEMMs quantize the weights the same way at all of them)."""

    def run(tokens: int) -> None:
        x, probs, _, weights = _experts_inputs(tokens=tokens)
        ids = make_routing("skewed", tokens, 2, 4, "cuda")
        fp8flow_routed_experts(x, probs, ids, *weights, recompute_experts=recompute).float().square().sum().backward()

    assert_sizes_compile_nothing_new(run, (2048, 2047, 2041, 2032, 1999, 1027, 1000, 517, 300))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["x_bf16", "x_fp32"])
def test_recompute_matches_stored_with_fp32_weights_under_autocast(x_dtype):
    """torchtitan's one-GPU setting: fp32 parameters, forward under bf16 autocast, eager experts.

    On an H200 torchtitan's fp8flow_gpu flavor trained with ``recompute_experts`` and eager experts
    (``compile_experts = "off"``) got NaN gradients at its first step, while the stored path and the
    compiled recompute trained normally (benchmarks/results/torchtitan_e2e.md). This reproduces that
    setting at the layer, at the flavor's expert shapes on a GPU: the gradients must be finite and
    recompute must stay bit-identical to the stored path. On the CPU it caught ambient autocast
    running the references' matmuls in bf16 in forward but not in the recompute (probs' gradient
    differed), fixed by running the path with autocast off. On the H200 it caught the cause of the
    NaN: recompute quantizes fp32 W13 in both orientations at once, and triton 3.6 miscompiled that
    kernel's transpose (wrong columns of dx), fixed by two passes for fp32 (quantize_128x128.py).
    Fresh allocations are NaN-filled here (torch's deterministic mode), so reading memory no kernel
    wrote shows up as a NaN every time.
    """
    gpu = DEVICE == "cuda"
    tokens, dim, hidden, experts, top_k = (4096, 2048, 768, 32, 8) if gpu else (256, 256, 128, 4, 2)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(tokens, dim, device=DEVICE, generator=gen).to(x_dtype)
    logits = torch.randn(tokens, experts, device=DEVICE, generator=gen)
    probs, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    w1, w3 = (torch.randn(experts, hidden, dim, device=DEVICE, generator=gen) * 0.02 for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, device=DEVICE, generator=gen) * 0.02
    grad = torch.randn(tokens, dim, device=DEVICE, generator=gen).to(x_dtype)

    def step(recompute: bool) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in (x, probs, w1, w2, w3)]
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = fp8flow_routed_experts(leaves[0], leaves[1], ids, *leaves[2:], recompute_experts=recompute)
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    # NaN in every fresh allocation, so a kernel that reads memory nothing wrote fails here every time
    # instead of now and then (the GPU NaN came in 3 of 5 recompute runs, in both eager and compiled).
    with nan_filled_allocations():
        stored, recomputed = step(False), step(True)
    for name, a, b in zip(("out", "x", "probs", "w1", "w2", "w3"), stored, recomputed, strict=True):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backward", ["fp8", "bf16_fc1_dgrad", "emulated_fp8_fc1_dgrad"])
@pytest.mark.parametrize("score_before", [False, True], ids=["score_after", "score_before"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_routed_path_compiles_fullgraph_bit_exact(recompute, score_before, backward):
    """Our routed path, forward and backward, traces as one graph and matches eager bit for bit (FC1's
    dgrad in FP8 or BF16).

    The routing is an input here: compiling the whole torchtitan layer also runs its router through
    AOT decompositions, which on a GPU may move a BF16 score by an ulp and flip a near-tie in top-k.
    """
    tokens, dim, hidden, experts, top_k = 128, 256, 128, 4, 2
    x = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16)
    probs = torch.rand(tokens, top_k, device=DEVICE)
    ids = torch.stack([torch.randperm(experts, device=DEVICE)[:top_k] for _ in range(tokens)])
    weights = [torch.randn(experts, *s, device=DEVICE, dtype=torch.bfloat16) * 0.05 for s in ((hidden, dim),) * 2]
    w2 = torch.randn(experts, dim, hidden, device=DEVICE, dtype=torch.bfloat16) * 0.05
    grad = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16)

    def step(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, probs, weights[0], w2, weights[1])]
        kwargs = {"recompute_experts": recompute, "score_before_experts": score_before, "backward": backward}
        out = fn(leaves[0], leaves[1], ids, *leaves[2:], **kwargs)
        out.backward(grad)
        return [t.grad for t in leaves]

    eager = step(fp8flow_routed_experts)
    torch._dynamo.reset()  # each option combination is its own graph: keep under dynamo's recompile limit
    compiled = step(torch.compile(fp8flow_routed_experts, fullgraph=True, backend="aot_eager"))
    for name, a, b in zip(("x", "probs", "w1", "w2", "w3"), eager, compiled, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("routing", ["balanced", "llama4_balanced"])
def test_converted_layer_compiles_fullgraph(runs, routing):
    """The whole converted torchtitan layer, forward and backward, traces as one graph (no break)."""
    x, grad = runs[routing]["inputs"]
    moe = convert_moe_layer(copy.deepcopy(runs[routing]["model"]), recompute_experts=True)
    # aot_eager: dynamo with fullgraph=True and AOT autograd on fakes, without inductor's slow CPU codegen
    moe.compile(fullgraph=True, backend="aot_eager")
    compiled = run_step(moe, x, grad)
    eager = runs[routing][True]
    assert torch.equal(compiled["out"], eager["out"])
    for key in ("x", *PARAMS):
        assert sqnr_db(eager[key], compiled[key]) >= 30, key


def test_compile_backend_compiles_the_routed_call_once_for_all_layers(runs):
    """``fp8flow_compile_backend`` (the torchtitan converter's ``compile_experts``) runs the experts' call of
    the routed path under torch.compile(fullgraph=True): the same bits as eager; the layer's own forward
    and the experts module's ``__call__`` (its hooks) stay eager; one graph serves same-shaped layers."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    x, grad = runs["balanced"]["inputs"]
    for _ in range(2):  # two layers
        moe = convert_moe_layer(copy.deepcopy(runs["balanced"]["model"]))
        moe.experts.fp8flow_compile_backend = "aot_eager"
        got = run_step(moe, x, grad)
        for key in ("out", "x", *PARAMS):
            assert torch.equal(got[key], runs["balanced"][False][key]), key
    assert len(_debug_get_cache_entry_list(_routed_experts.__code__)) == 1
    assert not _debug_get_cache_entry_list(fp8flow_routed_experts.__code__)  # its checks and lookup stay eager
    assert not _debug_get_cache_entry_list(FP8FlowMoE.forward.__code__)
    assert not _debug_get_cache_entry_list(type(moe.experts).forward.__code__)
    moe.compile(fullgraph=True, backend="aot_eager")  # a user compiling the layer traces the path with it
    assert torch.equal(run_step(moe, x, grad)["out"], got["out"])


@pytest.mark.parametrize(("backward", "compiled"), [("bf16_fc1_dgrad", True), ("bf16", False)])
def test_compile_backend_compiles_training_modes_not_ablations(runs, backward, compiled):
    """FC1's dgrad in BF16 is compiled like FP8-Flow; an ablation's backward (autograd) stays eager."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    x, grad = runs["balanced"]["inputs"]
    eager = run_step(convert_moe_layer(copy.deepcopy(runs["balanced"]["model"]), backward=backward), x, grad)
    moe = convert_moe_layer(copy.deepcopy(runs["balanced"]["model"]), backward=backward)
    moe.experts.fp8flow_compile_backend = "aot_eager"
    got = run_step(moe, x, grad)
    assert bool(_debug_get_cache_entry_list(_routed_experts.__code__)) == compiled
    for key in ("out", "x", *PARAMS):
        assert torch.equal(got[key], eager[key]), key


@pytest.mark.parametrize("backend", ["aot_min_cut", "inductor"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_compiled_routed_path_saves_x8_not_the_permuted_rows(recompute, backend):
    """Compiled as a user would (``torch.compile``, AOT autograd's common-subexpression elimination on),
    the path keeps what eager keeps of the tokens: ``x8 [T, D]``, not the permuted rows ``[~k*T, D]``
    nor their column-wise copy ``[D, ~k*T]``. Backward's gather is a distinct op, so the elimination
    cannot merge it with forward's; under inductor too, whose joint-graph passes (no-op removal) run
    before it. The weights stay parameters: nothing FP8 of them is held."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if backend == "aot_min_cut":  # the partitioner alone, without inductor's passes
        backend = aot_autograd(
            fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=min_cut_rematerialization_partition
        )
    tokens, dim, hidden, experts, top_k = 256, 256, 384, 4, 2
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).requires_grad_()
    probs = torch.rand(tokens, top_k, generator=g).requires_grad_()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w1, w2, w3 = (
        torch.nn.Parameter((torch.randn(experts, *s, generator=g) * 0.05).to(torch.bfloat16))
        for s in ((hidden, dim), (dim, hidden), (hidden, dim))
    )
    saved = []
    routed = torch.compile(fp8flow_routed_experts, fullgraph=True, backend=backend)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = routed(x, probs, ids, w1, w2, w3, recompute_experts=recompute)
    out.backward(torch.ones_like(out))
    fp8 = [tuple(t.shape) for t in saved if t.dtype == FP8]
    assert (tokens, dim) in fp8, "x8 itself"
    assert not any(dim in s and math.prod(s) > tokens * dim for s in fp8), f"no permuted rows of x: {fp8}"
    assert not any(len(s) == 3 for s in fp8), "no FP8 weight copy"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hidden": 192}, ValueError, "expert ffn dim H must be a multiple of 128"),
        ({"w2_shape": (4, 128, 256)}, ValueError, "w2 \\[E, D, H\\]"),
        ({"probs_shape": (64, 2)}, ValueError, "top_scores"),
        ({"ids_dtype": torch.float32}, TypeError, "selected_experts_indices"),
        # on CPU tensors the ids' values are checked for free: an expert past E (or below 0) is not clamped
        ({"bad_id": 4}, ValueError, r"^selected_experts_indices values must lie in \[0, 4\)"),
        ({"bad_id": -1}, ValueError, r"^selected_experts_indices values must lie in \[0, 4\)"),
        ({"w3_dtype": torch.float32}, TypeError, "w1, w2, w3 must share one dtype"),
        ({"w2_device": "meta"}, ValueError, "share one device"),
        ({"recompute_experts": "no"}, TypeError, "recompute_experts must be a bool"),
        ({"score_before_experts": 1}, TypeError, "score_before_experts must be a bool"),
        ({"ep_group": "world"}, TypeError, "ep_group must be a torch.distributed.ProcessGroup or None, got str"),
    ],
)
def test_routed_experts_bad_input(kwargs, error, match):
    tokens, dim, hidden, experts = 128, 256, kwargs.pop("hidden", 128), 4
    x = torch.randn(tokens, dim, dtype=torch.bfloat16)
    probs = torch.rand(kwargs.pop("probs_shape", (tokens, 2)))
    ids = torch.randint(0, experts, (tokens, 2)).to(kwargs.pop("ids_dtype", torch.int64))
    if "bad_id" in kwargs:
        ids[5, 1] = kwargs.pop("bad_id")
    w1 = torch.randn(experts, hidden, dim, dtype=torch.bfloat16)
    w3 = w1.to(kwargs.pop("w3_dtype", torch.bfloat16))
    w2 = torch.randn(kwargs.pop("w2_shape", (experts, dim, hidden)), dtype=torch.bfloat16)
    w2 = w2.to(kwargs.pop("w2_device", "cpu"))
    with pytest.raises(error, match=match):
        fp8flow_routed_experts(x, probs, ids, w1, w2, w3, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("routing", ["balanced", "skewed", "llama4_skewed"])
def test_gpu_kernels_match_bf16_layer_without_sync(routing, recompute):
    """Triton kernels at a moderate shape: numerics vs the BF16 layer, no device sync, deterministic, compiles."""
    dim, hidden, tokens = 1024, 512, 2048
    kwargs = {"balanced": {"experts": 8, "top_k": 4, "expert_bias": None}}.get(routing, ROUTINGS[routing])
    ref = make_moe(dim, hidden, **kwargs, device="cuda")
    x, grad = _inputs(dim, tokens, device="cuda")
    expected = run_step(ref, x, grad)
    moe = convert_moe_layer(copy.deepcopy(ref), recompute_experts=recompute)
    run_step(moe, x, grad)  # warm-up: Triton compiles outside the sync check
    moe.zero_grad()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = run_step(moe, x, grad)
        moe.zero_grad()
        second = run_step(moe, x, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert isinstance(moe, FP8FlowMoE)
    assert sqnr_db(expected["out"], first["out"]) >= 25
    for key in ("x", *PARAMS):
        assert sqnr_db(expected[key], first[key]) >= 22, key
        assert torch.equal(first[key], second[key]), key
    moe.zero_grad()
    moe.compile(fullgraph=True)
    compiled = run_step(moe, x, grad)
    assert sqnr_db(expected["out"], compiled["out"]) >= 25


# Shapes no benchmark or issue names: widths that are odd multiples of 128 (no 256-wide tiles), one
# expert, top_k == E, 64 experts with a few rows each, odd token counts per expert, empty experts.
UNLISTED_SHAPES = {
    "D384_H640_E3_top2": {"dim": 384, "hidden": 640, "tokens": 250, "experts": 3, "top_k": 2, "expert_bias": [1.0, 0.0, -0.5]},
    "D640_H384_E17_top3": {
        "dim": 640, "hidden": 384, "tokens": 1000, "experts": 17, "top_k": 3,
        "expert_bias": [-5.0 if i % 6 == 5 else 0.0 for i in range(17)],
    },
    "D1152_H128_E1_top1_score_before": {"dim": 1152, "hidden": 128, "tokens": 78, "experts": 1, "expert_bias": [0.0], **LLAMA4},
    "D1408_H896_E64_top6": {"dim": 1408, "hidden": 896, "tokens": 512, "experts": 64, "top_k": 6, "expert_bias": [-5.0 if i % 9 == 0 else 0.0 for i in range(64)]},
    "D256_H256_E5_top5_T8": {"dim": 256, "hidden": 256, "tokens": 8, "experts": 5, "top_k": 5, "expert_bias": [0.0] * 5},
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("shape", list(UNLISTED_SHAPES))
def test_gpu_layer_matches_bf16_at_unlisted_shapes(shape, recompute):
    """The Triton/Gluon kernels away from the benchmark shapes: numerics vs the BF16 layer (the thresholds of
    :func:`test_matches_bf16_layer`), exactly zero gradients for experts that get no token, compiled too."""
    kwargs = dict(UNLISTED_SHAPES[shape])
    dim, tokens = kwargs.pop("dim"), kwargs.pop("tokens")
    ref = make_moe(dim, kwargs.pop("hidden"), **kwargs, device="cuda")
    x, grad = _inputs(dim, tokens, device="cuda")
    expected = run_step(ref, x, grad)
    moe = convert_moe_layer(copy.deepcopy(ref), recompute_experts=recompute)
    for compiled in (False, True):
        if compiled:
            moe.zero_grad()
            torch._dynamo.reset()  # every shape is a new graph: keep under dynamo's recompile limit
            moe.compile(fullgraph=True)
        ours = run_step(moe, x, grad)
        assert sqnr_db(expected["out"], ours["out"]) >= 25
        assert sqnr_db(expected["x"], ours["x"]) >= 22
        assert sqnr_db(expected["router.gate.weight"], ours["router.gate.weight"]) >= 22
        for name in PARAMS[:3]:
            empty = torch.count_nonzero(expected[name].flatten(1), dim=1) == 0
            assert torch.count_nonzero(ours[name][empty]) == 0, name
            assert sqnr_db(expected[name][~empty], ours[name][~empty]) >= 22, name


def _random_routed_case(seed: int) -> dict:
    """Widths, expert counts, token counts and a skewed routing no test names, drawn from ``seed`` (some experts
    get no token, some one); the routed function's options drawn too."""
    g = torch.Generator().manual_seed(seed)
    draw = int_drawer(g)
    dim, hidden, experts, tokens = 128 * draw(12), 128 * draw(12), draw(48), draw(3000)
    top_k = draw(min(experts, 8))
    popularity = torch.rand(experts, generator=g) ** 4 * (torch.rand(experts, generator=g) > 0.2)
    popularity += 1e-6  # every expert possible, the unpopular ones seldom chosen
    ids = torch.multinomial(popularity.expand(tokens, -1), top_k, generator=g)
    w1, w3 = (torch.randn(experts, hidden, dim, generator=g) * dim**-0.5 for _ in range(2))
    return {
        "x": torch.randn(tokens, dim, generator=g) * torch.logspace(-1, 1, tokens)[:, None],
        "probs": torch.rand(tokens, top_k, generator=g), "ids": ids,
        "w1": w1, "w2": torch.randn(experts, dim, hidden, generator=g) * hidden**-0.5, "w3": w3,
        "grad": torch.randn(tokens, dim, generator=g),
        "options": {"recompute_experts": bool(seed % 2), "score_before_experts": bool(seed % 3 == 0)},
    }  # fmt: skip


def _routed_step(case: dict, device: str) -> dict[str, torch.Tensor]:
    """Forward + backward of :func:`fp8flow_routed_experts` on ``device``: out and the gradients."""
    leaves = {n: case[n].to(device).to(torch.bfloat16).requires_grad_() for n in ("x", "w1", "w2", "w3")}
    probs = case["probs"].to(device).requires_grad_()
    out = fp8flow_routed_experts(
        leaves["x"], probs, case["ids"].to(device), leaves["w1"], leaves["w2"], leaves["w3"], **case["options"]
    )
    out.backward(case["grad"].to(device).to(out.dtype))
    return {"out": out.detach(), "probs": probs.grad} | {n: t.grad for n, t in leaves.items()}


def routed_errors(gpu: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor]) -> dict[str, float]:
    """:func:`fp8_helpers.rel_error` of each result: out and x token by token, the weights expert by expert (an
    expert with one token has rank-1 gradients whose rows are multiples of one row: a row's error is then the
    error of a single, possibly cancelling, scalar), the top-k scores' gradients as a whole (rows of k)."""
    views = dict.fromkeys(("out", "x"), torch.as_tensor) | dict.fromkeys(("w1", "w2", "w3"), lambda t: t.flatten(1))
    views["probs"] = lambda t: t.reshape(1, -1)
    return {n: rel_error(view(gpu[n]), view(cpu[n])) for n, view in views.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(10))
def test_gpu_routed_experts_match_the_cpu_path_row_by_row(seed):
    """The GPU kernels against the CPU path (the torch references) at random shapes and routings, token by token
    and expert by expert: a wrong tile, group or row shows however small its magnitude (its error is ~1 or more),
    and an expert with no token must get exactly zero gradients. The two paths differ by the GEMMs' accumulation
    order, which moves some elements of the FP8 SwiGLU output and of its gradient by one FP8 step (1/16-1/8).
    Measured over these seeds on an H200 (session 52): out 0.014-0.035, x 0.012-0.024, weights 0.004-0.025,
    the scores' gradients 0.0011-0.0013; the bounds are twice the worst or more."""
    case = _random_routed_case(seed)
    gpu, cpu = _routed_step(case, "cuda"), _routed_step(case, "cpu")
    assert all(gpu[n].dtype == cpu[n].dtype for n in cpu)
    errors = routed_errors(gpu, cpu)
    bounds = {"out": 0.07, "x": 0.07, "w1": 0.05, "w2": 0.05, "w3": 0.05, "probs": 0.005}
    assert all(errors[n] < bound for n, bound in bounds.items()), errors


class _ReplayOnTheCpu(TorchDispatchMode):
    """Runs each ``fp8flow`` op as called (the GPU kernels) and again on CPU copies of its arguments (the op's CPU
    kernel: its torch reference); :attr:`calls` keeps, per call, the op's name and both results as
    ``(outputs, arguments)`` on the CPU (an op that writes into an argument is compared on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "fp8flow":
            return func(*args, **kwargs)

        def to_cpu(t):
            return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t

        cpu_args, cpu_kwargs = tree_map(to_cpu, (args, kwargs))
        out = func(*args, **kwargs)
        want = (func(*cpu_args, **cpu_kwargs), cpu_args, cpu_kwargs)
        self.calls.append((func._opname, tree_map(to_cpu, (out, args, kwargs)), want))
        return out


def _written(t: torch.Tensor) -> torch.Tensor:
    """Where a kernel wrote ``t``, with every fresh allocation filled (``fill_uninitialized_memory``: NaN, or the
    integer maximum): the elements that are not the fill."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8) & 0x7F != 0x7F
    if t.is_floating_point():
        return ~torch.isnan(t)
    return t != torch.iinfo(t.dtype).max


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [1, 3, 4, 8])
def test_gpu_every_op_of_a_random_step_matches_its_reference(seed):
    """Each op call of a GPU routed step (:func:`_random_routed_case`) replayed on the CPU on the same inputs:
    every element a kernel writes equals its reference's as the op's own tests require
    (:func:`_assert_written_matches`: bit for bit but for the GEMMs' sums and the SwiGLU ops' ``exp``). Fresh
    allocations hold NaN, so only what a kernel wrote is compared (some outputs have rows no later op reads, left
    unwritten); what later ops read is checked by :func:`test_gpu_routed_experts_match_the_cpu_path_row_by_row`."""
    case = _random_routed_case(seed)
    replay = _ReplayOnTheCpu()
    with nan_filled_allocations(), replay:
        _routed_step(case, "cuda")
    assert len(replay.calls) >= 8, [name for name, _, _ in replay.calls]
    for i, (name, got, want) in enumerate(replay.calls):
        outputs = [t for t in tree_leaves(got[0]) if isinstance(t, torch.Tensor)]
        assert any(_written(t).any() for t in outputs), (i, name, "wrote nothing: nothing was compared")
        pairs = zip(tree_leaves(got), tree_leaves(want), strict=True)
        for j, (g, w) in enumerate(p for p in pairs if isinstance(p[0], torch.Tensor)):
            assert g.shape == w.shape and g.dtype == w.dtype, (i, name, j)
            _assert_written_matches(name, g, w, (i, name, j, tuple(g.shape)))


def _assert_written_matches(name: str, got: torch.Tensor, want: torch.Tensor, where: tuple) -> None:
    """What a kernel wrote against its reference: bit for bit, except where the op's own tests allow less --
    the GEMMs' float outputs (accumulation order: row by row within the GEMM tolerance) and the SwiGLU ops,
    whose ``exp`` rounds differently on the GPU (``test_swiglu_quant.py``: FP8 data >= 99.9% bit-exact and one
    E4M3 step off elsewhere; ``grad_probs`` to 1e-5)."""
    written = _written(got)
    fp8 = got.dtype == torch.float8_e4m3fn
    if name.startswith("grouped_gemm") and got.is_floating_point() and not fp8:
        rows = written.reshape(-1, got.shape[-1]).all(dim=1)
        g, w = got.reshape(-1, got.shape[-1])[rows], want.reshape(-1, got.shape[-1])[rows]
        assert rel_error(g, w) < GEMM_TOLERANCE[got.dtype], (*where, rel_error(g, w))
    elif name.startswith("swiglu") and fp8:
        assert_fp8_close(got[written], want[written], 0.999, str(where))
    elif name.startswith("swiglu") and got.dim() == 1:  # grad_probs
        g, w = got[written], want[written]
        atol = 1e-6 * float(w.abs().max()) if w.numel() else 0.0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=atol, msg=str(where))
    else:
        bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
        assert torch.equal(bits(got)[written], bits(want)[written]), where


def test_weight_gradients_leave_the_function_contiguous():
    """w1's and w3's gradients come out of FC1's wgrad as two contiguous tensors, not strided halves
    of one [E, 2H, D] result (autograd would copy those into the parameters' layout: ~2 ms per
    DeepSeek-like step). ``autograd.grad`` returns the Function's gradients as they are."""
    experts, dim, hidden, tokens, top_k = 4, 256, 128, 64, 2
    g = torch.Generator(device=DEVICE).manual_seed(3)
    x = torch.randn(tokens, dim, device=DEVICE, generator=g).to(torch.bfloat16)
    w1, w3 = (torch.randn(experts, hidden, dim, device=DEVICE, generator=g).to(torch.bfloat16) for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, device=DEVICE, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, top_k, device=DEVICE, generator=g)
    ids = torch.randint(0, experts, (tokens, top_k), device=DEVICE, generator=g)
    weights = [w.requires_grad_() for w in (w1, w2, w3)]
    out = fp8flow_routed_experts(x, scores, ids, *weights)
    grads = torch.autograd.grad(out, weights, torch.randn_like(out))
    for name, w, grad in zip(("w1", "w2", "w3"), weights, grads, strict=True):
        assert grad.shape == w.shape and grad.is_contiguous(), name


# Gradient accumulation: the wgrad epilogue adds into the weights' existing gradients (fused_grad_target).
def _accumulation_inputs(dtype: torch.dtype, seed: int = 0):
    """Tokens, router output (skewed: expert 3 gets nothing) and [w1, w2, w3] leaf weights of ``dtype``."""
    experts, hidden, dim, tokens, top_k = 4, 128, 256, 96, 2
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, dim, device=DEVICE, generator=g).to(torch.bfloat16).requires_grad_()
    scores = torch.rand(tokens, top_k, device=DEVICE, generator=g).requires_grad_()
    ids = torch.stack([torch.randperm(experts - 1, device=DEVICE, generator=g)[:top_k] for _ in range(tokens)])
    shapes = ((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))
    weights = [torch.nn.Parameter(0.05 * torch.randn(s, device=DEVICE, generator=g).to(dtype)) for s in shapes]
    return x, scores, ids, weights


def _layer_loss(x, scores, ids, weights, **kwargs) -> torch.Tensor:
    return fp8flow_routed_experts(x, scores, ids, *weights, **kwargs).float().square().mean()


def _fresh_grads(x, scores, ids, weights, **kwargs) -> list[torch.Tensor]:
    """The weights' gradients from one backward with none before (the plain path)."""
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    _layer_loss(x.detach(), scores.detach(), ids, copies, **kwargs).backward()
    return [w.grad for w in copies]


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_accumulates_into_existing_weight_gradients(dtype, recompute):
    """A second micro-batch's .backward() adds each weight gradient into ``w.grad`` in the wgrad epilogue (three
    accumulating launches: w2, w1, w3; no fresh wgrad and no add), in place (same storage); the input and
    router gradients are those of the plain path, bit for bit."""
    x, scores, ids, weights = _accumulation_inputs(dtype)
    fresh = _fresh_grads(x, scores, ids, weights, recompute_experts=recompute)
    _layer_loss(x, scores, ids, [w.detach().clone().requires_grad_() for w in weights]).backward()
    plain_x, plain_scores = x.grad, scores.grad
    x.grad = scores.grad = None
    existing = [torch.randn_like(w) for w in weights]
    for w, e in zip(weights, existing, strict=True):
        w.grad = e.clone()
    storages = [w.grad.data_ptr() for w in weights]
    with FP8FlowOpCounter() as counter:
        _layer_loss(x, scores, ids, weights, recompute_experts=recompute).backward()
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 3 and counter.counts["grouped_gemm_fp8_wgrad"] == 0
    for w, e, f, storage in zip(weights, existing, fresh, storages, strict=True):
        assert w.grad.data_ptr() == storage and w.grad.dtype == dtype
        assert_accumulated(w.grad, e, f)
    assert torch.equal(x.grad, plain_x) and torch.equal(scores.grad, plain_scores)


def test_only_the_weights_holding_a_gradient_accumulate():
    """w1 holds a gradient, w2 and w3 do not: w1's half of FC1's wgrad adds into it; w3's half and w2's wgrad
    are written fresh, the same bits as the one launch that writes both halves."""
    x, scores, ids, weights = _accumulation_inputs(torch.float32)
    fresh = _fresh_grads(x, scores, ids, weights)
    existing = torch.randn_like(weights[0])
    weights[0].grad = existing.clone()
    with FP8FlowOpCounter() as counter:
        _layer_loss(x, scores, ids, weights).backward()
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 1 and counter.counts["grouped_gemm_fp8_wgrad"] == 2
    assert torch.equal(weights[0].grad, existing + fresh[0])
    assert torch.equal(weights[1].grad, fresh[1]) and torch.equal(weights[2].grad, fresh[2])


def test_post_accumulate_grad_hooks_see_the_sums():
    x, scores, ids, weights = _accumulation_inputs(torch.float32)
    fresh = _fresh_grads(x, scores, ids, weights)
    existing = [torch.randn_like(w) for w in weights]
    seen = []
    for w, e in zip(weights, existing, strict=True):
        w.grad = e.clone()
        w.register_post_accumulate_grad_hook(lambda p: seen.append((p, p.grad.clone())))
    with FP8FlowOpCounter() as counter:
        _layer_loss(x, scores, ids, weights).backward()
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 3 and len(seen) == 3
    for p, grad in seen:
        i = next(i for i, w in enumerate(weights) if w is p)
        assert torch.equal(grad, existing[i] + fresh[i])


@pytest.mark.parametrize("how", ["autograd_grad", "backward_inputs_without_weights", "tensor_hook", "create_graph"])
def test_layer_takes_the_plain_path_where_fusing_is_unsafe(how):
    """torch.autograd.grad hands the gradients to its caller (w.grad stays untouched); backward(inputs=[x])
    accumulates into no weight; a tensor hook must see (and may change) the gradient; create_graph accumulates
    out of place. Each gets exactly what it would without the fusion."""
    x, scores, ids, weights = _accumulation_inputs(torch.float32)
    fresh = _fresh_grads(x, scores, ids, weights)
    existing = [torch.randn_like(w) for w in weights]
    for w, e in zip(weights, existing, strict=True):
        w.grad = e.clone()
        if how == "tensor_hook":
            w.register_hook(lambda g: 2 * g)
    with FP8FlowOpCounter() as counter:
        loss = _layer_loss(x, scores, ids, weights)
        if how == "autograd_grad":
            grads = torch.autograd.grad(loss, weights)
            assert all(torch.equal(g, f) for g, f in zip(grads, fresh, strict=True))
        elif how == "backward_inputs_without_weights":
            loss.backward(inputs=[x])
        else:
            loss.backward(create_graph=how == "create_graph")
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 0
    scale = {"autograd_grad": 0, "backward_inputs_without_weights": 0, "tensor_hook": 2}.get(how, 1)
    for w, e, f in zip(weights, existing, fresh, strict=True):
        assert torch.equal(w.grad.detach(), e + scale * f if scale else e)


def test_layer_double_backward_raises_where_it_would_silently_drop_a_term():
    """A gradient penalty on dx (create_graph=True): dx is as without create_graph, and the penalty's
    backward raises instead of leaving the weights' second-order gradient at zero."""
    x, scores, ids, weights = _accumulation_inputs(torch.bfloat16)
    (plain,) = torch.autograd.grad(_layer_loss(x, scores, ids, weights), (x,))
    (grad_x,) = torch.autograd.grad(_layer_loss(x, scores, ids, weights), (x,), create_graph=True)
    assert torch.equal(grad_x.detach(), plain)
    with pytest.raises(RuntimeError, match="fp8flow_routed_experts: its backward is not differentiable"):
        grad_x.float().square().sum().backward()


def test_compiled_layer_path_does_not_fuse():
    """The compiled path's backward is traced once, so it must not depend on .grad existing: fresh gradients,
    which autograd adds to the existing ones."""
    torch._dynamo.reset()
    x, scores, ids, weights = _accumulation_inputs(torch.float32)
    fresh = _fresh_grads(x, scores, ids, weights)
    existing = [torch.randn_like(w) for w in weights]
    for w, e in zip(weights, existing, strict=True):
        w.grad = e.clone()
    loss = _layer_loss(x, scores, ids, weights, compile_backend="aot_eager")
    with FP8FlowOpCounter() as counter:  # (dynamo refuses to trace under a dispatch mode: backward only)
        loss.backward()
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 0 and counter.counts["grouped_gemm_fp8_wgrad"] == 2
    for w, e, f in zip(weights, existing, fresh, strict=True):
        torch.testing.assert_close(w.grad, e + f, rtol=1e-6, atol=1e-7)


def test_converted_layer_accumulates_over_micro_batches():
    """torchtitan's MoE layer, converted: two micro-batches without zero_grad, the second adding into the first's
    gradients in the wgrad epilogue (its experts' parameters are plain leaves)."""
    moe = convert_moe_layer(make_moe())
    x, grad = _inputs(256, 128)
    first = run_step(moe, x, grad)
    fresh = {name: first[name].clone() for name in PARAMS[:3]}
    with FP8FlowOpCounter() as counter:
        second = run_step(moe, x, grad)
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 3 and counter.counts["grouped_gemm_fp8_wgrad"] == 0
    for name in PARAMS[:3]:
        assert_accumulated(second[name], fresh[name], fresh[name])


def test_compile_mode_needs_inductor():
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    probs, ids = torch.rand(128, 2), torch.randint(0, 4, (128, 2))
    w = torch.randn(4, 128, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match='needs compile_backend="inductor"'):
        fp8flow_routed_experts(x, probs, ids, w, w.transpose(1, 2), w, compile_mode="reduce-overhead")


def _cuda_graph_rerecords() -> int:
    """How many times inductor's CUDA graph trees recorded a graph again (e.g. for a moved static input)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else sum(sum(counts.values()) for counts in manager.num_rerecord.values())


@pytest.mark.gpu
@pytest.mark.parametrize("weight_cache", ["off", "forward", "step"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_gpu_cuda_graphed_path_is_bit_identical(weight_cache, recompute):
    """``compile_mode="reduce-overhead"``: two layers a step, three steps with new tokens, routings and
    weights (an optimizer step between), every output and gradient bit for bit the eager path's. With
    ``"step"`` the cached tiles are graph inputs read in place: re-quantized into the same tensors after each
    update, so no graph is recorded again."""
    dim, hidden, experts, top_k, tokens = 1024, 512, 8, 4, 2048
    torch._dynamo.reset()
    rerecords, tile_addresses = _cuda_graph_rerecords(), set()
    layers = [
        [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.05) for s in shapes]
        for shapes in [((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))] * 2
    ]
    twins = [[w.detach().clone().requires_grad_() for w in ws] for ws in layers]
    kwargs = {"recompute_experts": recompute, "weight_cache": weight_cache}
    graphed = {"compile_backend": "inductor", "compile_mode": "reduce-overhead"}
    for step in range(3):
        x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(tokens, top_k, device="cuda")
        ids = torch.randint(0, experts - step, (tokens, top_k), device="cuda")  # later steps leave experts empty
        grad = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
        results = []
        for weights, extra in ((twins, {}), (layers, graphed)):
            leaves = [t.detach().clone().requires_grad_() for t in (x, probs)]
            h = fp8flow_routed_experts(leaves[0], leaves[1], ids, *weights[0], **kwargs, **extra)
            out = fp8flow_routed_experts(h, leaves[1], ids, *weights[1], **kwargs, **extra)
            out.backward(grad)
            results.append([out.detach().clone(), *(t.grad for t in leaves), *(w.grad for ws in weights for w in ws)])
        for i, (a, b) in enumerate(zip(*results, strict=True)):
            assert torch.equal(a, b), i
        if weight_cache == "step":  # a hit: the tiles this step's graphs read
            tile_addresses.add(tuple(t.data_ptr() for ws in layers for t in step_cached_weights(*ws, "step", True)))
        with torch.no_grad():
            for ws in (*layers, *twins):
                for w in ws:
                    w.sub_(1e-3 * w.grad / w.grad.abs().amax())  # a bounded step: the values stay finite
                    w.grad = None
    if weight_cache == "step":
        assert len(tile_addresses) == 1 and _cuda_graph_rerecords() == rerecords
