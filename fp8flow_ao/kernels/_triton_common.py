"""Triton device functions shared by every quantizing kernel (one copy of the scale rule).

They mirror :mod:`fp8flow_ao._format` bit for bit: the power-of-two scale comes from the bits of
the block maximum, never from ``log2``/``ceil``, so the kernels and the torch references agree
exactly on every input, including the GPU and the CPU interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8flow_ao import _format
from fp8flow_ao.kernels._launch import next_pow2

# Triton kernels may only read module globals that are tl.constexpr (plain floats fail to compile on
# the GPU, while the interpreter accepts them silently).
AMAX_EPS = tl.constexpr(_format.AMAX_EPS)
FP8_MAX_EXP = tl.constexpr(_format._FP8_MAX_EXP)
FP8_MAX_MANTISSA_BITS = tl.constexpr(_format._FP8_MAX_MANTISSA_BITS)


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
def gathered_rows(src_rows_ptr, rows, row_ok, GATHER: tl.constexpr):
    """``(read_ok, source rows int64)`` for output ``rows``: themselves; with ``GATHER`` the row map's
    ``src_rows[rows]``, negative (and past ``row_ok``) for pad rows that read nothing."""
    if GATHER:
        src = tl.load(src_rows_ptr + rows, mask=row_ok, other=-1)
        return src >= 0, src.to(tl.int64)
    return row_ok, rows.to(tl.int64)
