"""The lean op registration (``fp8flow_ao.kernels._registry``): the autograd behaviour custom_op had."""

import pytest
import torch

import fp8flow_ao.kernels.permute_pad  # noqa: F401  (registers fp8flow::route_pad)
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128_reference


def test_backward_through_an_op_without_formula_raises():
    """No silent fallback: torch's autograd fallback would only warn and could return wrong gradients."""
    x = torch.randn(4, 256, requires_grad=True)
    data, scale = torch.ops.fp8flow.quantize_1x128(x, 128)
    with pytest.raises(RuntimeError, match="fp8flow::quantize_1x128 has no gradient formula"):
        (data.float() * scale.repeat_interleave(128, dim=1)).sum().backward()


def test_without_grad_the_op_is_the_reference():
    x = torch.randn(4, 256)
    (data, scale), (ref_data, ref_scale) = torch.ops.fp8flow.quantize_1x128(x, 128), quantize_1x128_reference(x, 128)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(scale, ref_scale)


def test_an_op_with_a_formula_differentiates():
    """route_pad's formula (the probs' gradient gathered back) still runs through the shared autograd kernel."""
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    probs = torch.rand(3, 2, requires_grad=True)
    probs_out, _, dst_rows, _ = torch.ops.fp8flow.route_pad(ids, 2, probs)
    (probs_out * torch.arange(probs_out.numel())).sum().backward()
    assert torch.equal(probs.grad, dst_rows.view(3, 2).float())
