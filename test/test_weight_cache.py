"""FP8 expert weights quantized once per optimizer step: the cache never serves stale data, every
weight_cache mode gives bit-identical results, and each mode quantizes as often as it promises.

Stale cases: optimizer step, in-place ``copy_``, ``load_state_dict``, edits under ``no_grad``,
``param.data = new``, a dead weight whose address is reused; writes through ``param.data`` are the
documented blind spot (``invalidate``). Layer cases: eager, ``torch.compile(fullgraph=True)``,
gradient accumulation, activation checkpointing, ``recompute_experts``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import DEVICE
from torch.utils.checkpoint import checkpoint

from fp8flow_ao.config import FP8FlowConfig
from fp8flow_ao.debug import QUANTIZING_GEMMS, FP8FlowOpCounter
from fp8flow_ao.moe import fp8flow_routed_experts
from fp8flow_ao.weight_cache import (
    EXPERT_WEIGHT_CACHE,
    NOTHING,
    WEIGHT_CACHE_MODES,
    ExpertWeightsFP8,
    FP8WeightCache,
    quantize_expert_weights,
    step_cached_weights,
    weights_for_backward,
)

TOKENS, DIM, HIDDEN, EXPERTS, TOP_K = 128, 256, 128, 4, 2


@pytest.fixture(autouse=True)
def _empty_cache():
    EXPERT_WEIGHT_CACHE.invalidate()
    yield
    EXPERT_WEIGHT_CACHE.invalidate()


class _Producer:
    """``produce`` for :meth:`FP8WeightCache.get` that counts its calls and returns a fresh tensor each time."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.calls = w, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.w.detach() * 2


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(2, 128, 128))


def test_hit_returns_the_stored_value():
    cache, w = FP8WeightCache(), _param()
    produce = _Producer(w)
    first = cache.get((w,), produce)
    assert cache.get((w,), produce) is first and produce.calls == 1
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    assert cache.nbytes() == first.untyped_storage().nbytes()


def _optimizer_step(w):
    w.grad = torch.randn_like(w)
    torch.optim.SGD([w], lr=0.1).step()


def _copy(w):
    with torch.no_grad():
        w.copy_(torch.randn_like(w))


def _load_state_dict(w):
    module = torch.nn.Module()
    module.w = w
    module.load_state_dict({"w": torch.randn_like(w)})


def _edit_one_expert(w):
    with torch.no_grad():
        w[1].mul_(3)


def _rebind_data(w):
    w.data = torch.randn_like(w)


@pytest.mark.parametrize("change", [_optimizer_step, _copy, _load_state_dict, _edit_one_expert, _rebind_data])
def test_any_change_to_the_weight_misses(change):
    cache, w = FP8WeightCache(), _param()
    produce = _Producer(w)
    stale = cache.get((w,), produce).clone()
    change(w)
    fresh = cache.get((w,), produce)
    assert produce.calls == 2 and torch.equal(fresh, w.detach() * 2) and not torch.equal(fresh, stale)
    assert len(cache) == 1  # replaced, not accumulated


def test_views_of_one_base_share_an_entry_and_other_views_do_not():
    """A DTensor's to_local() is a new view object per call: it must hit; a view of other elements must not."""
    cache, w = FP8WeightCache(), _param()
    produce = _Producer(w)
    first = cache.get((w.view_as(w),), produce)
    assert cache.get((w.view_as(w),), produce) is first
    cache.get((w[:1],), produce)
    assert produce.calls == 2


def test_entry_dies_with_its_weight_and_a_new_weight_never_hits():
    cache = FP8WeightCache()
    w = _param()
    cache.get((w,), _Producer(w))
    shape = w.shape
    del w
    gc.collect()
    assert len(cache) == 0  # the FP8 copy is freed with the weight
    for _ in range(4):  # new weights, often at the old address with version 0 again
        w = torch.nn.Parameter(torch.randn(shape))
        produce = _Producer(w)
        cache.get((w,), produce)
        assert produce.calls == 1


def test_writes_through_data_are_invisible_until_invalidate():
    """The documented blind spot: ``.data`` has its own version counter, so only invalidate() helps."""
    cache, w = FP8WeightCache(), _param()
    produce = _Producer(w)
    cache.get((w,), produce)
    w.data.add_(1)
    cache.get((w,), produce)
    assert produce.calls == 1
    cache.invalidate()
    assert torch.equal(cache.get((w,), produce), w.detach() * 2) and produce.calls == 2


def test_refresh_remakes_a_stale_value_in_its_own_tensors():
    """``refresh``: same object and address after an update (what CUDA graphs need), a hit after it, and a
    new value once the weight's shape changes."""
    cache, w = FP8WeightCache(), _param()
    produce, refreshed = _Producer(w), []

    def refresh(old: torch.Tensor) -> torch.Tensor:
        refreshed.append(old)
        return old.copy_(w.detach() * 2)

    first = cache.get((w,), produce, refresh)
    address = first.data_ptr()
    _optimizer_step(w)
    again = cache.get((w,), produce, refresh)
    assert again is first and again.data_ptr() == address and torch.equal(again, w.detach() * 2)
    assert (produce.calls, len(refreshed)) == (1, 1)
    assert cache.get((w,), produce, refresh) is first and (cache.hits, cache.misses) == (1, 2)
    cache.invalidate(keep_values=True)  # stale though unchanged: refreshed in place, kept until then
    assert len(cache) == 1 and cache.get((w,), produce, refresh) is first and len(refreshed) == 2
    cache.invalidate(keep_values=True)
    assert cache.get((w,), produce) is not first and produce.calls == 2  # no refresh: a new value
    w.data = torch.randn(2, 256, 128)  # another shape: the old tensors cannot hold it
    assert cache.get((w,), produce, refresh).shape == (2, 256, 128) and (produce.calls, len(refreshed)) == (3, 2)


def test_step_tiles_for_cuda_graphs_keep_their_addresses():
    """``step_cached_weights(static_addresses=True)``: after an optimizer step the tiles are re-quantized into
    the same tensors (the bits of a fresh quantization, versions moved) and marked static for dynamo."""
    *_, weights = _layer_inputs()
    tiles = step_cached_weights(*weights, "step", static_addresses=True)
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in tiles)
    addresses, versions = [t.data_ptr() for t in tiles], [t._version for t in tiles]
    for w in weights:
        w.grad = torch.randn_like(w) * 0.01
    torch.optim.SGD(weights, lr=1.0).step()
    again = step_cached_weights(*weights, "step", static_addresses=True)
    assert [t.data_ptr() for t in again] == addresses
    assert all(t._version > v for t, v in zip(again, versions, strict=True))
    with torch.no_grad():
        fresh = quantize_expert_weights(*weights, True, True, with_w13_t=True, with_w2_t=True)
    for name, a, b in zip(ExpertWeightsFP8._fields, again, fresh, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert step_cached_weights(*weights, "step") is again  # the plain lookup hits the same entry


def test_fp8_gathered_weights_refuse_out():
    """FSDP2's FP8 all-gathered tiles are joined, not quantized: nothing to write into ``out``."""
    from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128
    from fp8flow_ao.tensor import Float8BlockwiseWeight

    w1, w2, w3 = (Float8BlockwiseWeight(*quantize_128x128(torch.randn(2, 128, 256))[:2], torch.float32) for _ in "abc")
    with pytest.raises(ValueError, match="out is not supported for FP8 all-gathered weights"):
        quantize_expert_weights(w1, w2, w3, True, True, with_w13_t=True, with_w2_t=True, out=NOTHING)


def test_inference_tensors_are_never_cached():
    cache = FP8WeightCache()
    with torch.inference_mode():
        w = torch.randn(128, 128)
    produce = _Producer(w)
    cache.get((w,), produce)
    cache.get((w,), produce)
    assert produce.calls == 2 and len(cache) == 0


# ---------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------


def _layer_inputs(tokens: int = TOKENS, dim: int = DIM, hidden: int = HIDDEN, experts: int = EXPERTS):
    x = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16)
    probs = torch.rand(tokens, TOP_K, device=DEVICE)
    ids = torch.stack([torch.randperm(experts, device=DEVICE)[:TOP_K] for _ in range(tokens)])
    grad = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16)
    shapes = ((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))
    weights = [torch.nn.Parameter(torch.randn(s, device=DEVICE, dtype=torch.bfloat16) * 0.05) for s in shapes]
    return x, probs, ids, grad, weights


def _step(fn, x, probs, ids, grad, weights, **kwargs) -> list[torch.Tensor]:
    """One forward + backward; returns [out, dx, dprobs, dw1, dw2, dw3] and leaves the weights' grads unset."""
    x, probs = (t.detach().clone().requires_grad_() for t in (x, probs))
    out = fn(x, probs, ids, *weights, **kwargs)
    grads = torch.autograd.grad(out, (x, probs, *weights), grad)
    return [out.detach(), *grads]


def _assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for name, u, v in zip(("out", "x", "probs", "w1", "w2", "w3"), a, b, strict=True):
        assert torch.equal(u, v), name


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_modes_are_bit_identical_and_quantize_as_promised(recompute, weight_quantization):
    x, probs, ids, grad, weights = _layer_inputs()
    results, counts = {}, {}
    for mode in WEIGHT_CACHE_MODES:
        with FP8FlowOpCounter() as counter:
            results[mode] = [
                _step(
                    fp8flow_routed_experts, x, probs, ids, grad, weights, recompute_experts=recompute, weight_cache=mode
                )
                for _ in range(2)
            ]
        gemms = counter.counts[QUANTIZING_GEMMS]
        counts[mode] = (counter.weight_quantizations - gemms, gemms)  # weights by quantize_128x128(_pair), by GEMMs
        _assert_identical(results[mode][0], results["off"][0])
        _assert_identical(results[mode][1], results["off"][0])
    # per micro-batch: "off" W13 + w2 in forward and again in backward, or (few rows per expert) each of the
    # 4 GEMMs (+ FC1's recompute) quantizing as it loads; "forward" both orientations in one pass each;
    # "step" once for both micro-batches (the second is a cache hit)
    off = (0, 2 * (4 + recompute)) if weight_quantization == "in_gemm" else (8, 0)
    assert counts == {"off": off, "forward": (4, 0), "step": (2, 0)}


def test_backward_quantizes_only_what_its_gemms_read():
    """FC1 recomputed with its dgrad in FP8: W13 and W13^T; with that dgrad in BF16: W13 alone (no unused
    transpose pass); FC2's dgrad: w2^T alone. The tiles are the same bits either way."""
    w1, w3 = (torch.randn(2, 128, 256, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w2 = torch.randn(2, 256, 128, device=DEVICE, dtype=torch.bfloat16)
    both = weights_for_backward(NOTHING, w1, w2, w3, True, "w13")
    data_only = weights_for_backward(NOTHING, w1, w2, w3, True, "w13", transpose=False)
    assert both.w13_t is not None and data_only.w13_t is None and data_only.w2_t is None
    assert torch.equal(both.w13, data_only.w13) and torch.equal(both.w13_scale, data_only.w13_scale)
    fc2 = weights_for_backward(NOTHING, w1, w2, w3, True, "w2")
    assert fc2.w2_t is not None and fc2.w13 is None and fc2.w13_t is None


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled_path"])
def test_step_cache_follows_weight_updates_between_micro_batches(monkeypatch, compile_backend):
    """Gradient accumulation, then an optimizer step, then a manual edit: never a stale weight; the same
    when the path runs compiled (``compile_backend``: the lookup stays eager, the graph takes the tiles)."""
    from fp8flow_ao.kernels import grouped_gemm_fp8_blockwise

    # the "off" twin quantizes with quantize_128x128 too, so the counts below are the cache's alone
    monkeypatch.setattr(grouped_gemm_fp8_blockwise, "IN_GEMM_MAX_ROWS_PER_EXPERT", 0)
    x, probs, ids, grad, weights = _layer_inputs()
    fresh = [w.detach().clone().requires_grad_() for w in weights]  # the "off" twin, updated alike

    def both_agree():
        kwargs = {"weight_cache": "step", "compile_backend": compile_backend}
        cached = _step(fp8flow_routed_experts, x, probs, ids, grad, weights, **kwargs)
        _assert_identical(cached, _step(fp8flow_routed_experts, x, probs, ids, grad, fresh))
        return cached

    hits, misses = EXPERT_WEIGHT_CACHE.hits, EXPERT_WEIGHT_CACHE.misses
    if compile_backend is None:  # the op counter is a dispatch mode, which dynamo does not trace under
        with FP8FlowOpCounter() as counter:
            both_agree()
            both_agree()  # micro-batch 2 reuses the weights
        assert counter.weight_quantizations == 2 + 2 * 4
        assert counter.counts["quantize_128x128_pair"] == 1 + 2  # each forward's W13 and w2 in one launch
    else:
        both_agree()
        both_agree()
    assert (EXPERT_WEIGHT_CACHE.hits, EXPERT_WEIGHT_CACHE.misses) == (hits + 1, misses + 1)
    update = [torch.randn_like(w) * 0.01 for w in weights]
    for group in (weights, fresh):
        for w, u in zip(group, update, strict=True):
            w.grad = u.clone()
        torch.optim.SGD(group, lr=1.0).step()
    before = both_agree()
    with torch.no_grad():
        for group in (weights, fresh):
            group[1][2].neg_()  # one expert of w2, edited in place outside any optimizer
    after = both_agree()
    assert not torch.equal(before[0], after[0])


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("first", ["train", "evaluate"])
def test_evaluation_neither_reads_nor_fills_the_step_cache(grad_off, first):
    """A forward with grad mode off quantizes afresh and leaves the cache as it was: an evaluation under
    ``inference_mode`` once left inference tensors there, and the next training forward failed to save them
    for backward. Either order of training and evaluation gives the "off" results."""
    x, probs, ids, grad, weights = _layer_inputs()

    def evaluate():
        with grad_off():
            out = fp8flow_routed_experts(x, probs, ids, *weights, weight_cache="step")
            assert torch.equal(out, fp8flow_routed_experts(x, probs, ids, *weights))
        return (len(EXPERT_WEIGHT_CACHE), EXPERT_WEIGHT_CACHE.hits, EXPERT_WEIGHT_CACHE.misses)

    def train():
        cached = _step(fp8flow_routed_experts, x, probs, ids, grad, weights, weight_cache="step")
        _assert_identical(cached, _step(fp8flow_routed_experts, x, probs, ids, grad, weights))

    if first == "train":
        train()
    before = (len(EXPERT_WEIGHT_CACHE), EXPERT_WEIGHT_CACHE.hits, EXPERT_WEIGHT_CACHE.misses)
    assert evaluate() == before
    train()
    train()
    assert len(EXPERT_WEIGHT_CACHE) == 1 and EXPERT_WEIGHT_CACHE.hits >= 1


def test_ema_weights_swapped_in_through_data_for_evaluation():
    """The EMA pattern (torch_ema's ``store`` / ``copy_to`` / ``restore``): averaged weights copied in through
    ``param.data`` (no version bump) for an evaluation under ``no_grad``, the training weights copied back.
    The evaluation runs on the averaged weights, not on the training weights' cached tiles, and the next
    training micro-batch on the training weights."""
    x, probs, ids, grad, weights = _layer_inputs()
    ema = [w.detach() * 0.5 for w in weights]
    _step(fp8flow_routed_experts, x, probs, ids, grad, weights, weight_cache="step")  # fills the cache
    saved = [w.detach().clone() for w in weights]
    with torch.no_grad():
        for w, e in zip(weights, ema, strict=True):
            w.data.copy_(e)
        evaluated = fp8flow_routed_experts(x, probs, ids, *weights, weight_cache="step")
        assert torch.equal(evaluated, fp8flow_routed_experts(x, probs, ids, *ema))
        for w, s in zip(weights, saved, strict=True):
            w.data.copy_(s)
    trained = _step(fp8flow_routed_experts, x, probs, ids, grad, weights, weight_cache="step")
    fresh = [s.clone().requires_grad_() for s in saved]
    _assert_identical(trained, _step(fp8flow_routed_experts, x, probs, ids, grad, fresh))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_step_cache_follows_every_torch_optim_step(fused):
    """torch.optim's fused optimizers write the weights without bumping their version counters: the hook
    registered by the first "step" lookup marks the cache stale after every torch.optim step, so the cached
    path stays bit-identical to re-quantizing each time across steps."""
    x, probs, ids, grad, weights = _layer_inputs()
    fresh = [w.detach().clone().requires_grad_() for w in weights]
    optimizers = [torch.optim.AdamW(group, lr=1e-2, fused=fused, foreach=not fused) for group in (weights, fresh)]
    for _ in range(3):
        cached = _step(fp8flow_routed_experts, x, probs, ids, grad, weights, weight_cache="step")
        _assert_identical(cached, _step(fp8flow_routed_experts, x, probs, ids, grad, fresh))
        for group, optimizer in zip((weights, fresh), optimizers, strict=True):
            for w, g in zip(group, cached[3:], strict=True):
                w.grad = g.clone()
            optimizer.step()
    assert not torch.equal(weights[0], _layer_inputs()[4][0])  # (the steps did move the weights)


def test_cached_weights_can_still_be_swapped():
    """The cache holds no weak reference to a weight itself (only to its storage), so torch.utils.swap_tensors
    (load_state_dict / Module.to under swap_module_params_on_conversion) still takes the parameter; the swapped
    weight misses."""
    cache, w = FP8WeightCache(), _param()
    produce = _Producer(w)
    cache.get((w,), produce)
    torch.utils.swap_tensors(w, torch.nn.Parameter(torch.randn_like(w)))
    assert torch.equal(cache.get((w,), produce), w.detach() * 2) and produce.calls == 2
    gc.collect()
    assert len(cache) == 1  # the old storage died with the tensor swapped out: its entry went with it


@pytest.mark.parametrize("mode", ["forward", "step"])
def test_modes_keep_the_transposes_for_backward(mode):
    """ "off" saves no FP8 weight copy (test_moe); the others keep the exact transposes [E, D, 2H], [E, H, D]:
    "forward" only those of the dgrads that will run (none for FC1's while x needs no gradient), "step" its
    cached tiles in any case."""
    x, probs, ids, _, weights = _layer_inputs()
    for x_grad in (True, False):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            fp8flow_routed_experts(x.requires_grad_(x_grad), probs.requires_grad_(), ids, *weights, weight_cache=mode)
        fp8_weights = sorted(tuple(t.shape) for t in saved if t.dtype == torch.float8_e4m3fn and t.dim() == 3)
        w13_t = [(EXPERTS, DIM, 2 * HIDDEN)] if x_grad or mode == "step" else []
        assert fp8_weights == [(EXPERTS, HIDDEN, DIM), *w13_t], x_grad
    assert (len(EXPERT_WEIGHT_CACHE) == 1) == (mode == "step")


@pytest.mark.parametrize("mode", ["forward", "step"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_modes_compile_fullgraph_bit_identical(mode, recompute):
    """Traced by the caller's compile, "step" quantizes in the graph ("forward"'s bits) and touches no cache
    (its lookup is Python state: ``compile_backend`` compiles the path with the lookup outside)."""
    x, probs, ids, grad, weights = _layer_inputs()
    compiled = torch.compile(fp8flow_routed_experts, fullgraph=True, backend="aot_eager")
    eager = _step(fp8flow_routed_experts, x, probs, ids, grad, weights, recompute_experts=recompute)
    EXPERT_WEIGHT_CACHE.invalidate()
    kwargs = {"recompute_experts": recompute, "weight_cache": mode}
    _assert_identical(_step(compiled, x, probs, ids, grad, weights, **kwargs), eager)
    assert len(EXPERT_WEIGHT_CACHE) == 0


def test_compiled_path_recompiles_for_new_shapes():
    """``compile_backend`` over calls whose shapes change (dynamo's dynamic-shape recompile, which failed
    on torch 2.11 when the path's checks were left out of the graph) and whose mode changes: eager's bits."""
    torch._dynamo.reset()
    layers = [
        (TOKENS, DIM, HIDDEN, EXPERTS),
        (2 * TOKENS, 2 * DIM, 2 * HIDDEN, 2 * EXPERTS),
        (3 * TOKENS, DIM, HIDDEN, EXPERTS),
    ]
    for shape, mode in zip(layers + layers[:1], ("off", "off", "step", "step"), strict=True):
        x, probs, ids, grad, weights = _layer_inputs(*shape)
        eager = _step(fp8flow_routed_experts, x, probs, ids, grad, weights)
        compiled = _step(
            fp8flow_routed_experts, x, probs, ids, grad, weights, weight_cache=mode, compile_backend="aot_eager"
        )
        _assert_identical(compiled, eager)


@pytest.mark.parametrize("mode", ["forward", "step"])
def test_activation_checkpointing_sees_the_same_bits(mode):
    x, probs, ids, grad, weights = _layer_inputs()
    plain = _step(fp8flow_routed_experts, x, probs, ids, grad, weights)

    def checkpointed(*args, **kwargs):
        return checkpoint(fp8flow_routed_experts, *args, use_reentrant=False, **kwargs)

    _assert_identical(_step(checkpointed, x, probs, ids, grad, weights, weight_cache=mode), plain)


def test_bad_mode():
    x, probs, ids, _, weights = _layer_inputs()
    with pytest.raises(ValueError, match="weight_cache must be one of"):
        fp8flow_routed_experts(x, probs, ids, *weights, weight_cache="always")
    with pytest.raises(ValueError, match="weight_cache must be one of"):
        FP8FlowConfig(weight_cache="always")
    with pytest.raises(ValueError, match="needs recipe='blockwise'"):
        FP8FlowConfig(weight_cache="step", recipe="rowwise")
    with pytest.raises(ValueError, match="compile_backend needs"):
        fp8flow_routed_experts(x, probs, ids, *weights, backward="bf16", compile_backend="aot_eager")


@pytest.mark.gpu
def test_gpu_modes_bit_identical_without_sync_and_compiled():
    """Triton kernels at a moderate shape: every mode gives the same bits, eager and compiled (inductor),
    and a "step" cache hit syncs nothing (the key reads only metadata and version counters)."""
    tokens, dim, hidden, experts, top_k = 2048, 1024, 512, 8, 4
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(tokens, top_k, device="cuda")
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    grad = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    shapes = ((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))
    weights = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.05) for s in shapes]
    args = (x, probs, ids, grad, weights)
    off = _step(fp8flow_routed_experts, *args)
    for mode in ("forward", "step"):
        _assert_identical(_step(fp8flow_routed_experts, *args, weight_cache=mode), off)
    torch.cuda.set_sync_debug_mode("error")
    try:
        hit = _step(fp8flow_routed_experts, *args, weight_cache="step")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_identical(hit, off)
    torch._dynamo.reset()  # other tests compiled this function at other shapes: start from no cache entries
    compiled = torch.compile(fp8flow_routed_experts, fullgraph=True)
    compiled_off = _step(compiled, *args)
    for mode in ("forward", "step"):
        _assert_identical(_step(compiled, *args, weight_cache=mode), compiled_off)
    # the path compiled with the lookup outside its graph: "step" is served from the cache (a hit, no sync)
    path_off = _step(fp8flow_routed_experts, *args, compile_backend="inductor")
    _assert_identical(_step(fp8flow_routed_experts, *args, weight_cache="step", compile_backend="inductor"), path_off)
    hits = EXPERT_WEIGHT_CACHE.hits
    torch.cuda.set_sync_debug_mode("error")
    try:
        hit = _step(fp8flow_routed_experts, *args, weight_cache="step", compile_backend="inductor")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert EXPERT_WEIGHT_CACHE.hits == hits + 1
    _assert_identical(hit, path_off)
