"""quantize_dual_1x128: bit-exact against the reference (Triton on GPU, or the CPU interpreter), group
offsets (padding rows never read, empty experts, skewed groups), op checks, bad input."""

from __future__ import annotations

import pytest
import torch
import triton
from conftest import DEVICE
from fp8_helpers import assert_fp8_equal, assert_scales_equal, build_spills, edge_case_rows

from fp8flow_ao.kernels.pad_group_offsets import pad_group_offsets_reference
from fp8flow_ao.kernels.quantize_1x128 import launch_quantize_1x128
from fp8flow_ao.kernels.quantize_dual_1x128 import (
    DEFAULT_CONFIG,
    LaunchConfig,
    launch_quantize_dual_1x128,
    launch_quantize_dual_1x128_sm90,
    quantize_dual_1x128,
    quantize_dual_1x128_configs,
    quantize_dual_1x128_reference,
)
from fp8flow_ao.kernels.unpermute_unpad import take_rows_or_zero

SHAPES = [(128, 128), (256, 384), (384, 256), (0, 256)]
NAMES = ("row_data", "row_scale", "col_data", "col_scale")
# The two kernels of the plain form: Triton (any GPU, the CPU interpreter) and the Hopper TMA kernel.
KERNELS = [pytest.param("triton", id="triton"), pytest.param("sm90", id="sm90", marks=pytest.mark.hopper)]


def _grad(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Random gradient whose magnitude varies along both dims, so row and column scales both vary."""
    m, n = shape
    row_mag = torch.logspace(-3, 3, max(m, 1))[:m, None]
    col_mag = torch.logspace(-2, 2, n)[torch.randperm(n)][None, :]
    return (torch.randn(shape) * row_mag * col_mag).to(DEVICE, dtype)


def _offsets(counts: list[int]) -> torch.Tensor:
    """int32 group end offsets from per-expert row counts, each group padded to a multiple of 128."""
    padded = [-(-c // 128) * 128 for c in counts]
    return torch.tensor(padded, dtype=torch.int64).cumsum(0).to(DEVICE, torch.int32)


def _check_against_reference(
    g: torch.Tensor, offsets: torch.Tensor | None = None, config: LaunchConfig = DEFAULT_CONFIG, kernel: str = "triton"
) -> tuple[torch.Tensor, ...]:
    if kernel == "sm90":
        out = launch_quantize_dual_1x128_sm90(g, offsets)
    else:
        out = launch_quantize_dual_1x128(g, offsets, config=config)
    expected = quantize_dual_1x128_reference(g.cpu(), None if offsets is None else offsets.cpu())
    for name, a, e in zip(NAMES, out, expected, strict=True):
        (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e, name)
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference(shape, dtype):
    _check_against_reference(_grad(shape, dtype))


@pytest.mark.parametrize(
    "config",
    quantize_dual_1x128_configs(),
    ids=lambda c: f"warps{c.num_warps}-maxnreg{c.maxnreg}",
)
def test_every_launch_config_matches_reference(config):
    # 6 tiles (2 row blocks x 3), an empty expert between two groups padded to 128 rows.
    g = _grad((256, 384), torch.bfloat16)
    _check_against_reference(g, _offsets([100, 0, 50]), config)


def test_layouts_and_agreement_with_quantize_1x128():
    g = _grad((256, 384), torch.bfloat16)
    row_data, row_scale, col_data, col_scale = launch_quantize_dual_1x128(g)
    assert col_data.shape == (384, 256) and col_scale.shape == (2, 384) and row_scale.shape == (256, 3)
    assert all(t.is_contiguous() for t in (row_data, row_scale, col_data, col_scale))
    # the row-wise half is exactly quantize_1x128 of g, the column-wise half quantize_1x128 of g.T
    ref_row = launch_quantize_1x128(g)
    ref_col = launch_quantize_1x128(g.t().contiguous())
    assert_fp8_equal(row_data, ref_row[0])
    assert_scales_equal(row_scale, ref_row[1])
    assert_fp8_equal(col_data, ref_col[0])
    assert_scales_equal(col_scale, ref_col[1].t())


@pytest.mark.hopper
@pytest.mark.parametrize("shape", [(128, 128), (384, 640), (1280, 2048), (4096, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sm90_matches_reference(shape, dtype):
    """The Hopper kernel: fewer tiles than SMs, and many tiles a program (the ring wraps, both partitions)."""
    _check_against_reference(_grad(shape, dtype), kernel="sm90")


def test_sm90_kernel_builds_for_hopper():
    """Compiled for sm_90a without a GPU (the interpreter cannot run Gluon): every form builds within Hopper's
    shared memory; bf16 does not spill (fp32 input, 64 values a thread in each layout: a few spill
    instructions, 2 with triton 3.6's ptxas, 10 with 3.9's)."""
    from fp8flow_ao.kernels._sm90_common import SM90_SMEM_BYTES

    most = {"bfloat16": 0, "float32": 2 if triton.__version__.startswith("3.6.") else 16}  # spills allowed
    builds = {f"build_sm90_quantize_dual_kernel({o}, torch.{d})": d for o in (True, False) for d in most}
    built = build_spills("quantize_dual_1x128", list(builds))
    assert all(shared <= SM90_SMEM_BYTES for _, shared, _ in built), built
    assert all(spills <= most[builds[b]] for b, _, spills in built), built


@pytest.mark.hopper
@pytest.mark.parametrize(("stages", "match"), [(0, "stages=0"), (9, "shared memory")])
def test_sm90_refuses_settings_it_cannot_run(stages, match):
    with pytest.raises(ValueError, match=match):
        launch_quantize_dual_1x128_sm90(_grad((128, 128), torch.bfloat16), stages=stages)


@pytest.mark.hopper
def test_op_takes_the_sm90_kernel_where_tma_can_load(monkeypatch):
    """On Hopper the op runs the TMA kernel for the plain form, and the Triton kernel for the gathering form
    and for a ``g`` TMA cannot load (a row stride off a 16-byte boundary); the bits agree."""
    import fp8flow_ao.kernels.quantize_dual_1x128 as module

    calls = []
    sm90 = module.launch_quantize_dual_1x128_sm90
    monkeypatch.setattr(module, "launch_quantize_dual_1x128_sm90", lambda *a: calls.append(1) or sm90(*a))
    offsets = _offsets([300, 0, 129])
    wide = _grad((1024, 388), torch.bfloat16)  # rows of 776 bytes: TMA cannot load them
    g = wide[:, :384].contiguous()
    expected = quantize_dual_1x128_reference(g.cpu(), offsets.cpu())
    outs = [quantize_dual_1x128(g, offsets)]
    assert calls == [1]
    outs.append(quantize_dual_1x128(wide[:, :384], offsets))
    quantize_dual_1x128(g, offsets, torch.arange(1023, -1, -1, dtype=torch.int32, device=DEVICE))
    assert calls == [1]
    for out in outs:
        for name, a, e in zip(NAMES, out, expected, strict=True):
            (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e, name)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transpose", [False, True])
def test_edge_values_bit_exact(dtype, transpose, kernel):
    # Edge rows (amax 448, just over, ties, subnormals, zeros, signed zeros, NaN, inf) padded to 128
    # rows; transposed they become edge columns, probing the column-wise blocks.
    edge = edge_case_rows(256, "cpu", torch.float32)
    g = torch.cat([edge, torch.randn(120, 256)])
    g = (g.t() if transpose else g).contiguous().to(DEVICE, dtype)
    _check_against_reference(g, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_edge_tiles_bit_exact(kernel):
    # Each 128-row block is one edge case spread over a whole tile: every row and column block sees it.
    g = edge_case_rows(128 * 128, DEVICE, torch.bfloat16).reshape(8 * 128, 128)
    _check_against_reference(g, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_row_stride_is_free(kernel):
    g = _grad((256, 512), torch.bfloat16)[:, :256]
    out = launch_quantize_dual_1x128_sm90(g) if kernel == "sm90" else launch_quantize_dual_1x128(g)
    expected = quantize_dual_1x128_reference(g.contiguous().cpu())
    for name, a, e in zip(NAMES, out, expected, strict=True):
        (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e, name)


@pytest.mark.parametrize(
    "counts",
    [
        [128, 256, 128],  # balanced-ish, ends exactly at M: nothing past the end
        [0, 300, 0, 5],  # empty experts, ragged groups padded to 128
        [512],  # one expert with all rows
        [0, 0, 0],  # every expert empty: everything is padding
        [1, 0, 130],  # skewed, buffer has slack past the last group
    ],
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_group_end_offsets(counts, kernel):
    m, n = 512, 256
    g = _grad((m, n), torch.bfloat16)
    offsets = _offsets(counts)
    end = int(offsets[-1])
    g[end:] = float("nan")  # rows past the end are never read: their NaN must not reach any output
    row_data, row_scale, col_data, col_scale = _check_against_reference(g, offsets, kernel=kernel)
    assert bool((row_data[end:].float() == 0).all()) and bool((row_scale[end:] == 0).all())
    assert bool((col_data[:, end:].float() == 0).all()) and bool((col_scale[end // 128 :] == 0).all())
    assert bool(torch.isfinite(row_data.float()).all()) and bool(torch.isfinite(col_data.float()).all())
    # rows before the end are quantized as without offsets
    if end:
        plain = launch_quantize_dual_1x128(g[:end])
        assert_fp8_equal(row_data[:end], plain[0])
        assert_scales_equal(col_scale[: end // 128], plain[3])


@pytest.mark.parametrize("counts", [[5, 0, 200, 1], [0, 0], [128, 130], [300]])
@pytest.mark.parametrize("extra", [0, 9])
def test_src_rows_gathers_into_padded_groups(counts, extra):
    """With ``src_rows`` (fp8_grouped_mm's unaligned groups) the outputs are those of the padded copy of
    ``g`` (pad rows 0), bit for bit, but for the pad rows' row-wise scales: 0 (the format's pad rows)."""
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = int(offs[-1]) + extra
    g = _grad((rows, 256), torch.bfloat16)
    g[:3] = edge_case_rows(256, DEVICE, torch.bfloat16)[: min(3, rows)]
    src_rows, _, padded_offs = pad_group_offsets_reference(offs, rows)
    out = launch_quantize_dual_1x128(g, padded_offs.to(DEVICE), src_rows.to(DEVICE))
    expected = list(quantize_dual_1x128_reference(take_rows_or_zero(g.cpu(), src_rows, 1), padded_offs))
    expected[1] = torch.where((src_rows >= 0)[:, None], expected[1], 0.0)
    reference = quantize_dual_1x128_reference(g.cpu(), padded_offs, src_rows)
    for name, a, r, e in zip(NAMES, out, reference, expected, strict=True):
        check = assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal
        check(a, e, name)
        check(r, e, name)


@pytest.mark.gpu
@pytest.mark.parametrize("offsets", [None, "skewed"])
def test_deepseek_shape_on_gpu(offsets):
    g = _grad((4096, 7168), torch.bfloat16)
    _check_against_reference(g, None if offsets is None else _offsets([0, 1000, 37, 0, 2000, 5, 0, 300]))


@pytest.mark.parametrize("with_offsets", [False, True])
def test_op_dispatch_and_compile(with_offsets):
    g = _grad((256, 384), torch.bfloat16)
    offsets = _offsets([100, 0]) if with_offsets else None
    src_rows = torch.arange(-1, 255, dtype=torch.int32, device=DEVICE).flip(0)
    for args in ((g, offsets), (g, offsets, src_rows)):
        eager = quantize_dual_1x128(*args)
        compiled = torch.compile(quantize_dual_1x128, fullgraph=True)(*args)
        for name, a, e in zip(NAMES, compiled, eager, strict=True):
            (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e, name)


@pytest.mark.parametrize("with_offsets", [False, True])
def test_opcheck(with_offsets):
    g = _grad((256, 256), torch.bfloat16)
    offsets = _offsets([128, 0]) if with_offsets else None
    torch.library.opcheck(torch.ops.fp8flow.quantize_dual_1x128.default, (g, offsets))
    src_rows = torch.arange(-28, 100, dtype=torch.int32, device=DEVICE)  # 28 pad rows, then g[:100]
    torch.library.opcheck(torch.ops.fp8flow.quantize_dual_1x128.default, (g[:100], offsets, src_rows))


_OK = torch.zeros(256, 256)
_OK_OFFSETS = torch.tensor([128, 256], dtype=torch.int32)


@pytest.mark.parametrize(
    ("g", "offsets", "error", "match"),
    [
        (torch.zeros(128, 128, dtype=torch.int32), None, TypeError, "g must have dtype"),
        (torch.zeros(2, 128, 128), None, ValueError, "g must have 2 dims"),
        (torch.zeros(100, 128), None, ValueError, r"g dim M \(0\) must be a multiple of 128"),
        (torch.zeros(128, 200), None, ValueError, r"g dim N \(1\) must be a multiple of 128"),
        (torch.zeros(256, 128).t(), None, ValueError, "g must be row-major"),
        ([[1.0]], None, TypeError, "g must be a torch.Tensor"),
        (_OK, _OK_OFFSETS.long(), TypeError, "group_end_offsets must have dtype"),
        (_OK, _OK_OFFSETS[None], ValueError, "group_end_offsets must have 1 dims"),
        (_OK, torch.zeros(0, dtype=torch.int32), ValueError, "group_end_offsets must hold at least one group"),
        (_OK, torch.arange(4, dtype=torch.int32)[::2], ValueError, "group_end_offsets must be contiguous"),
    ],
)
def test_bad_input(g, offsets, error, match):
    with pytest.raises(error, match=match):
        quantize_dual_1x128(g, offsets)


@pytest.mark.parametrize(
    ("src_rows", "error", "match"),
    [
        (torch.zeros(128, dtype=torch.int64), TypeError, "src_rows must have dtype"),
        (torch.zeros(100, dtype=torch.int32), ValueError, r"src_rows length \(M\) must be a multiple of 128"),
        (torch.zeros(256, dtype=torch.int32)[::2], ValueError, "src_rows must be contiguous"),
    ],
)
def test_bad_src_rows(src_rows, error, match):
    with pytest.raises(error, match=match):
        quantize_dual_1x128(torch.zeros(5, 128), None, src_rows)


@pytest.mark.parametrize(
    ("offsets", "match"), [([100, 256], "multiples of 128"), ([256, 128], "non-decreasing"), ([384], "past the end")]
)
def test_bad_offset_values_when_validating(monkeypatch, offsets, match):
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    with pytest.raises(ValueError, match=match):
        quantize_dual_1x128(_OK, torch.tensor(offsets, dtype=torch.int32))
