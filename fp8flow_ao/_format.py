"""The FP8 blockwise format every op of fp8flow_ao honours (see DESIGN.md).

* dtype: ``torch.float8_e4m3fn`` (E4M3, max 448) for activations, weights and gradients.
* blocks: 1x128 along the contiguous dim for activations/gradients, 128x128 for weights.
* ``scale_inv``: fp32, the *dequantize multiplier* (``x ~= fp8 * scale_inv``), always a power
  of two: the smallest ``2**k`` with ``amax <= 448 * 2**k``.
* casting: ``fp8 = round_to_nearest_even(x * (1 / scale_inv))``. Because both the scale and its
  reciprocal are exact powers of two, ``|x / scale_inv| <= 448`` holds exactly and the cast never
  saturates; it is bit-identical to the GPU's ``cvt.rn.satfinite.e4m3x2.f32``.
* non-finite input: a block holding +-inf gets ``scale_inv = +inf`` and NaN data where the input was
  non-finite, so dequantizing it yields NaN and a training loop's NaN check still fires. NaN inside
  an otherwise finite block stays NaN in the data; NaN never takes part in the block's amax.

This module holds the pure-torch primitives that every op's reference is built from. They are the
oracle for the Triton kernels and the CPU execution path.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
# Floor for a block's amax: an all-zero block gets a tiny finite scale (2**-42) instead of 0, so it
# never produces 0 * inf and can never win a max against a block holding real data.
AMAX_EPS = 1e-10
# 448 = 1.75 * 2**8: mantissa field of 1.75, and the exponent offset of FP8_MAX.
_FP8_MAX_MANTISSA_BITS = 0x600000
_FP8_MAX_EXP = 8


def pow2_scale_inv(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Power-of-two ``(scale_inv, scale)`` for non-negative, NaN-free fp32 block maxima.

    ``scale_inv = 2**k`` with the smallest integer ``k`` such that ``max(amax, AMAX_EPS) <= 448 * 2**k``,
    computed from the float's bits (no log2/ceil rounding). ``scale = 1 / scale_inv`` (exact).
    Where ``amax`` is +inf: ``scale_inv = +inf``, ``scale = 0``.
    """
    a = torch.clamp(amax.float(), min=AMAX_EPS)
    bits = a.view(torch.int32)
    k = (bits >> 23) - (127 + _FP8_MAX_EXP) + ((bits & 0x7FFFFF) > _FP8_MAX_MANTISSA_BITS).int()
    scale_inv = ((k + 127) << 23).view(torch.float32)
    scale = ((127 - k) << 23).view(torch.float32)
    is_inf = torch.isinf(a)
    scale_inv = torch.where(is_inf, torch.full_like(a, float("inf")), scale_inv)
    scale = torch.where(is_inf, torch.zeros_like(a), scale)
    return scale_inv, scale


def empty_row_and_column_wise(like: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Uninitialized E4M3 ``[rows, cols]`` in both orientations on ``like``'s device, as the kernels that write
    both lay them out: row-wise data ``[rows, cols]`` + fp32 scales ``[rows, cols / 128]`` (1 x 128 blocks),
    column-wise data transposed ``[cols, rows]`` (tokens contiguous) + fp32 scales ``[rows / 128, cols]``."""
    return (
        like.new_empty((rows, cols), dtype=FP8_DTYPE),
        like.new_empty((rows, cols // BLOCK), dtype=torch.float32),
        like.new_empty((cols, rows), dtype=FP8_DTYPE),
        like.new_empty((rows // BLOCK, cols), dtype=torch.float32),
    )


def cast_to_fp8(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3, round to nearest even, saturating at +-448, NaN kept (the GPU's ``satfinite``)."""
    return torch.clamp(y.float(), -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def nan_free_abs(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` in fp32 with NaN replaced by 0, so NaN never decides a block's scale."""
    a = x.float().abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def _scaled_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` fp32 in 1 x ``block`` blocks of its last dim ``[..., nb, block]`` (a ragged last block zero-padded),
    each multiplied by its power-of-two scale (``|y| <= 448``), and the blocks' ``scale_inv`` ``[..., nb]``."""
    k = x.shape[-1]
    nb = -(-k // block) if k else 0
    padded = torch.nn.functional.pad(x.float(), (0, nb * block - k))
    blocks = padded.reshape(*x.shape[:-1], nb, block)
    scale_inv, scale = pow2_scale_inv(nan_free_abs(blocks).amax(dim=-1))
    return blocks * scale.unsqueeze(-1), scale_inv


def quantize_rows_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 1 x ``block`` quantization of the last dim of ``x`` (any leading dims).

    Returns ``data`` (E4M3, shape of ``x``) and ``scale_inv`` (fp32, ``[..., ceil(K / block)]``).
    A ragged last block is quantized over its real elements only.
    """
    k = x.shape[-1]
    y, scale_inv = _scaled_blocks(x, block)
    data = cast_to_fp8(y).reshape(*x.shape[:-1], y.shape[-2] * block)[..., :k]
    return data.contiguous(), scale_inv


def round_rows_to_fp8_grid(x: torch.Tensor, block: int, rounding: str = "nearest") -> torch.Tensor:
    """The values (fp32, ``x``'s shape) that 1 x ``block`` E4M3 quantization of finite ``x`` represents:
    ``data * scale_inv`` of :func:`quantize_rows_reference` for ``rounding="nearest"``; for
    ``"stochastic"``, each value goes to one of its two neighbours on the same grid (the block's scale, E4M3's
    spacing at the value's binade: ``2**(max(e, -6) - 3)``) with probabilities by distance, so that the
    expectation is ``x`` itself (torch's global generator draws one uniform per element)."""
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    k = x.shape[-1]
    y, scale_inv = _scaled_blocks(x, block)
    if rounding == "nearest":
        y = cast_to_fp8(y).float()
    else:
        binade = ((y.view(torch.int32) >> 23) & 0xFF) - 127
        spacing = ((torch.clamp(binade, min=-6) - 3 + 127) << 23).view(torch.float32)
        y = torch.floor(y / spacing + torch.rand_like(y)) * spacing
    return (y * scale_inv.unsqueeze(-1)).reshape(*x.shape[:-1], y.shape[-2] * block)[..., :k]


def dequantize_rows_reference(
    data: torch.Tensor, scale_inv: torch.Tensor, block: int, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_rows_reference`: ``data * scale_inv`` broadcast over 1 x ``block``."""
    k = data.shape[-1]
    expanded = scale_inv.repeat_interleave(block, dim=-1)[..., :k]
    return (data.float() * expanded).to(out_dtype)
