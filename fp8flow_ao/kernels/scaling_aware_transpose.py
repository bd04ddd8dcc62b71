"""scaling_aware_transpose: row-wise FP8 ``[M, K]`` -> column-wise FP8 ``[K, M]`` without requantizing.

The weight-gradient GEMMs need the activations and output gradients column-wise (tokens
contiguous, K-major). Instead of ``dequantize -> transpose -> requantize`` (a BF16 round trip
through memory and an amax pass; with scales that are not powers of two, also a second rounding of
every element), each 128 x 128 tile is re-encoded by its exponents: with power-of-two scales, a
row block ``(r, kb)`` with ``scale_inv = 2**e_r`` moves into a tile whose scale is the max of its
rows' scales, ``2**e_max``, by multiplying every element by the exact power of two
``2**-(e_max - e_r)``. Results that stay normal are bit-exact copies of the
mantissa; results that fall below the smallest E4M3 normal are rounded to the nearest E4M3
subnormal (ties to even), exactly what ``cvt.rn.satfinite`` does. Signs, zeros and NaN survive.

Layouts: ``data`` E4M3 ``[M, K]`` contiguous, ``scale_inv`` fp32 ``[M, K / 128]`` contiguous (COMPACT
row-wise). ``data_t`` E4M3 ``[K, M]`` contiguous, ``scale_inv_t`` fp32 ``[M / 128, K]`` contiguous
(every column of a 128 x 128 tile carries the tile's scale). Both ``scale_inv`` are the dequantize
multiplier: ``x[r, k] ~= data[r, k] * scale_inv[r, k // 128] ~= data_t[k, r] * scale_inv_t[r // 128, k]``.

Special scales: a pad row (``scale_inv = 0``) never raises a tile's max and re-encodes to 0; a tile of
only pad rows gets data 0 and scale 0 (no 0/0). A row block with ``scale_inv = +inf`` (non-finite
input) makes its tile's scale +inf, so every element of that tile dequantizes to a non-finite value.
Rows at or past ``group_end_offsets[-1]`` are not read: data 0, scale 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp8flow_ao._checks import (
    check_contiguous,
    check_fp8,
    check_group_end_offsets,
    check_multiple,
    check_same_device,
    check_shape,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, cast_to_fp8, dequantize_rows_reference, quantize_rows_reference

# Any shift >= 19 sends every E4M3 value (|x| <= 448 < 2**9) below half the smallest subnormal
# (2**-10), so it rounds to +-0. Capping the shift at 24 changes no result and keeps 2**-shift
# exact in fp16 (smallest subnormal 2**-24), where a pad row's or an inf tile's shift (up to 255)
# would underflow.
_MAX_SHIFT = 24
_TL_MAX_SHIFT = tl.constexpr(_MAX_SHIFT)
_TL_BLOCK = tl.constexpr(BLOCK)


@dataclass(frozen=True)
class TransposeConfig:
    """Launch settings of the transpose kernel (they never change the result).

    k_blocks_per_program: 128 x 128 tiles one program walks along K (sharing its row range, the
        group-end read and the index math).
    num_warps: warps per program.
    """

    k_blocks_per_program: int
    num_warps: int


def transpose_configs() -> list[TransposeConfig]:
    """Autotune candidates; the first is the default (used by the CPU interpreter and unnamed calls).

    The tile is 128 x 128, fixed by the format: 128 rows share one output scale, and 128 columns
    are one input scale block, so one max per tile. It also makes every global access whole
    128-byte lines: each input row of the tile is 128 contiguous bytes, each output row 128
    contiguous tokens. 4 warps: each thread loads 16-byte vectors (128 threads x 16 B x 8 = 16 KiB)
    and Triton lowers the transpose to ``stmatrix`` (8 warps get plain 4-byte shared stores); ~165
    registers (sm_90, triton 3.6 and 3.9) leave 3 programs per SM, ~48 KiB of loads in flight per
    SM, above the ~20-30 KiB that bandwidth x latency asks for on H100/H200. 8 warps: ~100
    registers, 5 programs per SM, but ~20% more instructions per element.
    Several tiles per program cut the grid (7168 programs at 16384 x 7168 with one tile each);
    4 divides K/128 for both PERF.md K (7168, 2048).
    """
    return [
        TransposeConfig(k_blocks_per_program=4, num_warps=4),
        TransposeConfig(k_blocks_per_program=1, num_warps=4),
        TransposeConfig(k_blocks_per_program=4, num_warps=8),
        TransposeConfig(k_blocks_per_program=1, num_warps=8),
    ]


@triton.jit
def _exponent_shift_multiplier(s, s_max):
    """Per row block: the exact power of two ``s / s_max`` as ``2**-min(e_max - e_r, cap)``; 0 for pad rows.

    Taken from the exponent fields, not a division: it stays exact, and s_max = +inf (exponent 255)
    or 0 needs no special case (an inf row keeps its data; a pad row or pad tile gives 0).
    """
    e_r = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_max = (s_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    shift = tl.minimum(e_max - e_r, _TL_MAX_SHIFT)
    mult = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return tl.where(s == 0.0, 0.0, mult)


@triton.jit
def _load_rows(ptr, quads, b, cols, K, valid_rows):
    """Rows ``r = 4 * q + b`` (q < 32) of a 128 x 128 fp8 tile, 128 contiguous bytes each; 0 for r >= valid_rows."""
    r = 4 * quads + b
    return tl.load(ptr + r[:, None] * K + cols[None, :], mask=(r < valid_rows)[:, None], other=0.0)


@triton.jit
def _reencode_rows(x, scale_inv_ptr, quads, b, num_kb, s_max, valid_rows):
    """Re-encode rows ``4 * q + b`` of the tile to the tile's scale ``s_max``: fp8 -> fp16 -> x 2**-shift -> fp8.

    fp16 instead of fp32 because sm_90 converts fp8 <-> fp16 two at a time and multiplies fp16
    pairs (fp32 adds an fp16 -> fp32 widening and a scalar multiply per element): same bits. It is exact: an E4M3 value (4 significant bits,
    >= 2**-9) times 2**-shift (shift <= 24, a normal or subnormal fp16) is exact in fp16 whenever
    it is >= 2**-14; anything smaller becomes an E4M3 +-0 either way (it stays < 2**-10 = half the
    smallest E4M3 subnormal after fp16 rounding), so the one rounding that matters is the final
    round-to-nearest-even to E4M3 (``cvt.rn.satfinite.e4m3x2.f16x2``).
    """
    r = 4 * quads + b
    s = tl.load(scale_inv_ptr + r * num_kb, mask=r < valid_rows, other=0.0)
    mult = _exponent_shift_multiplier(s, s_max).to(tl.float16)
    return (x.to(tl.float16) * mult[:, None]).to(tl.float8e4nv)


@triton.jit
def _scaling_aware_transpose_kernel(
    data_ptr,
    scale_inv_ptr,
    group_end_offsets_ptr,
    data_t_ptr,
    scale_inv_t_ptr,
    M,
    K,
    num_groups,
    HAS_OFFSETS: tl.constexpr,
    K_BLOCKS_PER_PROGRAM: tl.constexpr,
):
    """One program: the 128 rows of row tile ``program_id(0)`` x ``K_BLOCKS_PER_PROGRAM`` scale blocks.

    Per 128 x 128 tile: load it as four 32 x 128 slices (rows 4q + b, b = 0..3; loads coalesced
    along K), take the max of the 128 row scales, re-encode each slice with its rows' shifts, then
    interleave the four slices (``tl.join``: register-only) so each thread holds 4 consecutive
    tokens of a column, and store the transposed tile coalesced along M. Triton then moves the tile
    through shared memory 4 bytes at a time (``stmatrix`` + 16-byte ``ld.shared`` on sm_90), where
    ``tl.trans`` of the plain 128 x 128 fp8 tile compiles to one 1-byte shared store per element
    (1144 instead of ~990 SASS instructions per tile at 4 warps). The tile's loads are issued
    before the scale max, whose cross-warp reduction is a barrier that loads cannot cross.
    Offsets inside a tile are int32 (127 * max(M, K) fits); the tile bases are int64.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_kb = K // _TL_BLOCK
    row0 = pid_m * _TL_BLOCK
    idx = tl.arange(0, _TL_BLOCK)  # rows, or columns, of the square tile
    quads = tl.arange(0, _TL_BLOCK // 4)
    rows_end = M
    if HAS_OFFSETS:  # rows at/after the last group end are neither read nor computed
        rows_end = tl.minimum(tl.load(group_end_offsets_ptr + num_groups - 1), M)
    valid_rows = rows_end - row0  # of this row tile
    data_tile = data_ptr + row0.to(tl.int64) * K
    scale_rows = scale_inv_ptr + row0 * num_kb
    kb_first = pid_k * K_BLOCKS_PER_PROGRAM
    for kb in range(kb_first, tl.minimum(kb_first + K_BLOCKS_PER_PROGRAM, num_kb)):
        x_ptr = data_tile + kb * _TL_BLOCK
        x0 = _load_rows(x_ptr, quads, 0, idx, K, valid_rows)
        x1 = _load_rows(x_ptr, quads, 1, idx, K, valid_rows)
        x2 = _load_rows(x_ptr, quads, 2, idx, K, valid_rows)
        x3 = _load_rows(x_ptr, quads, 3, idx, K, valid_rows)
        s_max = tl.max(tl.load(scale_rows + idx * num_kb + kb, mask=idx < valid_rows, other=0.0), axis=0)
        y0 = _reencode_rows(x0, scale_rows + kb, quads, 0, num_kb, s_max, valid_rows)
        y1 = _reencode_rows(x1, scale_rows + kb, quads, 1, num_kb, s_max, valid_rows)
        y2 = _reencode_rows(x2, scale_rows + kb, quads, 2, num_kb, s_max, valid_rows)
        y3 = _reencode_rows(x3, scale_rows + kb, quads, 3, num_kb, s_max, valid_rows)
        # [q, k, b] with b = row % 4 innermost, then [k, q, b] = [k, 128 tokens]
        y = tl.join(tl.join(y0, y1), tl.join(y2, y3))  # [q, k, b % 2, b // 2]
        y_t = tl.reshape(tl.permute(y, (1, 0, 3, 2)), (_TL_BLOCK, _TL_BLOCK))
        out = data_t_ptr + row0 + kb * _TL_BLOCK * M.to(tl.int64)
        tl.store(out + idx[:, None] * M + idx[None, :], y_t)
        tl.store(scale_inv_t_ptr + pid_m * K + kb * _TL_BLOCK + idx, tl.zeros([_TL_BLOCK], tl.float32) + s_max)


def _to_triton_config(c: TransposeConfig) -> triton.Config:
    return triton.Config({"K_BLOCKS_PER_PROGRAM": c.k_blocks_per_program}, num_warps=c.num_warps)


# Tuned per K only (the token count M varies every step and must not trigger a re-tune).
_autotuned_kernel = triton.autotune(configs=[_to_triton_config(c) for c in transpose_configs()], key=["K"])(
    _scaling_aware_transpose_kernel
)


def launch_scaling_aware_transpose(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None = None,
    config: TransposeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`scaling_aware_transpose`.

    ``config=None`` autotunes on a GPU and takes the first of :func:`transpose_configs` elsewhere
    (the interpreter cannot time kernels).
    """
    m, k = data.shape
    data_t = torch.empty((k, m), dtype=FP8_DTYPE, device=data.device)
    scale_inv_t = torch.empty((m // BLOCK, k), dtype=torch.float32, device=data.device)
    if m == 0 or k == 0:
        return data_t, scale_inv_t
    has_offsets = group_end_offsets is not None
    args = (
        data,
        scale_inv,
        group_end_offsets,
        data_t,
        scale_inv_t,
        m,
        k,
        group_end_offsets.numel() if has_offsets else 0,
    )

    def grid(kb_per_program: int) -> tuple[int, int]:
        return (m // BLOCK, triton.cdiv(k // BLOCK, kb_per_program))

    if config is None and data.is_cuda:
        _autotuned_kernel[lambda meta: grid(meta["K_BLOCKS_PER_PROGRAM"])](*args, HAS_OFFSETS=has_offsets)
    else:
        c = config or transpose_configs()[0]
        _scaling_aware_transpose_kernel[grid(c.k_blocks_per_program)](
            *args,
            HAS_OFFSETS=has_offsets,
            K_BLOCKS_PER_PROGRAM=c.k_blocks_per_program,
            num_warps=c.num_warps,
        )
    return data_t, scale_inv_t


def _valid_rows(m: int, group_end_offsets: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[M]`` bool: rows before the last group end (all rows without offsets). No host sync."""
    rows = torch.arange(m, device=device)
    return rows >= 0 if group_end_offsets is None else rows < group_end_offsets[-1].to(device)


def scaling_aware_transpose_reference(
    data: torch.Tensor, scale_inv: torch.Tensor, group_end_offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path): the kernel's arithmetic, tile by tile.

    It multiplies in fp32 where the kernel multiplies in fp16; both are exact up to the final
    round-to-nearest-even cast (see ``_reencode_rows``), which the exhaustive every-code x
    every-shift test confirms bit for bit.
    """
    m, k = data.shape
    nkb = k // BLOCK
    valid = _valid_rows(m, group_end_offsets, data.device)[:, None]
    s = torch.where(valid, scale_inv, 0.0)
    x = torch.where(valid, data.float(), 0.0).reshape(m, nkb, BLOCK)
    s_max = s.reshape(-1, BLOCK, nkb).amax(dim=1)  # [M/128, K/128]
    e_r = (s.view(torch.int32) >> 23) & 0xFF
    e_max = ((s_max.view(torch.int32) >> 23) & 0xFF).repeat_interleave(BLOCK, dim=0)
    shift = torch.clamp(e_max - e_r, max=_MAX_SHIFT)
    mult = torch.where(s == 0, 0.0, ((127 - shift) << 23).view(torch.float32))
    data_t = cast_to_fp8(x * mult[..., None]).reshape(m, k).t().contiguous()
    return data_t, s_max.repeat_interleave(BLOCK, dim=1)


def dequantize_transpose_requantize_reference(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive path this op replaces (tests and benchmarks only): dequantize to ``dtype``,
    transpose, re-quantize 1 x 128 along M. Returns the same layouts as the op (scales
    ``[M / 128, K]``); rows past the last group end are zeroed before requantizing."""
    valid = _valid_rows(data.shape[0], group_end_offsets, data.device)[:, None]
    x = torch.where(valid, dequantize_rows_reference(data, scale_inv, BLOCK, dtype), 0.0).to(dtype)
    data_t, scale_t = quantize_rows_reference(x.t(), BLOCK)
    return data_t, scale_t.t().contiguous()


@torch.library.custom_op("fp8flow::scaling_aware_transpose", mutates_args=())
def _scaling_aware_transpose_op(
    data: torch.Tensor, scale_inv: torch.Tensor, group_end_offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return scaling_aware_transpose_reference(data, scale_inv, group_end_offsets)


_scaling_aware_transpose_op.register_kernel("cuda")(launch_scaling_aware_transpose)


@_scaling_aware_transpose_op.register_fake
def _(
    data: torch.Tensor, scale_inv: torch.Tensor, group_end_offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = data.shape
    return data.new_empty((k, m), dtype=FP8_DTYPE), data.new_empty((m // BLOCK, k), dtype=torch.float32)


def scaling_aware_transpose(
    data: torch.Tensor, scale_inv: torch.Tensor, group_end_offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise (1 x 128) FP8 -> column-wise FP8 by exponent re-encoding, for the wgrad GEMM operand.

    Each 128 x 128 tile (128 rows, one 128-column scale block ``kb``) gets the max of its rows'
    scales, ``s_max``; every element is re-encoded as ``x * (s_r / s_max)`` (an exact power of two),
    so values that stay normal keep their mantissa bit for bit and values that underflow round to
    the nearest E4M3 subnormal (ties to even). No dequantize, no amax pass, one rounding.

    Args:
        data: E4M3 ``[M, K]``, contiguous (row-major), ``M`` and ``K`` multiples of 128.
        scale_inv: fp32 ``[M, K / 128]``, contiguous: power-of-two dequantize multipliers of the
            1 x 128 blocks (0 on pad rows; +inf on blocks with non-finite input).
        group_end_offsets: optional int32 ``[E]`` padded expert group end offsets (each a multiple
            of 128, non-decreasing, last <= M); read on the device. Rows at or past the last one
            are not read and come out as data 0, scale 0.

    Returns:
        ``(data_t, scale_inv_t)``: ``data_t`` E4M3 ``[K, M]`` contiguous (column-wise: tokens
        contiguous, K-major for the wgrad GEMM); ``scale_inv_t`` fp32 ``[M / 128, K]`` contiguous,
        the dequantize multiplier (``data[r, k] * scale_inv[r, k // 128] ==
        data_t[k, r] * scale_inv_t[r // 128, k]`` wherever the re-encoded value did not underflow).
    """
    check_fp8("data", data, ndim=2)
    check_contiguous("data", data)
    m, k = data.shape
    check_multiple("data", m, what="rows (M)")
    check_multiple("data", k, what="columns (K)")
    check_tensor("scale_inv", scale_inv, dtypes=torch.float32, ndim=2)
    check_shape("scale_inv", scale_inv, (m, k // BLOCK))
    check_contiguous("scale_inv", scale_inv)
    if group_end_offsets is not None:
        check_group_end_offsets("group_end_offsets", group_end_offsets, rows=m)
        if group_end_offsets.numel() == 0:
            raise ValueError("group_end_offsets must hold at least one group end, got an empty tensor")
    check_same_device(data=data, scale_inv=scale_inv, group_end_offsets=group_end_offsets)
    return torch.ops.fp8flow.scaling_aware_transpose(data, scale_inv, group_end_offsets)
