"""dequantize: E4M3 data + power-of-two ``scale_inv`` -> fp32/bf16/fp16, for every layout of the format.

For tests, debugging and fallbacks (the FP8-Flow path itself never dequantizes). One kernel serves
the three layouts: each is a 3-D view ``[B, R, C]`` of ``data`` whose scale for element ``(b, r, c)``
sits at ``b * s_b + (r // ROW_BLOCK) * s_r + (c // 128) * s_c`` of ``scale_inv``:

* ``"rowwise"``: data ``[..., K]``, scale_inv ``[..., ceil(K/128)]``; B = 1, R = rows, C = K,
  ROW_BLOCK = 1, strides ``(0, ceil(K/128), 1)``.
* ``"colwise"``: data ``[K, M]`` (stored transposed), scale_inv ``[ceil(M/128), K]``; B = 1, R = K,
  C = M, ROW_BLOCK = 1, strides ``(0, 1, K)``.
* ``"128x128"``: data ``[E, N, K]`` or ``[N, K]``, scale_inv ``[E, ceil(N/128), ceil(K/128)]``; B = E,
  R = N, C = K, ROW_BLOCK = 128, strides ``(ceil(N/128) * ceil(K/128), ceil(K/128), 1)``.

The output has ``data``'s shape and layout (``colwise`` stays ``[K, M]``): ``out = data * scale_inv``
computed in fp32 and rounded once to ``out_dtype``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from fp8flow_ao._checks import check_contiguous, check_fp8, check_no_grad, check_same_device, check_shape, check_tensor
from fp8flow_ao._format import BLOCK, dequantize_rows_reference
from fp8flow_ao.kernels._launch import cdiv, launch_kernel
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._triton_common import jit_any_count

LAYOUTS = ("rowwise", "colwise", "128x128")
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 64 x 128 elements per program: 8 KiB of fp8 in, 32 KiB of fp32 out, 64 elements per thread with
# 4 warps (16-byte fp8 loads, 16-byte stores); 64 divides 128, so a 128x128 tile's scale is one
# value per program row.
_BLOCK_R = 64
_NUM_WARPS = 4


@jit_any_count("R")
def _dequantize_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    R,
    C,
    stride_sb,
    stride_sr,
    stride_sc,
    ROW_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: rows ``pid_r * BLOCK_R ...`` x one 128-wide column block of matrix ``pid_b``."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < C)[None, :]
    offs = pid_b * R * C + rows.to(tl.int64)[:, None] * C + cols[None, :]
    d = tl.load(data_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s_offs = pid_b * stride_sb + (rows // ROW_BLOCK).to(tl.int64) * stride_sr + pid_c.to(tl.int64) * stride_sc
    s = tl.load(scale_ptr + s_offs, mask=row_ok, other=0.0)
    tl.store(out_ptr + offs, (d * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _scale_shape(shape: torch.Size, layout: str) -> tuple[int, ...]:
    """The ``scale_inv`` shape that goes with data of ``shape`` in ``layout``."""
    if layout == "rowwise":
        return (*shape[:-1], cdiv(shape[-1], BLOCK))
    if layout == "colwise":
        k, m = shape
        return (cdiv(m, BLOCK), k)
    *lead, n, k = shape
    return (*lead, cdiv(n, BLOCK), cdiv(k, BLOCK))


def _kernel_view(shape: torch.Size, layout: str) -> tuple[int, int, int, int, tuple[int, int, int]]:
    """``(B, R, C, ROW_BLOCK, (s_b, s_r, s_c))`` of the table in the module docstring."""
    if layout == "rowwise":
        c = shape[-1]
        return 1, shape.numel() // max(c, 1), c, 1, (0, cdiv(c, BLOCK), 1)
    if layout == "colwise":
        k, m = shape
        return 1, k, m, 1, (0, 1, k)
    *lead, n, k = shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    return (lead[0] if lead else 1), n, k, BLOCK, (nb * kb, kb, 1)


def launch_dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, layout: str = "rowwise", out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`dequantize`."""
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    b, r, c, row_block, strides = _kernel_view(data.shape, layout)
    if out.numel() == 0:
        return out
    grid = (cdiv(r, _BLOCK_R), cdiv(c, BLOCK), b)
    launch_kernel(
        _dequantize_kernel,
        grid,
        data,
        scale_inv,
        out,
        r,
        c,
        *strides,
        ROW_BLOCK=row_block,
        BLOCK_R=_BLOCK_R,
        BLOCK_C=BLOCK,
        num_warps=_NUM_WARPS,
    )
    return out


def dequantize_reference(
    data: torch.Tensor, scale_inv: torch.Tensor, layout: str = "rowwise", out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Torch reference (the oracle and the CPU path), built on :func:`dequantize_rows_reference`."""
    if layout == "rowwise":
        return dequantize_rows_reference(data, scale_inv, BLOCK, out_dtype)
    if layout == "colwise":
        # data[k, m] * scale_inv[m // 128, k]: row-wise blocks of data with the scales transposed.
        return dequantize_rows_reference(data, scale_inv.t(), BLOCK, out_dtype)
    n = data.shape[-2]
    row_scales = scale_inv.repeat_interleave(BLOCK, dim=-2)[..., :n, :]
    return dequantize_rows_reference(data, row_scales, BLOCK, out_dtype)


@define_op("dequantize")
def _dequantize_op(data: torch.Tensor, scale_inv: torch.Tensor, layout: str, out_dtype: torch.dtype) -> torch.Tensor:
    return dequantize_reference(data, scale_inv, layout, out_dtype)


_dequantize_op.register_kernel("cuda")(launch_dequantize)


@_dequantize_op.register_fake
def _(data: torch.Tensor, scale_inv: torch.Tensor, layout: str, out_dtype: torch.dtype) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=out_dtype)


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, layout: str = "rowwise", out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize E4M3 ``data`` with its power-of-two ``scale_inv``: ``out = data * scale_inv``.

    Args:
        data: E4M3, contiguous. ``"rowwise"``: ``[..., K]`` with 1 x 128 blocks along K.
            ``"colwise"``: ``[K, M]``, the column-wise layout stored transposed (M contiguous),
            with 128 x 1 blocks along M. ``"128x128"``: weights ``[E, N, K]`` or ``[N, K]``.
        scale_inv: fp32, contiguous, the dequantize multipliers. ``"rowwise"``: ``[..., ceil(K/128)]``.
            ``"colwise"``: ``[ceil(M/128), K]`` (``out[k, m] = data[k, m] * scale_inv[m // 128, k]``).
            ``"128x128"``: ``[E, ceil(N/128), ceil(K/128)]`` (no ``E`` dim for 2-D data).
        layout: one of ``"rowwise"``, ``"colwise"``, ``"128x128"``.
        out_dtype: fp32, bf16 or fp16; the product is computed in fp32 and rounded once.

    Returns:
        ``out_dtype`` tensor of ``data``'s shape, contiguous (``"colwise"`` stays ``[K, M]``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ndim = {"rowwise": None, "colwise": 2, "128x128": (2, 3)}[layout]
    check_fp8("data", data, ndim=ndim)
    if data.dim() == 0:
        raise ValueError("data must have at least 1 dim, got a 0-dim tensor")
    check_tensor("scale_inv", scale_inv, dtypes=torch.float32)
    check_contiguous("data", data)
    check_contiguous("scale_inv", scale_inv)
    check_same_device(data=data, scale_inv=scale_inv)
    check_shape(
        f"scale_inv (layout {layout!r}, data shape {tuple(data.shape)})", scale_inv, _scale_shape(data.shape, layout)
    )
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    check_no_grad("dequantize", data, scale_inv)
    return torch.ops.fp8flow.dequantize(data, scale_inv, layout, out_dtype)
