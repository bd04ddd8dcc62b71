"""launch_kernel: the same results as ``kernel[grid]``, one cache entry per Triton specialization."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from fp8_helpers import kernels_compiled
from triton.runtime.jit import JITFunction

from fp8flow_ao.kernels import _launch
from fp8flow_ao.kernels._launch import launch_kernel
from fp8flow_ao.kernels._sm90_common import descriptor
from fp8flow_ao.kernels._triton_common import jit_any_count


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
    if triton.__version__.startswith("3.6."):  # served by Triton 3.6's C launcher, called directly
        entries = [e for e in _launch._ENTRIES.values() if e.pins[0] is _scaled_copy_kernel]
        assert all(e.c_launch is not None and e.encodings == () for e in entries)


@pytest.mark.gpu
@pytest.mark.parametrize(("jit", "expected"), [(triton.jit, 2), (jit_any_count("n"), 1)], ids=["jit", "jit_any_count"])
def test_kernels_compiled_sees_each_new_specialization(jit, expected):
    """The tests' compile counter (``kernels_compiled``) sees every compile: n = 100 and 99 share a
    specialization, 96 (a multiple of 16) gets its own; ``jit_any_count("n")`` compiles one kernel for all."""
    kernel = jit(_scaled_copy_kernel.fn)  # a fresh JITFunction: nothing of it compiled in this process
    x = torch.randn(100, device="cuda")
    with kernels_compiled() as compiled:
        for n in (100, 99, 96, 100):
            out = torch.zeros_like(x)
            kernel[(1,)](x, out, n, 2.0, BLOCK=128)
            torch.testing.assert_close(out[:n], x[:n] * 2.0, rtol=0, atol=0)
    assert len(compiled) == expected and all("_scaled_copy_kernel" in c for c in compiled), compiled


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


def _desc_kernel(x_ptr, desc, n, BLOCK: tl.constexpr):  # only its signature is read (never compiled here)
    pass


class _FakeLauncher:
    """A Triton 3.6 ``CudaLauncher``'s fields; called only where the cache must not take the C launcher."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = True

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("fp4_padded", [False, True])
def test_cached_launch_calls_triton_3_6_c_launcher_with_encoded_descriptors(monkeypatch, fp4_padded):
    """A cached launch calls the C launcher directly, as ``CudaLauncher.__call__`` and Triton 3.6's descriptor
    wrapper would: the base arguments in their order, each TMA descriptor as (encoded map, shape, strides)
    with the encoding parameters of the kernel's metadata, then the constexpr tail. A descriptor this module
    does not encode (FP4-padded boxes) keeps the launch on the Python launcher."""
    kernel = JITFunction(_desc_kernel)
    run = _FakeLauncher()
    meta = {"swizzle": 3, "elem_size": 1, "elem_type": 9, "block_size": [128, 64], "fp4_padded": fp4_padded}
    compiled = SimpleNamespace(
        run=run,
        function=11,
        packed_metadata=(4, 1, 0),
        src=SimpleNamespace(signature={"x_ptr": "*fp32", "desc": "tensordesc<fp8e4nv[128, 64]>", "n": "i32"}),
        metadata=SimpleNamespace(tensordesc_meta=[meta]),
    )
    compiles, c_calls, fills = [], [], []
    monkeypatch.setattr(kernel, "run", lambda *args, **kwargs: compiles.append(args) or compiled)
    monkeypatch.setattr(_launch, "_c_launcher", lambda launcher: lambda *args: c_calls.append(args))
    monkeypatch.setattr(_launch, "_tma_fill", lambda: lambda *args: fills.append(args) or "tma-map")
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 99)
    x = torch.empty(64)
    t = torch.empty(256, 192, dtype=torch.float8_e4m3fn)
    desc = descriptor(t, (128, 64))
    for _ in range(2):
        launch_kernel(kernel, (3, 2), x, desc, 5, BLOCK=64)
    assert len(compiles) == 1  # the first launch compiles (kernel[grid]); the second is served by the cache
    if fp4_padded:
        assert not c_calls and not fills
        assert run.calls == [(3, 2, 1, 99, 11, (4, 1, 0), None, None, None, x, desc, 5, 64)]
        return
    assert not run.calls
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    assert fills == [(t.data_ptr(), 3, 1, TMA_DTYPE_DEVICE_TO_HOST[9], [128, 64], [256, 192], [192, 1], 0)]
    base = (3, 2, 1, 99, 11, False, True, None, None, (4, 1, 0), None, None, None)
    assert c_calls == [(*base, x, "tma-map", 256, 192, 192, 1, 5, 64)]


@pytest.mark.hopper
def test_cached_c_launch_of_a_tma_kernel_gives_the_first_launch_s_results():
    """The scaling-aware transpose's Hopper kernel (TMA descriptors) launched again and again on fresh operands of
    one specialization: every launch matches the reference bit for bit, and on Triton 3.6 the cached ones
    went through the C launcher with their descriptors encoded here."""
    from fp8flow_ao._format import quantize_rows_reference
    from fp8flow_ao.kernels import scaling_aware_transpose as sat

    for _ in range(3):
        data, scale_inv = quantize_rows_reference(torch.randn(384, 640).bfloat16() * 7, 128)
        data, scale_inv = data.cuda(), scale_inv.cuda()
        data_t, scale_t = sat.launch_scaling_aware_transpose_sm90(data, scale_inv)
        ref_t, ref_scale_t = sat.scaling_aware_transpose_reference(data.cpu(), scale_inv.cpu())
        assert torch.equal(data_t.cpu().view(torch.uint8), ref_t.view(torch.uint8))
        assert torch.equal(scale_t.cpu(), ref_scale_t)
    entries = [e for e in _launch._ENTRIES.values() if e.pins[0] is sat._scaling_aware_transpose_sm90_kernel]
    assert entries and all(e.encodings for e in entries)
    if triton.__version__.startswith("3.6."):
        assert all(e.c_launch is not None for e in entries)


def test_stream_tile_counter_is_one_per_stream_across_threads(monkeypatch):
    """The bookkeeping of the wgrad's tile counters, without a GPU (streams and allocation stubbed): one
    counter per (device, stream), made once even when threads ask at the same time (the forward's thread and
    the autograd engine's share a stream), another per other stream, and a fresh one while capturing."""
    import threading
    import time

    made = []

    def new_counter(device):
        time.sleep(0.01)  # widen the window in which a second maker would slip in
        made.append(torch.zeros(1, dtype=torch.int32))
        return made[-1]

    stream = {"raw": 111}
    monkeypatch.setattr(_launch, "_TILE_COUNTERS", {})
    monkeypatch.setattr(_launch, "_new_counter", new_counter)
    monkeypatch.setattr(_launch, "_raw_stream", lambda index: stream["raw"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    device = torch.device("cuda", 0)
    got = []
    threads = [threading.Thread(target=lambda: got.append(_launch.stream_tile_counter(device))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(c is made[0] for c in got)
    stream["raw"] = 222
    other = _launch.stream_tile_counter(device)
    assert other is not made[0] and len(made) == 2
    stream["raw"] = 111
    assert _launch.stream_tile_counter(device) is made[0]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: "fresh")
    assert _launch.stream_tile_counter(device) == "fresh" and len(made) == 2
