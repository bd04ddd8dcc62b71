"""Tensor subclasses: the FP8 blockwise activation (row ops move data and scales bit for bit, everything
else is refused, torch._grouped_mm runs FP8, all-to-all, compile) and the expert-weight wrapper
(routes torch._grouped_mm, plain tensor otherwise: optimizer, .to, detach, state_dict, FSDP2 hooks)."""

from __future__ import annotations

import socket
import types

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import assert_fp8_equal, assert_scales_equal
from torch import nn

from fp8flow_ao.grouped_mm import fp8_grouped_mm
from fp8flow_ao.kernels.dequantize import dequantize
from fp8flow_ao.kernels.permute_pad import permute_pad_rows, route_pad
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128
from fp8flow_ao.tensor import Float8BlockwiseActivation, FP8FlowExpertWeight, to_fp8_blockwise, wrap_expert_weights

OFFS = [128, 128, 384, 512]  # group ends, E = 4, one empty expert


def _assert_payload(x8: Float8BlockwiseActivation, data: torch.Tensor, scale: torch.Tensor) -> None:
    assert isinstance(x8, Float8BlockwiseActivation)
    assert x8.shape == data.shape and x8.dtype == torch.bfloat16
    assert_fp8_equal(x8._data, data)
    assert_scales_equal(x8._scale_inv, scale)


@pytest.fixture
def x_and_payload():
    x = torch.randn(256, 384, device=DEVICE, dtype=torch.bfloat16)
    data, scale = quantize_1x128(x)
    return x, data, scale


def test_activation_flatten_roundtrip(x_and_payload):
    x, data, scale = x_and_payload
    x8 = to_fp8_blockwise(x)
    _assert_payload(x8, data, scale)
    names, meta = x8.__tensor_flatten__()
    inner = {n: getattr(x8, n) for n in names}
    again = Float8BlockwiseActivation.__tensor_unflatten__(inner, meta, x8.shape, x8.stride())
    _assert_payload(again, data, scale)
    torch.testing.assert_close(x8.dequantize(torch.float32), dequantize(data, scale), rtol=0, atol=0)


def test_row_ops_move_data_and_scales_together(x_and_payload):
    x, data, scale = x_and_payload
    x8 = to_fp8_blockwise(x)
    idx = torch.randint(0, 256, (300,), device=DEVICE)
    _assert_payload(x8[idx], data[idx], scale[idx])
    _assert_payload(torch.index_select(x8, 0, idx), data[idx], scale[idx])
    _assert_payload(x8[10:70], data[10:70], scale[10:70])
    _assert_payload(x8.detach(), data, scale)
    _assert_payload(x8.clone(), data, scale)
    _assert_payload(x8.to(DEVICE), data, scale)
    parts = x8.split([100, 0, 156])
    assert [p.shape[0] for p in parts] == [100, 0, 156]
    _assert_payload(parts[2], data[100:], scale[100:])
    _assert_payload(
        torch.cat([parts[2], parts[0]]), torch.cat([data[100:], data[:100]]), torch.cat([scale[100:], scale[:100]])
    )
    src_rows, _, _ = route_pad(torch.randint(0, 4, (256, 2), device=DEVICE), 4)
    _assert_payload(x8.permute_pad_rows(src_rows, 2), *permute_pad_rows(data, scale, src_rows, 2))


@pytest.mark.parametrize(
    ("op", "name"),
    [
        (lambda t: t + 1, "aten.add"),
        (lambda t: t.sum(), "aten.sum"),
        (lambda t: t @ torch.ones(384, 8, dtype=torch.bfloat16, device=t.device), "aten.mm"),
        (lambda t: t.float(), "cannot be cast"),
        (lambda t: t[:, :128], "only along rows"),
        (lambda t: t.view(128, 768), "aten.view"),
        (lambda t: t.t(), "aten.t"),
        (lambda t: t[torch.ones(t.shape[0], dtype=torch.bool, device=t.device)], "one integer index"),
        (lambda t: torch.cat([t, torch.zeros_like(t._data, dtype=torch.bfloat16)]), "every tensor"),
    ],
)
def test_activation_refuses_other_ops(x_and_payload, op, name):
    x8 = to_fp8_blockwise(x_and_payload[0])
    with pytest.raises(NotImplementedError, match=name):
        op(x8)


def test_grouped_mm_and_gradient_through_fp8_rows(x_and_payload):
    """Gather FP8 rows, then torch._grouped_mm: same numbers as the BF16 route, gradient reaches x."""
    x = x_and_payload[0].requires_grad_()
    w = (torch.randn(4, 256, 384, device=DEVICE) * 0.05).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor(OFFS, dtype=torch.int32, device=DEVICE)
    rows = torch.randint(0, 256, (512,), device=DEVICE)
    out = torch._grouped_mm(to_fp8_blockwise(x)[rows], w.transpose(-2, -1), offs=offs)
    ref = fp8_grouped_mm(x[rows], w.transpose(-2, -1), offs)
    assert type(out) is torch.Tensor and torch.equal(out, ref)
    grad = torch.randn_like(ref)
    assert all(
        torch.equal(g, r)
        for g, r in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad), strict=True)
    )


def test_activation_compiles_fullgraph(x_and_payload):
    x = x_and_payload[0].requires_grad_()
    w = (torch.randn(4, 256, 384, device=DEVICE) * 0.05).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor(OFFS, dtype=torch.int32, device=DEVICE)
    rows = torch.randint(0, 256, (512,), device=DEVICE)

    def loss(x, w, rows, offs):
        x8 = to_fp8_blockwise(x)
        first, second = x8[rows].split([256, 256])
        return torch._grouped_mm(torch.cat([first, second]), w.transpose(-2, -1), offs=offs).float().square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        value = fn(x, w, rows, offs)
        results.append((value, *torch.autograd.grad(value, (x, w))))
    assert all(torch.equal(c, e) for c, e in zip(*results, strict=True))


def test_all_to_all_payload(x_and_payload, monkeypatch):
    """One-rank gloo group: the FP8 payload and its scales travel through funcol.all_to_all_single."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    x, data, scale = x_and_payload
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        x8 = to_fp8_blockwise(x.cpu())
        out = funcol.all_to_all_single(x8, [256], [256], dist.group.WORLD)
        _assert_payload(out, data.cpu(), scale.cpu())
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# expert-weight wrapper
# --------------------------------------------------------------------------------------------------


class _Experts(nn.Module):
    def __init__(self, e=4, n=256, k=384):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, n, k, device=DEVICE) * 0.05)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_wrapper_routes_grouped_mm(recipe):
    plain = _Experts()
    wrapped = wrap_expert_weights(_Experts(), recipe=recipe, names=("w1",))
    wrapped.load_state_dict(plain.state_dict())
    assert isinstance(wrapped.w1, FP8FlowExpertWeight) and wrapped.w1.recipe == recipe
    x = torch.randn(512, 384, device=DEVICE, dtype=torch.bfloat16)
    offs = torch.tensor(OFFS, dtype=torch.int32, device=DEVICE)
    # torchtitan's call: torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(x, wrapped.w1.bfloat16().transpose(-2, -1), offs=offs)
    w_ref = plain.w1.bfloat16()
    ref = fp8_grouped_mm(x, w_ref.transpose(-2, -1), offs, recipe=recipe)
    assert type(out) is torch.Tensor and torch.equal(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert type(wrapped.w1.grad) is torch.Tensor and torch.equal(wrapped.w1.grad, plain.w1.grad)


def test_wrapper_keeps_grouped_mm_output_dtype():
    """Without ``out_dtype`` the routed call returns A's dtype, as ``torch._grouped_mm`` does: fp32 tokens
    and weights give an fp32 output."""
    wrapped = wrap_expert_weights(_Experts(), names=("w1",))
    x = torch.randn(512, 384, device=DEVICE)
    offs = torch.tensor(OFFS, dtype=torch.int32, device=DEVICE)
    out = torch._grouped_mm(x, wrapped.w1.float().transpose(-2, -1), offs=offs)
    assert out.dtype == torch.float32
    assert torch.equal(
        out, fp8_grouped_mm(x, wrapped.w1.float().detach().transpose(-2, -1), offs, out_dtype=torch.float32)
    )


def test_wrapper_is_a_plain_tensor_elsewhere():
    plain = _Experts()
    wrapped = wrap_expert_weights(_Experts(), names=("w1",))
    wrapped.load_state_dict(plain.state_dict())
    w = wrapped.w1
    assert type(w + 1) is torch.Tensor and torch.equal(w + 1, plain.w1 + 1)
    assert torch.equal(w.sum(), plain.w1.sum())
    assert isinstance(w.detach(), FP8FlowExpertWeight) and isinstance(w.to(torch.bfloat16), FP8FlowExpertWeight)
    assert w.to(torch.bfloat16).dtype == torch.bfloat16
    # optimizer: identical updates on the wrapped and the plain parameter (one implementation for both:
    # on CUDA a plain tensor would otherwise take the foreach kernels, whose rounding differs)
    for module in (plain, wrapped):
        module.w1.grad = torch.ones_like(plain.w1)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=False)
        opt.step()
    assert isinstance(wrapped.w1, FP8FlowExpertWeight) and torch.equal(wrapped.w1._data, plain.w1.detach())
    # state_dict: same keys, plain tensors, loadable both ways
    state = wrapped.state_dict()
    assert list(state) == ["w1"] and type(state["w1"]) is torch.Tensor
    fresh = _Experts()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.w1, plain.w1)
    fresh.w1.data.mul_(2)
    wrapped.load_state_dict(fresh.state_dict())
    assert isinstance(wrapped.w1, FP8FlowExpertWeight) and torch.equal(wrapped.w1._data, fresh.w1.detach())
    with pytest.raises(ValueError, match="already an FP8FlowExpertWeight"):
        wrap_expert_weights(wrapped, names=("w1",))
    with pytest.raises(TypeError, match="names must be a sequence of parameter names, got the string 'w1'"):
        wrap_expert_weights(_Experts(), names="w1")
    with pytest.raises(TypeError, match="data must be a torch.Tensor, got list"):
        FP8FlowExpertWeight([1.0])
    with pytest.raises(TypeError, match="offs_aligned must be a bool"):
        FP8FlowExpertWeight(torch.randn(2, 128, 128), offs_aligned="no")


def test_wrapper_flatten_and_fsdp_hooks():
    w = FP8FlowExpertWeight(torch.randn(2, 128, 256, device=DEVICE), "rowwise")
    names, meta = w.__tensor_flatten__()
    again = FP8FlowExpertWeight.__tensor_unflatten__({n: getattr(w, n) for n in names}, meta, w.shape, w.stride())
    assert again.recipe == "rowwise" and torch.equal(again._data, w._data)
    policy = types.SimpleNamespace(param_dtype=torch.bfloat16)
    (gathered,), meta = w.fsdp_pre_all_gather(None, w.shape, w.stride(), None, policy)
    assert type(gathered) is torch.Tensor and gathered.dtype == torch.bfloat16
    unsharded, inner = w.fsdp_post_all_gather((gathered,), meta, torch.bfloat16)
    assert isinstance(unsharded, FP8FlowExpertWeight) and unsharded.recipe == "rowwise" and inner == (gathered,)
    fresh = gathered * 2
    assert unsharded.fsdp_post_all_gather((fresh,), meta, torch.bfloat16, out=unsharded) is None
    assert torch.equal(unsharded._data, fresh)


def test_wrapper_compiles_fullgraph():
    experts = wrap_expert_weights(_Experts(), names=("w1",))
    x = torch.randn(512, 384, device=DEVICE, dtype=torch.bfloat16)
    offs = torch.tensor(OFFS, dtype=torch.int32, device=DEVICE)

    def loss(x, offs):
        return torch._grouped_mm(x, experts.w1.bfloat16().transpose(-2, -1), offs=offs).float().square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        value = fn(x, offs)
        results.append((value, *torch.autograd.grad(value, (experts.w1,))))
    assert all(torch.equal(c, e) for c, e in zip(*results, strict=True))
