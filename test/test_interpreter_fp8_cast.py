"""The fp32 -> E4M3 cast that every bit-exact test relies on.

On a GPU this proves the hardware cast (``.to(tl.float8e4nv)``) is round-to-nearest-even with
saturation, i.e. equal to :func:`fp8flow_ao._format.cast_to_fp8`. Under the CPU interpreter it proves
the conftest patch makes the interpreter agree, and that the unpatched interpreter does not.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, INTERPRETING
from fp8_helpers import assert_fp8_equal

from fp8flow_ao._format import FP8_DTYPE, cast_to_fp8


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x.to(tl.float8e4nv), mask=offs < n)


@triton.jit
def _upcast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x.to(tl.float32), mask=offs < n)


def _probe_values() -> torch.Tensor:
    """Every finite E4M3 value, every midpoint between neighbours (ties), points just off the
    midpoints, values past 448, and the specials."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    off = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    specials = torch.tensor([125.5, 448.0, 449.0, 464.0, 480.0, 1e6, 2.0**-10, 2.0**-11, 3 * 2.0**-11, float("nan")])
    vals = torch.cat([finite, mids, off, specials])
    return torch.cat([vals, -vals]).float()


def _run(kernel, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def test_fp32_to_e4m3_cast_matches_round_to_nearest_even():
    x = _probe_values().to(DEVICE)
    assert_fp8_equal(_run(_cast_kernel, x, FP8_DTYPE), cast_to_fp8(x.cpu()), "cast")


def test_e4m3_to_fp32_is_exact():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(DEVICE)
    got = _run(_upcast_kernel, codes, torch.float32).cpu()
    torch.testing.assert_close(got, codes.cpu().float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not INTERPRETING, reason="shows the unpatched interpreter's bug; only meaningful when interpreting")
def test_unpatched_interpreter_is_wrong(monkeypatch):
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    monkeypatch.setattr(builder, "create_fp_to_fp", builder._fp8flow_original_fp_to_fp)
    x = torch.tensor([125.5, 3 * 2.0**-11])
    y = _run(_cast_kernel, x, FP8_DTYPE).float()
    # 125.5 lies halfway between 120 and 128: nearest even is 128, the unpatched interpreter gives 64.
    assert cast_to_fp8(x).float()[0].item() == 128.0
    assert y[0].item() != 128.0
