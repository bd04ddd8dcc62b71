"""Test set-up shared by the whole suite.

* Without a GPU, Triton kernels run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``,
  set here before anything imports Triton kernels).
* The interpreter's fp32 -> fp8e4nv cast is wrong (it rounds ties away from zero and drops the carry
  into the exponent: 125.5 becomes 64). :func:`_patch_interpreter_fp8_casts` replaces its fp8
  conversions with exact ones that do what the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` does (round to
  nearest even, saturate at +-448, keep NaN). ``test_interpreter_fp8_cast.py`` proves both the bug and
  the fix, and, on a GPU, that the GPU agrees with the same reference.
* Markers: ``gpu`` (needs CUDA), ``sm90`` (needs compute capability 9.0 or newer), ``hopper`` (needs
  exactly a Hopper GPU, 9.x: the Gluon wgmma kernels); all skip cleanly elsewhere.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() >= (9, 0)
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9

_TORCH_FP8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}


def _patch_interpreter_fp8_casts() -> None:
    """Make the interpreter's fp8 <-> float conversions exact (GPU semantics)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    if getattr(builder_cls, "_fp8flow_patched", False):
        return
    original = builder_cls.create_fp_to_fp
    np_float = {tl.float32: np.float32, tl.float16: np.float16}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        fp8_names = {getattr(tl, n).name for n in ("float8e4nv", "float8e5")}
        if dst_ty.name in fp8_names and src_ty in (tl.float32, tl.float16, tl.bfloat16):
            f32 = src.data if src_ty != tl.bfloat16 else original(self, src, tl.float32, None).data
            x = torch.from_numpy(np.asarray(f32, dtype=np.float32).copy())
            fmax = torch.finfo(_TORCH_FP8[dst_ty.name]).max
            q = torch.clamp(x, -fmax, fmax).to(_TORCH_FP8[dst_ty.name]).view(torch.uint8)
            return interpreter.TensorHandle(q.numpy().reshape(np.shape(src.data)), dst_ty)
        if src_ty.name in fp8_names and dst_ty in (tl.float32, tl.float16, tl.bfloat16):
            raw = torch.from_numpy(np.ascontiguousarray(src.data).view(np.uint8).copy())
            f = raw.view(_TORCH_FP8[src_ty.name]).float().numpy()
            if dst_ty == tl.bfloat16:
                f32_handle = interpreter.TensorHandle(f, tl.float32)
                return original(self, f32_handle, dst_type, rounding_mode)
            return interpreter.TensorHandle(f.astype(np_float[dst_ty]).reshape(np.shape(src.data)), dst_ty)
        return original(self, src, dst_type, rounding_mode)

    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls._fp8flow_patched = True
    builder_cls._fp8flow_original_fp_to_fp = original


def _patch_interpreter_bf16_downcast() -> None:
    """Make the interpreter's fp32/fp64 -> bf16 conversion round to nearest even, as the GPU does.

    The interpreter (triton 3.9) truncates: it drops the low mantissa bits, so 1 + 2**-7 + 2**-8 (a tie) stays
    1 + 2**-7 instead of rounding to the even 1 + 2**-6. ``test_unpermute_unpad.py`` proves the bug and the fix.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    if getattr(builder_cls, "_fp8flow_bf16_patched", False):
        return
    original = builder_cls.create_fp_trunc

    def create_fp_trunc(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64):
            x = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            bits = x.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(src.data))
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original(self, src, dst_type)

    builder_cls.create_fp_trunc = create_fp_trunc
    builder_cls._fp8flow_bf16_patched = True
    builder_cls._fp8flow_original_fp_trunc = original


if INTERPRETING:
    _patch_interpreter_fp8_casts()
    _patch_interpreter_bf16_downcast()


def pytest_configure(config: pytest.Config) -> None:
    _test_shard()  # a bad FP8FLOW_TEST_SHARD stops the run before anything is collected
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "sm90: needs compute capability 9.0 or newer (skipped elsewhere)")
    config.addinivalue_line("markers", "hopper: needs exactly a Hopper GPU, compute capability 9.x (skipped elsewhere)")


def _test_shard() -> tuple[int, int] | None:
    """``(i, N)`` from ``FP8FLOW_TEST_SHARD=i/N`` (1 <= i <= N), ``None`` where it is unset."""
    spec = os.environ.get("FP8FLOW_TEST_SHARD")
    if not spec:
        return None
    try:
        i, n = (int(part) for part in spec.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"FP8FLOW_TEST_SHARD must be i/N with 1 <= i <= N, got {spec!r}")
    return i, n


def shard_members(count: int, i: int, n: int) -> list[bool]:
    """Which of ``count`` collected tests the i-th of N consecutive slices holds."""
    return [k * n // count == i - 1 for k in range(count)]


@pytest.hookimpl(trylast=True)  # after -k / -m deselected theirs: the slices split the selected tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The whole suite on a GPU takes longer than one device call: FP8FLOW_TEST_SHARD=i/N runs the i-th of N
    # consecutive slices of the selected tests (a module's tests stay together: its fixtures are built once).
    if items and (shard := _test_shard()):
        in_slice = shard_members(len(items), *shard)
        config.hook.pytest_deselected(items=[item for item, keep in zip(items, in_slice, strict=True) if not keep])
        items[:] = [item for item, keep in zip(items, in_slice, strict=True) if keep]
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sm90 = pytest.mark.skip(reason="needs compute capability 9.0 or newer")
    skip_hopper = pytest.mark.skip(reason="needs a Hopper GPU (compute capability 9.x)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "sm90" in item.keywords and not IS_SM90:
            item.add_marker(skip_sm90)
        if "hopper" in item.keywords and not IS_HOPPER:
            item.add_marker(skip_hopper)


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> None:
    """Fresh but reproducible random inputs: each test gets its own seed from its node id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["in_gemm", "transposed_in_gemm", "separate"])
def weight_quantization(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The three ways FP8-Flow's grouped GEMMs get a BF16 weight's FP8 tiles, forced through the
    rows-per-expert rules (``quantize_in_gemm_pays``, ``transpose_in_gemm_pays``): quantized by the GEMMs as
    they load the weight ("in_gemm"); by ``quantize_128x128`` before them, forward orientation only, the
    dgrad GEMM transposing its tiles as it loads them ("transposed_in_gemm"); or by ``quantize_128x128``
    with the transposed copy ("separate"). All must give the same bits."""
    from fp8flow_ao.kernels import grouped_gemm_fp8_blockwise

    quantize, transpose = {"in_gemm": (1 << 30, 0), "transposed_in_gemm": (0, 1 << 30), "separate": (0, 0)}[
        request.param
    ]
    monkeypatch.setattr(grouped_gemm_fp8_blockwise, "IN_GEMM_MAX_ROWS_PER_EXPERT", quantize)
    monkeypatch.setattr(grouped_gemm_fp8_blockwise, "FORWARD_IN_GEMM_MAX_ROWS_PER_EXPERT", quantize)
    monkeypatch.setattr(grouped_gemm_fp8_blockwise, "TRANSPOSE_IN_GEMM_MAX_ROWS_PER_EXPERT", transpose)
    return request.param
