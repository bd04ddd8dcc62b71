"""fp8_grouped_mm / _Float8GroupedMM: numerics against fp32 math on the BF16 operands, what backward
keeps, the op sequence (no re-quantization), 128-aligned offsets, bad input, torch.compile."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import sqnr_db

from fp8flow_ao.debug import FP8FlowOpCounter
from fp8flow_ao.grouped_mm import fp8_grouped_mm
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


def _run(a, w, offs, recipe):
    out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, recipe=recipe)
    grad_out = torch.randn_like(out)
    grad_a, grad_w = torch.autograd.grad(out, (a, w), grad_out)
    return out, grad_a, grad_w, grad_out


def _check_numerics(groups, recipe, device=DEVICE, shape=(M, K, N), sync_debug=False):
    a, w, offs = _inputs(groups, *shape, device=device)
    if sync_debug:  # forward and backward may not wait on the device
        torch.cuda.set_sync_debug_mode("error")
    try:
        out, grad_a, grad_w, grad_out = _run(a, w, offs, recipe)
    finally:
        if sync_debug:
            torch.cuda.set_sync_debug_mode("default")
    ref, ref_a, ref_w = _fp32_reference(a, w, groups, grad_out)
    rows = groups[-1]  # rows past the last group end are not computed
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


def test_rowwise_matches_fp32_math():
    _check_numerics(GROUPS["skewed"], "rowwise")


def test_fp8_activation_input_is_the_same_gemm():
    """A Float8BlockwiseActivation input skips the quantize and gives bit-identical results."""
    a, w, offs = _inputs(GROUPS["balanced"])
    out, grad_a, grad_w, grad_out = _run(a, w, offs, "blockwise")
    out8 = fp8_grouped_mm(to_fp8_blockwise(a), w.transpose(-2, -1), offs)
    grad_a8, grad_w8 = torch.autograd.grad(out8, (a, w), grad_out)
    assert torch.equal(out8, out) and torch.equal(grad_a8, grad_a) and torch.equal(grad_w8, grad_w)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_backward_keeps_fp8_activations_and_casts_twice(recipe):
    """Blockwise saves FP8 A (never BF16), casts 2 activations (A, dOut) and quantizes the weight once."""
    a, w, offs = _inputs(GROUPS["balanced"])
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FP8FlowOpCounter() as counter:
        out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, recipe=recipe)
        out.sum().backward()
    hp_activations = [t for t in saved if t.dtype in (torch.bfloat16, torch.float32) and t.shape == a.shape]
    if recipe == "blockwise":
        assert hp_activations == []
        assert {t.dtype for t in saved} <= {FP8, torch.float32, torch.int32}
        assert any(t.dtype == FP8 and t.shape == a.shape for t in saved)
        assert counter.counts["quantize_128x128"] == 1  # dgrad uses the exact transpose, no re-quantize
        assert counter.counts["scaling_aware_transpose"] == 1
        assert counter.counts["dequantize"] == 0
        assert counter.activation_casts == 2
    else:  # torchao's row-wise recipe keeps the high-precision A for its per-expert column scales
        assert len(hp_activations) == 1
        assert counter.counts["quantize_1x128"] == 4  # A, W, dOut, W^T (the wgrad casts are torch ops)


def test_misaligned_offsets_raise():
    a, w, _ = _inputs(GROUPS["balanced"], device="cpu")
    offs = torch.tensor([100, 256, 384, 512], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_grouped_mm(a, w.transpose(-2, -1), offs)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a, b, o: (a, b, o, "tensorwise"), ValueError, "recipe"),
        (lambda a, b, o: (a[:, :200], b[:, :200], o, "blockwise"), ValueError, "multiple of 128"),
        (lambda a, b, o: (a[:100], b, o, "blockwise"), ValueError, "rows M"),
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
