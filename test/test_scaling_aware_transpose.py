"""scaling_aware_transpose: bit-exact against the reference (Triton on GPU, or the CPU interpreter),
exact RNE subnormals, the row-wise values preserved, error against the naive path, op checks, bad input."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import triton
from conftest import DEVICE
from fp8_helpers import assert_fp8_equal, assert_scales_equal, build_spills, fp8_bits, opcheck_fp8_inputs

from fp8flow_ao._format import BLOCK, FP8_DTYPE, FP8_MAX, dequantize_rows_reference, quantize_rows_reference
from fp8flow_ao.kernels.permute_pad import permute_pad_rows, route_pad
from fp8flow_ao.kernels.scaling_aware_transpose import (
    TransposeConfig,
    default_transpose_config,
    dequantize_transpose_requantize_reference,
    launch_scaling_aware_transpose,
    launch_scaling_aware_transpose_sm90,
    scaling_aware_transpose,
    scaling_aware_transpose_reference,
    transpose_configs,
)

CONFIGS = [None, *transpose_configs()]
# The two kernels of the plain form: Triton (any GPU, the CPU interpreter) and the Hopper TMA kernel.
KERNELS = [pytest.param("triton", id="triton"), pytest.param("sm90", id="sm90", marks=pytest.mark.hopper)]
SMALLEST_NORMAL = 2.0**-6  # of E4M3


def rowwise_input(m: int, k: int, spread: int = 20, device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 data whose 1 x 128 blocks have scales spread over 2**(+-spread): many shifts, many underflows."""
    block_mag = 2.0 ** torch.randint(-spread, spread + 1, (m, k // BLOCK)).float()
    x = torch.randn(m, k) * block_mag.repeat_interleave(BLOCK, dim=1)
    data, scale_inv = quantize_rows_reference(x.bfloat16(), BLOCK)
    return data.to(device), scale_inv.to(device)


def grouped_input(counts: list[int], m: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert groups padded to 128 rows (pad rows: data 0, scale 0) in an ``m``-row buffer whose rows
    past the last group end hold garbage (NaN, huge scales) that must never be read."""
    data, scale_inv = rowwise_input(m, k, device="cpu")
    ends = torch.cumsum(torch.tensor([-(-c // BLOCK) * BLOCK for c in counts]), 0).to(torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), ends[:-1]])
    is_pad = torch.ones(m, dtype=torch.bool)
    for start, count in zip(starts.tolist(), counts, strict=True):
        is_pad[start : start + count] = False
    is_pad[int(ends[-1]) :] = False
    data.view(torch.uint8)[is_pad] = 0
    scale_inv[is_pad] = 0
    tail = int(ends[-1])
    data.view(torch.uint8)[tail:] = 0x7F  # NaN
    scale_inv[tail:] = 2.0**100
    return data.to(DEVICE), scale_inv.to(DEVICE), ends.to(DEVICE)


def assert_matches_reference(data, scale_inv, offsets=None, config=None, kernel="triton"):
    if kernel == "sm90":
        data_t, scale_t = launch_scaling_aware_transpose_sm90(data, scale_inv, offsets)
    else:
        data_t, scale_t = launch_scaling_aware_transpose(data, scale_inv, offsets, config=config)
    ref_t, ref_scale_t = scaling_aware_transpose_reference(
        data.cpu(), scale_inv.cpu(), None if offsets is None else offsets.cpu()
    )
    assert data_t.is_contiguous() and scale_t.is_contiguous()
    assert_fp8_equal(data_t, ref_t, "data_t")
    assert_scales_equal(scale_t, ref_scale_t, "scale_inv_t")
    return data_t.cpu(), scale_t.cpu()


def dequantize_columnwise(data_t: torch.Tensor, scale_t: torch.Tensor) -> torch.Tensor:
    """``[K, M]`` fp32 from column-wise data ``[K, M]`` and scales ``[M / 128, K]``."""
    return data_t.float() * scale_t.t().repeat_interleave(BLOCK, dim=1)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("shape", [(128, 640), (384, 256)])  # 5 K blocks: a partial last program
def test_triton_matches_reference(shape, config):
    data, scale_inv = rowwise_input(*shape)
    assert_matches_reference(data, scale_inv, config=config)


@pytest.mark.hopper
@pytest.mark.parametrize("shape", [(128, 128), (384, 640), (1280, 2048), (4096, 7168)])
def test_sm90_matches_reference(shape):
    """The Hopper kernel: fewer tiles than SMs, and many tiles a program (the ring wraps, both partitions)."""
    data, scale_inv = rowwise_input(*shape)
    assert_matches_reference(data, scale_inv, kernel="sm90")


@pytest.mark.hopper
@pytest.mark.parametrize("end", [0, 1, 200, 383])
def test_sm90_end_inside_a_tile(end):
    """An end that is no multiple of 128 (outside the op's contract, inside the kernel's): the tile holding it
    zeroes the rows past it (NaN there must not leak through its 0 multiplier), later tiles are not read."""
    data, scale_inv = rowwise_input(512, 384)
    data.view(torch.uint8)[end:] = 0x7F  # NaN
    scale_inv[end:] = 2.0**100
    ends = torch.tensor([end], dtype=torch.int32, device=DEVICE)
    data_t, scale_t = assert_matches_reference(data, scale_inv, ends, kernel="sm90")
    assert bool((fp8_bits(data_t[:, end:]) == 0).all())


@pytest.mark.hopper
@pytest.mark.parametrize(("kwargs", "match"), [({"stages": 0}, "stages=0"), ({"stages": 11}, "shared memory")])
def test_sm90_refuses_settings_it_cannot_run(kwargs, match):
    data, scale_inv = rowwise_input(128, 128)
    with pytest.raises(ValueError, match=match):
        launch_scaling_aware_transpose_sm90(data, scale_inv, **kwargs)


def test_sm90_kernel_builds_for_hopper():
    """Compiled for sm_90a without a GPU (the interpreter cannot run Gluon): every form builds, none spills."""
    built = build_spills("scaling_aware_transpose", [f"build_sm90_transpose_kernel({o})" for o in (True, False)])
    # Spills: none with triton 3.6's ptxas (the GPU image's); newer ones move a few values of the default
    # partition through local memory at these register counts.
    most = 0 if triton.__version__.startswith("3.6.") else 16
    assert all(spills <= most for *_, spills in built), built


@pytest.mark.parametrize(
    "counts",
    [
        [128, 256, 128],  # balanced, aligned: no pad rows
        [0, 300, 0, 5, 0],  # empty experts, partial tiles, a 5-row group
        [1, 2, 3, 250],  # skewed: three nearly empty groups and one big one
        [400],  # one expert gets every row
        [0, 0],  # no rows at all: every row is past the end
    ],
)
@pytest.mark.parametrize(
    ("config", "kernel"),
    [
        (None, "triton"),
        (TransposeConfig(1, 8, 128, None), "triton"),
        (TransposeConfig(2, 8, 128, 2), "triton"),
        pytest.param(None, "sm90", marks=pytest.mark.hopper),
    ],
    ids=str,
)
def test_group_offsets(counts, config, kernel):
    m = 640  # rows past the last group end: garbage, never read
    data, scale_inv, ends = grouped_input(counts, m, 256)
    data_t, scale_t = assert_matches_reference(data, scale_inv, ends, config, kernel)
    tail = int(ends[-1])
    assert bool((fp8_bits(data_t[:, tail:]) == 0).all()), "rows past the last group end must come out as 0"
    assert bool((scale_t[tail // BLOCK :] == 0).all())
    assert bool(torch.isfinite(dequantize_columnwise(data_t, scale_t)).all())


@pytest.mark.parametrize("kernel", KERNELS)
def test_edge_values(kernel):
    """Zeros, -0, NaN, a block with scale +inf, pad rows inside a tile and a whole pad tile."""
    data, scale_inv = rowwise_input(384, 256, spread=4, device="cpu")
    bits = data.view(torch.uint8)
    bits[0, :128] = 0x00  # +0
    bits[1, :128] = 0x80  # -0
    bits[2, 5] = 0x7F  # NaN
    bits[3, 130] = 0xFF  # -NaN
    scale_inv[4, 1] = float("inf")  # non-finite input in block (4, 1): its data holds 0, -2 and NaN
    bits[4, 128:] = torch.tensor([0x00, 0xC0, 0x7F], dtype=torch.uint8).repeat(43)[:128]
    bits[10:20] = 0  # pad rows inside tile 0
    scale_inv[10:20] = 0
    bits[256:] = 0  # tile 2: all pad
    scale_inv[256:] = 0
    data, scale_inv = data.to(DEVICE), scale_inv.to(DEVICE)
    data_t, scale_t = assert_matches_reference(data, scale_inv, kernel=kernel)
    deq = dequantize_columnwise(data_t, scale_t)
    bits = fp8_bits(data_t)
    assert bool((bits[:128, 0] == 0x00).all()) and bool((bits[:128, 1] == 0x80).all())  # +0 and -0 survive
    assert torch.isnan(data_t[5, 2].float()) and torch.isnan(data_t[130, 3].float())  # NaN survives
    assert bool((scale_t[0, 128:] == float("inf")).all())  # inf scale wins the tile's max
    assert not bool(torch.isfinite(deq[128:, :128]).any())  # every element of that tile is non-finite
    assert bool((bits[:, 10:20] == 0).all())  # pad rows give 0
    assert bool((scale_t[2] == 0).all()) and bool((bits[:, 256:] == 0).all())  # pad tile: scale 0, data 0
    assert bool(torch.isfinite(deq[:, 256:]).all())  # ... and no 0 * inf or 0 / 0 NaN


def _all_codes_by_shift(max_shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tile 0: row 0 has scale 1 (the max); row r >= 1 has scale 2**-(r - 1) and every E4M3 code
    in its 256 columns, so each code is shifted by 0..max_shift."""
    m = BLOCK * (-(-(max_shift + 2) // BLOCK))
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    data = codes.repeat(m, 1)
    shift = torch.clamp(torch.arange(m) - 1, 0, max_shift)
    scale_inv = (2.0 ** -shift.float())[:, None].repeat(1, 2)
    scale_inv[BLOCK:] = 1.0  # later tiles (if any): unshifted
    return data, scale_inv, shift


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_code_every_shift_is_round_to_nearest_even(kernel):
    """Exhaustive: kernel == reference == an independent float64 oracle (exact value, one RNE cast)."""
    data, scale_inv, shift = _all_codes_by_shift(30)
    data_t, _ = assert_matches_reference(data.to(DEVICE), scale_inv.to(DEVICE), kernel=kernel)
    exact = data.double() * (2.0 ** -shift.double())[:, None]  # exact: <= 4 significant bits
    expected = exact.float().to(FP8_DTYPE)  # torch's fp32 -> E4M3 cast is round-to-nearest-even
    assert_fp8_equal(data_t.t().contiguous(), expected, "every code x every shift")


@pytest.mark.parametrize(
    ("code", "shift", "expected"),
    [
        (0x08, 4, 0x00),  # 2**-6 -> 2**-10: exactly half the smallest subnormal -> even (0)
        (0x88, 4, 0x80),  # same, negative: -0
        (0x0C, 3, 0x02),  # 1.5 * 2**-6 -> 1.5 subnormal steps: tie -> 2 (truncation gives 1)
        (0x0A, 2, 0x02),  # 1.25 * 2**-6 -> 2.5 steps: tie -> 2
        (0x0E, 2, 0x04),  # 1.75 * 2**-6 -> 3.5 steps: tie -> 4 (truncation gives 3)
        (0x0F, 1, 0x08),  # 1.875 * 2**-6 -> 7.5 steps: tie -> 8 = 2**-6, carries into the normal range
        (0x09, 1, 0x04),  # 1.125 * 2**-6 -> 4.5 steps: tie -> 4
        (0x7E, 12, 0x7E - (12 << 3)),  # 448 -> 448 * 2**-12: stays normal, exponent field - 12
        (0x7F, 20, 0x7F),  # NaN stays NaN
    ],
)
def test_hand_made_subnormal_ties(code, shift, expected):
    data = torch.zeros(BLOCK, BLOCK, dtype=torch.uint8)
    data[0, 0] = 0x7E  # row 0: scale 1, the tile max
    data[1, 0] = code
    scale_inv = torch.ones(BLOCK, 1)
    scale_inv[1] = 2.0**-shift
    data_t, scale_t = assert_matches_reference(data.view(FP8_DTYPE).to(DEVICE), scale_inv.to(DEVICE))
    assert fp8_bits(data_t)[0, 1].item() == fp8_bits(torch.tensor([expected], dtype=torch.uint8).view(FP8_DTYPE))[0]
    assert bool((scale_t == 1.0).all())


def test_keeps_rowwise_values_and_error_vs_naive_path():
    """(a) quantize a BF16 source row-wise; (b) transpose it ours and the naive way; (c) ours equals
    the row-wise values bit for bit wherever the re-encoded value did not underflow, and is within
    half a subnormal step of the tile scale where it did; (d) errors against the BF16 source.

    With power-of-two scales the naive path's requantization is itself an exponent shift (its
    per-column scale is <= ours, on a grid that contains ours), so it is never less accurate: it
    pays an amax pass and a BF16 round trip for a finer scale. What costs accuracy is a
    requantization onto a grid that is not aligned with the first one (``amax / 448`` scales, as in
    recipes without power-of-two scales): that path rounds every element twice.
    """
    m, k = 512, 512
    row_mag = 2.0 ** torch.randint(-6, 7, (m, 1)).float()
    source = (torch.randn(m, k) * row_mag).bfloat16()
    data, scale_inv = quantize_rows_reference(source, BLOCK)  # (a)
    ours = scaling_aware_transpose(data.to(DEVICE), scale_inv.to(DEVICE))  # (b)
    naive = dequantize_transpose_requantize_reference(data, scale_inv)
    ours_deq = dequantize_columnwise(ours[0].cpu(), ours[1].cpu())
    rowwise_deq = dequantize_rows_reference(data, scale_inv, BLOCK).t()

    tile_scale = ours[1].cpu().t().repeat_interleave(BLOCK, 1)  # [K, M]
    normal = rowwise_deq.abs() >= SMALLEST_NORMAL * tile_scale  # the re-encoded value is an E4M3 normal
    assert torch.equal(ours_deq[normal], rowwise_deq[normal])  # (c) exact where no underflow
    half_step = 2.0**-10 * tile_scale  # half the smallest E4M3 subnormal at the tile's scale
    assert bool(((ours_deq - rowwise_deq).abs() <= half_step)[~normal].all())
    assert int((~normal).sum()) > 0, "the input must exercise underflow"

    # a naive path that requantizes with non-power-of-two scales (amax / 448): two roundings
    deq_t = rowwise_deq.contiguous()
    amax = deq_t.abs().reshape(k, m // BLOCK, BLOCK).amax(-1, keepdim=True).clamp(min=1e-30)
    exact_scale = amax / FP8_MAX
    twice_rounded = ((deq_t.reshape(k, m // BLOCK, BLOCK) / exact_scale).to(FP8_DTYPE).float() * exact_scale).reshape(
        k, m
    )

    ref = source.float().t()

    def rel_err(y: torch.Tensor) -> float:
        return ((y - ref).norm() / ref.norm()).item()

    errors = {  # (d)
        "row-wise source": rel_err(rowwise_deq),
        "scaling-aware transpose (ours)": rel_err(ours_deq),
        "naive, power-of-two scales": rel_err(dequantize_columnwise(*naive)),
        "naive, amax/448 scales": rel_err(twice_rounded),
    }
    print(f"\nrelative error vs the BF16 source ({int((~normal).sum())} of {normal.numel()} values underflow):")
    print("\n".join(f"  {name:32s} {err:.7f}" for name, err in errors.items()))
    assert errors["naive, power-of-two scales"] <= errors["scaling-aware transpose (ours)"]
    assert errors["scaling-aware transpose (ours)"] <= errors["row-wise source"] * (1 + 1e-3)
    assert errors["scaling-aware transpose (ours)"] < errors["naive, amax/448 scales"]


@pytest.mark.parametrize("with_offsets", [False, True])
def test_op_dispatch_and_compile(with_offsets):
    if with_offsets:
        data, scale_inv, offsets = grouped_input([100, 0, 200], 512, 256)
    else:
        (data, scale_inv), offsets = rowwise_input(512, 256), None
    eager = scaling_aware_transpose(data, scale_inv, offsets)
    compiled = torch.compile(scaling_aware_transpose, fullgraph=True)(data, scale_inv, offsets)
    ref = scaling_aware_transpose_reference(data.cpu(), scale_inv.cpu(), None if offsets is None else offsets.cpu())
    for got in (eager, compiled):
        assert_fp8_equal(got[0], ref[0], "data_t")
        assert_scales_equal(got[1], ref[1], "scale_inv_t")


def test_compile_does_not_recompile_per_token_count():
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(scaling_aware_transpose, fullgraph=True, backend=counter)
    for m in (256, 384, 640, 1024):
        data, scale_inv, offsets = grouped_input([m // 3, m // 3], m, 256)
        out = compiled(data, scale_inv, offsets)
        assert out[0].shape == (256, m) and out[1].shape == (m // BLOCK, 256)
    assert counter.frame_count <= 2  # the first shape, then one graph dynamic in M


@pytest.mark.parametrize("with_offsets", [False, True])
def test_opcheck(with_offsets):
    data, scale_inv = rowwise_input(256, 256)
    offsets = torch.tensor([128, 128], dtype=torch.int32, device=DEVICE) if with_offsets else None
    opcheck_fp8_inputs(torch.ops.fp8flow.scaling_aware_transpose.default, (data, scale_inv, offsets, None, 1))


def _routed_tokens(tokens: int = 200, k: int = 256, top_k: int = 3):
    """Token rows and a skewed top-k routing over 5 experts (expert 1 empty): the gather's inputs."""
    data, scale_inv = rowwise_input(tokens, k)
    ids = torch.tensor([0, 0, 2, 3, 3, 3, 4, 4, 2, 0])[torch.randint(0, 10, (tokens, top_k))]
    src_rows, _, offsets = route_pad(ids.to(DEVICE), 5)
    return data, scale_inv, src_rows, offsets, top_k


@pytest.mark.parametrize("config", [None, TransposeConfig(1, 8, 128, None)], ids=str)
def test_gather_equals_permute_then_transpose(config):
    """With src_rows the op transposes the rows permute_pad_rows would gather (pad rows, an empty expert,
    rows past the last group end), bit for bit, without writing them."""
    data, scale_inv, src_rows, offsets, top_k = _routed_tokens()
    got = launch_scaling_aware_transpose(data, scale_inv, offsets, src_rows, top_k, config=config)
    rows, rows_scale = permute_pad_rows(data, scale_inv, src_rows, top_k)
    want = launch_scaling_aware_transpose(rows, rows_scale, offsets, config=config)
    ref = scaling_aware_transpose_reference(rows.cpu(), rows_scale.cpu(), offsets.cpu())
    for expected in (want, ref):
        assert_fp8_equal(got[0], expected[0], "data_t")
        assert_scales_equal(got[1], expected[1], "scale_inv_t")


def test_gather_op_dispatch_compile_and_opcheck():
    data, scale_inv, src_rows, offsets, top_k = _routed_tokens()
    eager = scaling_aware_transpose(data, scale_inv, offsets, src_rows, top_k)
    compiled = torch.compile(scaling_aware_transpose, fullgraph=True)(data, scale_inv, offsets, src_rows, top_k)
    ref = scaling_aware_transpose(*permute_pad_rows(data, scale_inv, src_rows, top_k), offsets)
    for got in (eager, compiled):
        assert_fp8_equal(got[0], ref[0], "data_t")
        assert_scales_equal(got[1], ref[1], "scale_inv_t")
    opcheck_fp8_inputs(torch.ops.fp8flow.scaling_aware_transpose.default, (data, scale_inv, offsets, src_rows, top_k))


@pytest.mark.hopper
def test_op_takes_the_sm90_kernel_for_the_plain_form(monkeypatch):
    """On Hopper the op runs the TMA kernel for the plain form (16-byte aligned data) and the Triton kernel for
    the gathering form and for data TMA cannot load (a base off a 16-byte boundary); the bits agree."""
    import fp8flow_ao.kernels.scaling_aware_transpose as module

    calls = []
    sm90 = module.launch_scaling_aware_transpose_sm90
    monkeypatch.setattr(module, "launch_scaling_aware_transpose_sm90", lambda *a: calls.append(1) or sm90(*a))
    data, scale_inv, offsets = grouped_input([300, 0, 129], 1024, 384)
    ref = scaling_aware_transpose_reference(data.cpu(), scale_inv.cpu(), offsets.cpu())
    got = scaling_aware_transpose(data, scale_inv, offsets)
    assert calls == [1]
    unaligned = torch.empty(data.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(FP8_DTYPE).view(data.shape)
    unaligned.copy_(data)
    got_unaligned = scaling_aware_transpose(unaligned, scale_inv, offsets)
    tokens, tok_scale, src_rows, tok_offsets, top_k = _routed_tokens()
    scaling_aware_transpose(tokens, tok_scale, tok_offsets, src_rows, top_k)
    assert calls == [1]
    for out in (got, got_unaligned):
        assert_fp8_equal(out[0], ref[0], "data_t")
        assert_scales_equal(out[1], ref[1], "scale_inv_t")


def test_no_rows():
    data_t, scale_t = scaling_aware_transpose(torch.empty(0, 256, dtype=FP8_DTYPE), torch.empty(0, 2))
    assert data_t.shape == (256, 0) and scale_t.shape == (0, 256)
    data_t, scale_t = launch_scaling_aware_transpose(torch.empty(0, 256, dtype=FP8_DTYPE), torch.empty(0, 2))
    assert data_t.shape == (256, 0) and scale_t.shape == (0, 256)


@pytest.mark.parametrize("k", [128, 2048, 7168])
def test_default_config_is_a_swept_config(k):
    assert default_transpose_config(k) in transpose_configs()


def _fp8(*shape):
    return torch.zeros(*shape, dtype=FP8_DTYPE)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.zeros(128, 128), torch.zeros(128, 1)), TypeError, "data must have dtype"),
        ((_fp8(2, 128, 128), torch.zeros(2, 128, 1)), ValueError, "data must have 2 dims"),
        ((_fp8(100, 128), torch.zeros(100, 1)), ValueError, "data rows"),
        ((_fp8(128, 200), torch.zeros(128, 2)), ValueError, "data columns"),
        ((_fp8(128, 256)[:, :128], torch.zeros(128, 1)), ValueError, "data must be contiguous"),
        ((_fp8(128, 256), torch.zeros(128, 2, dtype=torch.bfloat16)), TypeError, "scale_inv must have dtype"),
        ((_fp8(128, 256), torch.zeros(128, 1)), ValueError, "scale_inv must have shape"),
        ((_fp8(128, 256), torch.zeros(256, 1)), ValueError, "scale_inv must have shape"),
        ((_fp8(128, 256), torch.zeros(2, 128).t()), ValueError, "scale_inv must be contiguous"),
        ((_fp8(128, 128), torch.zeros(128, 1), torch.tensor([128])), TypeError, "group_end_offsets must have dtype"),
        ((_fp8(128, 128), torch.zeros(128, 1), torch.tensor([[128]], dtype=torch.int32)), ValueError, "1 dims"),
        ((_fp8(128, 128), torch.zeros(128, 1), torch.zeros(0, dtype=torch.int32)), ValueError, "at least one"),
        (([[1.0]], torch.zeros(128, 1)), TypeError, "data must be a torch.Tensor"),
        ((_fp8(100, 128), torch.zeros(100, 1), None, torch.zeros(128)), TypeError, "src_rows must have dtype"),
        ((_fp8(100, 128), torch.zeros(100, 1), None, torch.zeros(100, dtype=torch.int32)), ValueError, "src_rows"),
        ((_fp8(100, 128), torch.zeros(100, 1), None, torch.zeros(128, dtype=torch.int32), 0), ValueError, "top_k"),
    ],
)
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        scaling_aware_transpose(*args)


def test_cpu_row_maps_are_checked_without_opting_in():
    """On CPU tensors ``src_rows``' values are checked for free against ``top_k`` rows per token row."""
    data, scale = torch.zeros(2, 128, dtype=FP8_DTYPE), torch.ones(2, 1)
    src_rows = torch.full((128,), -1, dtype=torch.int32)
    src_rows[0] = 4  # token 2 of 2 at top_k = 2
    with pytest.raises(ValueError, match=r"src_rows values must lie in \[-1, 4\)"):
        scaling_aware_transpose(data, scale, None, src_rows, 2)
