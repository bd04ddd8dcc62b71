"""unpermute_unpad: the fused gather-combine and its fused backward, against the reference and a naive loop."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, INTERPRETING
from fp8_helpers import make_routing

from fp8flow_ao.kernels.permute_pad import route_pad
from fp8flow_ao.kernels.unpermute_unpad import (
    launch_unpermute_unpad,
    launch_unpermute_unpad_backward,
    unpermute_unpad,
    unpermute_unpad_backward,
    unpermute_unpad_backward_reference,
    unpermute_unpad_reference,
)


@triton.jit
def _to_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)


def _bf16_probe() -> torch.Tensor:
    """fp32 values at and around bf16 rounding boundaries: ties to even (down and up), carries into the
    exponent, just above a tie, subnormals, specials."""
    one = 1.0 + torch.tensor([2.0**-7 + 2.0**-8, 2.0**-8, 2.0**-8 + 2.0**-20, 2.0**-7 - 2.0**-24])
    v = torch.cat([one, torch.tensor([2.0 - 2.0**-8, 3e-39, 1e-45, 0.0, float("inf"), float("nan")]), torch.randn(50)])
    return torch.cat([v, -v])


def test_fp32_to_bf16_cast_rounds_to_nearest_even():
    x = _bf16_probe().to(DEVICE)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _to_bf16_kernel[(1,)](x, y, x.numel(), BLOCK=256)
    torch.testing.assert_close(y.cpu(), x.cpu().to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not INTERPRETING, reason="shows the unpatched interpreter's bug; only meaningful when interpreting")
def test_unpatched_interpreter_truncates_bf16(monkeypatch):
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    monkeypatch.setattr(builder, "create_fp_trunc", builder._fp8flow_original_fp_trunc)
    x = torch.tensor([1.0 + 2.0**-7 + 2.0**-8])  # halfway between 1 + 2**-7 and 1 + 2**-6: even is 1 + 2**-6
    y = torch.empty(1, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](x, y, 1, BLOCK=16)
    assert x.to(torch.bfloat16).item() == 1.0 + 2.0**-6
    assert y.item() == 1.0 + 2.0**-7


# (kind, T, k, E): top-k 1 and 8, T = 0, skewed with empty experts, one expert with every row, duplicates
ROUTINGS = [
    ("distinct", 37, 8, 12),
    ("distinct", 50, 1, 4),
    ("skewed", 150, 2, 9),
    ("one_expert", 70, 2, 4),
    ("twice", 23, 3, 5),
    ("distinct", 0, 2, 4),
]


def _case(routing, cols: int, probs_dtype: torch.dtype | None, dtype: torch.dtype = torch.bfloat16):
    """Route, then expert outputs with NaN in every pad row (which must never be read)."""
    kind, tokens, top_k, experts = routing
    src_rows, dst_rows, _ = route_pad(make_routing(kind, tokens, top_k, experts, DEVICE), experts)
    y = torch.randn(src_rows.shape[0], cols, device=DEVICE).to(dtype)
    y[src_rows < 0] = float("nan")
    probs = None if probs_dtype is None else torch.rand(tokens, top_k, device=DEVICE).to(probs_dtype)
    return y, src_rows, dst_rows, probs, top_k


def _naive_combine(y, dst_rows, top_k, probs):
    """out[t] = sum_j p[t, j] * y[row] one token at a time, fp32, slots in order."""
    tokens = dst_rows.numel() // top_k
    out = torch.zeros(tokens, y.shape[1])
    for t in range(tokens):
        acc = torch.zeros(y.shape[1])
        for j in range(top_k):
            row = y[int(dst_rows[t * top_k + j])].float()
            acc = acc + (row if probs is None else row * probs[t, j].float())
        out[t] = acc
    return out.to(y.dtype)


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: f"{r[0]}-T{r[1]}-k{r[2]}")
@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [256, 200])
def test_kernel_matches_reference(routing, probs_dtype, cols):
    y, _, dst_rows, probs, top_k = _case(routing, cols, probs_dtype)
    out = launch_unpermute_unpad(y, dst_rows, top_k, probs)
    ref = unpermute_unpad_reference(y.cpu(), dst_rows.cpu(), top_k, None if probs is None else probs.cpu())
    assert out.dtype == torch.bfloat16 and out.shape == (dst_rows.numel() // top_k, cols)
    assert bool(torch.isfinite(out).all())  # NaN pad rows were never read
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("routing", [ROUTINGS[0], ROUTINGS[4]], ids=lambda r: r[0])
@pytest.mark.parametrize("probs_dtype", [None, torch.float32])
def test_reference_is_the_naive_sum(routing, probs_dtype):
    y, _, dst_rows, probs, top_k = (
        t.cpu() if isinstance(t, torch.Tensor) else t for t in _case(routing, 64, probs_dtype)
    )
    ref = unpermute_unpad_reference(y, dst_rows, top_k, probs)
    torch.testing.assert_close(ref, _naive_combine(y, dst_rows, top_k, probs), rtol=0, atol=0)


def test_fp32_rows_and_row_stride():
    y, _, dst_rows, probs, top_k = _case(ROUTINGS[2], 512, torch.float32, torch.float32)
    view = y[:, :256]  # row stride 512
    out = launch_unpermute_unpad(view, dst_rows, top_k, probs)
    ref = unpermute_unpad_reference(view.contiguous().cpu(), dst_rows.cpu(), top_k, probs.cpu())
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: f"{r[0]}-T{r[1]}-k{r[2]}")
@pytest.mark.parametrize(("with_probs", "with_y"), [(True, True), (True, False), (False, False)])
def test_backward_kernel_matches_reference(routing, with_probs, with_y):
    y, src_rows, dst_rows, probs, top_k = _case(routing, 200, torch.float32 if with_probs else None)
    y = y.nan_to_num(0.0) if with_y else None
    grad_out = torch.randn(dst_rows.numel() // top_k, 200, device=DEVICE, dtype=torch.bfloat16)
    grad_y, grad_probs = launch_unpermute_unpad_backward(grad_out, y, src_rows, dst_rows, probs, top_k)
    cpu = [None if t is None else t.cpu() for t in (grad_out, y, src_rows, dst_rows, probs)]
    ref_y, ref_probs = unpermute_unpad_backward_reference(*cpu, top_k)
    torch.testing.assert_close(grad_y.cpu(), ref_y, rtol=0, atol=0)  # one fp32 product, rounded once
    assert not bool(grad_y.cpu()[src_rows.cpu() < 0].view(torch.int16).any())  # pad rows are +0
    if with_y:
        torch.testing.assert_close(grad_probs.cpu(), ref_probs, rtol=1e-5, atol=1e-4)  # fp32 dots, another order
    else:
        assert grad_probs.numel() == 0


@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16])
def test_autograd_matches_fp64(probs_dtype):
    y, src_rows, dst_rows, probs, top_k = _case(ROUTINGS[4], 128, probs_dtype)
    y = y.nan_to_num(0.0).requires_grad_()
    inputs = (y,) if probs is None else (y, probs.requires_grad_())
    grad_out = torch.randn(dst_rows.numel() // top_k, 128, device=DEVICE, dtype=torch.bfloat16)
    grads = torch.autograd.grad(unpermute_unpad(y, dst_rows, top_k, probs), inputs, grad_out)
    # fp64 reference autograd through plain indexing
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    rows = ref_inputs[0][dst_rows.long()].view(-1, top_k, 128)
    if probs is not None:
        rows = rows * ref_inputs[1][..., None]
    ref_grads = torch.autograd.grad(rows.sum(1), ref_inputs, grad_out.double())
    assert grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0].double(), ref_grads[0], rtol=2**-8, atol=0)  # one bf16 rounding of p * g
    assert not bool(grads[0][src_rows < 0].float().any())
    if probs is not None:
        assert grads[1].dtype == probs.dtype
        tol = 2**-7 if probs.dtype == torch.bfloat16 else 1e-5  # fp32 dot, then rounded to probs' dtype
        torch.testing.assert_close(grads[1].double(), ref_grads[1], rtol=tol, atol=max(tol, 1e-4))


def test_compile_fullgraph_forward_and_backward():
    y, _, dst_rows, probs, top_k = _case(ROUTINGS[2], 128, torch.float32)
    y = y.nan_to_num(0.0)
    grad_out = torch.randn(dst_rows.numel() // top_k, 128, device=DEVICE, dtype=torch.bfloat16)

    def fwd_bwd(y, probs):
        y, probs = y.detach().requires_grad_(), probs.detach().requires_grad_()
        out = unpermute_unpad(y, dst_rows, top_k, probs)
        return (out, *torch.autograd.grad(out, (y, probs), grad_out))

    eager = fwd_bwd(y, probs)
    compiled_out = torch.compile(unpermute_unpad, fullgraph=True)(y, dst_rows, top_k, probs)
    torch.testing.assert_close(compiled_out, eager[0], rtol=0, atol=0)
    y_c, p_c = y.clone().requires_grad_(), probs.clone().requires_grad_()
    out_c = torch.compile(unpermute_unpad, fullgraph=True)(y_c, dst_rows, top_k, p_c)
    out_c.backward(grad_out)
    torch.testing.assert_close(y_c.grad, eager[1], rtol=0, atol=0)
    torch.testing.assert_close(p_c.grad, eager[2], rtol=0, atol=0)


def test_opcheck():
    y, src_rows, dst_rows, probs, top_k = _case(ROUTINGS[0], 128, torch.float32)
    y = y.nan_to_num(0.0)  # opcheck compares outputs without equal_nan
    grad_out = torch.randn(dst_rows.numel() // top_k, 128, device=DEVICE, dtype=torch.bfloat16)
    # The op carries no gradient (unpermute_unpad, the public function, does): inputs without requires_grad.
    torch.library.opcheck(torch.ops.fp8flow.unpermute_unpad.default, (y, dst_rows, top_k, probs))
    torch.library.opcheck(torch.ops.fp8flow.unpermute_unpad.default, (y, dst_rows, top_k, None))
    op = torch.ops.fp8flow.unpermute_unpad_backward.default
    torch.library.opcheck(op, (grad_out, y, src_rows, dst_rows, probs, top_k))
    torch.library.opcheck(op, (grad_out, None, src_rows, dst_rows, None, top_k))


def test_public_backward_maps_empty_to_none():
    y, src_rows, dst_rows, probs, top_k = _case(ROUTINGS[1], 128, torch.float32)
    grad_out = torch.randn(dst_rows.numel() // top_k, 128, device=DEVICE, dtype=torch.bfloat16)
    grad_y, grad_probs = unpermute_unpad_backward(grad_out, None, src_rows, dst_rows, probs, top_k)
    assert grad_probs is None and grad_y.shape == y.shape
    _, grad_probs = unpermute_unpad_backward(grad_out, y.nan_to_num(0.0), src_rows, dst_rows, probs, top_k)
    assert grad_probs.shape == probs.shape and grad_probs.dtype == torch.float32


def _bad_cases():
    y = torch.zeros(256, 128, dtype=torch.bfloat16)
    dst = torch.zeros(8, dtype=torch.int32)
    return [
        ((y.to(torch.float8_e4m3fn), dst, 2), {}, TypeError, "y must have dtype"),
        ((y[None], dst, 2), {}, ValueError, "y must have 2 dims"),
        ((torch.zeros(128, 256, dtype=torch.bfloat16).t(), dst, 2), {}, ValueError, "y must be row-major"),
        ((y, dst.long(), 2), {}, TypeError, "dst_rows must have dtype"),
        ((y, torch.zeros(16, dtype=torch.int32)[::2], 2), {}, ValueError, "dst_rows must be contiguous"),
        ((y, dst, 3), {}, ValueError, "multiple of top_k"),
        ((y, dst, 0), {}, ValueError, "top_k must be a positive int"),
        ((y, dst, 2), {"probs": torch.ones(4, 3)}, ValueError, "probs must have shape"),
        ((y, dst, 2), {"probs": torch.ones(4, 2, dtype=torch.float64)}, TypeError, "probs must have dtype"),
        ((y, dst, 2), {"probs": torch.ones(2, 4).t()}, ValueError, "probs must be contiguous"),
    ]


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), _bad_cases())
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        unpermute_unpad(*args, **kwargs)


def test_bad_backward_input():
    g = torch.zeros(4, 128, dtype=torch.bfloat16)
    src, dst = torch.full((128,), -1, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="dst_rows must have shape"):
        unpermute_unpad_backward(g, None, src, dst[:6], None, 2)
    with pytest.raises(ValueError, match="y must have shape"):
        unpermute_unpad_backward(g, torch.zeros(64, 128, dtype=torch.bfloat16), src, dst, None, 2)
    with pytest.raises(TypeError, match="y must have dtype"):
        unpermute_unpad_backward(g, torch.zeros(128, 128), src, dst, None, 2)


def test_out_of_range_rows_raise_in_validation_mode(monkeypatch):
    y = torch.zeros(128, 64, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    dst[3] = 128
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"dst_rows values must lie in \[0, 128\)"):
        unpermute_unpad(y, dst, 2)


@pytest.mark.parametrize("bad", [9999, -1])
def test_cpu_row_maps_are_checked_without_opting_in(bad):
    """On CPU tensors the row map's values are checked for free: an index past the rows, or -1 (which
    would read the last row), is a ValueError naming ``dst_rows``."""
    y = torch.zeros(8, 128, dtype=torch.bfloat16)
    dst_rows = torch.arange(8, dtype=torch.int32)
    dst_rows[3] = bad
    with pytest.raises(ValueError, match=r"dst_rows values must lie in \[0, 8\)"):
        unpermute_unpad(y, dst_rows, 2)
