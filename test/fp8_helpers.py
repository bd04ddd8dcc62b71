"""Helpers shared by the tests: bit-exact fp8 comparison and inputs that probe the edges."""

from __future__ import annotations

import torch

from fp8flow_ao._format import FP8_DTYPE


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    """The E4M3 bit patterns of ``t`` with every NaN folded to 0x7F (the GPU and CPU may differ in a NaN's sign)."""
    bits = t.contiguous().view(torch.uint8)
    return torch.where((bits & 0x7F) == 0x7F, torch.full_like(bits, 0x7F), bits)


def assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "data") -> None:
    """Bit-exact comparison of two E4M3 tensors (shape, dtype and every bit but a NaN's sign)."""
    assert actual.dtype == FP8_DTYPE == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    a, e = fp8_bits(actual.cpu()), fp8_bits(expected.cpu())
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{name}: {bad.shape[0]} of {a.numel()} bytes differ, first at {bad[0].tolist()}: "
        f"{a[tuple(bad[0])].item():#04x} vs {e[tuple(bad[0])].item():#04x}"
    )


def assert_scales_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "scale_inv") -> None:
    """Bit-exact comparison of fp32 scale tensors (NaN == NaN)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual.shape, expected.shape)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True, msg=name)


def edge_case_rows(k: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows that probe the format's edges, each ``k`` wide.

    Values near 448 and above it, ties between E4M3 neighbours, tiny values that land on E4M3
    subnormals, a whole-zero row, +-0, a row with one NaN and a row with one inf.
    """
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(8, k, generator=g)
    rows = [
        base[0] * 448 / base[0].abs().max(),  # amax exactly 448
        base[1] * 449 / base[1].abs().max(),  # just over 448: scale 2
        torch.full((k,), 125.5) * torch.sign(base[2]),  # tie halfway between 124 and 128 at scale 1... after scaling
        base[3] * 1e-6,  # tiny: subnormals after scaling
        torch.zeros(k),  # whole-zero row
        torch.where(base[5] > 0, 0.0, -0.0) + torch.arange(k) * 0.0,  # signed zeros
        base[6],
        base[7] * 3e4,
    ]
    x = torch.stack(rows)
    x[6, 3] = float("nan")
    x[7, min(5, k - 1)] = float("inf")
    return x.to(device=device, dtype=dtype)
