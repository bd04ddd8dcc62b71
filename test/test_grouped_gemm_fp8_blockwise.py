"""grouped_gemm_fp8_blockwise: both kernels -- Triton (GPU, or the CPU interpreter) and the Gluon sm90
kernel (Hopper; on the CPU it is built for sm_90a, not run) -- against the fp32 reference, forward
and dgrad, group edge cases, op registration, compile and bad input."""

from __future__ import annotations

import conftest
import pytest
import torch
import triton
from conftest import DEVICE, INTERPRETING
from fp8_helpers import GEMM_TOLERANCE as TOLERANCE
from fp8_helpers import (
    RANDOM_GROUPING_SEEDS,
    assert_fp8_equal,
    assert_scales_equal,
    build_every_sm90_config,
    padded_ends,
    param_id,
    random_grouping,
    rel_error,
)

from fp8flow_ao._format import BLOCK, quantize_rows_reference
from fp8flow_ao.kernels import grouped_gemm_fp8_blockwise as mod
from fp8flow_ao.kernels._grouped_gemm_common import AUTOTUNE_KEY
from fp8flow_ao.kernels._sm90_common import SM90_SMEM_BYTES
from fp8flow_ao.kernels.grouped_gemm_fp8_blockwise import (
    OUT_DTYPES,
    Sm90Config,
    grouped_gemm_fp8_blockwise,
    grouped_gemm_fp8_blockwise_reference,
    launch_grouped_gemm_fp8_blockwise_sm90,
    launch_grouped_gemm_fp8_blockwise_triton,
)
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128_reference

LAUNCHERS = {"triton": launch_grouped_gemm_fp8_blockwise_triton, "sm90": launch_grouped_gemm_fp8_blockwise_sm90}


@pytest.fixture(params=["triton", pytest.param("sm90", marks=pytest.mark.hopper)])
def launch(request: pytest.FixtureRequest):
    """Each kernel's launcher; the sm90 one only where it runs (a Hopper GPU)."""
    return LAUNCHERS[request.param]


def make_rows(counts: list[int], k: int, extra_rows: int = 0, device: str = DEVICE):
    """Permuted+padded 1x128 FP8 rows: real rows random (magnitudes spread over 1e-3..1e3), pad rows
    data 0 / scale 0 as the permute op writes them, and ``extra_rows`` garbage (NaN) past the last end."""
    ends = padded_ends(counts)
    m = (ends[-1] if ends else 0) + extra_rows
    x = torch.randn(m, k) * torch.logspace(-3, 3, max(m, 1))[torch.randperm(max(m, 1))][:m, None]
    data, scale = quantize_rows_reference(x, BLOCK)
    start = 0
    for c, end in zip(counts, ends, strict=True):
        data[start + c : end] = 0
        scale[start + c : end] = 0
        start = end
    data[start:] = float("nan")  # never read: NaN here would poison the output if it were
    scale[start:] = float("nan")
    offsets = torch.tensor(ends, dtype=torch.int32)
    return data.to(device), scale.to(device), offsets.to(device)


def make_weights(e: int, n: int, k: int, device: str = DEVICE):
    w = torch.randn(e, n, k) * torch.logspace(-2, 2, e)[:, None, None]
    data, scale, _, _ = quantize_128x128_reference(w, with_transpose=False)
    return data.to(device), scale.to(device)


def check(out, a, a_scale, b, b_scale, offsets, out_dtype):
    ref = grouped_gemm_fp8_blockwise_reference(
        a.cpu(), a_scale.cpu(), b.cpu(), b_scale.cpu(), offsets.cpu(), torch.float32
    )
    assert out.shape == ref.shape and out.dtype == out_dtype
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[out_dtype], rel_error(out, ref)
    last = int(offsets[-1])
    assert torch.equal(out[last:].cpu(), torch.zeros_like(out[last:].cpu())), "rows past the last end must be 0"


# (rows per expert, K, N, rows past the last end)
CASES = {
    "balanced": ([128, 128, 128], 256, 256, 0),
    "empty_experts": ([0, 200, 0, 60], 256, 128, 0),
    "one_expert_all_rows": ([0, 0, 384, 0], 128, 256, 0),
    "groups_of_128": ([128, 128, 128, 128], 128, 128, 0),
    "n_k_128": ([100, 156], 128, 128, 0),
    "skewed": ([300, 5, 0, 70], 256, 256, 0),
    "rows_past_last_end": ([130, 90], 256, 128, 77),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_forward_matches_reference(case, out_dtype, launch):
    counts, k, n, extra = CASES[case]
    a, a_scale, offsets = make_rows(counts, k, extra)
    b, b_scale = make_weights(len(counts), n, k)
    out = launch(a, a_scale, b, b_scale, offsets, out_dtype)
    check(out, a, a_scale, b, b_scale, offsets, out_dtype)


@pytest.mark.parametrize("seed", RANDOM_GROUPING_SEEDS)
def test_random_groupings_match_reference(seed, launch):
    """Groupings and widths no case above names, checked row by row (:func:`fp8_helpers.rel_error`)."""
    counts, k, n, extra = random_grouping(seed)
    a, a_scale, offsets = make_rows(counts, k, extra)
    b, b_scale = make_weights(len(counts), n, k)
    out = launch(a, a_scale, b, b_scale, offsets, torch.bfloat16)
    check(out, a, a_scale, b, b_scale, offsets, torch.bfloat16)


def test_dgrad_uses_the_transposed_weight(launch):
    """dgrad: dX = dY @ W_e, with W_e's exact FP8 transpose ([E, K, N] data, [E, K/128, N/128] scales)."""
    counts, k, n = [256, 0, 128], 128, 256  # forward W: [E, N=256, K=128]; dY: [M, N]
    dy, dy_scale, offsets = make_rows(counts, n)
    w, w_scale = make_weights(len(counts), n, k)
    w_t, w_t_scale = w.transpose(1, 2).contiguous(), w_scale.transpose(1, 2).contiguous()
    out = launch(dy, dy_scale, w_t, w_t_scale, offsets, torch.float32)
    assert out.shape == (dy.shape[0], k)
    # oracle written independently: dequantize and multiply by the untransposed weight
    dy32 = dy.float().cpu() * dy_scale.cpu().repeat_interleave(BLOCK, 1)
    w32 = w.float().cpu() * w_scale.cpu().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    expected = torch.cat([dy32[:256] @ w32[0], dy32[256:384] @ w32[2]])
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


def test_non_finite_scales_give_non_finite_output(launch):
    a, a_scale, offsets = make_rows([128, 128], 128)
    b, b_scale = make_weights(2, 128, 128)
    a_scale[5, 0] = float("nan")
    b_scale[1, 0, 0] = float("inf")
    out = launch(a, a_scale, b, b_scale, offsets, torch.float32).cpu()
    assert torch.isnan(out[5]).all()
    assert not torch.isfinite(out[128:]).any()
    assert torch.isfinite(out[:128][torch.arange(128) != 5]).all()


@pytest.mark.gpu
def test_nan_data_gives_nan_output(launch):
    """GPU only: the interpreter's fp8 dot converts E4M3 NaN (0x7F) to a finite number."""
    a, a_scale, offsets = make_rows([128, 128], 128)
    b, b_scale = make_weights(2, 128, 128)
    a[5, 7] = float("nan")
    b[1, 3, 9] = float("nan")
    out = launch(a, a_scale, b, b_scale, offsets, torch.float32).cpu()
    assert torch.isnan(out[5]).all() and torch.isnan(out[128:, 3]).all()
    assert int(torch.isnan(out).sum()) == 128 + 128


def test_row_stride_is_free(launch):
    a, a_scale, offsets = make_rows([128, 128], 128)
    b, b_scale = make_weights(2, 128, 128)
    wide = torch.zeros(a.shape[0], 384, dtype=a.dtype, device=DEVICE)
    wide[:, 128:256] = a
    scale_wide = torch.zeros(a.shape[0], 3, device=DEVICE)
    scale_wide[:, 1:2] = a_scale
    out = launch(wide[:, 128:256], scale_wide[:, 1:2], b, b_scale, offsets, torch.float32)
    check(out, a, a_scale, b, b_scale, offsets, torch.float32)


def test_zero_rows():
    a, a_scale = torch.empty(0, 128, dtype=torch.float8_e4m3fn, device=DEVICE), torch.empty(0, 1, device=DEVICE)
    b, b_scale = make_weights(2, 128, 128)
    offsets = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    assert grouped_gemm_fp8_blockwise(a, a_scale, b, b_scale, offsets).shape == (0, 128)


@pytest.mark.gpu
def test_promotion_keeps_error_flat_in_k(launch):
    """Per-128-K promotion: the tensor cores' limited-precision sums never span more than one block,
    so the relative error does not grow with K (it would, were the whole K summed on the tensor cores)."""
    errors = []
    for k in (128, 4096):
        a, a_scale, offsets = make_rows([256, 256], k)
        b, b_scale = make_weights(2, 256, k)
        out = launch(a, a_scale, b, b_scale, offsets, torch.float32)
        ref = grouped_gemm_fp8_blockwise_reference(*(t.cpu() for t in (a, a_scale, b, b_scale, offsets)), torch.float32)
        errors.append(rel_error(out, ref))
    assert errors[1] < 2 * errors[0] + 1e-6, errors


EVERY_CONFIG = [
    pytest.param(launch_grouped_gemm_fp8_blockwise_triton, c, marks=pytest.mark.gpu) for c in mod.FORWARD_CONFIGS
]
EVERY_CONFIG += [
    pytest.param(launch_grouped_gemm_fp8_blockwise_sm90, c, marks=pytest.mark.hopper) for c in mod.SM90_CONFIGS
]


@pytest.mark.parametrize(("launcher", "config"), EVERY_CONFIG, ids=param_id)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_every_config(launcher, config, out_dtype):
    """Each launch config is correct (the autotuner, or a sweep, may pick any), on a shape with many
    tiles per program (so the persistent loop and the TMA ring wrap around)."""
    counts = [300, 0, 1000, 129, 640, 0, 17, 900, 4100, 0, 2000, 128]
    a, a_scale, offsets = make_rows(counts, 1024, extra_rows=200)
    b, b_scale = make_weights(len(counts), 512, 1024)
    if isinstance(config, Sm90Config) and mod.sm90_smem_bytes(config, out_dtype) > SM90_SMEM_BYTES:
        pytest.skip(f"{config} does not fit with {out_dtype} out")
    out = launcher(a, a_scale, b, b_scale, offsets, out_dtype, config=config)
    check(out, a, a_scale, b, b_scale, offsets, out_dtype)


def skip_many_tiles_when_interpreting(case: str) -> None:
    """The ``many_tiles`` cases make the sm90 kernels' rings wrap around many times a program (GPU); the CPU
    interpreter takes 25-70 s a case on the Triton kernel, whose loops the smaller cases already cover."""
    if case == "many_tiles" and INTERPRETING:
        pytest.skip("many_tiles: the sm90 ring's wrap-around, run on a GPU (25-70 s a case in the interpreter)")


# (rows per expert, forward W [E, Nw, Kw] rows and columns, rows past the last end): dgrad shapes, K = Nw.
FP8_T_CASES = {
    "empty_experts": ([128, 0, 200, 60], 256, 384, 9),
    "many_tiles": ([300, 0, 1000, 129, 640, 0, 17, 900, 2000, 128], 512, 512, 200),
}


@pytest.mark.parametrize("case", list(FP8_T_CASES))
def test_fp8_transpose_b_is_the_transposed_copy(case, launch):
    """An FP8 ``W`` with ``transpose_b`` (tiles transposed in the kernel) gives, bit for bit, the output of
    the same call on ``W``'s transposed copy (``[E, Kw, Nw]``, scales transposed with it): what the dgrad
    used to need a second FP8 weight for. Non-finite scales reach the same outputs."""
    skip_many_tiles_when_interpreting(case)
    counts, nw, kw, extra = FP8_T_CASES[case]
    w, w_scale = make_weights(len(counts), nw, kw)
    w_scale[0, 1, 0] = float("inf")
    a, a_scale, offsets = make_rows(counts, nw, extra)
    w_t, w_t_scale = w.transpose(1, 2).contiguous(), w_scale.transpose(1, 2).contiguous()
    config = {"config": Sm90Config(128, 4, 8)} if launch is launch_grouped_gemm_fp8_blockwise_sm90 else {}
    for out_dtype in OUT_DTYPES:
        out = launch(a, a_scale, w, w_scale, offsets, out_dtype, transpose_b=True)
        expected = launch(a, a_scale, w_t, w_t_scale, offsets, out_dtype, **config)
        assert out.shape == (a.shape[0], kw)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
        assert not torch.isfinite(out.float()).all() and torch.isfinite(out.float()).any()


@pytest.mark.hopper
@pytest.mark.parametrize("config", mod.HP_B_CONFIGS, ids=str)
def test_every_fp8_transpose_b_config(config):
    """Each stage count of the transposing sm90 kernel that fits is bit-exact against the transposed copy."""
    counts, nw, kw, extra = FP8_T_CASES["many_tiles"]
    w, w_scale = make_weights(len(counts), nw, kw)
    a, a_scale, offsets = make_rows(counts, nw, extra)
    w_t, w_t_scale = w.transpose(1, 2).contiguous(), w_scale.transpose(1, 2).contiguous()
    for out_dtype in OUT_DTYPES:
        if mod.sm90_smem_bytes(config, out_dtype, torch.float8_e4m3fn, True) > SM90_SMEM_BYTES:
            continue
        out = launch_grouped_gemm_fp8_blockwise_sm90(
            a, a_scale, w, w_scale, offsets, out_dtype, None, True, config=config
        )
        expected = launch_grouped_gemm_fp8_blockwise_sm90(a, a_scale, w_t, w_t_scale, offsets, out_dtype, config=config)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_fp8_transpose_b_reference_and_op():
    """The op (CPU: its reference) with an FP8 ``W`` and ``transpose_b`` equals the reference on the
    transposed copy, bit for bit, and matches an independent dequantize-then-multiply oracle."""
    counts = [256, 0, 128]
    w, w_scale = make_weights(3, 256, 128)
    dy, dy_scale, offsets = make_rows(counts, 256)
    out = grouped_gemm_fp8_blockwise(dy, dy_scale, w, w_scale, offsets, torch.float32, transpose_b=True)
    if DEVICE == "cpu":  # the op is its reference here: bit for bit the reference on the transposed copy
        w_t, w_t_scale = w.transpose(1, 2).contiguous(), w_scale.transpose(1, 2).contiguous()
        ref = grouped_gemm_fp8_blockwise_reference(dy, dy_scale, w_t, w_t_scale, offsets, torch.float32)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dy32 = dy.float().cpu() * dy_scale.cpu().repeat_interleave(BLOCK, 1)
    w32 = w.float().cpu() * w_scale.cpu().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    expected = torch.cat([dy32[:256] @ w32[0], dy32[256:384] @ w32[2]])
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


def test_sm90_fp8_transpose_b_builds_for_hopper():
    """The transposing variant of the Gluon kernel compiles for sm_90a with this Triton (bf16 and fp32
    output), its shared memory within Hopper's."""
    built = build_every_sm90_config(
        "grouped_gemm_fp8_blockwise",
        "HP_B_CONFIGS",
        "build_sm90_kernel",
        extra="8, torch.float8_e4m3fn, True",
        smem_extra="torch.float8_e4m3fn, True",
    )
    assert built, "no config fits"
    # Spills: none with triton 3.6's ptxas (the GPU image's) at SM90_REGS_FP8_TRANSPOSED; newer ones spill a
    # few instructions there (3.9: 4-12), bounded here so that a register split that spills in the loop shows.
    most = 0 if triton.__version__.startswith("3.6.") else 16
    for config, out_dtype, shared, cubin_bytes, spills in built:
        assert shared <= SM90_SMEM_BYTES and cubin_bytes > 0, (config, out_dtype, shared)
        assert spills <= most, (config, out_dtype, spills)


def make_hp_weights(e: int, n: int, k: int, dtype: torch.dtype, device: str = DEVICE, edge: bool = False):
    """High-precision weights ``[E, N, K]``, magnitudes spread over 1e-2..1e2 by expert; ``edge`` puts a NaN,
    an inf, an all-zero 128x128 tile and a tile of values at E4M3 rounding ties into expert 0."""
    w = torch.randn(e, n, k) * torch.logspace(-2, 2, e)[:, None, None]
    if edge:
        w[0, 3, 5] = float("nan")
        w[0, 130, 7] = float("inf")
        w[0, :128, 128:256] = 0
        w[0, 128:256, 128:256] = 125.5 * torch.sign(w[0, 128:256, 128:256])  # ties at scale 1
    return w.to(device=device, dtype=dtype)


def quantized_operand(w: torch.Tensor, tail: torch.Tensor | None, transpose: bool):
    """What a high-precision ``b`` stands for: ``quantize_128x128``'s tiles of ``cat([w, tail], 1)`` (transposed)."""
    data, scale, data_t, scale_t = quantize_128x128_reference(w.cpu(), w_tail=None if tail is None else tail.cpu())
    return (data_t, scale_t) if transpose else (data, scale)


# (rows per expert, W rows (head, tail), W columns, rows past the last end)
HP_CASES = {
    "forward": ([128, 0, 200, 60], (256, 0), 384, 9),
    "with_tail": ([300, 5, 0, 70], (256, 128), 256, 0),
    "many_tiles": ([300, 0, 1000, 129, 640, 0, 17, 900, 2000, 128], (256, 256), 512, 200),
}


@pytest.mark.parametrize("case", list(HP_CASES))
@pytest.mark.parametrize("transpose_b", [False, True], ids=["W", "W^T"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_high_precision_b_is_quantize_128x128_then_fp8(case, transpose_b, w_dtype, launch):
    """A bf16/fp32 ``b`` (+ tail, transposed or not) quantized by the kernel gives, bit for bit, the output
    of the FP8 call on ``quantize_128x128``'s tiles of the same weight: same scales, same roundings, and
    non-finite weights reach the same outputs."""
    skip_many_tiles_when_interpreting(case)
    counts, (n_head, n_tail), kw, extra = HP_CASES[case]
    e = len(counts)
    w = make_hp_weights(e, n_head, kw, w_dtype, edge=True)
    tail = make_hp_weights(e, n_tail, kw, w_dtype) if n_tail else None
    k = n_head + n_tail if transpose_b else kw
    a, a_scale, offsets = make_rows(counts, k, extra)
    for out_dtype in OUT_DTYPES:
        out = launch(a, a_scale, w, None, offsets, out_dtype, b_tail=tail, transpose_b=transpose_b)
        b, b_scale = (t.to(DEVICE) for t in quantized_operand(w, tail, transpose_b))
        expected = launch(a, a_scale, b, b_scale, offsets, out_dtype)
        assert out.shape == expected.shape == (a.shape[0], kw if transpose_b else n_head + n_tail)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(out.float()).any() and torch.isfinite(out.float()).any()


@pytest.mark.hopper
@pytest.mark.parametrize("config", mod.HP_B_CONFIGS, ids=str)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transpose_b", [False, True], ids=["W", "W^T"])
def test_every_high_precision_b_config(config, w_dtype, transpose_b):
    """Each stage count of the quantizing sm90 kernel that fits is bit-exact against the FP8 path, on the
    many-tiles shape (the ring wraps around many times per program)."""
    counts, (n_head, n_tail), kw, extra = HP_CASES["many_tiles"]
    w = make_hp_weights(len(counts), n_head, kw, w_dtype)
    tail = make_hp_weights(len(counts), n_tail, kw, w_dtype)
    a, a_scale, offsets = make_rows(counts, n_head + n_tail if transpose_b else kw, extra)
    b, b_scale = (t.to(DEVICE) for t in quantized_operand(w, tail, transpose_b))
    for out_dtype in OUT_DTYPES:
        if mod.sm90_smem_bytes(config, out_dtype, w_dtype) > SM90_SMEM_BYTES:
            continue
        out = launch_grouped_gemm_fp8_blockwise_sm90(
            a, a_scale, w, None, offsets, out_dtype, tail, transpose_b, config=config
        )
        expected = launch_grouped_gemm_fp8_blockwise_sm90(a, a_scale, b, b_scale, offsets, out_dtype)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("transpose_b", [False, True], ids=["W", "W^T"])
def test_high_precision_b_reference_and_op(transpose_b):
    """The op (CPU: its reference) with a high-precision ``b`` equals the reference on the quantized tiles,
    and the Triton kernel matches it within the GEMM tolerance."""
    counts = [128, 0, 256]
    w = make_hp_weights(3, 256, 128, torch.bfloat16)
    tail = make_hp_weights(3, 128, 128, torch.bfloat16)
    a, a_scale, offsets = make_rows(counts, 384 if transpose_b else 128)
    out = grouped_gemm_fp8_blockwise(a, a_scale, w, None, offsets, torch.float32, b_tail=tail, transpose_b=transpose_b)
    b, b_scale = quantized_operand(w, tail, transpose_b)
    check(out, a, a_scale, b.to(DEVICE), b_scale.to(DEVICE), offsets, torch.float32)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("transpose_b", "keep_b"), [(False, False), (True, False), (False, True)], ids=["W", "W^T", "W kept"]
)
def test_sm90_high_precision_b_builds_for_hopper(w_dtype, transpose_b, keep_b):
    """The quantizing variant of the Gluon kernel compiles for sm_90a with this Triton (both weight dtypes,
    both orientations, the forward that keeps its tiles, bf16 and fp32 output), its shared memory within
    Hopper's."""
    built = build_every_sm90_config(
        "grouped_gemm_fp8_blockwise",
        "HP_B_CONFIGS",
        "build_sm90_kernel",
        extra=f"8, torch.{str(w_dtype).split('.')[1]}, {transpose_b}, {keep_b}",
        smem_extra=f"torch.{str(w_dtype).split('.')[1]}",
    )
    assert built, "no config fits"
    for config, out_dtype, shared, cubin_bytes, _ in built:
        assert shared <= SM90_SMEM_BYTES and cubin_bytes > 0, (config, out_dtype, shared)


def check_kept_tiles(kept, w: torch.Tensor, tail: torch.Tensor | None, counts: list[int]) -> None:
    """``kept = (data, scale)`` is ``quantize_128x128``'s output of ``cat([w, tail], 1)`` bit for bit (but a NaN's
    sign, as everywhere) on every expert with rows (the others are left unwritten)."""
    data, scale = quantized_operand(w, tail, transpose=False)
    rows = torch.tensor(counts) > 0
    assert kept[0].shape == data.shape and kept[1].shape == scale.shape
    assert_fp8_equal(kept[0].cpu()[rows], data[rows], "kept data")
    assert_scales_equal(kept[1].cpu()[rows], scale[rows], "kept scale_inv")


@pytest.mark.parametrize("case", list(HP_CASES))
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_keep_b_writes_the_tiles_a_dgrad_transposes(case, w_dtype, launch):
    """The forward that keeps its tiles gives the same output bits as the one that does not, writes
    ``quantize_128x128``'s tiles and scales for every expert with rows (empty groups, a group of 5 rows,
    non-finite weights), and a dgrad on those tiles with ``transpose_b`` equals the dgrad on ``W`` itself."""
    skip_many_tiles_when_interpreting(case)
    counts, (n_head, n_tail), kw, extra = HP_CASES[case]
    e = len(counts)
    w = make_hp_weights(e, n_head, kw, w_dtype, edge=True)
    tail = make_hp_weights(e, n_tail, kw, w_dtype) if n_tail else None
    a, a_scale, offsets = make_rows(counts, kw, extra)
    kept = mod._kept_b(w, tail)
    for out_dtype in OUT_DTYPES:
        out = launch(a, a_scale, w, None, offsets, out_dtype, tail, False, kept)
        expected = launch(a, a_scale, w, None, offsets, out_dtype, b_tail=tail)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
        check_kept_tiles(kept, w, tail, counts)
    g, g_scale, _ = make_rows(counts, n_head + n_tail, extra)
    dgrad = launch(g, g_scale, kept[0], kept[1], offsets, torch.bfloat16, transpose_b=True)
    expected = launch(g, g_scale, w, None, offsets, torch.bfloat16, b_tail=tail, transpose_b=True)
    torch.testing.assert_close(dgrad, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.hopper
@pytest.mark.parametrize("config", mod.HP_B_CONFIGS, ids=str)
def test_every_keep_b_config(config):
    """Each stage count of the quantizing sm90 kernel keeps the same tiles and output bits (the ring wraps
    around many times per program, and the kept tiles' stores are waited for before a slot is reused)."""
    counts, (n_head, n_tail), kw, extra = HP_CASES["many_tiles"]
    w = make_hp_weights(len(counts), n_head, kw, torch.bfloat16)
    tail = make_hp_weights(len(counts), n_tail, kw, torch.bfloat16)
    a, a_scale, offsets = make_rows(counts, kw, extra)
    kept = mod._kept_b(w, tail)
    out = launch_grouped_gemm_fp8_blockwise_sm90(
        a, a_scale, w, None, offsets, torch.bfloat16, tail, False, kept, config=config
    )
    expected = launch_grouped_gemm_fp8_blockwise_sm90(a, a_scale, w, None, offsets, torch.bfloat16, tail, config=config)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    check_kept_tiles(kept, w, tail, counts)


def test_keep_b_reference_op_and_compile():
    """``keep_b=True`` through the op (CPU: the reference) returns the output of the plain call and
    ``quantize_128x128``'s tiles; compiles with fullgraph; fake and schema pass opcheck."""
    counts = [128, 0, 256]
    w = make_hp_weights(3, 256, 256, torch.bfloat16)
    tail = make_hp_weights(3, 128, 256, torch.bfloat16)
    a, a_scale, offsets = make_rows(counts, 256)
    args = (a, a_scale, w, None, offsets, torch.bfloat16)
    out, data, scale = grouped_gemm_fp8_blockwise(*args, b_tail=tail, keep_b=True)
    torch.testing.assert_close(out, grouped_gemm_fp8_blockwise(*args, b_tail=tail), rtol=0, atol=0)
    check_kept_tiles((data, scale), w, tail, counts)
    compiled = torch.compile(grouped_gemm_fp8_blockwise, fullgraph=True)(*args, b_tail=tail, keep_b=True)
    torch.testing.assert_close(compiled[0], out, rtol=0, atol=0)
    check_kept_tiles(compiled[1:], w, tail, counts)
    # Every expert with rows: on the GPU an empty expert's tiles are left unwritten, which opcheck's
    # comparisons of whole outputs would read.
    a, a_scale, offsets = make_rows([128, 5, 256], 256)
    torch.library.opcheck(
        torch.ops.fp8flow.grouped_gemm_fp8_blockwise_keep_b.default,
        (a, a_scale, w, offsets, torch.bfloat16, tail),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_quantize_in_gemm_rule():
    """One M tile per expert on average: 128 rows per expert for 128-aligned groups, 64 for groups padded one
    by one (routed tokens); twice that for a forward whose tiles no dgrad reads; bf16 weights only."""
    bf16 = torch.bfloat16
    for forward_only, per_expert in ((False, 128), (True, 256)):
        assert mod.quantize_in_gemm_pays(per_expert * 8, 8, bf16, True, forward_only)
        assert not mod.quantize_in_gemm_pays(per_expert * 8 + 1, 8, bf16, True, forward_only)
        assert mod.quantize_in_gemm_pays(per_expert // 2 * 8, 8, bf16, False, forward_only)
        assert not mod.quantize_in_gemm_pays(per_expert // 2 * 8 + 1, 8, bf16, False, forward_only)
        assert not mod.quantize_in_gemm_pays(8, 8, torch.float32, True, forward_only)


def test_transpose_in_gemm_rule():
    """Two M tiles per expert on average: 256 rows per expert for 128-aligned groups, 128 for groups padded
    one by one; any weight dtype (the forward tiles are FP8 by then)."""
    assert mod.transpose_in_gemm_pays(256 * 8, 8, aligned=True)
    assert not mod.transpose_in_gemm_pays(256 * 8 + 1, 8, aligned=True)
    assert mod.transpose_in_gemm_pays(128 * 8, 8, aligned=False)
    assert not mod.transpose_in_gemm_pays(128 * 8 + 1, 8, aligned=False)


def test_sm90_default_config_for_high_precision_b():
    for w_dtype in (torch.bfloat16, torch.float32):
        for out_dtype in OUT_DTYPES:
            config = mod.sm90_default_config(7168, w_dtype, out_dtype)
            assert config.block_n == 128 and mod.sm90_smem_bytes(config, out_dtype, w_dtype) <= SM90_SMEM_BYTES
    # bf16 weights and output: the E4M3 tile written over its staging slot leaves room for 4 stages
    assert mod.sm90_default_config(7168, torch.bfloat16).stages == 4


def test_sm90_kernel_builds_for_hopper():
    """On any machine: the Gluon kernel compiles to sm_90a cubins with this Triton, every config, both
    output dtypes -- API drift between Triton releases shows up in the CPU suite, not first on a GPU."""
    built = build_every_sm90_config("grouped_gemm_fp8_blockwise", "SM90_CONFIGS", "build_sm90_kernel")
    fitting = [c for c in mod.SM90_CONFIGS for d in OUT_DTYPES if mod.sm90_smem_bytes(c, d) <= SM90_SMEM_BYTES]
    assert len(built) == len(fitting) >= len(mod.SM90_CONFIGS)
    for config, out_dtype, shared, cubin_bytes, spills in built:
        assert shared <= SM90_SMEM_BYTES and cubin_bytes > 0, (config, out_dtype, shared)
        # ptxas keeps every config in registers (a 128x256 tile's second partial takes the first's:
        # it spilled a value a reduction block before)
        assert spills == 0, (config, out_dtype, spills)


@pytest.mark.parametrize(
    ("n", "config", "match"),
    [
        (128, Sm90Config(stages=7), "shared memory"),
        (384, Sm90Config(256, 3), "divide the output width"),
        (256, Sm90Config(64), "128"),
        (256, Sm90Config(128, out_buffers=2), "out_buffers"),
        (256, Sm90Config(256, out_buffers=3), "out_buffers"),
    ],
)
def test_sm90_refuses_bad_configs(n, config, match):
    a, a_scale, offsets = make_rows([128], 128)
    b, b_scale = make_weights(1, n, 128)
    with pytest.raises(ValueError, match=match):
        launch_grouped_gemm_fp8_blockwise_sm90(a, a_scale, b, b_scale, offsets, torch.float32, config=config)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_sm90_default_config_fits_and_prefers_wide_tiles(out_dtype):
    for n in (128, 384, 256, 7168):
        config = mod.sm90_default_config(n, out_dtype=out_dtype)
        assert n % config.block_n == 0 and mod.sm90_smem_bytes(config, out_dtype) <= SM90_SMEM_BYTES
        assert config.block_n == (256 if n % 256 == 0 else 128) and config in mod.SM90_CONFIGS
        # a staging buffer per half of a 128x256 tile where it fits (bf16 out)
        assert config.out_buffers == (2 if config.block_n == 256 and out_dtype == torch.bfloat16 else 1)


@pytest.mark.skipif(conftest.IS_HOPPER, reason="checks the refusal off Hopper")
def test_sm90_refuses_other_devices():
    a, a_scale, offsets = make_rows([128], 128)
    b, b_scale = make_weights(1, 128, 128)
    with pytest.raises(RuntimeError, match="need a Hopper GPU"):
        launch_grouped_gemm_fp8_blockwise_sm90(a, a_scale, b, b_scale, offsets)


def test_autotune_keys_are_kernel_arguments():
    tuned = mod._grouped_gemm_fp8_blockwise_tuned
    assert list(tuned.keys) == AUTOTUNE_KEY and "M" not in tuned.keys
    assert set(tuned.keys) <= set(tuned.fn.arg_names)


def test_cuda_kernel_picks_the_launcher_by_device():
    """The op's CUDA kernel is the sm90 launcher on Hopper and the Triton one elsewhere (here: the
    interpreter on the CPU), bit for bit."""
    a, a_scale, offsets = make_rows([128, 0, 256], 256)
    b, b_scale = make_weights(3, 128, 256)
    args = (a, a_scale, b, b_scale, offsets, torch.float32)
    expected = LAUNCHERS["sm90" if conftest.IS_HOPPER else "triton"](*args)
    assert torch.equal(mod.launch_grouped_gemm_fp8_blockwise(*args), expected)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_op_dispatch_and_compile(out_dtype):
    a, a_scale, offsets = make_rows([128, 0, 256], 256)
    b, b_scale = make_weights(3, 128, 256)
    eager = grouped_gemm_fp8_blockwise(a, a_scale, b, b_scale, offsets, out_dtype)
    compiled = torch.compile(grouped_gemm_fp8_blockwise, fullgraph=True)(a, a_scale, b, b_scale, offsets, out_dtype)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    check(eager, a, a_scale, b, b_scale, offsets, out_dtype)


def test_opcheck():
    a, a_scale, offsets = make_rows([128, 128], 128)
    b, b_scale = make_weights(2, 128, 128)
    args = (a, a_scale, b, b_scale, offsets, torch.bfloat16)
    before = [t.clone() for t in args[:5]]
    # test_schema is left out: its mutation check calls torch.allclose, which has no fp8 kernel
    # ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); the check below replaces it.
    torch.library.opcheck(
        torch.ops.fp8flow.grouped_gemm_fp8_blockwise.default,
        args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    for t, t0 in zip(args[:5], before, strict=True):
        assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8)), "inputs must not be mutated"


def _good():
    a = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    return {
        "a": a,
        "a_scale": torch.ones(256, 2),
        "b": torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn),
        "b_scale": torch.ones(2, 1, 2),
        "group_end_offsets": torch.tensor([128, 256], dtype=torch.int32),
    }


BAD = [
    ({"a": torch.zeros(256, 256)}, TypeError, "a must have dtype"),
    ({"a": torch.zeros(256, 2, 128, dtype=torch.float8_e4m3fn)}, ValueError, "a must have 2 dims"),
    ({"a_scale": torch.ones(256, 2, dtype=torch.float64)}, TypeError, "a_scale must have dtype"),
    ({"b": torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)}, ValueError, "the B operand must have K = 256"),
    ({"b": torch.zeros(2, 100, 256, dtype=torch.float8_e4m3fn)}, ValueError, "b dim 1"),
    ({"a": torch.zeros(256, 200, dtype=torch.float8_e4m3fn)}, ValueError, "a K"),
    ({"a": torch.zeros(256, 256, dtype=torch.float8_e4m3fn).t()}, ValueError, "a must be row-major"),
    ({"b": torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn).mT}, ValueError, "b must be contiguous"),
    ({"a_scale": torch.ones(2, 256).t()}, ValueError, "a_scale must be row-major"),
    ({"a_scale": torch.ones(256, 1)}, ValueError, "a_scale must have shape"),
    ({"b_scale": torch.ones(2, 2, 1)}, ValueError, "b_scale must have shape"),
    ({"group_end_offsets": torch.tensor([128, 256])}, TypeError, "group_end_offsets must have dtype"),
    ({"group_end_offsets": torch.tensor([256], dtype=torch.int32)}, ValueError, "one end per expert"),
]


@pytest.mark.parametrize(("override", "error", "match"), BAD, ids=[m for _, _, m in BAD])
def test_bad_input(override, error, match):
    args = {**_good(), **override}
    with pytest.raises(error, match=match):
        grouped_gemm_fp8_blockwise(**args)


HP_BAD = [
    ({"b": torch.zeros(2, 128, 256), "b_scale": torch.ones(2, 1, 2)}, ValueError, "b_scale must be None"),
    ({"b_tail": torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)}, ValueError, "high-precision b only"),
    ({"transpose_b": True}, ValueError, "the B operand must have K"),  # FP8 W^T: K = W's dim 1 = 128
    ({"b": torch.zeros(2, 128, 256), "b_scale": None, "transpose_b": 1}, TypeError, "transpose_b must be a bool"),
    (
        {"b": torch.zeros(2, 128, 256), "b_scale": None, "b_tail": torch.zeros(2, 128, 128)},
        ValueError,
        "b_tail must be",
    ),
    ({"b": torch.zeros(2, 128, 256), "b_scale": None, "b_tail": torch.zeros(2, 100, 256)}, ValueError, "b_tail dim 1"),
    (
        {"b": torch.zeros(2, 128, 256), "b_scale": None, "b_tail": torch.zeros(2, 128, 256, dtype=torch.bfloat16)},
        TypeError,
        "b_tail must have dtype",
    ),
    ({"b": torch.zeros(2, 128, 256, dtype=torch.float16), "b_scale": None}, TypeError, "b must have dtype"),
    ({"b": torch.zeros(2, 128, 256), "b_scale": None, "transpose_b": True}, ValueError, "the B operand must have K"),
    ({"b": torch.zeros(2, 128, 256).mT.contiguous().mT, "b_scale": None}, ValueError, "b must be contiguous"),
    ({"keep_b": True}, ValueError, "keep_b needs a high-precision b"),
    ({"b": torch.zeros(2, 256, 128), "b_scale": None, "transpose_b": True, "keep_b": True}, ValueError, "keep_b needs"),
    ({"b": torch.zeros(2, 128, 256), "b_scale": None, "keep_b": 1}, TypeError, "keep_b must be a bool"),
]


@pytest.mark.parametrize(("override", "error", "match"), HP_BAD, ids=[m for _, _, m in HP_BAD])
def test_bad_high_precision_b(override, error, match):
    args = {**_good(), **override}
    with pytest.raises(error, match=match):
        grouped_gemm_fp8_blockwise(**args)


def test_high_precision_b_dispatch_compile_and_opcheck():
    a, a_scale, offsets = make_rows([128, 0, 256], 384)
    w = make_hp_weights(3, 256, 256, torch.bfloat16)
    tail = make_hp_weights(3, 128, 256, torch.bfloat16)
    args = (a, a_scale, w, None, offsets, torch.bfloat16)
    kwargs = {"b_tail": tail, "transpose_b": True}
    eager = grouped_gemm_fp8_blockwise(*args, **kwargs)
    compiled = torch.compile(grouped_gemm_fp8_blockwise, fullgraph=True)(*args, **kwargs)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.library.opcheck(
        torch.ops.fp8flow.grouped_gemm_fp8_blockwise.default,
        (*args, tail, True),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_bad_out_dtype():
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_gemm_fp8_blockwise(**_good(), out_dtype=torch.float16)


@pytest.mark.parametrize(
    ("ends", "match"),
    [([256, 128], "non-decreasing"), ([100, 256], "multiples of 128"), ([128, 384], "past the end")],
)
def test_opt_in_validation_of_offsets(monkeypatch, ends, match):
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    args = {**_good(), "group_end_offsets": torch.tensor(ends, dtype=torch.int32)}
    with pytest.raises(ValueError, match=match):
        grouped_gemm_fp8_blockwise(**args)
