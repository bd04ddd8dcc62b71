"""grouped_gemm_fp8_wgrad: both kernels -- Triton (GPU, or the CPU interpreter) and the Gluon sm90
kernel (Hopper; on the CPU it is built for sm_90a, not run) -- against the fp32 reference, group
edge cases, op registration, compile and bad input."""

from __future__ import annotations

import itertools

import conftest
import pytest
import torch
from conftest import DEVICE
from fp8_helpers import GEMM_TOLERANCE as TOLERANCE
from fp8_helpers import (
    RANDOM_GROUPING_SEEDS,
    build_every_sm90_config,
    capture_cuda_graph,
    padded_ends,
    param_id,
    random_grouping,
    rel_error,
)

from fp8flow_ao._format import BLOCK, FP8_DTYPE, quantize_rows_reference
from fp8flow_ao.kernels import grouped_gemm_fp8_wgrad as mod
from fp8flow_ao.kernels._grouped_gemm_common import AUTOTUNE_KEY
from fp8flow_ao.kernels._sm90_common import SM90_SMEM_BYTES, Sm90Config
from fp8flow_ao.kernels.grouped_gemm_fp8_wgrad import (
    OUT_DTYPES,
    grouped_gemm_fp8_wgrad,
    grouped_gemm_fp8_wgrad_reference,
    launch_grouped_gemm_fp8_wgrad_sm90,
    launch_grouped_gemm_fp8_wgrad_triton,
)
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose_reference

LAUNCHERS = {"triton": launch_grouped_gemm_fp8_wgrad_triton, "sm90": launch_grouped_gemm_fp8_wgrad_sm90}


@pytest.fixture(params=["triton", pytest.param("sm90", marks=pytest.mark.hopper)])
def launch(request: pytest.FixtureRequest):
    """Each kernel's launcher; the sm90 one only where it runs (a Hopper GPU)."""
    return LAUNCHERS[request.param]


def column_wise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, C] -> column-wise FP8: data [C, M] (tokens contiguous), scales [ceil(M/128), C]."""
    data, scale = quantize_rows_reference(x.T.contiguous(), BLOCK)
    return data, scale.T.contiguous()


def make_operands(counts: list[int], n: int, k: int, extra_rows: int = 0, device: str = DEVICE):
    """Column-wise dY^T [N, M] and X^T [K, M] for padded groups; pad rows are 0, and rows past the
    last end are NaN (never read: they would poison the output if they were)."""
    ends = padded_ends(counts)
    m = ends[-1] + extra_rows
    spread = torch.logspace(-3, 3, max(m, 1))[torch.randperm(max(m, 1))][:m, None]
    dy, x = torch.randn(m, n) * spread, torch.randn(m, k)
    real = torch.zeros(m, dtype=torch.bool)
    start = 0
    for c, end in zip(counts, ends, strict=True):
        real[start : start + c] = True
        start = end
    dy[~real], x[~real] = 0, 0
    a_t, a_t_scale = column_wise(dy)
    b_t, b_t_scale = column_wise(x)
    for data, scale in ((a_t, a_t_scale), (b_t, b_t_scale)):
        data[:, ends[-1] :] = float("nan")
        scale[ends[-1] // BLOCK :] = float("nan")
    offsets = torch.tensor(ends, dtype=torch.int32)
    return [t.to(device) for t in (a_t, a_t_scale, b_t, b_t_scale, offsets)]


def check(out, a_t, a_t_scale, b_t, b_t_scale, offsets, out_dtype, counts):
    ref = grouped_gemm_fp8_wgrad_reference(*(t.cpu() for t in (a_t, a_t_scale, b_t, b_t_scale, offsets)))
    assert out.shape == ref.shape and out.dtype == out_dtype
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[out_dtype], rel_error(out, ref)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(out[e].cpu(), torch.zeros_like(out[e].cpu())), f"empty expert {e} must be 0"


# (rows per expert, N, K, rows past the last end)
CASES = {
    "balanced": ([128, 128, 128], 256, 256, 0),
    "empty_experts": ([0, 200, 0, 60], 128, 256, 0),
    "one_expert_all_rows": ([0, 384, 0], 256, 128, 0),
    "groups_of_128": ([128, 128, 128, 128], 128, 128, 0),
    "n_k_128": ([100, 156], 128, 128, 0),
    "skewed": ([300, 5, 0, 70], 256, 256, 0),
    "rows_past_last_end": ([130, 90], 128, 256, 80),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_matches_reference(case, out_dtype, launch):
    counts, n, k, extra = CASES[case]
    args = make_operands(counts, n, k, extra)
    out = launch(*args, out_dtype)
    check(out, *args, out_dtype, counts)


@pytest.mark.parametrize("seed", RANDOM_GROUPING_SEEDS)
def test_random_groupings_match_reference(seed, launch):
    """Groupings and widths no case above names, checked row by row (:func:`fp8_helpers.rel_error`)."""
    counts, n, k, extra = random_grouping(seed)
    args = make_operands(counts, n, k, extra - extra % 16)  # the column-wise operands' rows: 16-byte aligned
    out = launch(*args, torch.float32)
    check(out, *args, torch.float32, counts)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_into_adds_a_fresh_wgrad_in_fp32(out_dtype, launch):
    """The epilogue's accumulation: the existing gradient plus the same kernel's fresh fp32 wgrad,
    summed in fp32 and rounded once, bit for bit (same tiles, same reduction order); empty experts
    keep the existing values exactly. Updated in place, and returned."""
    counts = [300, 0, 129, 60]
    args = make_operands(counts, 256, 256, extra_rows=16)
    fresh = launch(*args, torch.float32)
    existing = torch.randn(len(counts), 256, 256, device=DEVICE).to(out_dtype)
    into = existing.clone()
    out = launch(*args, out_dtype, accumulate_into=into)
    assert out is into
    assert torch.equal(into, (existing.float() + fresh).to(out_dtype))
    assert torch.equal(into[1], existing[1])
    ref = grouped_gemm_fp8_wgrad_reference(*(t.cpu() for t in args), out_dtype, existing.cpu())
    assert rel_error(into, ref) < TOLERANCE[out_dtype]


@pytest.mark.hopper
@pytest.mark.parametrize("config", mod.SM90_WGRAD_CONFIGS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_sm90_accumulate_is_exact_on_a_large_grid(config, out_dtype):
    """Accumulating over thousands of tiles, many per program, three times: each run equals the
    existing gradient plus a fresh fp32 wgrad bit for bit. (When the epilogue read the stored tile by
    per-thread loads, some runs at such sizes returned wrong sums: on an H200 up to a few in 10^4
    elements of fp32 gradients, every config. It now reads it by TMA.)"""
    if mod.sm90_smem_bytes(config, out_dtype) > SM90_SMEM_BYTES:
        pytest.skip(f"{config} does not fit with {out_dtype} out")
    counts = [128] * 96 + [256] * 16
    args = make_operands(counts, 1024, 1024)
    # Every config sums each element's token blocks in the same order: any one that fits fp32 out will do.
    fp32_fits = mod.sm90_smem_bytes(config, torch.float32) <= SM90_SMEM_BYTES
    fresh = launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.float32, config if fp32_fits else Sm90Config(128, 4, 16))
    existing = torch.randn(len(counts), 1024, 1024, device=DEVICE).to(out_dtype)
    expected = (existing.float() + fresh).to(out_dtype)
    for _ in range(3):
        into = existing.clone()
        launch_grouped_gemm_fp8_wgrad_sm90(*args, out_dtype, config, accumulate_into=into)
        mismatches = int((into != expected).sum())
        assert mismatches == 0, f"{mismatches} of {into.numel()} elements differ"


@pytest.mark.hopper
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_sm90_tiles_from_the_counter_under_heavy_skew(accumulate):
    """The sm90 kernel's programs take their tiles from the stream's counter: with far more tiles than
    programs and tiles of very different lengths (one expert 32x another's token blocks, empty experts
    first, between and last), every tile is computed once -- the result matches the reference, empty
    experts stay untouched -- and launches back to back (the counter left at zero by each) give the same
    bits."""
    counts = [0, 4096, 128, 0, 1280, 200, 128, 0, 640, 0]
    args = make_operands(counts, 2048, 1024)
    existing = torch.randn(len(counts), 2048, 1024, device=DEVICE).to(torch.bfloat16)
    runs = []
    for _ in range(3):
        into = existing.clone() if accumulate else None
        runs.append(
            launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.bfloat16, accumulate_into=into, b_tile_scales=False)
        )
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    if accumulate:
        fresh = launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.float32, Sm90Config(128, 4, 16))
        assert torch.equal(runs[0], (existing.float() + fresh).to(torch.bfloat16))
    else:
        check(runs[0], *args, torch.bfloat16, counts)


@pytest.mark.hopper
def test_sm90_stream_counter_is_left_at_zero_and_graphs_take_their_own():
    """The tile counter is one tensor per stream, kept across launches: every launch (of any size, with
    fewer or more tiles than SMs) leaves it at zero, another stream gets its own, and a launch captured
    in a CUDA graph uses a fresh one, so replays match an eager launch bit for bit."""
    from fp8flow_ao.kernels._launch import stream_tile_counter

    device = torch.device(DEVICE)
    counter = stream_tile_counter(device)
    skewed = ([0, 4096, 128, 0, 1280], 1024, 1024)  # 160 tiles of 128x256: more than an H100/H200 has SMs
    for counts, n, k in (([256], 256, 256), skewed, ([256, 0, 128], 512, 512)):
        args = make_operands(counts, n, k)
        out = launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.bfloat16)
        assert stream_tile_counter(device) is counter
        assert int(counter.item()) == 0
        check(out, *args, torch.bfloat16, counts)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert stream_tile_counter(device) is not counter
    args = make_operands(*skewed)
    eager = launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.bfloat16)
    graph, captured = capture_cuda_graph(lambda: launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.bfloat16))
    for _ in range(2):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    assert int(counter.item()) == 0


@pytest.mark.parametrize(("n", "n_chunks"), [(256, 2), (384, 3)])
def test_n_chunks_stores_each_chunk_of_every_expert_contiguously(launch, n, n_chunks):
    """``n_chunks``: the same tiles, the same bits, only the rows' places change:
    ``out[c, e] == unchunked[e, c * N/n_chunks : (c + 1) * N/n_chunks]``; empty experts stay zero."""
    counts = [300, 0, 129, 60]
    args = make_operands(counts, n, 256, extra_rows=16)
    whole = launch(*args, torch.bfloat16)
    out = launch(*args, torch.bfloat16, n_chunks=n_chunks)
    assert out.shape == (n_chunks, len(counts), n // n_chunks, 256) and out.is_contiguous()
    assert torch.equal(out, whole.view(len(counts), n_chunks, n // n_chunks, 256).transpose(0, 1))
    ref = grouped_gemm_fp8_wgrad_reference(*(t.cpu() for t in args), torch.bfloat16, n_chunks=n_chunks)
    assert torch.equal(
        ref,
        grouped_gemm_fp8_wgrad_reference(*(t.cpu() for t in args), torch.bfloat16)
        .view(len(counts), n_chunks, n // n_chunks, 256)
        .transpose(0, 1),
    )
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]
    chunks = grouped_gemm_fp8_wgrad(*args, torch.bfloat16, n_chunks=n_chunks).unbind(0)
    assert all(c.is_contiguous() for c in chunks)  # e.g. w1's and w3's gradients, each its own weight


def test_accumulate_zero_rows_leaves_the_gradient():
    a_t = torch.empty(128, 0, dtype=FP8_DTYPE, device=DEVICE)
    b_t = torch.empty(256, 0, dtype=FP8_DTYPE, device=DEVICE)
    scales = torch.empty(0, 128, device=DEVICE), torch.empty(0, 256, device=DEVICE)
    existing = torch.randn(2, 128, 256, device=DEVICE)
    into = existing.clone()
    offsets = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    assert grouped_gemm_fp8_wgrad(a_t, scales[0], b_t, scales[1], offsets, accumulate_into=into) is into
    assert torch.equal(into, existing)


def test_reference_is_dy_transpose_x():
    """The oracle itself against an independent formulation: per expert, dY_e^T @ X_e in fp32."""
    counts = [128, 0, 256]
    a_t, a_t_scale, b_t, b_t_scale, offsets = (t.cpu() for t in make_operands(counts, 128, 256, device="cpu"))
    dy = (a_t.float() * a_t_scale.T.repeat_interleave(BLOCK, 1)).T  # [M, N]
    x = (b_t.float() * b_t_scale.T.repeat_interleave(BLOCK, 1)).T  # [M, K]
    ref = grouped_gemm_fp8_wgrad_reference(a_t, a_t_scale, b_t, b_t_scale, offsets)
    assert rel_error(ref[0], dy[:128].T @ x[:128]) < 1e-6  # summation order differs: rounding only
    assert rel_error(ref[2], dy[128:384].T @ x[128:384]) < 1e-6
    assert torch.equal(ref[1], torch.zeros(128, 256))


def test_non_finite_scales_give_non_finite_output(launch):
    a_t, a_t_scale, b_t, b_t_scale, offsets = make_operands([128, 128], 128, 128)
    a_t_scale[1, 5] = float("nan")  # expert 1, column n = 5
    b_t_scale[0, 9] = float("inf")  # expert 0, column k = 9
    out = launch(a_t, a_t_scale, b_t, b_t_scale, offsets).cpu()
    assert torch.isnan(out[1, 5]).all() and not torch.isfinite(out[0, :, 9]).any()
    assert int((~torch.isfinite(out)).sum()) == 128 + 128


def tile_scaled_operands(counts: list[int], n: int, k: int, extra_rows: int = 0):
    """:func:`make_operands` with ``b_t`` as the MoE layer makes it: X quantized row-wise (1x128), then
    re-encoded column-wise by ``scaling_aware_transpose`` (one scale per 128x128 tile, repeated over its
    columns). ``extra_rows``: a multiple of 128, as the transpose needs."""
    a_t, a_t_scale, _, _, offsets = make_operands(counts, n, k, extra_rows, device="cpu")
    m = a_t.shape[1]
    x = torch.randn(m, k) * torch.logspace(-2, 2, k)[torch.randperm(k)]  # tiles of unlike column scales
    x_data, x_scale = quantize_rows_reference(x, BLOCK)
    b_t, b_t_scale = scaling_aware_transpose_reference(x_data, x_scale, offsets)
    assert torch.equal(b_t_scale, b_t_scale[:, ::BLOCK].repeat_interleave(BLOCK, dim=1))
    return [t.to(DEVICE) for t in (a_t, a_t_scale, b_t, b_t_scale, offsets)]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_b_tile_scales_is_bit_identical_on_transposed_operands(out_dtype, launch):
    """Where ``b_t_scale`` repeats one scale per tile (``scaling_aware_transpose``'s output), reading one
    per tile changes no bit (power-of-two scales: the products are exact), writing, in chunks or adding
    into a gradient; and the reference with the flag equals it without."""
    counts = [300, 0, 129, 640, 0]
    args = tile_scaled_operands(counts, 256, 384, extra_rows=128)
    plain = launch(*args, out_dtype)
    assert torch.equal(launch(*args, out_dtype, b_tile_scales=True), plain)
    check(plain, *args, out_dtype, counts)
    chunked = launch(*args, out_dtype, n_chunks=2, b_tile_scales=True)
    assert torch.equal(chunked, launch(*args, out_dtype, n_chunks=2))
    existing = torch.randn(len(counts), 256, 384, device=DEVICE).to(out_dtype)
    into, into_tiles = existing.clone(), existing.clone()
    launch(*args, out_dtype, accumulate_into=into)
    launch(*args, out_dtype, accumulate_into=into_tiles, b_tile_scales=True)
    assert torch.equal(into_tiles, into)
    cpu = [t.cpu() for t in args]
    assert torch.equal(
        grouped_gemm_fp8_wgrad_reference(*cpu, b_tile_scales=True), grouped_gemm_fp8_wgrad_reference(*cpu)
    )


def test_b_tile_scales_takes_each_blocks_first_column(launch):
    """The flag's contract where the scales do not repeat: every column of a block is promoted by the
    block's first scale (the kernels and the reference agree), which is not the per-column result."""
    counts = [256, 0, 300]
    args = make_operands(counts, 128, 256)
    out = launch(*args, torch.float32, b_tile_scales=True)
    cpu = [t.cpu() for t in args]
    expected = grouped_gemm_fp8_wgrad_reference(*cpu, b_tile_scales=True)
    assert rel_error(out, expected) < TOLERANCE[torch.float32]
    assert rel_error(out, grouped_gemm_fp8_wgrad_reference(*cpu)) > 0.1


@pytest.mark.hopper
@pytest.mark.parametrize("config", mod.SM90_WGRAD_CONFIGS, ids=str)
def test_sm90_b_tile_scales_every_config(config):
    """Every sm90 config with per-tile B scales, bit for bit its per-column form, on many tiles per program."""
    counts = [300, 0, 1000, 129, 640, 0, 17, 900, 4100, 0, 2000, 128]
    args = tile_scaled_operands(counts, 384, 512, extra_rows=128)
    out = launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.bfloat16, config, b_tile_scales=True)
    assert torch.equal(out, launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.bfloat16, config))
    check(out, *args, torch.bfloat16, counts)


EVERY_CONFIG = [pytest.param(launch_grouped_gemm_fp8_wgrad_triton, c, marks=pytest.mark.gpu) for c in mod.WGRAD_CONFIGS]
EVERY_CONFIG += [
    pytest.param(launch_grouped_gemm_fp8_wgrad_sm90, c, marks=pytest.mark.hopper) for c in mod.SM90_WGRAD_CONFIGS
]


@pytest.mark.parametrize(("launcher", "config"), EVERY_CONFIG, ids=param_id)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_every_config(launcher, config, out_dtype):
    """Each launch config is correct (the autotuner, or a sweep, may pick any), on a shape with many
    tiles per program (so the persistent loop and the TMA ring wrap around)."""
    counts = [300, 0, 1000, 129, 640, 0, 17, 900, 4100, 0, 2000, 128]
    args = make_operands(counts, 384, 512, extra_rows=48)
    if isinstance(config, Sm90Config) and mod.sm90_smem_bytes(config, out_dtype) > SM90_SMEM_BYTES:
        pytest.skip(f"{config} does not fit with {out_dtype} out")
    out = launcher(*args, out_dtype, config=config)
    check(out, *args, out_dtype, counts)


@pytest.mark.parametrize(
    ("accumulate", "b_tile_scales"), [(False, False), (True, False), (False, True), (True, True)],
    ids=["write", "accumulate", "write-tile-scales", "accumulate-tile-scales"],
)  # fmt: skip
def test_sm90_kernel_builds_for_hopper(accumulate, b_tile_scales):
    """On any machine: the Gluon kernel compiles to sm_90a cubins with this Triton, every config, both
    output dtypes, writing or accumulating, per-column or per-tile B scales (API drift between Triton
    releases shows up here, not first on a GPU)."""
    built = build_every_sm90_config(
        "grouped_gemm_fp8_wgrad",
        "SM90_WGRAD_CONFIGS",
        "build_sm90_wgrad_kernel",
        f"accumulate={accumulate}, b_tile_scales={b_tile_scales}",
    )
    fitting = [c for c in mod.SM90_WGRAD_CONFIGS for d in OUT_DTYPES if mod.sm90_smem_bytes(c, d) <= SM90_SMEM_BYTES]
    assert len(built) == len(fitting) >= len(mod.SM90_WGRAD_CONFIGS)
    for config, out_dtype, shared, cubin_bytes, spills in built:
        assert shared <= SM90_SMEM_BYTES and cubin_bytes > 0, (config, out_dtype, shared)
        # No ptxas spill in any config the op picks: every one with per-tile B scales, 128x128 with
        # per-column ones (their 128x256 form spills: sm90_wgrad_default_config leaves it out).
        if b_tile_scales or "block_n=128" in config:
            assert spills == 0, (config, out_dtype, spills)


@pytest.mark.parametrize(
    ("k", "config", "match"),
    [
        (256, Sm90Config(128, 6), "shared memory"),
        (384, Sm90Config(256, 2), "divide the output width"),
        (256, Sm90Config(128, 2, out_buffers=2), "or 2 with block_n=256"),
    ],
)
def test_sm90_refuses_bad_configs(k, config, match):
    args = make_operands([128], 128, k)
    with pytest.raises(ValueError, match=match):
        launch_grouped_gemm_fp8_wgrad_sm90(*args, torch.float32, config)


def test_sm90_default_config_fits_and_prefers_wide_tiles():
    for k in (128, 384, 256, 7168):
        wide = k % 256 == 0
        for out_dtype, accumulate in itertools.product(OUT_DTYPES, (False, True)):
            config = mod.sm90_wgrad_default_config(k, accumulate, True, out_dtype)
            assert k % config.block_n == 0 and config in mod.SM90_WGRAD_CONFIGS
            assert mod.sm90_smem_bytes(config, out_dtype) <= SM90_SMEM_BYTES
            # bf16 at 128x256: a staging buffer per half (writing or accumulating); fp32 leaves no room for
            # the second, and then an accumulating tile takes one 128-wide half per consumer, whose stored
            # values load under the reduction.
            two = wide and out_dtype == torch.bfloat16
            assert config.block_n == (256 if two or (wide and not accumulate) else 128)
            assert config.out_buffers == (2 if two else 1)
            # Per-column B scales: 128x128 (at 128x256 their scale vectors make ptxas spill).
            assert mod.sm90_wgrad_default_config(k, accumulate, False, out_dtype) == Sm90Config(128, 4, 16)


@pytest.mark.skipif(conftest.IS_HOPPER, reason="checks the refusal off Hopper")
def test_sm90_refuses_other_devices():
    with pytest.raises(RuntimeError, match="need a Hopper GPU"):
        launch_grouped_gemm_fp8_wgrad_sm90(*make_operands([128], 128, 128))


def test_zero_rows():
    a_t = torch.empty(128, 0, dtype=FP8_DTYPE, device=DEVICE)
    b_t = torch.empty(256, 0, dtype=FP8_DTYPE, device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    out = grouped_gemm_fp8_wgrad(
        a_t, torch.empty(0, 128, device=DEVICE), b_t, torch.empty(0, 256, device=DEVICE), offsets
    )
    assert out.shape == (3, 128, 256) and not out.any()


def test_autotune_keys_are_kernel_arguments():
    tuned = mod._grouped_gemm_fp8_wgrad_tuned
    assert list(tuned.keys) == AUTOTUNE_KEY and "M" not in tuned.keys
    assert set(tuned.keys) <= set(tuned.fn.arg_names)


def test_cuda_kernel_picks_the_launcher_by_device():
    """The op's CUDA kernel is the sm90 launcher on Hopper and the Triton one elsewhere (here: the
    interpreter on the CPU), bit for bit."""
    args = (*make_operands([128, 0, 256], 128, 256), torch.float32)
    expected = LAUNCHERS["sm90" if conftest.IS_HOPPER else "triton"](*args)
    assert torch.equal(mod.launch_grouped_gemm_fp8_wgrad(*args), expected)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_op_dispatch_and_compile(out_dtype):
    counts = [128, 0, 256]
    args = make_operands(counts, 128, 256)
    eager = grouped_gemm_fp8_wgrad(*args, out_dtype)
    compiled = torch.compile(grouped_gemm_fp8_wgrad, fullgraph=True)(*args, out_dtype)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    check(eager, *args, out_dtype, counts)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_op_dispatch_and_compile(out_dtype):
    """The mutating op through the public function, eager and compiled (functionalized: the graph
    writes the sum back into the input), both equal to the reference's sum."""
    args = make_operands([128, 0, 256], 128, 256)
    existing = torch.randn(3, 128, 256, device=DEVICE).to(out_dtype)
    eager, compiled = existing.clone(), existing.clone()
    grouped_gemm_fp8_wgrad(*args, accumulate_into=eager)

    def accumulate(*a):
        grouped_gemm_fp8_wgrad(*a, accumulate_into=compiled)

    torch.compile(accumulate, fullgraph=True)(*args)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    ref = grouped_gemm_fp8_wgrad_reference(*(t.cpu() for t in args), out_dtype, existing.cpu())
    assert rel_error(eager, ref) < TOLERANCE[out_dtype]


@pytest.mark.parametrize("b_tile_scales", [False, True])
def test_opcheck(b_tile_scales):
    args = make_operands([128, 128], 128, 128)
    before = [t.clone() for t in args]
    # test_schema is left out: its mutation check calls torch.allclose, which has no fp8 kernel
    # ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); the check below replaces it.
    torch.library.opcheck(
        torch.ops.fp8flow.grouped_gemm_fp8_wgrad.default,
        (*args, torch.float32, 1, b_tile_scales),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    for t, t0 in zip(args, before, strict=True):
        assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8)), "inputs must not be mutated"


def test_accumulate_opcheck():
    """Fake tensor and AOT dispatch of the mutating op; the schema check by hand: only
    ``accumulate_into`` changes."""
    op = torch.ops.fp8flow.grouped_gemm_fp8_wgrad_accumulate.default
    args = make_operands([128, 128], 128, 128)
    into = torch.randn(2, 128, 128, device=DEVICE)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, (*args, into), test_utils=utils)
    torch.library.opcheck(op, (*args, into, True), test_utils=utils)
    before, into_before = [t.clone() for t in args], into.clone()
    assert op(*args, into) is None
    for t, t0 in zip(args, before, strict=True):
        assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8)), "only accumulate_into may change"
    assert not torch.equal(into, into_before)


def _good():
    return {
        "a_t": torch.zeros(128, 256, dtype=FP8_DTYPE),
        "a_t_scale": torch.ones(2, 128),
        "b_t": torch.zeros(256, 256, dtype=FP8_DTYPE),
        "b_t_scale": torch.ones(2, 256),
        "group_end_offsets": torch.tensor([128, 256], dtype=torch.int32),
    }


BAD = [
    ({"a_t": torch.zeros(128, 256)}, TypeError, "a_t must have dtype"),
    ({"b_t": torch.zeros(256, 2, 128, dtype=FP8_DTYPE)}, ValueError, "b_t must have 2 dims"),
    ({"b_t_scale": torch.ones(2, 256, dtype=torch.bfloat16)}, TypeError, "b_t_scale must have dtype"),
    ({"b_t": torch.zeros(256, 384, dtype=FP8_DTYPE)}, ValueError, "b_t must have M = 256"),
    ({"a_t": torch.zeros(100, 256, dtype=FP8_DTYPE)}, ValueError, "a_t N"),
    ({"b_t": torch.zeros(200, 256, dtype=FP8_DTYPE)}, ValueError, "b_t K"),
    (
        {"a_t": torch.zeros(128, 250, dtype=FP8_DTYPE), "b_t": torch.zeros(256, 250, dtype=FP8_DTYPE)},
        ValueError,
        "a_t M",
    ),
    ({"a_t": torch.zeros(256, 128, dtype=FP8_DTYPE).t()}, ValueError, "a_t must be contiguous"),
    ({"b_t_scale": torch.ones(256, 2).t()}, ValueError, "b_t_scale must be contiguous"),
    ({"a_t_scale": torch.ones(2, 256)}, ValueError, "a_t_scale must have shape"),
    ({"group_end_offsets": torch.tensor([128, 256])}, TypeError, "group_end_offsets must have dtype"),
    ({"group_end_offsets": torch.zeros(0, dtype=torch.int32)}, ValueError, "must hold at least one"),
]


@pytest.mark.parametrize(("override", "error", "match"), BAD, ids=[m for _, _, m in BAD])
def test_bad_input(override, error, match):
    with pytest.raises(error, match=match):
        grouped_gemm_fp8_wgrad(**{**_good(), **override})


@pytest.mark.parametrize(
    ("n_chunks", "into", "match"),
    [(0, False, "n_chunks must be"), (2, False, "into multiples of 128"), (3, False, "into multiples of 128"),
     (2, True, "accumulate_into takes the")],
)  # fmt: skip
def test_bad_n_chunks(n_chunks, into, match):
    good = _good()  # N = 128: one chunk only
    if into:
        good["a_t"] = torch.zeros(256, 256, dtype=FP8_DTYPE)
        good["a_t_scale"] = torch.ones(2, 256)
        into = torch.zeros(good["group_end_offsets"].shape[0], 256, good["b_t"].shape[0])
    with pytest.raises(ValueError, match=match):
        grouped_gemm_fp8_wgrad(**good, n_chunks=n_chunks, accumulate_into=into if into is not False else None)


def test_bad_out_dtype():
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_gemm_fp8_wgrad(**_good(), out_dtype=torch.float16)


@pytest.mark.parametrize(
    ("into", "out_dtype", "error", "match"),
    [
        (torch.zeros(2, 128, 256, dtype=torch.float16), None, TypeError, "out_dtype"),
        (torch.zeros(2, 128, 256), torch.bfloat16, TypeError, "accumulate_into must have dtype"),
        (torch.zeros(3, 128, 256), None, ValueError, "accumulate_into must have shape"),
        (torch.zeros(2, 256, 128).transpose(1, 2), None, ValueError, "accumulate_into must be contiguous"),
    ],
)
def test_bad_accumulate_into(into, out_dtype, error, match):
    with pytest.raises(error, match=match):
        grouped_gemm_fp8_wgrad(**_good(), out_dtype=out_dtype, accumulate_into=into)


def test_b_tile_scales_must_be_a_bool():
    with pytest.raises(TypeError, match="b_tile_scales must be a bool"):
        grouped_gemm_fp8_wgrad(**_good(), b_tile_scales=1)


def test_opt_in_validation_of_tile_scales(monkeypatch):
    """FP8FLOW_VALIDATE=1: per-tile B scales must repeat over each 128-column block (NaN repeats NaN)."""
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    good = _good()
    good["b_t_scale"][1, 128:] = float("nan")
    grouped_gemm_fp8_wgrad(**good, b_tile_scales=True)
    good["b_t_scale"][1, 130] = 2.0
    with pytest.raises(ValueError, match=r"block \(1, 1\) differs at column 130"):
        grouped_gemm_fp8_wgrad(**good, b_tile_scales=True)
    grouped_gemm_fp8_wgrad(**good)  # per-column scales: nothing to check


def test_opt_in_validation_of_offsets(monkeypatch):
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_gemm_fp8_wgrad(**{**_good(), "group_end_offsets": torch.tensor([64, 256], dtype=torch.int32)})
