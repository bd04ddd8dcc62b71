"""Triton device functions shared by every quantizing kernel (one copy of the scale rule).

They mirror :mod:`fp8flow_ao._format` bit for bit: the power-of-two scale comes from the bits of
the block maximum, never from ``log2``/``ceil``, so the kernels and the torch references agree
exactly on every input, including the GPU and the CPU interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl

from fp8flow_ao import _format
from fp8flow_ao.kernels._launch import next_pow2

# Triton kernels may only read module globals that are tl.constexpr (plain floats fail to compile on
# the GPU, while the interpreter accepts them silently).
AMAX_EPS = tl.constexpr(_format.AMAX_EPS)
FP8_MAX_EXP = tl.constexpr(_format._FP8_MAX_EXP)
FP8_MAX_MANTISSA_BITS = tl.constexpr(_format._FP8_MAX_MANTISSA_BITS)
# Any exponent shift >= 19 sends every E4M3 value (|x| <= 448 < 2**9) below half the smallest subnormal
# (2**-10), so it rounds to +-0. Capping the shift at 24 changes no result and keeps 2**-shift exact in
# fp16 (smallest subnormal 2**-24), where a pad row's or an inf tile's shift (up to 255) would underflow.
MAX_SHIFT = 24
_TL_MAX_SHIFT = tl.constexpr(MAX_SHIFT)


def jit_any_count(*counts: str) -> Callable[[Callable[..., object]], triton.runtime.JITFunction]:
    """``triton.jit`` that compiles one kernel for every value of the named row/token-count arguments.

    Triton specializes an int argument on ``== 1`` and on being a multiple of 16, and compiles a kernel for
    each combination it meets. Counts that change from step to step (the rows an expert-parallel rank
    receives, ``fp8_grouped_mm``'s unaligned ``M``) then recompile kernels in the middle of training, a
    second or more each. Name only counts that vary and that mask whole rows (each row a vector of its own):
    the compiler vectorizes a masked access only where it knows the mask constant over the vector, and a
    stride must stay divisible to vectorize at all. Padded counts (multiples of 128: the padded rows, a
    column-major ``[K, M]`` output's ``M``) keep their specialization, which never changes; so does a
    count the launcher rounds to a multiple of 16. Measured on sm_90 SASS: the unpermute backward's pad-row
    loads lost their 128-bit vectors with the padded row count unspecialized, and the route's fill stores
    with its per-program share."""
    return triton.jit(do_not_specialize=list(counts))


@triton.jit
def pow2_scale_inv_and_scale(amax):
    """fp32 block maxima (>= 0, no NaN) -> (scale_inv = 2**k, scale = 2**-k); +inf -> (inf, 0)."""
    a = tl.maximum(amax, AMAX_EPS)
    # k = exponent(a) - (127 + FP8_MAX_EXP) + (mantissa(a) > FP8_MAX_MANTISSA_BITS): adding the
    # mantissa's complement to FP8_MAX_MANTISSA_BITS carries into the exponent field exactly when the
    # mantissa exceeds it (2 integer instructions instead of 4; a <= inf, so the sum cannot overflow).
    e = (a.to(tl.int32, bitcast=True) + (0x7FFFFF - FP8_MAX_MANTISSA_BITS)) >> 23  # k + 127 + FP8_MAX_EXP
    scale_inv = ((e - FP8_MAX_EXP) << 23).to(tl.float32, bitcast=True)
    scale = ((2 * 127 - e + FP8_MAX_EXP) << 23).to(tl.float32, bitcast=True)
    is_inf = a == float("inf")
    scale_inv = tl.where(is_inf, float("inf"), scale_inv)
    scale = tl.where(is_inf, 0.0, scale)
    return scale_inv, scale


@triton.jit
def nan_free_abs(x):
    """|x| in fp32 with NaN replaced by 0 (NaN never decides a block's scale)."""
    a = tl.abs(x.to(tl.float32))
    return tl.where(a != a, 0.0, a)


def col_block(cols: int, max_block: int, min_block: int = 16) -> int:
    """Power-of-two column tile for a row-wise memory-bound kernel (host-side launch helper).

    The largest power of two ``<= max_block`` and ``>= min_block`` that divides ``cols``, so no program
    runs a masked tail (D = 7168 = 7 x 1024 gets 1024, not 2048 with a half-empty last tile); when
    none divides, the tile covers ``cols`` up to ``max_block`` and the last one is masked.
    """
    widest = min(next_pow2(max(cols, 1)), max_block)
    block = widest
    while block >= min_block:
        if cols % block == 0:
            return block
        block //= 2
    return widest


@triton.jit
def nan_ignoring_amax(x, axis: tl.constexpr):
    """Block maxima of |x| along ``axis`` for :func:`pow2_scale_inv_and_scale`, NaN ignored.

    Gives the scales that ``tl.max(nan_free_abs(x), axis)`` gives, two instructions per element
    cheaper (no compare + select): Triton's ``max`` is ``maxnum`` on the GPU and ``np.nanmax`` in the
    interpreter, both skip NaN. An all-NaN slice yields NaN instead of 0, and
    :func:`pow2_scale_inv_and_scale` floors both to ``AMAX_EPS`` alike (``maximum`` is ``maxnum`` too).
    """
    return tl.max(tl.abs(x.to(tl.float32)), axis=axis)


@triton.jit
def quantize_tile(w):
    """A whole block (any shape, e.g. one 128x128 weight tile) -> ``(E4M3 block, scale_inv)`` with one
    power-of-two scale from its NaN-free amax: the 128x128 weight format (quantize_128x128, and the grouped
    GEMM that quantizes weights as it loads them)."""
    x = w.to(tl.float32)
    scale_inv, scale = pow2_scale_inv_and_scale(tl.max(tl.max(nan_free_abs(x), axis=1), axis=0))
    return (x * scale).to(tl.float8e4nv), scale_inv


@triton.jit
def last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS: tl.constexpr):
    """First row not computed: the last group end offset (read on the device, clamped to ``M``), or ``M``."""
    end = M
    if HAS_OFFSETS:
        end = tl.minimum(tl.load(offsets_ptr + num_groups - 1), M)
    return end


@triton.jit
def transpose_row_slices(q0, q1, q2, q3):
    """The ``[4R, C]`` tile whose row ``4r + b`` is row ``r`` of slice ``q<b>`` (four ``[R, C]`` slices),
    transposed: ``[C, 4R]``.

    Why slices: ``tl.join`` and ``tl.permute`` only rename registers (each thread then holds 4
    consecutive rows of a column), so the layout change Triton makes for the transposed store moves
    4 bytes at a time through shared memory. ``tl.trans`` of a whole 1-byte tile compiles to one
    1-byte shared-memory load per element (sm_90a: 64 ``LDS.U8`` a thread for a 128 x 128 tile at 8
    warps), and those conflict: ncu counted ~900 bank conflicts a tile each way in the kernels that did
    so (``benchmarks/results/memory_bound_notes.md``).
    """
    y = tl.join(tl.join(q0, q1), tl.join(q2, q3))  # [r, c, b % 2, b // 2]
    return tl.reshape(tl.permute(y, (1, 0, 3, 2)), (q0.shape[1], 4 * q0.shape[0]))


@triton.jit
def store_rowwise(x, rows, rows_ok, data_ptr, scale_ptr, cols64, row_stride, scale_row_stride, scale_col):
    """Quantize fp32 ``x [R, 128]`` (rows ``rows``, columns ``cols64``) in 1 x 128 blocks and store it:
    data at ``data_ptr[rows * row_stride + cols64]``, each row's scale at ``scale_ptr[rows *
    scale_row_stride + scale_col]`` (0 where not ``rows_ok``). Returns what it stored: ``(E4M3 [R, 128],
    scales [R])``, for a kernel that also re-encodes the tile (:func:`reencode_tile_transposed`)."""
    scale_inv, scale = pow2_scale_inv_and_scale(nan_ignoring_amax(x, axis=1))
    rows64 = rows.to(tl.int64)
    q = (x * scale[:, None]).to(tl.float8e4nv)
    stored_scale = tl.where(rows_ok, scale_inv, 0.0)
    tl.store(data_ptr + rows64[:, None] * row_stride + cols64[None, :], q)
    tl.store(scale_ptr + rows64 * scale_row_stride + scale_col, stored_scale)
    return q, stored_scale


@triton.jit
def store_colwise_transposed(x0, x1, x2, x3, row0, cols64, M, data_t_ptr, scale_t_ptr, block_ok):
    """Quantize the fp32 tile of 128 rows from ``row0`` held as four row slices (``x<b>``: rows ``row0 + 4r
    + b``, columns ``cols64``) in 128 x 1 blocks and store it transposed: data at ``data_t_ptr[cols64 * M
    + row0 + [0, 128)]`` (tokens contiguous), each column's scale at ``scale_t_ptr[cols64]`` (0 unless
    ``block_ok``)."""
    # One reduction over the slices' elementwise maximum (maxnum: NaN ignored, as within a slice).
    amax = nan_ignoring_amax(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))), 0)
    scale_inv, scale = pow2_scale_inv_and_scale(amax)
    q_t = transpose_row_slices(
        (x0 * scale[None, :]).to(tl.float8e4nv),
        (x1 * scale[None, :]).to(tl.float8e4nv),
        (x2 * scale[None, :]).to(tl.float8e4nv),
        (x3 * scale[None, :]).to(tl.float8e4nv),
    )
    tokens = row0 + tl.arange(0, 4 * x0.shape[0])
    tl.store(data_t_ptr + cols64[:, None] * M + tokens[None, :], q_t)
    tl.store(scale_t_ptr + cols64, tl.where(block_ok, scale_inv, 0.0))


@triton.jit
def gathered_rows(src_rows_ptr, rows, row_ok, GATHER: tl.constexpr):
    """``(read_ok, source rows int64)`` for output ``rows``: themselves; with ``GATHER`` the row map's
    ``src_rows[rows]``, negative (and past ``row_ok``) for pad rows that read nothing."""
    if GATHER:
        src = tl.load(src_rows_ptr + rows, mask=row_ok, other=-1)
        return src >= 0, src.to(tl.int64)
    return row_ok, rows.to(tl.int64)


@triton.jit
def exponent_shift_multiplier(s, s_max):
    """Per row block: the exact power of two ``s / s_max`` as ``2**-min(e_max - e_r, MAX_SHIFT)``; 0 for pad
    rows (``s == 0``).

    Taken from the exponent fields, not a division: it stays exact, and s_max = +inf (exponent 255)
    or 0 needs no special case (an inf row keeps its data; a pad row or pad tile gives 0).
    """
    e_r = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_max = (s_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    shift = tl.minimum(e_max - e_r, _TL_MAX_SHIFT)
    mult = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return tl.where(s == 0.0, 0.0, mult)


@triton.jit
def reencode_rows(x, s, s_max):
    """Re-encode a row slice of E4M3 ``x [R, C]`` with row scales ``s [R]`` to the tile's scale ``s_max``:
    fp8 -> fp16 -> x 2**-shift -> fp8 (the scaling-aware transpose's rule).

    fp16 instead of fp32 because sm_90 converts fp8 <-> fp16 two at a time and multiplies fp16
    pairs (fp32 adds an fp16 -> fp32 widening and a scalar multiply per element): same bits. It is exact: an E4M3 value (4 significant bits,
    >= 2**-9) times 2**-shift (shift <= 24, a normal or subnormal fp16) is exact in fp16 whenever
    it is >= 2**-14; anything smaller becomes an E4M3 +-0 either way (it stays < 2**-10 = half the
    smallest E4M3 subnormal after fp16 rounding), so the one rounding that matters is the final
    round-to-nearest-even to E4M3 (``cvt.rn.satfinite.e4m3x2.f16x2``).
    """
    mult = exponent_shift_multiplier(s, s_max).to(tl.float16)
    return (x.to(tl.float16) * mult[:, None]).to(tl.float8e4nv)


@triton.jit
def reencode_tile_transposed(x0, x1, x2, x3, s0, s1, s2, s3):
    """A row-wise E4M3 tile of ``4R`` rows held as four row slices (``x<b> [R, C]``: rows ``4r + b``, row scales
    ``s<b> [R]``; 0 for pad rows) -> ``(y_t, s_max)``: the tile re-encoded to one scale, the max of its rows'
    (:func:`reencode_rows`), and transposed, ``[C, 4R]`` E4M3 (tokens contiguous)."""
    s_max = tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), axis=0)
    y_t = transpose_row_slices(
        reencode_rows(x0, s0, s_max),
        reencode_rows(x1, s1, s_max),
        reencode_rows(x2, s2, s_max),
        reencode_rows(x3, s3, s_max),
    )
    return y_t, s_max
