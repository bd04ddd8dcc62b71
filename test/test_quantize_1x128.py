"""quantize_1x128: bit-exact against the reference (Triton on GPU, or the CPU interpreter), op checks, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import assert_fp8_equal, assert_scales_equal, edge_case_rows, run_build_script

from fp8flow_ao._format import FP8_MAX, dequantize_rows_reference, quantize_rows_reference, round_rows_to_fp8_grid
from fp8flow_ao.kernels.permute_pad import permute_pad_rows_reference
from fp8flow_ao.kernels.quantize_1x128 import (
    launch_quantize_1x128,
    launch_quantize_1x128_transpose,
    quantize_1x128,
    quantize_1x128_reference,
    quantize_1x128_transpose_reference,
)
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose_reference

SHAPES = [(1, 128), (37, 256), (130, 384), (64, 200), (5, 7), (0, 256), (3, 1000)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_k", [128, None])
def test_triton_matches_reference(shape, dtype, block_k):
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[0] or 1)[: shape[0], None]).to(DEVICE, dtype)
    data, scale_inv = launch_quantize_1x128(x, block_k)
    ref_data, ref_scale = quantize_1x128_reference(x.cpu(), block_k)
    assert_fp8_equal(data, ref_data)
    assert_scales_equal(scale_inv, ref_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_edge_values_bit_exact(dtype):
    x = edge_case_rows(256, DEVICE, dtype)
    data, scale_inv = launch_quantize_1x128(x)
    ref_data, ref_scale = quantize_1x128_reference(x.cpu())
    assert_fp8_equal(data, ref_data)
    assert_scales_equal(scale_inv, ref_scale)


def test_reference_properties():
    x = edge_case_rows(256, "cpu", torch.float32)
    data, scale_inv = quantize_1x128_reference(x)
    finite = torch.isfinite(scale_inv)
    # power-of-two scales, and the smallest one that keeps the block within 448
    assert torch.equal(torch.frexp(scale_inv[finite])[0], torch.full_like(scale_inv[finite], 0.5))
    amax = x.abs().nan_to_num(0).reshape(8, 2, 128).amax(-1)
    ok = finite & (amax > 1e-10)
    assert bool((amax[ok] <= FP8_MAX * scale_inv[ok]).all())
    assert bool((amax[ok] > FP8_MAX * scale_inv[ok] / 2).all())
    assert torch.equal(scale_inv[0], torch.ones(2))  # amax exactly 448 -> scale 1
    # all-zero block: tiny finite scale, zero data
    assert bool((scale_inv[4] > 0).all()) and bool((data[4].float() == 0).all())
    # signed zeros survive
    assert torch.equal(torch.signbit(data[5].float()), torch.signbit(x[5]))
    # non-finite input gives non-finite dequantized output in its block
    assert torch.isnan(data[6, 3].float()) and torch.isinf(scale_inv[7, 0])
    # 125.5 with scale 0.5 lands on 251, between E4M3's 240 and 256: the nearest, 256
    assert torch.equal(scale_inv[2], torch.full((2,), 0.5)) and bool((data[2].float().abs() == 256).all())


def test_ties_round_to_even():
    """Values halfway between E4M3 neighbours (scale 1: the block's amax is 448) go to the even mantissa, in the
    reference and in the kernel: 232 between 224 and 240 -> 224, 200 between 192 and 208 -> 192, 34 between
    32 and 36 -> 32, 38 between 36 and 40 -> 40."""
    x = torch.zeros(1, 128)
    x[0, :6] = torch.tensor([448.0, 232.0, 200.0, -232.0, 34.0, 38.0])
    data, scale_inv = quantize_1x128_reference(x)
    assert torch.equal(scale_inv, torch.ones(1, 1))
    assert data[0, :6].float().tolist() == [448.0, 224.0, 192.0, -224.0, 32.0, 40.0]
    kernel_data, _ = launch_quantize_1x128(x.to(DEVICE))
    assert_fp8_equal(kernel_data, data)


def test_row_stride_is_free():
    x = torch.randn(16, 512, device=DEVICE)[:, :256]
    data, scale_inv = launch_quantize_1x128(x)
    ref_data, ref_scale = quantize_1x128_reference(x.contiguous().cpu())
    assert_fp8_equal(data, ref_data)
    assert_scales_equal(scale_inv, ref_scale)


@pytest.mark.parametrize("block_k", [128, None])
def test_op_dispatch_and_compile(block_k):
    x = torch.randn(64, 384, device=DEVICE, dtype=torch.bfloat16)
    src_rows = _src_rows(64, 200)
    for args in ((x, block_k), (x, block_k, src_rows)):
        eager = quantize_1x128(*args)
        compiled = torch.compile(quantize_1x128, fullgraph=True)(*args)
        assert_fp8_equal(compiled[0], eager[0])
        assert_scales_equal(compiled[1], eager[1])


def test_opcheck():
    x = torch.randn(32, 256, device=DEVICE, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fp8flow.quantize_1x128.default, (x, 128))
    torch.library.opcheck(torch.ops.fp8flow.quantize_1x128.default, (x, 128, _src_rows(32, 70)))


def _src_rows(rows: int, out_rows: int, seed: int = 0) -> torch.Tensor:
    """A row map of ``out_rows`` entries: every source row once in a shuffled order, the rest -1 (pad)."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.full((out_rows,), -1, dtype=torch.int32)
    src[torch.randperm(out_rows, generator=gen)[:rows]] = torch.randperm(rows, generator=gen, dtype=torch.int32)
    return src.to(DEVICE)


@pytest.mark.parametrize(("rows", "out_rows", "cols"), [(37, 128, 256), (130, 300, 384), (5, 9, 200), (0, 128, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_k", [128, None])
def test_src_rows_gathers_as_permute_pad_rows_after_quantize(rows, out_rows, cols, dtype, block_k):
    """With ``src_rows`` each output row quantizes its source row (non-finite values included) and pad rows
    are data 0, scale 0: quantize then permute_pad_rows, bit for bit, without the gathered copy."""
    x = torch.cat([edge_case_rows(cols, "cpu", dtype), torch.randn(rows, cols, dtype=dtype) * 100])[:rows]
    src_rows = _src_rows(rows, out_rows)
    data, scale_inv = launch_quantize_1x128(x.to(DEVICE), block_k, src_rows)
    expected = permute_pad_rows_reference(*quantize_1x128_reference(x, block_k), src_rows.cpu(), 1)
    assert_fp8_equal(data, expected[0])
    assert_scales_equal(scale_inv, expected[1])
    ref_data, ref_scale = quantize_1x128_reference(x, block_k, src_rows.cpu())
    assert_fp8_equal(ref_data, expected[0])
    assert_scales_equal(ref_scale, expected[1])
    assert bool((scale_inv.cpu()[src_rows.cpu() < 0] == 0).all())


@pytest.mark.parametrize(
    ("x", "block_k", "error", "match"),
    [
        (torch.zeros(4, 128, dtype=torch.int32), 128, TypeError, "x must have dtype"),
        (torch.zeros(4, 2, 128), 128, ValueError, "x must have 2 dims"),
        (torch.zeros(128, 4).t(), 128, ValueError, "x must be row-major"),
        (torch.zeros(4, 128), 0, ValueError, "block_k"),
        ([[1.0]], 128, TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input(x, block_k, error, match):
    with pytest.raises(error, match=match):
        quantize_1x128(x, block_k)


@pytest.mark.parametrize(
    ("src_rows", "error", "match"),
    [
        (torch.zeros(4, dtype=torch.int64), TypeError, "src_rows must have dtype"),
        (torch.zeros(2, 2, dtype=torch.int32), ValueError, "src_rows must have 1 dims"),
        (torch.zeros(8, dtype=torch.int32)[::2], ValueError, "src_rows must be contiguous"),
    ],
)
def test_bad_src_rows(src_rows, error, match):
    with pytest.raises(error, match=match):
        quantize_1x128(torch.zeros(4, 128), 128, src_rows)


def test_src_rows_out_of_range_with_validation(monkeypatch):
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"src_rows values must lie in \[-1, 4\)"):
        quantize_1x128(torch.zeros(4, 128), 128, torch.tensor([0, 4], dtype=torch.int32))


def test_round_rows_to_fp8_grid_nearest_is_quantize_then_dequantize():
    x = torch.randn(37, 300) * torch.logspace(-6, 2, 37)[:, None]
    data, scale_inv = quantize_rows_reference(x, 128)
    assert torch.equal(round_rows_to_fp8_grid(x, 128), dequantize_rows_reference(data, scale_inv, 128))


def test_round_rows_to_fp8_grid_stochastic_is_unbiased_on_the_same_grid():
    """Each value lands on one of its two neighbours among the E4M3 values at its block's scale (the nearest
    rounding's grid, subnormals included); grid values stay put; the mean over draws is the value."""
    torch.manual_seed(0)
    x = torch.randn(8, 256) * torch.logspace(-4, 1, 8)[:, None]
    x[:, 0] = 2.0 ** torch.ceil(torch.log2(x[:, 1:].abs().amax(dim=1)))  # a power of two: on the grid
    x[:, 1] = x[:, 0] * 2**-12  # E4M3 subnormals at the block's scale
    _, scale_inv = quantize_rows_reference(x, 128)
    y = x / scale_inv.repeat_interleave(128, dim=1)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()  # sorted
    below = e4m3[torch.searchsorted(e4m3, y, right=True) - 1]
    above = e4m3[torch.searchsorted(e4m3, y)]
    draws = torch.stack([round_rows_to_fp8_grid(x, 128, "stochastic") for _ in range(400)])
    draws = draws / scale_inv.repeat_interleave(128, dim=1)
    assert bool(((draws == below) | (draws == above)).all())
    assert torch.equal(draws[:, :, 0], y[:, 0].expand(400, -1))
    # unbiased: the mean's error is within 5 standard errors of a two-point draw (<= gap / 2 / sqrt(n))
    assert bool(((draws.mean(0) - y).abs() <= 5 * (above - below) / 2 / 400**0.5 + 1e-6).all())
    with pytest.raises(ValueError, match="rounding must be"):
        round_rows_to_fp8_grid(x, 128, "down")


def test_cpu_values_are_checked_without_opting_in():
    """On CPU tensors reading the row map costs no device sync, so its values are always checked: an
    out-of-range row is a ValueError naming ``src_rows``, not an IndexError from another module. A bool
    block width (an int subclass) is refused."""
    x = torch.zeros(4, 128)
    with pytest.raises(ValueError, match=r"src_rows values must lie in \[-1, 4\)"):
        quantize_1x128(x, 128, torch.tensor([0, 300], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_k must be a positive int or None, got True"):
        quantize_1x128(x, True)


def _assert_transpose_outputs_equal(out, expected):
    for got, want, equal in zip(out, expected, (assert_fp8_equal, assert_scales_equal) * 2, strict=True):
        equal(got, want)


# Group end offsets (128-aligned, as the copy's column blocks need) for 256 rows and for 384 gathered rows.
_OFFSETS = {
    "none": (None, None),
    "past_end": ([0, 128], [128, 256]),  # the rows past the last end belong to no group: pad rows of the copy
    "all_empty": ([0, 0], [0, 0]),
    "every_row": ([128, 256], [256, 384]),
}


@pytest.mark.parametrize("offsets", list(_OFFSETS))
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transpose_is_the_scaling_aware_transpose_of_its_rows(offsets, gather, dtype):
    """``transpose=True``: the rows are ``quantize_1x128``'s bit for bit (non-finite and tiny values, pad rows,
    rows past the last group end included) and the copy is ``scaling_aware_transpose`` of them."""
    gen = torch.Generator().manual_seed(len(offsets) + gather)
    x = torch.randn(300, 256, generator=gen) * torch.logspace(-8, 5, 300)[:, None]
    x = torch.cat([edge_case_rows(256, "cpu", torch.float32), x]).to(dtype)
    src_rows = _src_rows(x.shape[0], 384, seed=3) if gather else None
    if not gather:
        x = x[:256]
    ends = _OFFSETS[offsets][gather]
    offs = None if ends is None else torch.tensor(ends, dtype=torch.int32)
    out = launch_quantize_1x128_transpose(x.to(DEVICE), src_rows, None if offs is None else offs.to(DEVICE))
    rows = quantize_1x128_reference(x, 128, None if src_rows is None else src_rows.cpu())
    _assert_transpose_outputs_equal(out, (*rows, *scaling_aware_transpose_reference(*rows, offs)))
    ref = quantize_1x128_transpose_reference(x, None if src_rows is None else src_rows.cpu(), offs)
    _assert_transpose_outputs_equal(ref, (*rows, *scaling_aware_transpose_reference(*rows, offs)))


def test_transpose_row_stride_is_free():
    """A row-major view with a row stride wider than K (a slice of wider rows) quantizes as its contiguous copy."""
    x = torch.randn(128, 512, device=DEVICE, dtype=torch.bfloat16)[:, 128:384]
    out = launch_quantize_1x128_transpose(x)
    _assert_transpose_outputs_equal(out, quantize_1x128_transpose_reference(x.contiguous().cpu()))


def test_transpose_public_function_compile_and_opcheck():
    """The public function with ``transpose=True``, eager and compiled (fullgraph), equals the launcher; empty
    shapes; opcheck of the op."""
    x = torch.randn(256, 384, device=DEVICE, dtype=torch.bfloat16)
    src_rows, offs = _src_rows(256, 384), torch.tensor([128, 256], dtype=torch.int32, device=DEVICE)
    for args, kwargs in (((x,), {}), ((x, 128, src_rows), {"group_end_offsets": offs})):
        eager = quantize_1x128(*args, transpose=True, **kwargs)
        compiled = torch.compile(quantize_1x128, fullgraph=True)(*args, transpose=True, **kwargs)
        expected = launch_quantize_1x128_transpose(x, *args[2:], kwargs.get("group_end_offsets"))
        _assert_transpose_outputs_equal(eager, expected)
        _assert_transpose_outputs_equal(compiled, expected)
    empty = quantize_1x128(x[:0], transpose=True)
    assert [tuple(t.shape) for t in empty] == [(0, 384), (0, 3), (384, 0), (0, 384)]
    op = torch.ops.fp8flow.quantize_1x128_transpose.default
    torch.library.opcheck(op, (x[:128, :256],))
    torch.library.opcheck(op, (x, src_rows, offs))


@pytest.mark.parametrize(
    ("x", "kwargs", "error", "match"),
    [
        (torch.zeros(128, 256), {"block_k": None}, ValueError, "transpose=True needs block_k=128"),
        (torch.zeros(100, 256), {}, ValueError, r"output rows \(transpose=True\) must be a multiple of 128"),
        (torch.zeros(128, 200), {}, ValueError, r"columns K \(transpose=True\) must be a multiple of 128"),
        (torch.zeros(128, 256), {"transpose": 1}, TypeError, "transpose must be a bool"),
        (torch.zeros(128, 256), {"group_end_offsets": torch.zeros(1, dtype=torch.int64)}, TypeError, "int32"),
        (torch.zeros(128, 256), {"group_end_offsets": torch.zeros(0, dtype=torch.int32)}, ValueError, "one group"),
        (
            torch.zeros(128, 256),
            {"group_end_offsets": torch.tensor([256], dtype=torch.int32)},
            ValueError,
            "past the end of the 128 rows",
        ),
    ],
)
def test_transpose_bad_input(x, kwargs, error, match):
    kwargs = {"transpose": True, **kwargs}
    with pytest.raises(error, match=match):
        quantize_1x128(x, kwargs.pop("block_k", 128), **kwargs)
    with pytest.raises(ValueError, match="group_end_offsets is for transpose=True"):
        quantize_1x128(x, group_end_offsets=torch.zeros(1, dtype=torch.int32))


def test_transpose_kernel_builds_for_sm90():
    """The interpreter runs the kernel without compiling it: build the forms fp8_grouped_mm's launches take
    (bf16 or fp32 A, gathered into padded groups or not, with the group ends) for sm_90a; no spill."""
    built = run_build_script(_BUILD_TRANSPOSE)
    assert len(built) == 4 and all(spills == 0 for _, spills in built), built


_BUILD_TRANSPOSE = """
from fp8flow_ao.kernels._sm90_common import compile_for_sm90
from fp8flow_ao.kernels import quantize_1x128 as mod

def build(item):
    dtype, gather, has_offsets = item
    runtime = {"x_ptr": dtype, "src_rows_ptr": "*i32", "offsets_ptr": "*i32", "data_ptr": "*fp8e4nv",
               "scale_inv_ptr": "*fp32", "data_t_ptr": "*fp8e4nv", "scale_inv_t_ptr": "*fp32", "M": "i32",
               "K": "i32", "stride_xm": "i32", "num_groups": "i32"}
    constexprs = dict(GATHER=gather, HAS_OFFSETS=has_offsets)
    signature = {**runtime, **dict.fromkeys(constexprs, "constexpr")}
    built = compile_for_sm90(mod._quantize_1x128_transpose_kernel, signature, constexprs,
                             num_warps=mod._TRANSPOSE_NUM_WARPS,
                             aligned=(*(k for k in runtime if k.endswith("_ptr")), "M", "K", "stride_xm"))
    return [list(item), local_memory_instructions(built.asm["cubin"])]

items = [("*bf16", False, True), ("*bf16", True, True), ("*fp32", False, True), ("*bf16", False, False)]
print(json.dumps(parallel_map(build, items)))
"""
