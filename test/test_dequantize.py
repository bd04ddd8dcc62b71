"""dequantize: bit-exact against the reference for every layout (Triton on GPU, or the CPU
interpreter), round trips through every quantizer within the format's error, op checks, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import opcheck_fp8_inputs

from fp8flow_ao._format import BLOCK, FP8_DTYPE
from fp8flow_ao.kernels.dequantize import _scale_shape, dequantize, dequantize_reference, launch_dequantize
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128
from fp8flow_ao.kernels.quantize_dual_1x128 import quantize_dual_1x128

CASES = [
    ("rowwise", (37, 200)),
    ("rowwise", (2, 3, 256)),
    ("rowwise", (300,)),
    ("rowwise", (0, 128)),
    ("colwise", (200, 300)),
    ("colwise", (128, 256)),
    ("128x128", (256, 384)),
    ("128x128", (2, 128, 256)),
    ("128x128", (130, 200)),
]
ONE_PER_LAYOUT = [("rowwise", (37, 200)), ("colwise", (200, 300)), ("128x128", (2, 128, 256))]


def _random_fp8_and_scales(
    shape: tuple[int, ...], layout: str, specials: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every E4M3 bit pattern and power-of-two scales; with ``specials``, NaN data and a zero and an
    inf scale too (without, every output is finite: opcheck compares outputs without equal_nan)."""
    bits = torch.randint(0, 256, shape, dtype=torch.uint8)
    if not specials:
        bits = torch.where((bits & 0x7F) == 0x7F, 0, bits)  # drop the two NaN codes
    data = bits.view(FP8_DTYPE)
    scale_shape = _scale_shape(torch.Size(shape), layout)
    scale_inv = torch.exp2(torch.randint(-20, 20, scale_shape).float())
    if specials and scale_inv.numel() >= 2:
        scale_inv.view(-1)[0] = 0.0
        scale_inv.view(-1)[-1] = float("inf")
    return data.to(DEVICE), scale_inv.to(DEVICE)


def _assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("layout", "shape"), CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(layout, shape, out_dtype):
    data, scale_inv = _random_fp8_and_scales(shape, layout)
    out = launch_dequantize(data, scale_inv, layout, out_dtype)
    _assert_bits_equal(out, dequantize_reference(data.cpu(), scale_inv.cpu(), layout, out_dtype))


def test_reference_semantics_per_layout():
    data, scale_inv = _random_fp8_and_scales((200, 300), "colwise")
    out = dequantize_reference(data, scale_inv, "colwise")
    k, m = 7, 260
    assert out[k, m].item() == pytest.approx(data[k, m].float().item() * scale_inv[m // BLOCK, k].item(), nan_ok=True)
    data, scale_inv = _random_fp8_and_scales((2, 256, 384), "128x128")
    out = dequantize_reference(data, scale_inv, "128x128")
    e, n, kk = 1, 200, 300
    want = data[e, n, kk].float().item() * scale_inv[e, n // BLOCK, kk // BLOCK].item()
    assert out[e, n, kk].item() == pytest.approx(want, nan_ok=True)


def _assert_within_format_error(x: torch.Tensor, deq: torch.Tensor, block_scale: torch.Tensor) -> None:
    """E4M3 keeps 3 mantissa bits: a normal result is off by at most half an ulp (2**-4 of |x|), a
    subnormal one by half the subnormal step (2**-10 of the block scale). Both are well inside the
    issue's bound of 2**-3 relative to the block scale."""
    err = (deq.float() - x.float()).abs()
    bound = 2.0**-4 * x.float().abs() + 2.0**-10 * block_scale
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert bool((err <= 2.0**-3 * 448 * block_scale).all())


def _signal(shape: tuple[int, ...]) -> torch.Tensor:
    """bf16 values spanning ten decades, with some exact zeros."""
    x = torch.randn(shape) * torch.exp(torch.empty(shape).uniform_(-12, 12))
    x[..., ::17] = 0.0
    return x.to(DEVICE, torch.bfloat16)


def test_round_trip_rowwise():
    x = _signal((64, 384))
    data, scale_inv = quantize_1x128(x)
    deq = dequantize(data, scale_inv, "rowwise")
    _assert_within_format_error(x, deq, scale_inv.repeat_interleave(BLOCK, dim=-1))


def test_round_trip_128x128():
    w = _signal((2, 256, 384))
    data, scale_inv, data_t, scale_inv_t = quantize_128x128(w)
    block_scale = scale_inv.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    _assert_within_format_error(w, dequantize(data, scale_inv, "128x128"), block_scale)
    _assert_within_format_error(w.transpose(-1, -2), dequantize(data_t, scale_inv_t, "128x128"), block_scale.mT)


def test_round_trip_dual():
    g = _signal((256, 384))
    row_data, row_scale, col_data, col_scale = quantize_dual_1x128(g)
    _assert_within_format_error(g, dequantize(row_data, row_scale, "rowwise"), row_scale.repeat_interleave(BLOCK, -1))
    col_block_scale = col_scale.repeat_interleave(BLOCK, dim=0).t()  # [N, M], like col_data
    _assert_within_format_error(g.t(), dequantize(col_data, col_scale, "colwise"), col_block_scale)


@pytest.mark.parametrize(("layout", "shape"), ONE_PER_LAYOUT)
def test_op_dispatch_and_compile(layout, shape):
    data, scale_inv = _random_fp8_and_scales(shape, layout)
    eager = dequantize(data, scale_inv, layout, torch.bfloat16)
    compiled = torch.compile(dequantize, fullgraph=True)(data, scale_inv, layout, torch.bfloat16)
    _assert_bits_equal(compiled, eager)


@pytest.mark.parametrize(("layout", "shape"), ONE_PER_LAYOUT)
def test_opcheck(layout, shape):
    data, scale_inv = _random_fp8_and_scales(shape, layout, specials=False)
    opcheck_fp8_inputs(torch.ops.fp8flow.dequantize.default, (data, scale_inv, layout, torch.float32))


_D = torch.zeros(256, 384, dtype=FP8_DTYPE)


@pytest.mark.parametrize(
    ("data", "scale_inv", "layout", "out_dtype", "error", "match"),
    [
        (_D, torch.ones(256, 3), "blockwise", torch.float32, ValueError, "layout must be one of"),
        (_D.float(), torch.ones(256, 3), "rowwise", torch.float32, TypeError, "data must have dtype"),
        (_D, torch.ones(256, 3, dtype=torch.float64), "rowwise", torch.float32, TypeError, "scale_inv must have dtype"),
        (
            _D,
            torch.ones(256, 2),
            "rowwise",
            torch.float32,
            ValueError,
            r"scale_inv \(layout 'rowwise'.*shape \(256, 3\)",
        ),
        (
            _D,
            torch.ones(256, 3),
            "colwise",
            torch.float32,
            ValueError,
            r"scale_inv \(layout 'colwise'.*shape \(3, 256\)",
        ),
        (_D, torch.ones(3, 2), "128x128", torch.float32, ValueError, r"scale_inv \(layout '128x128'.*shape \(2, 3\)"),
        (_D[None], torch.ones(3, 256), "colwise", torch.float32, ValueError, "data must have 2 dims"),
        (_D[None, None], torch.ones(1, 1, 2, 3), "128x128", torch.float32, ValueError, "data must have 2 or 3 dims"),
        (_D.t(), torch.ones(3, 256), "colwise", torch.float32, ValueError, "data must be contiguous"),
        (_D, torch.ones(3, 256).t(), "rowwise", torch.float32, ValueError, "scale_inv must be contiguous"),
        (_D[0, 0], torch.ones(()), "rowwise", torch.float32, ValueError, "at least 1 dim"),
        (_D, torch.ones(256, 3), "rowwise", torch.int32, TypeError, "out_dtype must be one of"),
    ],
)
def test_bad_input(data, scale_inv, layout, out_dtype, error, match):
    with pytest.raises(error, match=match):
        dequantize(data, scale_inv, layout, out_dtype)
