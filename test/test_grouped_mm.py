"""fp8_grouped_mm / _Float8GroupedMM: numerics against fp32 math on the BF16 operands, what backward
keeps, the op sequence (no re-quantization), 128-aligned and arbitrary offsets (padded on the device),
the weight gradient's dtype and its accumulation into an existing gradient, bad input, torch.compile."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import (
    GEMM_TOLERANCE,
    assert_accumulated,
    assert_sizes_compile_nothing_new,
    capture_cuda_graph,
    padded_ends,
    random_grouping,
    rel_error,
    sqnr_db,
)

from fp8flow_ao.debug import QUANTIZING_GEMMS, FP8FlowOpCounter
from fp8flow_ao.grouped_mm import fp8_grouped_mm
from fp8flow_ao.kernels.permute_pad import padded_rows_bound
from fp8flow_ao.tensor import to_fp8_blockwise

FP8 = torch.float8_e4m3fn
M, K, N = 512, 256, 256
GROUPS = {  # group END offsets (each a multiple of 128), E = 4
    "balanced": [128, 256, 384, 512],
    "skewed": [0, 384, 384, 512],  # two empty experts, one large
    "one_expert": [0, 0, 0, 384],  # all rows on the last expert, rows past the end unused
}


def _inputs(groups, m=M, k=K, n=N, device=DEVICE):
    offs = torch.tensor(groups, dtype=torch.int32, device=device)
    a = torch.randn(m, k, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(len(groups), n, k, device=device) * 0.05).to(torch.bfloat16).requires_grad_()
    return a, w, offs


def _fp32_reference(a, w, groups, grad_out):
    """fp32 math on the same BF16 operands, one matmul per group (group ends known on the host)."""
    a32, w32 = a.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    out = torch.zeros(a.shape[0], w.shape[1], device=a.device)
    for e, (start, end) in enumerate(zip([0, *groups[:-1]], groups, strict=True)):
        out[start:end] = a32[start:end] @ w32[e].t()
    out.backward(grad_out.float())
    return out, a32.grad, w32.grad


def _run(a, w, offs, recipe, offs_aligned=True):
    out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, recipe=recipe, offs_aligned=offs_aligned)
    grad_out = torch.randn_like(out)
    grad_a, grad_w = torch.autograd.grad(out, (a, w), grad_out)
    return out, grad_a, grad_w, grad_out


def _check_numerics(groups, recipe, device=DEVICE, shape=(M, K, N), sync_debug=False, offs_aligned=True):
    a, w, offs = _inputs(groups, *shape, device=device)
    if sync_debug:  # forward and backward may not wait on the device
        torch.cuda.set_sync_debug_mode("error")
    try:
        out, grad_a, grad_w, grad_out = _run(a, w, offs, recipe, offs_aligned)
    finally:
        if sync_debug:
            torch.cuda.set_sync_debug_mode("default")
    ref, ref_a, ref_w = _fp32_reference(a, w, groups, grad_out)
    rows = groups[-1]  # rows past the last group end belong to no group: zeros, never uninitialized memory
    assert torch.count_nonzero(out[rows:]) == 0 and torch.count_nonzero(grad_a[rows:]) == 0
    assert out.dtype == torch.bfloat16 and grad_a.dtype == a.dtype and grad_w.dtype == w.dtype
    assert grad_w.shape == w.shape
    assert sqnr_db(ref[:rows], out[:rows]) >= 25
    assert sqnr_db(ref_a[:rows], grad_a[:rows]) >= 22
    for e, end in enumerate(groups):
        start = groups[e - 1] if e else 0
        if end == start:  # empty expert: exactly zero weight gradient
            assert torch.count_nonzero(grad_w[e]) == 0
        else:
            assert sqnr_db(ref_w[e], grad_w[e]) >= 22


@pytest.mark.parametrize("groups", list(GROUPS.values()), ids=list(GROUPS))
def test_blockwise_matches_fp32_math(groups):
    _check_numerics(groups, "blockwise")


@pytest.mark.parametrize("offs_aligned", [True, False], ids=["aligned", "padded"])
@pytest.mark.parametrize("groups", ["skewed", "one_expert"])
def test_rowwise_matches_fp32_math(offs_aligned, groups):
    _check_numerics(GROUPS[groups], "rowwise", offs_aligned=offs_aligned)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_padding_aligned_groups_changes_no_bit(recipe):
    """Aligned offsets through the padded path (offs_aligned=False) give the same bits as the direct
    path: the padded layout has the same 128-row blocks, so every kernel sees the same numbers."""
    a, w, offs = _inputs(GROUPS["skewed"])
    direct = _run(a, w, offs, recipe, offs_aligned=True)
    out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, recipe=recipe)
    padded = (out, *torch.autograd.grad(out, (a, w), direct[3]))
    for p, d in zip(padded, direct[:3], strict=True):
        assert torch.equal(p, d)


# Group END offsets that torch._grouped_mm takes and the FP8-Flow layout does not (M, K, N = rows,
# 256, 256): a group of 1 row, empty groups first, last and in between, M not a multiple of 128.
UNALIGNED = {
    "offs_129_384_500": ([129, 384, 500], 500),
    "one_row_group": ([1, 129, 300, 301], 301),
    "empty_first": ([0, 0, 200, 333], 333),
    "empty_last": ([100, 300, 300], 300),
    "empty_between": ([57, 57, 57, 420], 420),
    "rows_past_last_end": ([70, 200], 260),
}


def _unaligned_loss_and_grads(fn, a, w, offs):
    out = fn(a, w, offs)
    loss = out.float().square().mean()
    return (out, *torch.autograd.grad(loss, (a, w)))


def _bf16_grouped_mm(a, w, offs):
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


def _fp8_grouped_mm(a, w, offs):
    return fp8_grouped_mm(a, w.transpose(-2, -1), offs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(UNALIGNED))
def test_unaligned_groups_match_bf16_grouped_mm(case, compiled):
    """torchao's thresholds for its blockwise op: SQNR vs BF16 torch._grouped_mm >= 27 dB for out,
    >= 26 dB for dA and dB with the loss out.float().square().mean(); empty experts get exactly zero
    weight gradient, rows past the last end zero output and zero dA. Compiled: fullgraph, and the
    same bits as eager."""
    ends, m = UNALIGNED[case]
    a, w, offs = _inputs(ends, m=m, k=256, n=256)
    ref_out, ref_a, ref_w = _unaligned_loss_and_grads(_bf16_grouped_mm, a, w, offs)
    out, grad_a, grad_w = _unaligned_loss_and_grads(_fp8_grouped_mm, a, w, offs)
    if compiled:
        fn = torch.compile(_fp8_grouped_mm, fullgraph=True, backend="aot_eager")
        for c, e in zip(_unaligned_loss_and_grads(fn, a, w, offs), (out, grad_a, grad_w), strict=True):
            assert torch.equal(c, e)
    rows = ends[-1]
    assert out.shape == (m, 256) and grad_a.dtype == a.dtype and grad_w.dtype == w.dtype
    assert sqnr_db(ref_out[:rows], out[:rows]) >= 27
    assert sqnr_db(ref_a[:rows], grad_a[:rows]) >= 26
    assert sqnr_db(ref_w, grad_w) >= 26
    assert not out[rows:].any() and not grad_a[rows:].any()
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if start == end:
            assert not grad_w[e].any(), f"empty expert {e} must get a zero weight gradient"


@pytest.mark.parametrize("fp8_input", [False, True], ids=["bf16_a", "fp8_a"])
def test_unaligned_blockwise_pads_as_it_quantizes(fp8_input):
    """Unaligned groups, blockwise: one launch makes the row maps, A is padded as it is quantized (or its FP8
    rows gathered) and dOut as backward quantizes it: no high-precision padded copy of either, and only
    the output and dA gathered back."""
    a, w, offs = _inputs([1, 129, 300, 301], m=310, k=256, n=256)
    x = to_fp8_blockwise(a) if fp8_input else a
    with FP8FlowOpCounter() as counter:
        out = fp8_grouped_mm(x, w.transpose(-2, -1), offs)
        torch.autograd.grad(out.float().square().mean(), (a, w))
    assert counter.counts["pad_group_offsets"] == 1 and counter.counts["route_pad"] == 0
    assert counter.counts["permute_pad_rows"] == fp8_input  # the FP8 rows of a quantized A move as they are
    assert counter.counts["unpermute_unpad_backward"] == 0
    assert counter.counts["unpermute_unpad"] == 2  # out and dA
    assert counter.counts["quantize_1x128_transpose"] == (not fp8_input) and counter.counts["quantize_dual_1x128"] == 1
    # A's column-wise copy comes from the forward's quantizer; an FP8 A is transposed in backward
    assert counter.counts["quantize_1x128"] == 0 and counter.counts["scaling_aware_transpose"] == fp8_input


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_gpu_unaligned_groups_no_sync(recipe):
    """The padded path on the GPU kernels, device syncs forbidden; uneven groups with an empty one."""
    _check_numerics(
        [1000, 1000, 2309, 4000], recipe, device="cuda", shape=(4100, 1024, 2048), sync_debug=True, offs_aligned=False
    )


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_gpu_new_row_counts_compile_no_kernel(recipe):
    """A caller whose M changes from call to call (unaligned groups, an empty one) compiles its kernels once:
    forward and backward at M = 2100 first, then at counts of every kind (odd, a multiple of 16, ...)."""

    def run(m: int) -> None:
        a, w, offs = _inputs([m // 4, m // 2, m // 2, m], m=m, k=256, n=256, device="cuda")
        _run(a, w, offs, recipe, offs_aligned=False)

    assert_sizes_compile_nothing_new(run, (2100, 2099, 2093, 2080, 2011))


# Group ends and M for CUDA graph capture: 128 rows an expert (the weight quantized inside the forward GEMM), 512
# (quantize_128x128 before it, a transposed copy for the dgrad), and unaligned groups (padded on the device).
GRAPHED = {
    "aligned_in_gemm": ([128, 256, 384, 512], 512),
    "aligned_separate": ([512, 1024, 1536, 2048], 2048),
    "unaligned": ([129, 384, 384, 500], 500),
}


def _graph_operands(ends: list[int], m: int, accumulate: bool) -> dict[str, torch.Tensor]:
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    a = torch.randn(m, 256, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(len(ends), 256, 256, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    if accumulate:
        a.grad, w.grad = torch.randn_like(a), torch.randn_like(w)
    return {"a": a, "w": w, "offs": offs, "grad_out": torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)}


def _graph_step(t: dict[str, torch.Tensor], aligned: bool, accumulate: bool) -> tuple[torch.Tensor, ...]:
    """Forward + backward: out, dA, dW (``torch.autograd.grad``), or out and the accumulated ``.grad`` s."""
    out = fp8_grouped_mm(t["a"], t["w"].transpose(-2, -1), t["offs"], offs_aligned=aligned)
    if accumulate:
        out.backward(t["grad_out"])  # the wgrad epilogue adds into w.grad; autograd adds dA into a.grad
        return out, t["a"].grad, t["w"].grad
    return (out, *torch.autograd.grad(out, (t["a"], t["w"]), t["grad_out"]))


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh_grads", "accumulating"])
@pytest.mark.parametrize("case", list(GRAPHED))
def test_gpu_cuda_graph_replays_the_op_bit_for_bit(case, accumulate):
    """fp8_grouped_mm forward + backward captured in a CUDA graph (what a caller does to take the host out of a
    host-bound step, e.g. fine-grained experts): no host sync stops the capture, and each replay on new values of
    A, W, the offsets, dOut (and the gradients accumulated into) gives eager's bits."""
    ends, m = GRAPHED[case]
    aligned = case != "unaligned"
    static = _graph_operands(ends, m, accumulate)
    # The replays read the gradients accumulated into where the capture found them: autograd adds into a.grad in
    # place (no reference to it is held here, which would make it add out of place), the epilogue into w.grad.
    grad_ptrs = [static[n].grad.data_ptr() for n in ("a", "w")] if accumulate else []
    graph, captured = capture_cuda_graph(lambda: _graph_step(static, aligned, accumulate), warmups=2)
    if accumulate:
        assert [static[n].grad.data_ptr() for n in ("a", "w")] == grad_ptrs
    for round_ in range(2):
        shift = 0 if aligned else round_  # unaligned: other offset values on the second replay
        fresh = _graph_operands([max(e - shift, 0) for e in ends], m, accumulate)
        with torch.no_grad():
            for name in ("a", "w", "offs", "grad_out"):
                static[name].copy_(fresh[name])
            if accumulate:
                static["a"].grad.copy_(fresh["a"].grad)
                static["w"].grad.copy_(fresh["w"].grad)
        graph.replay()
        eager = _graph_step(fresh, aligned, accumulate)
        for got, want in zip(captured, eager, strict=True):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["aligned_in_gemm", "unaligned"])
def test_gpu_reduce_overhead_compile_replays_the_op_bit_for_bit(case):
    """``torch.compile(mode="reduce-overhead", fullgraph=True)`` of a function that calls the op, backward by
    autograd outside it (a compiled model's usual step): cudagraph trees warm up, record, then replay the forward
    and backward graphs, one step each on new inputs, each bit for bit eager's."""
    ends, m = GRAPHED[case]
    aligned = case != "unaligned"

    def forward(a, w, offs):
        return fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=aligned)

    def step(fn, t):
        out = fn(t["a"], t["w"], t["offs"])
        return [x.clone() for x in (out, *torch.autograd.grad(out, (t["a"], t["w"]), t["grad_out"]))]

    torch._dynamo.reset()
    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    for round_ in range(3):
        shift = 0 if aligned else round_
        t = _graph_operands([max(e - shift, 0) for e in ends], m, False)
        torch.compiler.cudagraph_mark_step_begin()
        for got, want in zip(step(compiled, t), step(forward, t), strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_in_the_weight_dtype_without_a_cast(dtype):
    """The wgrad epilogue writes the weight's dtype: no fp32 output, no copy or cast kernel after it."""
    a, w, offs = _inputs(GROUPS["skewed"])
    w = w.detach().to(dtype).requires_grad_()
    out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=True)
    with FP8FlowOpCounter() as counter, torch.profiler.profile() as prof:
        out.float().square().mean().backward()
    assert w.grad.dtype == dtype and counter.counts["grouped_gemm_fp8_wgrad"] == 1
    # (the op's name appears once per dispatch level it passes through)
    wgrad_end = max(e.time_range.end for e in prof.events() if e.name == "fp8flow::grouped_gemm_fp8_wgrad")
    after = [e.name for e in prof.events() if e.time_range.start >= wgrad_end]
    assert not [n for n in after if n in ("aten::_to_copy", "aten::copy_", "aten::add_")], after


@pytest.mark.parametrize(
    ("groups", "offs_aligned"),
    [(GROUPS["balanced"], True), (GROUPS["balanced"], False), ([1, 129, 129, 400], False)],
    ids=["aligned", "padded", "unaligned"],
)
def test_fp8_activation_input_is_the_same_gemm(groups, offs_aligned):
    """A Float8BlockwiseActivation input skips the quantize and gives bit-identical results (padded:
    its data and scales move together into the padded layout, and dA flows back through it)."""
    a, w, offs = _inputs(groups)
    out, grad_a, grad_w, grad_out = _run(a, w, offs, "blockwise", offs_aligned)
    out8 = fp8_grouped_mm(to_fp8_blockwise(a), w.transpose(-2, -1), offs, offs_aligned=offs_aligned)
    grad_a8, grad_w8 = torch.autograd.grad(out8, (a, w), grad_out)
    assert torch.equal(out8, out) and torch.equal(grad_a8, grad_a) and torch.equal(grad_w8, grad_w)


@pytest.mark.parametrize("offs_aligned", [True, False], ids=["aligned", "padded"])
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_backward_keeps_fp8_activations_and_casts_twice(recipe, offs_aligned, weight_quantization):
    """Blockwise saves FP8 A (never BF16), casts 2 activations (A, dOut) and quantizes the weight once: one
    quantize_128x128 pass (with or without the transposed copy), or the forward GEMM from the weight itself,
    keeping its tiles for the dgrad; padded or not (the padded A has M_pad rows; the padding gathers save
    only row maps)."""
    a, w, offs = _inputs(GROUPS["balanced"])
    rows = a.shape[0] if offs_aligned else padded_rows_bound(a.shape[0], len(GROUPS["balanced"]) + 1)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FP8FlowOpCounter() as counter:
        out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, recipe=recipe, offs_aligned=offs_aligned)
        out.sum().backward()
    hp_activations = [
        t for t in saved if t.dtype in (torch.bfloat16, torch.float32) and t.shape in (a.shape, (rows, K))
    ]
    if recipe == "blockwise":
        assert hp_activations == []
        in_gemm = weight_quantization == "in_gemm"
        assert not [t for t in saved if t.dtype == w.dtype and t.shape == w.shape]
        assert {t.dtype for t in saved if t.shape != w.shape} <= {FP8, torch.float32, torch.int32}
        # A's FP8 copy is the column-wise one the wgrad reads (no rows kept to transpose in backward)
        assert any(t.dtype == FP8 and t.shape == (K, rows) for t in saved)
        assert not any(t.dtype == FP8 and t.shape == (rows, K) for t in saved)
        # The dgrad's FP8 weight: the transposed copy, or the forward tiles its GEMM transposes.
        fp8_weights = [tuple(t.shape) for t in saved if t.dtype == FP8 and t.dim() == 3]
        w_t_shape = (w.shape[0], w.shape[2], w.shape[1])
        expected = {"in_gemm": [tuple(w.shape)], "transposed_in_gemm": [tuple(w.shape)], "separate": [w_t_shape]}
        assert fp8_weights == expected[weight_quantization], fp8_weights
        # one pass for both orientations (or the forward one alone), or the forward GEMM from W itself
        assert counter.counts["quantize_128x128"] == (not in_gemm)
        assert counter.counts[QUANTIZING_GEMMS] == in_gemm
        assert counter.weight_quantizations == 1
        assert counter.counts["quantize_1x128_transpose"] == 1 and counter.counts["scaling_aware_transpose"] == 0
        assert counter.counts["dequantize"] == 0
        assert counter.activation_casts == 2
    else:  # torchao's row-wise recipe keeps the high-precision A for its per-expert column scales
        assert len(hp_activations) == 1
        assert counter.counts["quantize_1x128"] == 4  # A, W, dOut, W^T (the wgrad casts are torch ops)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("offs_aligned", [True, False], ids=["aligned", "padded"])
def test_weight_quantized_in_the_gemms_gives_the_same_bits(offs_aligned, compiled, monkeypatch):
    """The blockwise op whose forward GEMM quantizes the bf16 weight as it loads it (keeping the tiles for
    the dgrad) equals, bit for bit, the op that quantizes it with quantize_128x128 first: out, dA and dW
    (eager, and compiled fullgraph)."""
    from fp8flow_ao.kernels import grouped_gemm_fp8_blockwise as gemm

    a, w, offs = _inputs(GROUPS["skewed"] if offs_aligned else [1, 129, 129, 400])
    grad_out = None
    results = {}
    # The rules' thresholds: quantize_128x128 first with the transposed copy, or without it (the dgrad
    # transposes), then the GEMMs quantizing the weight themselves.
    for quantize, transpose in ((0, 0), (0, 1 << 30), (1 << 30, 0)):
        monkeypatch.setattr(gemm, "IN_GEMM_MAX_ROWS_PER_EXPERT", quantize)
        monkeypatch.setattr(gemm, "TRANSPOSE_IN_GEMM_MAX_ROWS_PER_EXPERT", transpose)
        torch._dynamo.reset()  # the rules are read while tracing: trace again for each threshold
        fn = torch.compile(fp8_grouped_mm, fullgraph=True) if compiled else fp8_grouped_mm
        out = fn(a, w.transpose(-2, -1), offs, offs_aligned=offs_aligned)
        grad_out = torch.randn_like(out) if grad_out is None else grad_out
        results[quantize, transpose] = (out, *torch.autograd.grad(out, (a, w), grad_out))
        if not compiled:  # (a dispatch mode and torch.compile do not mix)
            with FP8FlowOpCounter() as counter:
                torch.autograd.grad(fn(a, w.transpose(-2, -1), offs, offs_aligned=offs_aligned), (a, w), grad_out)
            assert counter.counts["quantize_128x128"] == (quantize == 0)
            assert counter.counts[QUANTIZING_GEMMS] == (quantize != 0)  # the forward, keeping its tiles
    expected = results[0, 0]
    for got in results.values():
        for name, x, y in zip(("out", "dA", "dW"), got, expected, strict=True):
            assert torch.equal(x, y), name


def test_misaligned_offsets_raise():
    a, w, _ = _inputs(GROUPS["balanced"], device="cpu")
    offs = torch.tensor([100, 256, 384, 512], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=True)
    for bad, match in (([256, 100, 384, 512], "non-decreasing"), ([128, 256, 384, 600], "past the end")):
        with pytest.raises(ValueError, match=match):
            fp8_grouped_mm(a, w.transpose(-2, -1), torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(TypeError, match="offs_aligned must be a bool"):
        fp8_grouped_mm(a, w.transpose(-2, -1), torch.tensor([128, 256, 384, 512], dtype=torch.int32), offs_aligned="no")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a, b, o: (a, b, o, "tensorwise"), ValueError, "recipe"),
        (lambda a, b, o: (a[:, :200], b[:, :200], o, "blockwise"), ValueError, "multiple of 128"),
        (lambda a, b, o: (a[:100], b, o, "blockwise"), ValueError, "past the end"),
        (lambda a, b, o: (a, b, o[:3], "blockwise"), ValueError, "one group end per expert"),
        (lambda a, b, o: (a, b, o.long(), "blockwise"), TypeError, "offs"),
        (lambda a, b, o: (a.to(FP8), b, o, "blockwise"), TypeError, "a must have dtype"),
        (lambda a, b, o: (a, b[0], o, "blockwise"), ValueError, "b_t must have 3 dims"),
        (lambda a, b, o: (to_fp8_blockwise(a), b, o, "rowwise"), TypeError, "recipe='blockwise'"),
    ],
)
def test_bad_input_raises(change, error, match):
    a, w, offs = _inputs(GROUPS["balanced"], device="cpu")
    args = change(a.detach(), w.detach().transpose(-2, -1), offs)
    with pytest.raises(error, match=match):
        fp8_grouped_mm(*args[:3], recipe=args[3])


def test_compile_fullgraph_matches_eager():
    a, w, offs = _inputs(GROUPS["skewed"])

    def loss(a, w, offs):
        return fp8_grouped_mm(a, w.transpose(-2, -1), offs).float().square().sum()

    # aot_eager: dynamo (no graph break allowed) + AOT autograd of forward and backward on fakes,
    # without inductor's slow CPU code generation
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (loss, compiled):
        value = fn(a, w, offs)
        results.append((value, *torch.autograd.grad(value, (a, w))))
    for c, e in zip(*results, strict=True):
        assert torch.equal(c, e)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
@pytest.mark.parametrize("groups", ["balanced", "skewed"])
def test_gpu_kernels_numerics_and_no_sync(recipe, groups):
    """Triton kernels (and torch._scaled_grouped_mm) at a moderate shape, with device syncs forbidden."""
    ends = {"balanced": [1024, 2048, 3072, 4096], "skewed": [0, 3072, 3072, 4096]}[groups]
    _check_numerics(ends, recipe, device="cuda", shape=(4096, 1024, 2048), sync_debug=True)


def _random_op_case(seed: int) -> dict:
    """A random grouping (:func:`fp8_helpers.random_grouping`) as the op takes it, with the choices the seed
    also draws: offsets 128-aligned (the FP8-Flow layout) or not (padded inside the op), bf16 or fp32
    weights, and a weight gradient already there to accumulate into."""
    counts, k, n, extra = random_grouping(seed)
    g = torch.Generator().manual_seed(seed)
    aligned, fp32_w, accumulate = (bool(b) for b in torch.randint(0, 2, (3,), generator=g))
    ends = padded_ends(counts) if aligned else torch.tensor(counts).cumsum(0).tolist()
    m = ends[-1] + (-(-extra // 128) * 128 if aligned else extra)
    w_dtype = torch.float32 if fp32_w else torch.bfloat16
    a = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[torch.randperm(m, generator=g)][:, None]
    w = torch.randn(len(counts), n, k, generator=g) * torch.logspace(-3, -1, len(counts))[:, None, None]
    return {
        "a": a.to(torch.bfloat16), "w": w.to(w_dtype), "offs": torch.tensor(ends, dtype=torch.int32),
        "grad_out": torch.randn(m, n, generator=g).to(torch.bfloat16), "aligned": aligned,
        "existing": torch.randn(w.shape, generator=g).to(w_dtype) if accumulate else None,
    }  # fmt: skip


def _op_step(case: dict, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward + ``.backward()`` on ``device``: out, a.grad, w.grad (added into ``existing`` where there is one)."""
    a, w = (case[n].to(device).requires_grad_() for n in ("a", "w"))
    if case["existing"] is not None:
        w.grad = case["existing"].to(device)
    out = fp8_grouped_mm(a, w.transpose(-2, -1), case["offs"].to(device), offs_aligned=case["aligned"])
    out.backward(case["grad_out"].to(device))
    return out.detach(), a.grad, w.grad


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(200, 212))
def test_gpu_random_cases_match_the_cpu_path_row_by_row(seed):
    """The kernels (GPU) against the op's torch references (CPU), which quantize to the same FP8 bits: out, dA
    and dW agree row by row to the GEMMs' accumulation order (and each empty expert's dW is its existing
    gradient, or zero). Row by row, because the rows' and experts' magnitudes spread over four decades."""
    case = _random_op_case(seed)
    gpu, cpu = _op_step(case, "cuda"), _op_step(case, "cpu")
    for name, got, want in zip(("out", "dA", "dW"), gpu, cpu, strict=True):
        assert got.dtype == want.dtype, name
        assert rel_error(got, want) < GEMM_TOLERANCE[want.dtype], (name, rel_error(got, want))
    rows = int(case["offs"][-1])
    assert torch.count_nonzero(gpu[0][rows:]) == 0 and torch.count_nonzero(gpu[1][rows:]) == 0


class _FP8FlowCalls(FP8FlowOpCounter):
    """The op counter, plus ``with_transpose`` of each quantize_128x128 call."""

    def __init__(self) -> None:
        super().__init__()
        self.transposes_asked: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fp8flow" and func._opname == "quantize_128x128":
            self.transposes_asked.append(args[1])
        return super().__torch_dispatch__(func, types, args, kwargs)


# More than 256 rows per expert: the weight is quantized apart (quantize_128x128), not in the GEMMs, and
# the dgrad reads its transposed copy.
SEPARATE_QUANTIZE_GROUPS = [256, 768, 1536, 2048]


@pytest.mark.parametrize("frozen", ["a", "w"])
def test_backward_computes_only_the_gradients_asked_for(frozen):
    """A frozen weight: no column-wise copy of A (and nothing of A kept for backward), no wgrad. An input that
    needs no gradient: no transposed FP8 weight in forward, no dgrad GEMM. The gradients computed are the same
    bits."""
    a, w, offs = _inputs(SEPARATE_QUANTIZE_GROUPS, m=2048)
    out_full, grad_a_full, grad_w_full, grad_out = _run(a, w, offs, "blockwise")
    (a if frozen == "a" else w).requires_grad_(False)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with _FP8FlowCalls() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=True)
        out.backward(grad_out)
    assert torch.equal(out, out_full)
    counts = mode.counts
    a_copies = [t for t in saved if t.dtype == FP8 and t.dim() == 2]
    assert counts["scaling_aware_transpose"] == 0
    if frozen == "a":
        assert a.grad is None and torch.equal(w.grad, grad_w_full)
        assert mode.transposes_asked == [False]
        assert counts["grouped_gemm_fp8_blockwise"] == 1  # forward only
        assert counts["quantize_1x128_transpose"] == counts["grouped_gemm_fp8_wgrad"] == 1
        assert [tuple(t.shape) for t in a_copies] == [(a.shape[1], a.shape[0])]
    else:
        assert w.grad is None and torch.equal(a.grad, grad_a_full)
        assert mode.transposes_asked == [True]
        assert counts["grouped_gemm_fp8_blockwise"] == 2
        assert counts["quantize_1x128"] == 1 and counts["quantize_1x128_transpose"] == 0
        assert counts["grouped_gemm_fp8_wgrad"] == 0 and a_copies == []


def test_no_grad_forward_writes_no_transposed_weight():
    """Under torch.no_grad() no backward follows: the weight is quantized in its forward orientation only,
    and the output is the same bits as with grad mode on."""
    a, w, offs = _inputs(SEPARATE_QUANTIZE_GROUPS, m=2048)
    with_grad = fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=True)
    with torch.no_grad(), _FP8FlowCalls() as mode:
        out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=True)
    assert mode.transposes_asked == [False]
    assert torch.equal(out, with_grad.detach())


def test_forward_only_quantizes_in_the_gemm_up_to_256_rows_per_expert():
    """Two M tiles per expert: a training forward quantizes the weight apart (its tiles feed the dgrad), a
    forward with no dgrad to come quantizes it in the GEMM (FORWARD_IN_GEMM_MAX_ROWS_PER_EXPERT); same bits."""
    a, w, offs = _inputs([256, 512, 768, 1024], m=1024)
    with FP8FlowOpCounter() as training:
        with_grad = fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=True)
    with torch.no_grad(), FP8FlowOpCounter() as inference:
        out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, offs_aligned=True)
    assert training.counts["quantize_128x128"] == 1 and training.counts[QUANTIZING_GEMMS] == 0
    assert inference.counts["quantize_128x128"] == 0 and inference.counts[QUANTIZING_GEMMS] == 1
    assert torch.equal(out, with_grad.detach())


def _loss(a, b_t, offs):
    return fp8_grouped_mm(a, b_t, offs, offs_aligned=True).float().square().mean()


def _fresh_weight_grad(a, w, offs):
    """The plain path's weight gradient (no existing .grad: nothing to accumulate into)."""
    w2 = w.detach().clone().requires_grad_()
    _loss(a.detach(), w2.transpose(-2, -1), offs).backward()
    return w2.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_accumulates_into_an_existing_weight_gradient(dtype):
    """Gradient accumulation: the second .backward() adds dW to w.grad in the wgrad epilogue (the
    mutating op runs, in place: same storage), giving the existing gradient plus a fresh one, summed in
    fp32 (bit for bit for fp32 weights, where the plain path's add is the same fp32 add)."""
    a, w, offs = _inputs(GROUPS["skewed"])
    w = w.detach().to(dtype).requires_grad_()
    fresh = _fresh_weight_grad(a, w, offs)
    existing = torch.randn_like(w)
    w.grad = existing.clone()
    storage = w.grad.data_ptr()
    with FP8FlowOpCounter() as counter:
        _loss(a, w.transpose(-2, -1), offs).backward()
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 1 and counter.counts["grouped_gemm_fp8_wgrad"] == 0
    assert w.grad.data_ptr() == storage and w.grad.dtype == dtype
    assert_accumulated(w.grad, existing, fresh)
    assert a.grad is not None  # the input's gradient is unaffected by the fusion


def test_post_accumulate_grad_hook_sees_the_sum():
    a, w, offs = _inputs(GROUPS["balanced"])
    w = w.detach().float().requires_grad_()
    fresh = _fresh_weight_grad(a, w, offs)
    existing = torch.randn_like(w)
    w.grad = existing.clone()
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    with FP8FlowOpCounter() as counter:
        _loss(a, w.transpose(-2, -1), offs).backward()
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 1
    assert len(seen) == 1 and torch.equal(seen[0], existing + fresh)


def _plain_path_cases():
    """(name, set-up of w, how backward runs): where fusing would be wrong, the plain path runs."""

    def hooked(w):
        w.register_hook(lambda g: g * 2)  # a tensor hook must see (and may change) this gradient
        return 2

    return {
        "autograd_grad": (lambda w: 0, "grad"),
        "backward_inputs_without_w": (lambda w: 0, "inputs_a"),
        "tensor_hook": (hooked, "backward"),
        "create_graph": (lambda w: 0, "create_graph"),
    }


@pytest.mark.parametrize("case", list(_plain_path_cases()))
def test_plain_path_where_fusing_is_unsafe(case):
    """torch.autograd.grad hands dW to its caller (w.grad must stay untouched); backward(inputs=[a])
    does not accumulate into w; a tensor hook must see the gradient; create_graph accumulates out of
    place. Each gets exactly what it would without the fusion."""
    setup, how = _plain_path_cases()[case]
    a, w, offs = _inputs(GROUPS["skewed"])
    w = w.detach().float().requires_grad_()
    fresh = _fresh_weight_grad(a, w, offs)
    scale = setup(w) or 1
    existing = torch.randn_like(w)
    w.grad = existing.clone()
    with FP8FlowOpCounter() as counter:
        loss = _loss(a, w.transpose(-2, -1), offs)
        if how == "grad":
            (grad_w,) = torch.autograd.grad(loss, (w,))
            assert torch.equal(grad_w, fresh)
        elif how == "inputs_a":
            loss.backward(inputs=[a])
        else:
            loss.backward(create_graph=how == "create_graph")
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 0
    expected = existing if how in ("grad", "inputs_a") else existing + scale * fresh
    assert torch.equal(w.grad.detach(), expected)


def test_double_backward_raises_where_it_would_silently_drop_a_term():
    """A gradient penalty through the op: the first-order gradients are as without create_graph, and
    differentiating them again raises (they once came back as constants, their second-order term zero)."""
    a, w, offs = _inputs(GROUPS["skewed"])
    (plain,) = torch.autograd.grad(_loss(a, w.transpose(-2, -1), offs), (a,))
    (grad_a,) = torch.autograd.grad(_loss(a, w.transpose(-2, -1), offs), (a,), create_graph=True)
    assert torch.equal(grad_a.detach(), plain) and grad_a.requires_grad
    with pytest.raises(RuntimeError, match="fp8_grouped_mm: its backward is not differentiable"):
        grad_a.float().square().sum().backward()


def test_b_t_leaf_takes_the_plain_path():
    """A leaf B_t [E, K, N] keeps its gradient in that layout, whose rows are not the epilogue's
    [E, N, K] rows: the plain path, and autograd's accumulation, sum correctly."""
    a, w, offs = _inputs(GROUPS["balanced"])
    b_t = w.detach().float().transpose(-2, -1).contiguous().requires_grad_()
    with FP8FlowOpCounter() as counter:
        for _ in range(2):
            _loss(a, b_t, offs).backward()
    fresh = _fresh_weight_grad(a, b_t.detach().transpose(-2, -1), offs).transpose(-2, -1)
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 0 and torch.equal(b_t.grad, fresh + fresh)


def test_compiled_backward_does_not_fuse():
    """Under torch.compile the backward is traced once, so it must not depend on .grad existing: the
    plain path, and autograd's accumulation, give existing + fresh."""
    a, w, offs = _inputs(GROUPS["skewed"])
    w = w.detach().float().requires_grad_()
    fresh = _fresh_weight_grad(a, w, offs)
    existing = torch.randn_like(w)
    w.grad = existing.clone()
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")
    loss = compiled(a, w.transpose(-2, -1), offs)
    with FP8FlowOpCounter() as counter:  # (dynamo refuses to trace under a dispatch mode: backward only)
        loss.backward()
    assert counter.counts["grouped_gemm_fp8_wgrad"] == 1
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 0
    torch.testing.assert_close(w.grad, existing + fresh, rtol=1e-6, atol=1e-7)
