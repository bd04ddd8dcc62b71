"""The lean op registration (``fp8flow_ao.kernels._registry``): no op has an autograd kernel; an op with a
gradient formula differentiates through its public function (an autograd Function, only where needed)."""

import pytest
import torch

from fp8flow_ao.kernels.permute_pad import _route_pad_op, route_pad_reference
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128, quantize_1x128_reference


def test_a_public_function_without_formula_refuses_inputs_that_need_a_gradient():
    """No silent fallback: the op has no autograd kernel, so its public function refuses up front."""
    x = torch.randn(4, 256, requires_grad=True)
    with pytest.raises(RuntimeError, match="fp8flow::quantize_1x128 has no gradient formula"):
        quantize_1x128(x)
    with torch.no_grad():
        data, _ = quantize_1x128(x)
    assert not data.requires_grad
    data, _ = quantize_1x128(x.detach())
    assert not data.requires_grad


def test_the_raw_op_without_formula_warns_on_backward():
    """Called through torch.ops on an input that requires grad, torch's autograd fallback applies:
    the op has no autograd kernel of ours (see _registry), and a backward through it warns."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("fp8flow::quantize_1x128", "Autograd")
    x = torch.randn(4, 256, requires_grad=True)
    data, scale = torch.ops.fp8flow.quantize_1x128(x, 128)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        (data.float() * scale.repeat_interleave(128, dim=1)).sum().backward()


def test_without_grad_the_op_is_the_reference():
    x = torch.randn(4, 256)
    (data, scale), (ref_data, ref_scale) = torch.ops.fp8flow.quantize_1x128(x, 128), quantize_1x128_reference(x, 128)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(scale, ref_scale)


def test_an_op_with_a_formula_differentiates_through_its_function():
    """route_pad's formula (the probs' gradient gathered back) runs in the autograd Function its LeanOp
    applies when an input requires grad; the op itself has no autograd kernel."""
    for op in ("route_pad", "permute_pad_rows", "permute_pad_rows_recompute", "unpermute_unpad"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8flow::{op}", "Autograd"), op
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    probs = torch.rand(3, 2, requires_grad=True)
    probs_out, _, dst_rows, _ = _route_pad_op(ids, 2, probs)
    assert probs_out.grad_fn is not None
    (probs_out * torch.arange(probs_out.numel())).sum().backward()
    assert torch.equal(probs.grad, dst_rows.view(3, 2).float())


def test_an_op_with_a_formula_skips_its_function_where_no_gradient_is_needed():
    """Without an input that requires grad, or under no_grad, the call goes straight to the op (no graph
    node) and gives the reference's outputs."""
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    probs = torch.rand(3, 2, requires_grad=True)
    with torch.no_grad():
        no_grad = _route_pad_op(ids, 2, probs)
    detached = _route_pad_op(ids, 2, probs.detach())
    for out in (no_grad, detached):
        assert out[0].grad_fn is None
        for got, want in zip(out, route_pad_reference(ids, 2, probs.detach()), strict=True):
            assert torch.equal(got, want)
