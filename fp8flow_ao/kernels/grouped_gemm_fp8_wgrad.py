"""grouped_gemm_fp8_wgrad: per expert ``dW_e = dY_e^T @ X_e`` from column-wise (transposed) 1x128 FP8.

The weight-gradient GEMM of the routed experts. Both operands are column-wise FP8, i.e. the data
physically transposed so the token dim (the reduction dim here) is contiguous, as Hopper's FP8
tensor cores need: ``a_t`` = dY^T ``[N, M]`` with scales ``[M/128, N]``, ``b_t`` = X^T ``[K, M]``
with scales ``[M/128, K]`` (one scale per 128 tokens x 1 feature). The reduction over expert
``e``'s rows runs in 128-row blocks; each block's tensor-core partial is promoted into the fp32
accumulator with the outer product ``a_t_scale[mb, n] * b_t_scale[mb, k]``.

Kernel: a persistent grid walks (expert, N tile, K tile) output tiles; each tile reads its expert's
rows from the group end offsets on the device (no host sync). An empty expert runs no block and
stores zeros.
"""

from __future__ import annotations

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
from fp8flow_ao._format import BLOCK
from fp8flow_ao.kernels._grouped_gemm_common import (
    BLOCK_K,
    autotuned,
    check_tma_operand,
    gemm_config,
    group_rows,
    grouped_tile,
    interpreting,
    launch,
    persistent_grid,
    set_tma_workspace_allocator,
)

OUT_DTYPES = (torch.float32, torch.bfloat16)
# TMA row alignment: the token dim M is the contiguous one, so it must be a multiple of 16.
_M_ALIGN = 16

# Launch configs, from the sweeps in benchmarks/results/grouped_gemm_notes.md (H200): 64x128 or
# 128x64 output tiles with 2 programs per SM, whose MMAs overlap each other's promotions, beat one
# 128x128 program per SM (its accumulator + partial + pipelined per-column scales take 255
# registers) by 3-20%. Two programs fit: 3 stages of operand tiles + the 32 KiB fp32 output tile
# come to 105 KiB of shared memory each.
WGRAD_CONFIGS = [
    gemm_config(64, 128, num_warps=4, num_stages=3, programs_per_sm=2),
    gemm_config(128, 64, num_warps=8, num_stages=3, programs_per_sm=2),
]
INTERPRET_CONFIG = gemm_config(128, 128, num_warps=8, num_stages=1, group_m=2)


@triton.jit
def _grouped_gemm_fp8_wgrad_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    out_ptr,
    ends_ptr,
    M,
    N,
    K,
    E,
    stride_a,
    stride_b,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # sizes the grid only
):
    """Persistent blockwise FP8 grouped weight-gradient GEMM.

    a = dY^T ``[N, M]`` (row stride ``stride_a``), a_scale ``[M/128, N]`` contiguous,
    b = X^T ``[K, M]`` (row stride ``stride_b``), b_scale ``[M/128, K]`` contiguous,
    out ``[E, N, K]`` contiguous, ends ``[E]`` int32 group end offsets. Output tile = BLOCK_M rows
    of N x BLOCK_N columns of K.
    """
    row_blocks = tl.cdiv(M, BLOCK_K)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, M], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, M], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_n = tl.cdiv(N, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_N)
    tiles_per_expert = num_n * num_k
    # (No loop flattening: the reduction length is data-dependent, which the compiler cannot fuse.)
    for tile in range(tl.program_id(0), E * tiles_per_expert, tl.num_programs(0)):
        e = tile // tiles_per_expert
        pid_n, pid_k = grouped_tile(tile % tiles_per_expert, num_n, num_k, GROUP_M)
        n0 = pid_n * BLOCK_M
        k0 = pid_k * BLOCK_N
        start, end = group_rows(ends_ptr, e)
        # Clamp to the rows that exist: bad offsets may skip work but never read out of bounds.
        first_block = start // BLOCK_K
        last_block = tl.minimum(end // BLOCK_K, row_blocks)
        cols_n = n0 + tl.arange(0, BLOCK_M)
        cols_k = k0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for mb in range(first_block, last_block):
            a = a_desc.load([n0, mb * BLOCK_K])
            b = b_desc.load([k0, mb * BLOCK_K])
            # Scales by pointer loads, which the compiler pipelines like the operands. (By TMA, the
            # [1, BLOCK] scale rows were loaded synchronously every block: 2x slower.)
            sa = tl.load(a_scale_ptr + mb * N + cols_n, mask=cols_n < N, other=0.0)
            sb = tl.load(b_scale_ptr + mb * K + cols_k, mask=cols_k < K, other=0.0)
            acc = tl.dot(a, b.T) * (sa[:, None] * sb[None, :]) + acc
        out_desc.store([e * N + n0, k0], acc.to(out_ptr.dtype.element_ty))


_grouped_gemm_fp8_wgrad_tuned = autotuned(WGRAD_CONFIGS)(_grouped_gemm_fp8_wgrad_kernel)


def launch_grouped_gemm_fp8_wgrad(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`grouped_gemm_fp8_wgrad`.

    ``config`` pins one launch config (tests, config sweeps); by default the GPU autotunes over
    :data:`WGRAD_CONFIGS` and the interpreter runs :data:`INTERPRET_CONFIG`.
    """
    n, m = a_t.shape
    k = b_t.shape[0]
    e = group_end_offsets.shape[0]
    if m == 0:
        return torch.zeros((e, n, k), dtype=out_dtype, device=a_t.device)
    out = torch.empty((e, n, k), dtype=out_dtype, device=a_t.device)
    check_tma_operand("a_t", a_t)
    check_tma_operand("b_t", b_t)
    set_tma_workspace_allocator(a_t.device)
    grid = persistent_grid(
        a_t.device, lambda meta: e * triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"])
    )
    launch(
        _grouped_gemm_fp8_wgrad_tuned,
        grid,
        a_t,
        a_t_scale,
        b_t,
        b_t_scale,
        out,
        group_end_offsets,
        m,
        n,
        k,
        e,
        a_t.stride(0),
        b_t.stride(0),
        config=INTERPRET_CONFIG if config is None and interpreting() else config,
    )
    return out


def _dequantize_columns(data_t: torch.Tensor, scale_t: torch.Tensor) -> torch.Tensor:
    """Column-wise FP8 ``[C, M]`` with scales ``[ceil(M/128), C]`` -> fp32 ``[C, M]``."""
    m = data_t.shape[1]
    return data_t.float() * scale_t.T.repeat_interleave(BLOCK, dim=1)[:, :m]


def grouped_gemm_fp8_wgrad_reference(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Torch reference (the oracle and the CPU path): dequantize, then one fp32 matmul per expert.

    Rows of each operand outside every group (at or past the last end) are masked out, so they are
    never part of any expert's sum.
    """
    m = a_t.shape[1]
    a32 = _dequantize_columns(a_t, a_t_scale)
    b32 = _dequantize_columns(b_t, b_t_scale)
    rows = torch.arange(m, device=a_t.device, dtype=torch.int32)
    owner = torch.searchsorted(group_end_offsets, rows, right=True)
    out = [
        # zero the other rows first, so NaN/inf outside the group cannot leak in through 0 * inf
        torch.where((owner == e)[None, :], a32, 0.0) @ torch.where((owner == e)[None, :], b32, 0.0).T
        for e in range(group_end_offsets.shape[0])
    ]
    return torch.stack(out).to(out_dtype)


@torch.library.custom_op("fp8flow::grouped_gemm_fp8_wgrad", mutates_args=())
def _grouped_gemm_fp8_wgrad_op(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return grouped_gemm_fp8_wgrad_reference(a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, out_dtype)


_grouped_gemm_fp8_wgrad_op.register_kernel("cuda")(launch_grouped_gemm_fp8_wgrad)


@_grouped_gemm_fp8_wgrad_op.register_fake
def _(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a_t.new_empty((group_end_offsets.shape[0], a_t.shape[0], b_t.shape[0]), dtype=out_dtype)


def _check_inputs(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> None:
    check_fp8("a_t", a_t, ndim=2)
    check_fp8("b_t", b_t, ndim=2)
    check_tensor("a_t_scale", a_t_scale, dtypes=torch.float32, ndim=2)
    check_tensor("b_t_scale", b_t_scale, dtypes=torch.float32, ndim=2)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    n, m = a_t.shape
    k, mb = b_t.shape
    if mb != m:
        raise ValueError(f"b_t must have M = {m} (a_t's dim 1) tokens in dim 1, got shape {tuple(b_t.shape)}")
    check_multiple("a_t", n, what="N (dim 0)")
    check_multiple("b_t", k, what="K (dim 0)")
    check_multiple("a_t", m, _M_ALIGN, what="M (dim 1, the contiguous token dim; TMA row alignment)")
    check_group_end_offsets("group_end_offsets", group_end_offsets, rows=m)
    if group_end_offsets.shape[0] == 0:
        raise ValueError("group_end_offsets must hold at least one expert, got an empty tensor")
    blocks = -(-m // BLOCK)
    check_shape("a_t_scale", a_t_scale, (blocks, n))
    check_shape("b_t_scale", b_t_scale, (blocks, k))
    for name, t in (("a_t", a_t), ("b_t", b_t), ("a_t_scale", a_t_scale), ("b_t_scale", b_t_scale)):
        check_contiguous(name, t)  # tokens contiguous: the reduction dim must be K-major for the tensor cores
    check_same_device(a_t=a_t, a_t_scale=a_t_scale, b_t=b_t, b_t_scale=b_t_scale, group_end_offsets=group_end_offsets)


def grouped_gemm_fp8_wgrad(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Blockwise FP8 grouped weight gradient: ``out[e] = dequant(a_t)[:, rows_e] @ dequant(b_t)[:, rows_e]^T``.

    With ``a_t`` = dY^T and ``b_t`` = X^T this is ``dW_e = dY_e^T X_e`` for every expert ``e``,
    where ``rows_e = [end[e-1], end[e])``.

    Args:
        a_t: E4M3 ``[N, M]`` contiguous (column-wise dY: tokens contiguous), ``N % 128 == 0``,
            ``M % 16 == 0`` (TMA row alignment).
        a_t_scale: fp32 ``[ceil(M/128), N]`` contiguous: one ``scale_inv`` per 128 tokens x 1 column.
        b_t: E4M3 ``[K, M]`` contiguous (column-wise X), ``K % 128 == 0``.
        b_t_scale: fp32 ``[ceil(M/128), K]`` contiguous.
        group_end_offsets: int32 ``[E]`` on the operands' device: padded group END offsets,
            non-decreasing multiples of 128, last ``<= M``. Values are checked only with
            ``FP8FLOW_VALIDATE=1`` (the check syncs the device).
        out_dtype: ``torch.float32`` (default) or ``torch.bfloat16``.

    Returns:
        ``[E, N, K]`` contiguous ``out_dtype``: fp32 accumulation, each 128-token block's partial
        promoted by ``a_t_scale[mb, n] * b_t_scale[mb, k]``. An empty expert yields zeros; tokens at
        or past the last group end are never read.
    """
    _check_inputs(a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, out_dtype)
    return torch.ops.fp8flow.grouped_gemm_fp8_wgrad(a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, out_dtype)
