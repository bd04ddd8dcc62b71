"""launch_kernel: the same results as ``kernel[grid]``, one cache entry per Triton specialization."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fp8flow_ao.kernels import _launch
from fp8flow_ao.kernels._launch import launch_kernel
from fp8flow_ao.kernels._sm90_common import descriptor


@triton.jit
def _scaled_copy_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def _scaled_copy(x: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(x)
    launch_kernel(_scaled_copy_kernel, (triton.cdiv(x.numel(), 128),), x, out, x.numel(), scale, BLOCK=128)
    return out


@pytest.mark.gpu
def test_each_specialization_gets_its_own_entry():
    """Triton compiles apart an int == 1, a multiple of 16 and any other int, and a 16-byte aligned pointer
    and one that is not: a launch of each must run its own kernel, also when served from the cache."""
    base = torch.randn(1100, device="cuda")
    before = len(_launch._ENTRIES)
    cases = [(n, off, dtype) for n in (1, 16, 1000) for off in (0, 1) for dtype in (torch.float32, torch.bfloat16)]
    for n, off, dtype in cases:
        x = base.to(dtype)[off : off + n]
        for _ in range(2):  # the first launch goes through kernel[grid], the second through the cache
            torch.testing.assert_close(_scaled_copy(x, 2.0), x * 2.0, rtol=0, atol=0)
    # n in {1, 16, other} x pointers 16-byte aligned or not x dtype: twelve specializations
    assert len(_launch._ENTRIES) - before == len(cases)


@pytest.mark.gpu
def test_runtime_parameters_by_keyword_are_refused():
    """A runtime argument given by name would key the cache by its value (one entry per call)."""
    x = torch.randn(64, device="cuda")
    with pytest.raises(TypeError, match="positionally"):
        launch_kernel(_scaled_copy_kernel, (1,), x, torch.empty_like(x), 64, scale=1.0, BLOCK=128)


def test_descriptor_key_holds_what_triton_specializes_on():
    """A TMA descriptor is keyed by its dtype, block, layout and padding (Triton's own specialization of it),
    not by its tensor's address or shape, which the launcher reads on every launch."""
    a = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    b = torch.empty(512, 384, dtype=torch.float8_e4m3fn)
    assert _launch._descriptor_key(descriptor(a, (128, 128))) == _launch._descriptor_key(descriptor(b, (128, 128)))
    assert _launch._descriptor_key(descriptor(a, (128, 128))) != _launch._descriptor_key(descriptor(a, (64, 128)))
    c = torch.empty(256, 256, dtype=torch.bfloat16)
    assert _launch._descriptor_key(descriptor(a, (128, 128))) != _launch._descriptor_key(descriptor(c, (128, 128)))


def test_plain_form_takes_the_sm90_kernel_only_where_tma_can_load_it(monkeypatch):
    """The host-side rule of the ops with a Hopper kernel of their plain form (quantize_dual_1x128,
    scaling_aware_transpose): no row gather, a Hopper GPU, base and row stride on 16-byte boundaries."""
    from fp8flow_ao.kernels import _sm90_common

    takes = _sm90_common.sm90_takes_plain_form
    buf = torch.empty(64 * 272, dtype=torch.bfloat16)  # CPU allocations start on 64-byte boundaries
    aligned = buf[: 64 * 256].view(64, 256)
    assert not takes(aligned, None)  # not a Hopper GPU
    monkeypatch.setattr(_sm90_common, "sm90_supported", lambda device: True)
    assert takes(aligned, None)
    assert takes(buf.view(64, 272)[:, :256], None)  # rows of 544 bytes
    assert not takes(aligned, torch.zeros(64, dtype=torch.int32))  # gathering
    assert not takes(buf[1 : 1 + 64 * 256].view(64, 256), None)  # base 2 bytes off
    assert not takes(buf[: 64 * 260].view(64, 260)[:, :256], None)  # rows of 520 bytes
