"""Triton device functions shared by every quantizing kernel (one copy of the scale rule).

They mirror :mod:`fp8flow_ao._format` bit for bit: the power-of-two scale comes from the bits of
the block maximum, never from ``log2``/``ceil``, so the kernels and the torch references agree
exactly on every input, including the GPU and the CPU interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8flow_ao import _format

# Triton kernels may only read module globals that are tl.constexpr (plain floats fail to compile on
# the GPU, while the interpreter accepts them silently).
AMAX_EPS = tl.constexpr(_format.AMAX_EPS)
FP8_MAX_EXP = tl.constexpr(_format._FP8_MAX_EXP)
FP8_MAX_MANTISSA_BITS = tl.constexpr(_format._FP8_MAX_MANTISSA_BITS)


@triton.jit
def pow2_scale_inv_and_scale(amax):
    """fp32 block maxima (>= 0, no NaN) -> (scale_inv = 2**k, scale = 2**-k); +inf -> (inf, 0)."""
    a = tl.maximum(amax, AMAX_EPS)
    bits = a.to(tl.int32, bitcast=True)
    k = (bits >> 23) - (127 + FP8_MAX_EXP) + ((bits & 0x7FFFFF) > FP8_MAX_MANTISSA_BITS).to(tl.int32)
    scale_inv = ((k + 127) << 23).to(tl.float32, bitcast=True)
    scale = ((127 - k) << 23).to(tl.float32, bitcast=True)
    is_inf = a == float("inf")
    scale_inv = tl.where(is_inf, float("inf"), scale_inv)
    scale = tl.where(is_inf, 0.0, scale)
    return scale_inv, scale


@triton.jit
def nan_free_abs(x):
    """|x| in fp32 with NaN replaced by 0 (NaN never decides a block's scale)."""
    a = tl.abs(x.to(tl.float32))
    return tl.where(a != a, 0.0, a)
