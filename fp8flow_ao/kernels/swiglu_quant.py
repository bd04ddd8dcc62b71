"""swiglu_quant: fused SwiGLU (x router prob) + 1x128 E4M3 quantization, forward and backward.

The MoE layer runs FC1 as one grouped GEMM against ``cat([w1, w3], dim=-2)``, so its output
``h`` is ``[M, 2H]`` BF16 with the gate in columns ``[0, H)`` and the up projection in ``[H, 2H)``.

Forward: ``a = silu(gate) * up * prob`` in fp32, quantized 1x128 straight to E4M3 (FC2's operand);
no BF16 activation is written.

Two places for the router prob ``p``, one constexpr flag of both kernels:

* after the experts (torchtitan's ``score_before_experts=False``, DeepSeek-V3, Qwen3): ``p`` scales
  the expert's output, and FC2 is linear, so it scales ``a``: ``a = silu(g) * u * p``;
* before the experts (``score_before_experts=True``, Llama 4): the expert sees ``p * x``, and FC1
  is linear, so SwiGLU's inputs are ``p * h``: ``a = silu(p * g) * (p * u)``. The expert input
  stays the unscaled token (quantized once, before dispatch), so the two-cast count is unchanged.

Backward: from ``grad_a`` (FC2's dgrad, BF16 ``[M, H]``) and ``h``, in fp32. After the experts::

    s = 1 / (1 + exp(-g));  silu = g * s
    d_up = (grad_a * silu) * p;  d_gate = (grad_a * up * p) * (s * (1 + g * (1 - s)))
    grad_probs[m] = sum_h (grad_a * silu) * up

Before the experts, with ``g' = p * g`` and ``u' = p * u`` (SwiGLU's inputs) and ``s = sigmoid(g')``::

    dsilu = s * (1 + g' * (1 - s));  t_up = grad_a * (g' * s);  t_gate = grad_a * u' * dsilu
    d_up = t_up * p;  d_gate = t_gate * p   (t: the gradients w.r.t. g', u')
    grad_probs[m] = sum_h (t_gate * g + t_up * u) = sum_h grad_a * u * g' * (s + dsilu)

``dh = [d_gate | d_up]`` goes straight to E4M3 twice from the same fp32 values: row-wise (FC1 dgrad)
and column-wise, physically transposed (FC1 wgrad; ``transpose=False`` skips it where no FC1 wgrad runs,
e.g. frozen expert weights). One kernel, no BF16 ``dh``.

Where the work is saved: the backward recomputes ``sigmoid(gate)`` from ``h`` (an exp and a
division per element) instead of reading anything more that the forward could have stored (4 more
bytes per element, written once and read once). The forward writes only ``a``'s FP8 data and scales,
which the layer keeps for FC2's wgrad (or recomputes under ``recompute_experts``).

Layouts (every tensor contiguous unless said otherwise; ``scale_inv`` = dequantize multiplier, a
power of two, fp32):

* ``h`` ``[M, 2H]`` and ``grad_a`` ``[M, H]``: row-major (last dim contiguous; row stride free).
* ``a_data [M, H]`` + ``a_scale [M, H/128]``; ``dh_data [M, 2H]`` + ``dh_scale [M, 2H/128]``: row-wise.
* ``dh_t_data [2H, M]`` (tokens contiguous) + ``dh_t_scale [M/128, 2H]``: column-wise, one scale per
  (128-row block, column).
* Rows at or after the last group end offset are neither read nor computed: data 0, scale 0,
  ``grad_probs`` 0. (Pad rows *inside* a group cannot be told apart from real rows by the end
  offsets alone: there FC1 wrote zeros, so the data is 0 and the scale the all-zero block's tiny one.)

Kernels: the forward is a Triton kernel. The backward runs, on Hopper, a warp-specialized TMA-ring kernel
(``launch_swiglu_quant_backward_sm90``: a loader warp keeps two tiles' ``grad_a``, gate and up boxes in flight
beside an 8-warp partition that holds a tile's d_gate and d_up in registers for both quantizations; 0.72-0.74x
the Triton kernel's device time, 61-72% of copy bandwidth, the same ``dh`` bits; H200, 2026-11-27) wherever TMA can load
``grad_a`` and ``h`` (bases and row strides on 16-byte boundaries), and the Triton kernel
(``launch_swiglu_quant_backward``) elsewhere.

Numerics: the kernels and the references evaluate the same formulas in the same order, in fp32,
with no fused multiply-add (``enable_fp_fusion=False``). ``exp`` and the division are the only
steps whose rounding can differ: torch's CPU ``exp``, numpy's (the interpreter) and the GPU's
``ex2.approx.ftz`` differ by an ulp or two, and the GPU takes the reciprocal with ``rcp.approx.ftz`` (within 1 ulp),
which moves an E4M3 rounding at a few elements per million and, far more rarely, a scale whose block maximum sits next to a power of
two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.language.extra import libdevice

from fp8flow_ao._checks import (
    check_bool,
    check_contiguous,
    check_group_end_offsets,
    check_multiple,
    check_no_grad,
    check_row_major,
    check_same_device,
    check_shape,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, empty_row_and_column_wise, quantize_rows_reference
from fp8flow_ao.kernels._grouped_gemm_common import check_tma_operand, interpreting, sm_count
from fp8flow_ao.kernels._launch import cdiv, launch_kernel
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._sm90_common import (
    SM90_BLOCK,
    compile_for_sm90,
    descriptor,
    descriptor_signature,
    partition_barrier,
    shared_reinterpret,
    sm90_supported,
    sm90_takes_plain_form,
    tile_ring_loader,
    tile_smem_layout,
)
from fp8flow_ao.kernels._triton_common import (
    last_group_end,
    pow2_scale_inv_and_scale,
    reencode_tile_transposed,
    store_colwise_transposed,
    store_rowwise,
)
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose_reference


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of one kernel (they never change ``dh``; ``grad_probs`` is summed in another order).

    block_m: rows per program (the backward's is 128: one column-wise scale block).
    num_warps: warps per program.
    num_stages: software-pipeline stages of the backward's loop over 128-column tiles.
    col_tiles: backward only: 128-column tiles of ``H`` one program walks (0: all of ``H``). Fewer
        tiles give more programs (and, with fewer registers, more of them per SM); each program then
        writes a partial ``grad_probs`` that the launcher sums.
    maxnreg: register cap per thread (``None``: the compiler's choice).
    """

    block_m: int
    num_warps: int
    num_stages: int = 1
    col_tiles: int = 0
    maxnreg: int | None = None


# Forward: 32 rows x 128 columns of gate and of up per program (16 KiB of BF16), 48 registers with
# 4 warps: many programs share an SM, so one program's loads overlap another's math (H200 sweep,
# 2026-11-24: 87-95% of copy bandwidth, device-only; block_m 16 to 64 within 4%).
FORWARD_CONFIG = LaunchConfig(block_m=32, num_warps=4)
# Forward with ``a``'s scaling-aware transpose: a program owns a 128-row block (the transposed tile's scale
# block); only ``num_warps`` is free.
TRANSPOSE_CONFIG = LaunchConfig(block_m=128, num_warps=8)
_TL_BLOCK = tl.constexpr(BLOCK)


def backward_configs() -> list[LaunchConfig]:
    """Launch candidates of the backward timed by ``benchmarks/bench_swiglu_quant.py --sweep``; the first
    is :data:`BACKWARD_CONFIG`.

    A program owns one 128-row block (the column-wise scale block), so it owns every scale block it
    writes, and walks ``col_tiles`` 128-column tiles of H. The block is held as four 32-row slices for the
    transposed stores (``store_colwise_transposed``: 4-byte shared-memory moves instead of ``tl.trans``'s
    one-byte ones, for which ncu counted ~1800 bank conflicts a program each way). Device time on one H200
    (triton 3.6, 2026-11-27, ``swiglu_quant_sweep.md``, M = 32768, H = 2048 / 768; registers from ptxas):
    one tile a program at 8 warps (209 registers, 3704 SASS instructions a thread, no spill) 333 / 136 us,
    48% / 44% of copy bandwidth (the same kernel on a whole 128 x 128 tile with ``tl.trans``: 245
    registers, 3832 instructions, 356 / 145 us); capped at 128 registers 349 / 135 us; 16 warps 400 / 161
    us; two tiles a program 474 / 186 us; all of H with 2 pipeline stages 864 / 324 us. Far from copy
    bandwidth: ~60 instructions per (gate, up) pair against 10 bytes, and one 8-warp program per SM (ncu:
    12.5% occupancy, 0.36 instructions issued per scheduler a cycle, 42% of DRAM bandwidth;
    ``benchmarks/results/memory_bound_notes.md``). On Hopper the op runs
    :func:`launch_swiglu_quant_backward_sm90` instead, where TMA can load the inputs.
    """
    return [
        LaunchConfig(block_m=BLOCK, num_warps=8, num_stages=1, col_tiles=1),
        LaunchConfig(block_m=BLOCK, num_warps=8, num_stages=1, col_tiles=1, maxnreg=128),
        LaunchConfig(block_m=BLOCK, num_warps=8, num_stages=1, col_tiles=2),
        LaunchConfig(block_m=BLOCK, num_warps=8, num_stages=2),
        LaunchConfig(block_m=BLOCK, num_warps=16, num_stages=1, col_tiles=1),
        LaunchConfig(block_m=BLOCK, num_warps=16, num_stages=1),
    ]


BACKWARD_CONFIG = backward_configs()[0]


@triton.jit
def _sigmoid(g, APPROX: tl.constexpr):
    """1 / (1 + exp(-g)), as the reference writes it.

    With ``APPROX`` (the GPU): ``ex2.approx.ftz`` (``__expf``) and ``rcp.approx.ftz``: 4 instructions an
    element instead of 12 (``ex2.approx`` without ftz and ``div.full`` each add a compare and two predicated
    multiplies for subnormal or huge operands). ``rcp.approx.ftz`` gives ``div.approx.ftz(1, d)``'s bits (both
    flush a subnormal quotient) without the flushing add ptxas puts after the latter. The results differ from
    the plain form's only where it keeps a subnormal (``exp(-g)`` for g > 87, the quotient when ``1 + exp(-g) >
    2**126``) and these flush it to 0: by at most 2**-126. Without it (the CPU interpreter, which has no
    libdevice nor PTX), ``tl.exp`` and ``/``; never ``tl.div_rn``, whose slow-path subroutine call at every
    element made ptxas spill the whole tile.
    """
    if APPROX:
        d = 1.0 + libdevice.fast_expf(g * -1.0)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], tl.float32, True, 1)
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _swiglu_rows(
    h_ptr,
    probs_ptr,
    rows,
    row_ok,
    cols,
    H,
    stride_hm,
    HAS_PROBS: tl.constexpr,
    SCORE_BEFORE_EXPERTS: tl.constexpr,
    APPROX: tl.constexpr,
):
    """fp32 ``a [R, 128]`` of rows ``rows`` and columns ``cols`` of H (reads those columns of gate and of up);
    0 in rows not ``row_ok``."""
    rows64 = rows.to(tl.int64)
    gate_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    g = tl.load(gate_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + H, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if SCORE_BEFORE_EXPERTS:  # the expert saw p * x: FC1 is linear, so SwiGLU's inputs are p * h
        g = g * p
        u = u * p
    a = g * _sigmoid(g, APPROX) * u
    if HAS_PROBS and not SCORE_BEFORE_EXPERTS:
        a = a * p
    return a


@triton.jit
def _swiglu_quant_rows(
    rows,
    h_ptr,
    probs_ptr,
    end,
    cols,
    H,
    stride_hm,
    data_ptr,
    scale_inv_ptr,
    pid_h,
    HAS_PROBS: tl.constexpr,
    SCORE_BEFORE_EXPERTS: tl.constexpr,
    APPROX: tl.constexpr,
):
    """``a`` of rows ``rows`` (those before ``end``) and columns ``cols``, quantized 1x128 and stored row-wise;
    returns what was stored (:func:`~fp8flow_ao.kernels._triton_common.store_rowwise`)."""
    ok = rows < end
    a = _swiglu_rows(h_ptr, probs_ptr, rows, ok, cols, H, stride_hm, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX)
    return store_rowwise(a, rows, ok, data_ptr, scale_inv_ptr, cols.to(tl.int64), H, H // _TL_BLOCK, pid_h)


@triton.jit
def _swiglu_quant_kernel(
    h_ptr,
    probs_ptr,
    offsets_ptr,
    data_ptr,
    scale_inv_ptr,
    data_t_ptr,
    scale_inv_t_ptr,
    M,
    H,
    stride_hm,
    num_groups,
    HAS_PROBS: tl.constexpr,
    SCORE_BEFORE_EXPERTS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    APPROX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows x one 128-column block of ``a`` (reads that block of gate and of up).

    With ``TRANSPOSE`` (``BLOCK_M`` = 128) the block is held as four 32-row slices (rows ``4q + b``): each
    slice is quantized row-wise and stored, then the tile of those E4M3 rows is re-encoded to one scale and
    stored transposed -- :func:`scaling_aware_transpose`'s tile, bit for bit, without writing ``a`` and
    reading it back."""
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    cols = pid_h * _TL_BLOCK + tl.arange(0, _TL_BLOCK)
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    args = (h_ptr, probs_ptr, end, cols, H, stride_hm, data_ptr, scale_inv_ptr, pid_h)
    if not TRANSPOSE:
        _swiglu_quant_rows(row0 + tl.arange(0, BLOCK_M), *args, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX)
    else:
        rows = row0 + 4 * tl.arange(0, BLOCK_M // 4)  # slice b holds rows + b
        q0, s0 = _swiglu_quant_rows(rows, *args, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX)
        q1, s1 = _swiglu_quant_rows(rows + 1, *args, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX)
        q2, s2 = _swiglu_quant_rows(rows + 2, *args, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX)
        q3, s3 = _swiglu_quant_rows(rows + 3, *args, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX)
        y_t, s_max = reencode_tile_transposed(q0, q1, q2, q3, s0, s1, s2, s3)
        tokens = row0 + tl.arange(0, BLOCK_M)
        cols64 = cols.to(tl.int64)
        tl.store(data_t_ptr + cols64[:, None] * M + tokens[None, :], y_t)
        tl.store(scale_inv_t_ptr + pid_m.to(tl.int64) * H + cols64, tl.zeros([_TL_BLOCK], tl.float32) + s_max)


@triton.jit
def _dh_math(ga, g, u, p, HAS_PROBS: tl.constexpr, SCORE_BEFORE_EXPERTS: tl.constexpr, APPROX: tl.constexpr):
    """``(d_gate, d_up, grad_probs terms)`` in fp32 from fp32 ``grad_a``, gate and up tiles and the rows'
    probs ``p`` (``[R, 1]``; unused without ``HAS_PROBS``): the formulas of the module docstring in the
    reference's order. With probs the terms sum along a row to that row's share of ``grad_probs`` (without,
    they mean nothing and are not used). Shared by the Triton and the Hopper kernels."""
    if SCORE_BEFORE_EXPERTS:
        # SwiGLU's inputs were g' = p * gate and u' = p * up. grad_probs = sum(t_gate * gate +
        # t_up * up) (t: the gradients w.r.t. g', u'), written as sum(grad_a * up * g' * (s + dsilu))
        # so that gate and up die early.
        gp = g * p
        s = _sigmoid(gp, APPROX)
        d_up = ga * (gp * s)
        gu = ga * u
        dsilu = s * (1.0 + gp * (1.0 - s))
        terms = gu * (gp * (s + dsilu))
        d_up = d_up * p
        d_gate = ((gu * p) * dsilu) * p
    else:
        s = _sigmoid(g, APPROX)
        d_up = ga * (g * s)
        d_gate = ga * u
        terms = d_up  # a placeholder: without probs no grad_probs is written
        if HAS_PROBS:
            terms = d_up * u
            d_up = d_up * p
            d_gate = d_gate * p
        d_gate = d_gate * (s * (1.0 + g * (1.0 - s)))
    return d_gate, d_up, terms


@triton.jit
def _dh_slice(
    grad_a_ptr,
    h_ptr,
    p,
    rows,
    row_ok,
    cols,
    H,
    stride_gm,
    stride_hm,
    HAS_PROBS: tl.constexpr,
    SCORE_BEFORE_EXPERTS: tl.constexpr,
    APPROX: tl.constexpr,
):
    """``d_gate``, ``d_up`` (fp32 ``[R, 128]``) of rows ``rows`` and columns ``cols`` of H, and those
    columns' terms of ``grad_probs`` summed per row (``[R]``, with probs); 0 in rows not ``row_ok``. ``p``: the
    rows' probs ``[R, 1]`` (unused without ``HAS_PROBS``)."""
    rows64 = rows.to(tl.int64)
    ga = tl.load(grad_a_ptr + rows64[:, None] * stride_gm + cols[None, :], mask=row_ok[:, None], other=0.0)
    gate_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    g = tl.load(gate_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + H, mask=row_ok[:, None], other=0.0).to(tl.float32)
    d_gate, d_up, terms = _dh_math(ga.to(tl.float32), g, u, p, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX)
    return d_gate, d_up, tl.sum(terms, axis=1)


@triton.jit
def _store_both_ways(
    x0, x1, x2, x3, row0, rows, ok0, ok1, ok2, ok3, col0, end, M, two_h, out_ptrs, TRANSPOSE: tl.constexpr
):
    """Quantize one fp32 128-row x 128-column tile of ``dh`` (columns ``col0 + [0, 128)``), held as four
    row slices (``x<b>``: rows ``rows + b``, computed where ``ok<b>``), both ways: row-wise into ``dh``,
    and with ``TRANSPOSE`` column-wise (transposed, tokens contiguous) into ``dh_t`` with its scales in the
    row of column-wise scales of this 128-row block. Both from the same fp32 values. ``out_ptrs``: ``(dh,
    dh_scale, dh_t, that scale row)``."""
    dh_ptr, dh_scale_ptr, dh_t_ptr, scale_t_row_ptr = out_ptrs
    width: tl.constexpr = 4 * x0.shape[0]
    cols64 = (col0 + tl.arange(0, width)).to(tl.int64)
    per_row = two_h // width
    tile = col0 // width
    store_rowwise(x0, rows, ok0, dh_ptr, dh_scale_ptr, cols64, two_h, per_row, tile)
    store_rowwise(x1, rows + 1, ok1, dh_ptr, dh_scale_ptr, cols64, two_h, per_row, tile)
    store_rowwise(x2, rows + 2, ok2, dh_ptr, dh_scale_ptr, cols64, two_h, per_row, tile)
    store_rowwise(x3, rows + 3, ok3, dh_ptr, dh_scale_ptr, cols64, two_h, per_row, tile)
    if TRANSPOSE:
        store_colwise_transposed(x0, x1, x2, x3, row0, cols64, M, dh_t_ptr, scale_t_row_ptr, row0 < end)


@triton.jit
def _swiglu_quant_backward_kernel(
    grad_a_ptr,
    h_ptr,
    probs_ptr,
    offsets_ptr,
    dh_ptr,
    dh_scale_ptr,
    dh_t_ptr,
    dh_t_scale_ptr,
    grad_probs_ptr,
    M,
    H,
    stride_gm,
    stride_hm,
    num_groups,
    HAS_PROBS: tl.constexpr,
    SCORE_BEFORE_EXPERTS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    APPROX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    COL_TILES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """One program: one 128-row block x ``COL_TILES`` 128-column tiles of H (program axis 1 picks
    which); writes the d_gate and d_up tiles of ``dh`` row-wise and, with ``TRANSPOSE``, column-wise, and the
    block's partial ``grad_probs`` over those columns (row ``program_id(1)`` of ``grad_probs_ptr [S, M]``).

    The block is held as four 32-row slices (rows ``4q + b``), so that the column-wise data is
    transposed by :func:`~fp8flow_ao.kernels._triton_common.transpose_row_slices` (4 bytes at a time
    through shared memory)."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    row0 = pid * BLOCK_M
    rows = row0 + 4 * tl.arange(0, BLOCK_M // 4)  # slice b holds rows + b
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    ok0, ok1, ok2, ok3 = rows < end, rows + 1 < end, rows + 2 < end, rows + 3 < end
    out_ptrs = (dh_ptr, dh_scale_ptr, dh_t_ptr, dh_t_scale_ptr + pid.to(tl.int64) * 2 * H)
    # Without probs these are neither loaded (masked off) nor used.
    p0 = tl.load(probs_ptr + rows, mask=ok0 & HAS_PROBS, other=0.0)[:, None]
    p1 = tl.load(probs_ptr + rows + 1, mask=ok1 & HAS_PROBS, other=0.0)[:, None]
    p2 = tl.load(probs_ptr + rows + 2, mask=ok2 & HAS_PROBS, other=0.0)[:, None]
    p3 = tl.load(probs_ptr + rows + 3, mask=ok3 & HAS_PROBS, other=0.0)[:, None]
    gp0 = tl.zeros([BLOCK_M // 4], dtype=tl.float32)
    gp1 = tl.zeros([BLOCK_M // 4], dtype=tl.float32)
    gp2 = tl.zeros([BLOCK_M // 4], dtype=tl.float32)
    gp3 = tl.zeros([BLOCK_M // 4], dtype=tl.float32)
    col_begin = pid_s * (COL_TILES * BLOCK_H)
    col_end = tl.minimum(col_begin + COL_TILES * BLOCK_H, H)
    for col0 in tl.range(col_begin, col_end, BLOCK_H, num_stages=NUM_STAGES):
        cols = col0 + tl.arange(0, BLOCK_H)
        g0, u0, t0 = _dh_slice(
            grad_a_ptr, h_ptr, p0, rows, ok0, cols, H, stride_gm, stride_hm, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX
        )
        g1, u1, t1 = _dh_slice(
            grad_a_ptr, h_ptr, p1, rows + 1, ok1, cols, H, stride_gm, stride_hm, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX
        )
        g2, u2, t2 = _dh_slice(
            grad_a_ptr, h_ptr, p2, rows + 2, ok2, cols, H, stride_gm, stride_hm, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX
        )
        g3, u3, t3 = _dh_slice(
            grad_a_ptr, h_ptr, p3, rows + 3, ok3, cols, H, stride_gm, stride_hm, HAS_PROBS, SCORE_BEFORE_EXPERTS, APPROX
        )
        gp0 += t0
        gp1 += t1
        gp2 += t2
        gp3 += t3
        # d_gate first: only d_up stays live across its quantization (fewest registers).
        ok = (ok0, ok1, ok2, ok3)
        _store_both_ways(g0, g1, g2, g3, row0, rows, *ok, col0, end, M, 2 * H, out_ptrs, TRANSPOSE)
        _store_both_ways(u0, u1, u2, u3, row0, rows, *ok, H + col0, end, M, 2 * H, out_ptrs, TRANSPOSE)
    if HAS_PROBS:
        partial = grad_probs_ptr + pid_s.to(tl.int64) * M + rows
        tl.store(partial, gp0)
        tl.store(partial + 1, gp1)
        tl.store(partial + 2, gp2)
        tl.store(partial + 3, gp3)


# The interpreter (TRITON_INTERPRET=1, read by triton.jit at import as here) has no libdevice: the plain
# sigmoid there (see ``_sigmoid``), whatever device the tensors are on.
_APPROX = not interpreting()


def _kernel_flags(
    probs: torch.Tensor | None, group_end_offsets: torch.Tensor | None, score_before_experts: bool
) -> dict[str, bool]:
    """The optional inputs' constexpr flags, shared by every kernel of the op (the Triton kernels add ``APPROX``).
    Absent optional inputs pass a pointer of the launch's that is never read."""
    return {
        "HAS_PROBS": probs is not None,
        "SCORE_BEFORE_EXPERTS": bool(score_before_experts),
        "HAS_OFFSETS": group_end_offsets is not None,
    }


def _no_column_wise(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The column-wise pair's place without ``transpose``: empty ``(0,)`` tensors (custom ops return no ``None``)."""
    return h.new_empty((0,), dtype=FP8_DTYPE), h.new_empty((0,), dtype=torch.float32)


def _allocate_outputs(h: torch.Tensor, width: int, transpose: bool) -> tuple[torch.Tensor, ...]:
    """E4M3 ``[M, width]`` row-wise with its scales, and column-wise with ``transpose`` (else
    :func:`_no_column_wise`), for ``h``'s ``M`` rows: the forward's ``a`` (``width = H``), the backward's ``dh``
    (``2H``)."""
    m = h.shape[0]
    if transpose:
        return empty_row_and_column_wise(h, m, width)
    row_wise = h.new_empty((m, width), dtype=FP8_DTYPE), h.new_empty((m, width // BLOCK), dtype=torch.float32)
    return *row_wise, *_no_column_wise(h)


def launch_swiglu_quant(
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
    transpose: bool = False,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``) of the op ``fp8flow::swiglu_quant``:
    :func:`swiglu_quant`'s four outputs, the column-wise pair empty ``(0,)`` tensors without ``transpose``.
    ``config``: :data:`FORWARD_CONFIG` / :data:`TRANSPOSE_CONFIG` when ``None``."""
    config = config or (TRANSPOSE_CONFIG if transpose else FORWARD_CONFIG)
    if (config.block_m != BLOCK) if transpose else (BLOCK % config.block_m):
        need = f"block_m == {BLOCK}" if transpose else f"block_m dividing {BLOCK} (M is a multiple of it)"
        raise ValueError(f"the forward{' with transpose' if transpose else ''} needs {need}, got {config}")
    m, two_h = h.shape
    hidden = two_h // 2
    out = _allocate_outputs(h, hidden, transpose)
    if m == 0:
        return out
    args = (h, h if probs is None else probs, h if group_end_offsets is None else group_end_offsets)
    sizes = (m, hidden, h.stride(0), 0 if group_end_offsets is None else group_end_offsets.numel())
    launch_kernel(
        _swiglu_quant_kernel,
        (cdiv(m, config.block_m), hidden // BLOCK),
        *args,
        *(out if transpose else out[:2] * 2),  # without the transpose its pointers are never written
        *sizes,
        **_kernel_flags(probs, group_end_offsets, score_before_experts),
        APPROX=_APPROX,
        BLOCK_M=config.block_m,
        TRANSPOSE=transpose,
        num_warps=config.num_warps,
        enable_fp_fusion=False,  # no fma contraction: the same roundings as the reference
    )
    return out


def launch_swiglu_quant_backward(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
    transpose: bool = True,
    config: LaunchConfig = BACKWARD_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as the op
    ``fp8flow::swiglu_quant_backward`` (``grad_probs`` is an empty tensor without ``probs``; the column-wise pair
    empty ``(0,)`` tensors without ``transpose``)."""
    if config.block_m != BLOCK:
        raise ValueError(f"the backward needs block_m == {BLOCK} (one column-wise scale block), got {config}")
    m, two_h = h.shape
    h_tiles = two_h // 2 // BLOCK
    col_tiles = min(config.col_tiles or h_tiles, h_tiles)
    splits = cdiv(h_tiles, col_tiles)
    dh, dh_scale, dh_t, dh_t_scale, partials = _allocate_backward(h, splits, probs, transpose)
    if m == 0:
        return dh, dh_scale, dh_t, dh_t_scale, partials[0]
    launch_kernel(
        _swiglu_quant_backward_kernel,
        (m // BLOCK, splits),
        grad_a,
        h,
        h if probs is None else probs,
        h if group_end_offsets is None else group_end_offsets,
        dh,
        dh_scale,
        dh_t if transpose else dh,  # without the transpose these pointers are never written
        dh_t_scale if transpose else dh_scale,
        h if probs is None else partials,
        m,
        two_h // 2,
        grad_a.stride(0),
        h.stride(0),
        0 if group_end_offsets is None else group_end_offsets.numel(),
        **_kernel_flags(probs, group_end_offsets, score_before_experts),
        APPROX=_APPROX,
        BLOCK_M=BLOCK,
        BLOCK_H=BLOCK,
        COL_TILES=col_tiles,
        NUM_STAGES=config.num_stages,
        TRANSPOSE=transpose,
        num_warps=config.num_warps,
        maxnreg=config.maxnreg,
        enable_fp_fusion=False,  # no fma contraction: the same roundings as the reference
    )
    return dh, dh_scale, dh_t, dh_t_scale, _sum_partials(partials)


def _allocate_backward(
    h: torch.Tensor, splits: int, probs: torch.Tensor | None, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's outputs for ``h [M, 2H]`` (``dh`` row-wise, and column-wise with ``transpose``), and
    ``grad_probs``' partial sums: a row per column split (``[1, 0]`` without probs)."""
    m = h.shape[0]
    partials = h.new_empty((splits, m) if probs is not None else (1, 0), dtype=torch.float32)
    return (*_allocate_outputs(h, h.shape[1], transpose), partials)


def _sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """``grad_probs`` from its partial sums: with one split it is the partials' row itself (no sum launched)."""
    return partials[0] if partials.shape[0] == 1 else partials.sum(0)


# The Hopper kernel (TMA ring, warp-specialized). Each 128 x 128 tile of dh (a column block of d_gate and the
# same of d_up) comes from three landed bf16 tiles (grad_a's, gate's, up's): 96 KiB a ring slot.
SM90_STAGES = 2  # slots: 192 KiB of the 227, beside the reductions' scratch; the outputs leave from registers
# One compute partition of 8 warps (the default one, beside the loader warp): with 12 warps a CTA it gets 168
# registers, enough to hold a tile's d_gate and d_up whole (64 fp32 values a thread each) for both
# quantizations, so each input is read and each sigmoid computed once (triton 3.6: no spill; 3.9: none in the
# layer's form, 179-255 spill instructions in the forms without probs or with the score before the experts,
# their speed not measured). Two partitions
# (of 8 or 16 warps) leave the default one 96 registers: 16 warps recomputing the sigmoid for a second pass
# issued 1.5x the Triton kernel's instructions and ran at its speed (H200, 2026-11-27).
SM90_WARPS = gl.constexpr(8)
# Each thread holds 8 rows x 8 columns of a tile: 16-byte shared-memory loads of each input row (a warp's 8
# threads a row read 128 consecutive bytes, one phase, no bank conflict), 8-byte stores of each row-wise row
# and, transposed, of each column-wise column (the 8 rows are consecutive tokens).
_SM90_TILE_LAYOUT = gl.constexpr(gl.BlockedLayout([8, 8], [4, 8], [4, 2], [1, 0]))
_SM90_TILE_LAYOUT_T = gl.constexpr(gl.BlockedLayout([8, 8], [8, 4], [2, 4], [1, 0]))
# The input tiles read as int32 pairs of bf16 (columns 2j and 2j + 1), each thread the same 8 x 8 values as in
# _SM90_TILE_LAYOUT: one instruction a value to fp32 (a shift or a mask) where the bf16 load and its
# conversion took two for every odd column.
_SM90_PAIR_LAYOUT = gl.constexpr(gl.BlockedLayout([8, 4], [4, 8], [4, 2], [1, 0]))
# A bf16 slot's shared layout seen as int32: the same swizzle over the same bytes, so int32 j of a row holds
# the row's columns 2j (low half) and 2j + 1 (high half) where TMA wrote them.
_SM90_PAIR_SMEM = gl.constexpr(
    gl.NVMMASharedLayout(tile_smem_layout((BLOCK, BLOCK), torch.bfloat16).swizzle_byte_width, 32)
)
# A tile's 128 row (or column) maxima, one a thread (two threads each): their scales are computed once,
# not in each of the 16 threads that share a row (or column) after the reduction, then spread back.
_SM90_SCALE_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [8], [0]))


@gluon.jit
def _sm90_f32_tile(tile):
    """A bf16 128 x 128 shared tile as fp32 in ``_SM90_TILE_LAYOUT``, read as int32 pairs: a bf16 is the high
    half of its fp32, so the even column is the pair shifted up and the odd one the pair masked."""
    pairs = shared_reinterpret(tile, gl.int32, [SM90_BLOCK, SM90_BLOCK // 2], _SM90_PAIR_SMEM).load(_SM90_PAIR_LAYOUT)
    even = (pairs << 16).to(gl.float32, bitcast=True)
    odd = (pairs & -65536).to(gl.float32, bitcast=True)
    # join + reshape interleave the columns in registers; the conversion only renames the layout
    return gl.convert_layout(gl.reshape(gl.join(even, odd), [SM90_BLOCK, SM90_BLOCK]), _SM90_TILE_LAYOUT)


@gluon.jit
def _sm90_slot_tiles(in_bufs, s):
    """Ring slot ``s``'s ``grad_a``, gate and up tiles, fp32, in ``_SM90_TILE_LAYOUT``."""
    return (
        _sm90_f32_tile(in_bufs.index(3 * s)),
        _sm90_f32_tile(in_bufs.index(3 * s + 1)),
        _sm90_f32_tile(in_bufs.index(3 * s + 2)),
    )


@gluon.jit
def _sm90_scales(amax, layout: gl.constexpr):
    """``(scale_inv, scale)`` of a tile's 128 block maxima (any 1-D layout), computed in
    ``_SM90_SCALE_LAYOUT``: ``scale_inv`` stays there (for its store), ``scale`` comes back in ``layout``."""
    scale_inv, scale = pow2_scale_inv_and_scale(gl.convert_layout(amax, _SM90_SCALE_LAYOUT))
    return scale_inv, gl.convert_layout(scale, layout)


@gluon.jit
def _sm90_store_both_ways(x, row0, col0, end, tensors, TRANSPOSE: gl.constexpr):
    """Quantize the fp32 128 x 128 tile ``x`` of ``dh`` (rows ``row0 + [0, 128)``, columns ``col0 + [0, 128)``;
    zero in rows at or past ``end``) row-wise into ``dh`` and, with ``TRANSPOSE``, column-wise, transposed, into
    ``dh_t``, with their scales, straight from registers. ``tensors`` as for ``_swiglu_bwd_sm90_partition``."""
    dh_ptr, dh_scale_ptr, dh_t_ptr, dh_t_scale_ptr, probs_ptr, partials_ptr, offsets_ptr, M, H, num_groups = tensors
    row_layout: gl.constexpr = gl.SliceLayout(1, _SM90_TILE_LAYOUT)
    col_layout: gl.constexpr = gl.SliceLayout(0, _SM90_TILE_LAYOUT)
    rows64 = (row0 + gl.arange(0, SM90_BLOCK, layout=row_layout)).to(gl.int64)
    cols = col0 + gl.arange(0, SM90_BLOCK, layout=col_layout)
    i = gl.arange(0, SM90_BLOCK, layout=_SM90_SCALE_LAYOUT)
    # maxnum: NaN ignored, as nan_ignoring_amax in the Triton kernel
    scale_inv, scale = _sm90_scales(gl.max(gl.abs(x), axis=1), row_layout)
    gl.store(dh_ptr + rows64[:, None] * (2 * H) + cols[None, :], (x * scale[:, None]).to(gl.float8e4nv))
    scale_rows = (row0 + i).to(gl.int64) * (2 * H // SM90_BLOCK) + col0 // SM90_BLOCK
    gl.store(dh_scale_ptr + scale_rows, gl.where(row0 + i < end, scale_inv, 0.0))
    if TRANSPOSE:
        scale_inv, scale = _sm90_scales(gl.max(gl.abs(x), axis=0), col_layout)
        # The permute renames registers (each thread's 8 values of a column are 8 consecutive tokens); the
        # conversion only orders them for 8-byte stores.
        q_t = gl.convert_layout(gl.permute((x * scale[None, :]).to(gl.float8e4nv), (1, 0)), _SM90_TILE_LAYOUT_T)
        cols_t = col0 + gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(1, _SM90_TILE_LAYOUT_T))
        tokens = row0 + gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(0, _SM90_TILE_LAYOUT_T))
        gl.store(dh_t_ptr + cols_t.to(gl.int64)[:, None] * M + tokens[None, :], q_t)
        block_ok = gl.zeros_like(i) + row0 < end
        gl.store(dh_t_scale_ptr + (row0 // SM90_BLOCK) * (2 * H) + col0 + i, gl.where(block_ok, scale_inv, 0.0))


@gluon.jit
def _sm90_zero_rows_past_end(in_bufs, s, row0, end):
    """Zero the rows at or past ``end`` of ring slot ``s``'s three tiles (rows ``row0 + [0, 128)``), so they read
    as the Triton kernel's masked loads do (TMA brought whatever the rows hold, and a tile wholly past the end
    was not loaded at all): their dh and grad_probs terms are then 0. Only tiles that the end cuts pay."""
    ok = (row0 + gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(1, _SM90_TILE_LAYOUT)) < end)[:, None]
    for i in gl.static_range(3):
        tile = in_bufs.index(3 * s + i)
        x = tile.load(_SM90_TILE_LAYOUT)
        partition_barrier()  # every warp has read the tile before any overwrites it
        tile.store(gl.where(ok, x, gl.zeros_like(x)))
    # The zeros are seen by every warp's reads, and ordered before the TMA writes of the slot's next use.
    fence_async_shared()
    partition_barrier()


@gluon.jit
def _swiglu_bwd_sm90_partition(
    HAS_PROBS: gl.constexpr,
    SCORE_BEFORE_EXPERTS: gl.constexpr,
    HAS_OFFSETS: gl.constexpr,
    TRANSPOSE: gl.constexpr,
    ring,
    tensors,
):
    """8 warps: the program's landed tiles in turn. ``ring = (in_bufs, ready, empty)``; ``tensors = (dh,
    dh_scale, dh_t, dh_t_scale, probs, partials, offsets, M, H, num_groups)``.

    The slot is freed as soon as its three tiles are in registers, before the arithmetic, so the loader
    refills it while this tile is computed and stored."""
    in_bufs, ready, empty = ring
    dh_ptr, dh_scale_ptr, dh_t_ptr, dh_t_scale_ptr, probs_ptr, partials_ptr, offsets_ptr, M, H, num_groups = tensors
    STAGES: gl.constexpr = in_bufs.type.shape[0] // 3
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    num_hb = H // SM90_BLOCK
    tiles = gl.cdiv(gl.maximum((M // SM90_BLOCK) * num_hb - gl.program_id(0), 0), gl.num_programs(0))
    r = gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(1, _SM90_TILE_LAYOUT))
    for it in range(tiles):
        t = gl.program_id(0) + it * gl.num_programs(0)
        hb = t % num_hb
        row0 = (t // num_hb) * SM90_BLOCK
        p = gl.load(probs_ptr + row0 + r, mask=(row0 + r < end) & HAS_PROBS, other=0.0)[:, None]
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if row0 + SM90_BLOCK > end:
            _sm90_zero_rows_past_end(in_bufs, s, row0, end)
        ga, g, u = _sm90_slot_tiles(in_bufs, s)
        # Every warp has read the slot before it is freed: the barrier of this partition's warps.
        partition_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        d_gate, d_up, terms = _dh_math(ga, g, u, p, HAS_PROBS, SCORE_BEFORE_EXPERTS, True)
        if HAS_PROBS:
            gl.store(partials_ptr + hb * M + row0 + r, gl.sum(terms, axis=1))
        _sm90_store_both_ways(d_gate, row0, hb * SM90_BLOCK, end, tensors, TRANSPOSE)
        _sm90_store_both_ways(d_up, row0, H + hb * SM90_BLOCK, end, tensors, TRANSPOSE)


@gluon.jit
def _swiglu_quant_backward_sm90_kernel(
    ga_desc,
    h_desc,
    dh_ptr,
    dh_scale_ptr,
    dh_t_ptr,
    dh_t_scale_ptr,
    probs_ptr,
    partials_ptr,
    offsets_ptr,
    M,
    H,
    num_groups,
    HAS_PROBS: gl.constexpr,
    SCORE_BEFORE_EXPERTS: gl.constexpr,
    HAS_OFFSETS: gl.constexpr,
    STAGES: gl.constexpr,
    TRANSPOSE: gl.constexpr,
):
    """Persistent: program ``p`` takes the tiles ``p, p + programs, ...`` of the ``[M / 128, H / 128]`` grid (row
    tile major). One loader warp keeps ``STAGES`` tiles' three input boxes in flight (``tile_ring_loader``); the
    8-warp default partition computes and stores each landed tile (``dh`` column-wise too with ``TRANSPOSE``)."""
    # _sm90_f32_tile widens the tiles by their bits, which holds for bf16 only (the op's one input dtype)
    gl.static_assert(ga_desc.dtype == gl.bfloat16 and h_desc.dtype == gl.bfloat16, "grad_a and h must be bf16")
    in_bufs = gl.allocate_shared_memory(ga_desc.dtype, [3 * STAGES] + ga_desc.block_type.shape, ga_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    ring = (in_bufs, ready, empty)
    tensors = (dh_ptr, dh_scale_ptr, dh_t_ptr, dh_t_scale_ptr, probs_ptr, partials_ptr, offsets_ptr, M, H, num_groups)
    sources = ((ga_desc, 0), (h_desc, 0), (h_desc, H))
    # Constexprs spelled out: Gluon keeps them only in literal argument tuples.
    gl.warp_specialize(
        [
            (_swiglu_bwd_sm90_partition, (HAS_PROBS, SCORE_BEFORE_EXPERTS, HAS_OFFSETS, TRANSPOSE, ring, tensors)),
            (tile_ring_loader, (sources, in_bufs, ready, empty, offsets_ptr, M, H, num_groups, HAS_OFFSETS)),
        ],
        [1],
        [40],
    )


def build_sm90_swiglu_backward_kernel(
    has_probs: bool = True,
    score_before_experts: bool = False,
    has_offsets: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    transpose: bool = True,
) -> Any:
    """Compile the Hopper kernel for sm_90a without a GPU (see
    :func:`~fp8flow_ao.kernels._sm90_common.compile_for_sm90`), as a launch with these flags and inputs of
    ``dtype`` would (any dtype but bf16 fails the kernel's static assertion)."""
    fp32 = "*fp32"
    signature = {
        "ga_desc": descriptor_signature((BLOCK, BLOCK), dtype),
        "h_desc": descriptor_signature((BLOCK, BLOCK), dtype),
        "dh_ptr": "*fp8e4nv",
        "dh_scale_ptr": fp32,
        "dh_t_ptr": "*fp8e4nv",
        "dh_t_scale_ptr": fp32,
        # Absent inputs: the launcher passes dh_scale (an fp32 pointer, unread) in their place.
        "probs_ptr": fp32,
        "partials_ptr": fp32,
        "offsets_ptr": "*i32" if has_offsets else fp32,
        **dict.fromkeys(("M", "H", "num_groups"), "i32"),
        **dict.fromkeys(("HAS_PROBS", "SCORE_BEFORE_EXPERTS", "HAS_OFFSETS", "STAGES", "TRANSPOSE"), "constexpr"),
    }
    constexprs = {
        "HAS_PROBS": has_probs,
        "SCORE_BEFORE_EXPERTS": score_before_experts,
        "HAS_OFFSETS": has_offsets,
        "STAGES": SM90_STAGES,
        "TRANSPOSE": transpose,
    }
    return compile_for_sm90(
        _swiglu_quant_backward_sm90_kernel,
        signature,
        constexprs,
        num_warps=SM90_WARPS.value,
        # What a launch specializes: torch's allocations 16-byte aligned, M and H multiples of 128.
        aligned=("dh_ptr", "dh_scale_ptr", "dh_t_ptr", "dh_t_scale_ptr", "probs_ptr", "partials_ptr", "M", "H"),
        enable_fp_fusion=False,
    )


def launch_swiglu_quant_backward_sm90(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
    transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gluon launcher (Hopper GPUs only; bf16 ``grad_a`` and ``h`` whose bases and row strides lie on 16-byte
    boundaries, TMA's rule). Same contract and formulas as :func:`launch_swiglu_quant_backward`, same bits for ``dh``
    (``grad_probs`` is summed in another order).

    One program an SM walks the 128 x 128 tiles of H; a loader warp keeps two tiles' ``grad_a``, gate and up
    boxes in flight by TMA; an 8-warp partition computes each landed tile's d_gate and d_up
    (``_swiglu_bwd_sm90_partition``) and stores each both ways from registers. The Triton kernel runs one
    245-register program an SM whose warps wait while its tile is in flight (ncu: 12.5% occupancy, 0.36
    instructions issued per scheduler a cycle; ``benchmarks/results/memory_bound_notes.md``)."""
    if not sm90_supported(h.device):
        raise RuntimeError(
            f"the sm90 swiglu_quant_backward needs a Hopper GPU (compute capability 9.x), got {h.device}"
        )
    check_tma_operand("grad_a", grad_a)
    check_tma_operand("h", h)
    m, two_h = h.shape
    hidden = two_h // 2
    dh, dh_scale, dh_t, dh_t_scale, partials = _allocate_backward(h, hidden // BLOCK, probs, transpose)
    tiles = (m // BLOCK) * (hidden // BLOCK)
    if tiles == 0:
        return dh, dh_scale, dh_t, dh_t_scale, partials[0]
    has_offsets = group_end_offsets is not None
    launch_kernel(
        _swiglu_quant_backward_sm90_kernel,
        (min(tiles, sm_count(h.device)),),
        descriptor(grad_a, (BLOCK, BLOCK)),
        descriptor(h, (BLOCK, BLOCK)),
        dh,
        dh_scale,
        dh_t if transpose else dh,  # without the transpose these pointers are never written
        dh_t_scale if transpose else dh_scale,
        dh_scale if probs is None else probs,
        dh_scale if probs is None else partials,
        group_end_offsets if has_offsets else dh_scale,
        m,
        hidden,
        group_end_offsets.shape[0] if has_offsets else 0,
        **_kernel_flags(probs, group_end_offsets, score_before_experts),
        STAGES=SM90_STAGES,
        TRANSPOSE=transpose,
        num_warps=SM90_WARPS.value,
        enable_fp_fusion=False,  # no fma contraction: the same roundings as the reference
    )
    return dh, dh_scale, dh_t, dh_t_scale, _sum_partials(partials)


def _launch_backward_op_kernel(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None,
    group_end_offsets: torch.Tensor | None,
    score_before_experts: bool = False,
    transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's CUDA kernel: the Hopper TMA kernel where :func:`backward_takes_sm90_kernel`, the Triton kernel
    otherwise. Same ``dh`` bits."""
    launcher = (
        launch_swiglu_quant_backward_sm90 if backward_takes_sm90_kernel(grad_a, h) else launch_swiglu_quant_backward
    )
    return launcher(grad_a, h, probs, group_end_offsets, score_before_experts, transpose)


def backward_takes_sm90_kernel(grad_a: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether the backward op runs the Hopper TMA kernel on these inputs: a Hopper GPU, and TMA can load
    ``grad_a`` and ``h`` (bases and row strides on 16-byte boundaries); else the Triton kernel."""
    return sm90_takes_plain_form(h, None) and sm90_takes_plain_form(grad_a, None)


def _rows_computed(m: int, group_end_offsets: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Bool ``[M]``: rows before the last group end offset (all rows without offsets). No host sync."""
    if group_end_offsets is None:
        return torch.ones(m, dtype=torch.bool, device=device)
    return torch.arange(m, device=device) < group_end_offsets[-1].clamp(max=m)


def _sigmoid_reference(g: torch.Tensor) -> torch.Tensor:
    """The kernels' sigmoid, operation for operation."""
    return 1.0 / (1.0 + torch.exp(-g))


def _gate_up_reference(h: torch.Tensor, rows_ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 gate and up halves of ``h``, zero in rows that are not computed (the kernels' masked loads)."""
    hf = torch.where(rows_ok[:, None], h.float(), 0.0)
    hidden = h.shape[1] // 2
    return hf[:, :hidden], hf[:, hidden:]


def _probs_reference(probs: torch.Tensor, rows_ok: torch.Tensor) -> torch.Tensor:
    """``probs`` as the kernels' ``[M, 1]`` masked load (0 in rows that are not computed)."""
    return torch.where(rows_ok, probs, 0.0)[:, None]


def swiglu_quant_reference(
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the op ``fp8flow::swiglu_quant`` (the oracle and the CPU path): ``a`` row-wise, then
    column-wise by :func:`~fp8flow_ao.kernels.scaling_aware_transpose.scaling_aware_transpose_reference` of it
    (empty ``(0,)`` tensors without ``transpose``)."""
    rows_ok = _rows_computed(h.shape[0], group_end_offsets, h.device)
    data, scale_inv = quantize_rows_reference(
        swiglu_reference(h, probs, group_end_offsets, score_before_experts), BLOCK
    )
    scale_inv = torch.where(rows_ok[:, None], scale_inv, 0.0)
    if not transpose:
        return data, scale_inv, *_no_column_wise(h)
    return data, scale_inv, *scaling_aware_transpose_reference(data, scale_inv, group_end_offsets)


def swiglu_reference(
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
) -> torch.Tensor:
    """fp32 ``[M, H]`` SwiGLU of ``h`` ``[M, 2H]`` with the probs as :func:`swiglu_quant` applies them, before
    quantization; 0 in rows at or past the last group end. Differentiable in ``h`` and ``probs``."""
    rows_ok = _rows_computed(h.shape[0], group_end_offsets, h.device)
    g, u = _gate_up_reference(h, rows_ok)
    if score_before_experts:
        p = _probs_reference(probs, rows_ok)
        g, u = g * p, u * p
    a = g * _sigmoid_reference(g) * u
    if probs is not None and not score_before_experts:
        a = a * _probs_reference(probs, rows_ok)
    return a


def _quantize_columns_reference(x: torch.Tensor, rows_ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise 128x1 quantization of ``x [M, N]``: data transposed ``[N, M]``, scales ``[M/128, N]``."""
    data_t, scale_t = quantize_rows_reference(x.t(), BLOCK)
    return data_t, torch.where(rows_ok[::BLOCK, None], scale_t.t(), 0.0).contiguous()


def swiglu_backward_reference(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`swiglu_reference` for ``grad_a`` ``[M, H]``, in fp32 and in closed form (the
    kernels' formulas, operation for operation): ``dh``'s gate and up halves, each ``[M, H]`` (``dh`` is their
    concatenation), and the probs' ``[M]`` (empty without ``probs``); 0 in rows at or past the last group end."""
    rows_ok = _rows_computed(h.shape[0], group_end_offsets, h.device)
    g, u = _gate_up_reference(h, rows_ok)
    ga = torch.where(rows_ok[:, None], grad_a.float(), 0.0)
    grad_probs = h.new_empty((0,), dtype=torch.float32)
    if score_before_experts:  # gradients w.r.t. SwiGLU's inputs p * g, p * u, then the chain rule's p
        p = _probs_reference(probs, rows_ok)
        gp, gu = g * p, ga * u
        s = _sigmoid_reference(gp)
        dsilu = s * (1.0 + gp * (1.0 - s))
        grad_probs = (gu * (gp * (s + dsilu))).sum(dim=1)
        return ((gu * p) * dsilu) * p, (ga * (gp * s)) * p, grad_probs
    s = _sigmoid_reference(g)
    t = ga * (g * s)
    d_up, d_gate = t, ga * u
    if probs is not None:
        p = _probs_reference(probs, rows_ok)
        d_up, d_gate = d_up * p, d_gate * p
        grad_probs = (t * u).sum(dim=1)
    return d_gate * (s * (1.0 + g * (1.0 - s))), d_up, grad_probs


def swiglu_quant_backward_reference(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
    transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the op ``fp8flow::swiglu_quant_backward`` (``grad_probs`` empty without ``probs``; the
    column-wise pair empty ``(0,)`` tensors without ``transpose``)."""
    rows_ok = _rows_computed(h.shape[0], group_end_offsets, h.device)
    d_gate, d_up, grad_probs = swiglu_backward_reference(grad_a, h, probs, group_end_offsets, score_before_experts)
    dh = torch.cat([d_gate, d_up], dim=1)
    dh_data, dh_scale = quantize_rows_reference(dh, BLOCK)
    dh_scale = torch.where(rows_ok[:, None], dh_scale, 0.0)
    if not transpose:
        return dh_data, dh_scale, *_no_column_wise(h), grad_probs
    return dh_data, dh_scale, *_quantize_columns_reference(dh, rows_ok), grad_probs


@define_op("swiglu_quant")
def _swiglu_quant_op(
    h: torch.Tensor,
    probs: torch.Tensor | None,
    group_end_offsets: torch.Tensor | None,
    score_before_experts: bool = False,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_quant_reference(h, probs, group_end_offsets, score_before_experts, transpose)


_swiglu_quant_op.register_kernel("cuda")(launch_swiglu_quant)


@_swiglu_quant_op.register_fake
def _(
    h: torch.Tensor,
    probs: torch.Tensor | None,
    group_end_offsets: torch.Tensor | None,
    score_before_experts: bool = False,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _allocate_outputs(h, h.shape[1] // 2, transpose)


@define_op("swiglu_quant_backward")
def _swiglu_quant_backward_op(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None,
    group_end_offsets: torch.Tensor | None,
    score_before_experts: bool = False,
    transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_quant_backward_reference(grad_a, h, probs, group_end_offsets, score_before_experts, transpose)


_swiglu_quant_backward_op.register_kernel("cuda")(_launch_backward_op_kernel)


@_swiglu_quant_backward_op.register_fake
def _(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None,
    group_end_offsets: torch.Tensor | None,
    score_before_experts: bool = False,
    transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m, two_h = h.shape
    return (*_allocate_outputs(h, two_h, transpose), h.new_empty((m if probs is not None else 0,), dtype=torch.float32))


def _check_inputs(h: object, probs: object, group_end_offsets: object, score_before_experts: object) -> None:
    """The checks both public ops share (shapes, dtypes, strides, devices; no data read)."""
    check_tensor("h", h, dtypes=torch.bfloat16, ndim=2)
    check_row_major("h", h)
    m, two_h = h.shape
    if two_h == 0:
        raise ValueError(f"h must be [M, 2H] with H > 0, got shape {tuple(h.shape)}")
    check_multiple("h", two_h, 2 * BLOCK, what="width 2H (gate | up, H a multiple of 128)")
    check_multiple("h", m, BLOCK, what="row count M")
    if probs is not None:
        check_tensor("probs", probs, dtypes=torch.float32, ndim=1)
        check_shape("probs", probs, (m,))
        check_contiguous("probs", probs)
    if group_end_offsets is not None:
        check_group_end_offsets("group_end_offsets", group_end_offsets, rows=m)
        if group_end_offsets.numel() == 0:
            raise ValueError("group_end_offsets must hold at least one group end offset, got an empty tensor")
    check_same_device(h=h, probs=probs, group_end_offsets=group_end_offsets)
    check_bool("score_before_experts", score_before_experts)
    if score_before_experts and probs is None:
        raise ValueError("score_before_experts=True scales SwiGLU's inputs by probs: probs must be given, got None")


def swiglu_quant(
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
    transpose: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``a = silu(gate) * up * prob`` (or ``silu(prob * gate) * (prob * up)``) quantized 1x128 to E4M3, in one pass.

    Args:
        h: FC1's output, BF16 ``[M, 2H]``, row-major (last dim contiguous; the row stride is free):
            gate in columns ``[0, H)``, up projection in ``[H, 2H)``. ``M`` and ``H`` multiples of 128.
        probs: fp32 ``[M]`` contiguous router probability of each row (0 on pad rows), or ``None``
            (no weighting).
        group_end_offsets: int32 ``[E]`` expert group end offsets (multiples of 128, non-decreasing,
            on ``h``'s device), or ``None`` (every row is computed). Rows at or after the last one
            are not read; their outputs are data 0 and scale 0.
        score_before_experts: where the prob enters (torchtitan's ``MoE.score_before_experts``):
            ``False``: ``a = silu(gate) * up * prob`` (the prob scales the expert's output);
            ``True``: ``a = silu(prob * gate) * (prob * up)`` (the prob scaled the expert's input,
            and FC1 is linear). ``True`` needs ``probs``.
        transpose: also return ``a``'s column-wise copy (FC2's wgrad operand), made by the same kernel from
            the E4M3 rows it writes: :func:`~fp8flow_ao.kernels.scaling_aware_transpose.scaling_aware_transpose`
            of ``(a_data, a_scale, group_end_offsets)``, bit for bit, without reading ``a`` back.

    Returns:
        ``(a_data, a_scale)``: ``a_data`` E4M3 ``[M, H]`` row-major; ``a_scale`` fp32
        ``[M, H / 128]`` (COMPACT row-wise), the dequantize multiplier (``a ~= data * scale``), a
        power of two. With ``transpose``, ``(a_data, a_scale, a_t_data, a_t_scale)``: ``a_t_data`` E4M3
        ``[H, M]`` (tokens contiguous), ``a_t_scale`` fp32 ``[M / 128, H]``, one power of two per 128 x 128 tile
        (every column of a tile carries it), the dequantize multiplier.
    """
    _check_inputs(h, probs, group_end_offsets, score_before_experts)
    check_bool("transpose", transpose)
    check_no_grad("swiglu_quant", h, probs)
    out = torch.ops.fp8flow.swiglu_quant(h, probs, group_end_offsets, score_before_experts, transpose)
    return out if transpose else out[:2]


def swiglu_quant_backward(
    grad_a: torch.Tensor,
    h: torch.Tensor,
    probs: torch.Tensor | None = None,
    group_end_offsets: torch.Tensor | None = None,
    score_before_experts: bool = False,
    *,
    transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """SwiGLU backward: ``dh = [d_gate | d_up]`` in fp32, quantized to E4M3 row-wise and column-wise.

    Args:
        grad_a: gradient of :func:`swiglu_quant`'s ``a`` (FC2's dgrad), BF16 ``[M, H]`` row-major.
        h, probs, group_end_offsets, score_before_experts: as for :func:`swiglu_quant` (the forward's inputs).
        transpose: also write ``dh`` column-wise, the FC1 wgrad's operand (``False``: no weight gradient of
            FC1 to compute, e.g. frozen expert weights; the row-wise outputs and ``grad_probs`` are the same bits).

    Returns:
        ``(dh_data, dh_scale, dh_t_data, dh_t_scale, grad_probs)``:

        * ``dh_data`` E4M3 ``[M, 2H]`` row-major + ``dh_scale`` fp32 ``[M, 2H / 128]``: 1x128
          row-wise blocks (FC1 dgrad's operand).
        * ``dh_t_data`` E4M3 ``[2H, M]`` (``dh`` transposed: tokens contiguous) + ``dh_t_scale``
          fp32 ``[M / 128, 2H]``: one scale per (128-row block, column) (FC1 wgrad's operand); both ``None``
          without ``transpose``.
        * ``grad_probs`` fp32 ``[M]`` (``sum_h grad_a * d a / d prob``: ``grad_a * silu(gate) * up``
          after the experts), or ``None`` without ``probs``.

        Scales are dequantize multipliers (powers of two). Rows at or after the last group end
        offset: data 0 and scale 0 in both layouts, ``grad_probs`` 0.
    """
    _check_inputs(h, probs, group_end_offsets, score_before_experts)
    check_tensor("grad_a", grad_a, dtypes=torch.bfloat16, ndim=2)
    check_row_major("grad_a", grad_a)
    check_shape("grad_a", grad_a, (h.shape[0], h.shape[1] // 2))
    check_same_device(grad_a=grad_a, h=h)
    check_bool("transpose", transpose)
    check_no_grad("swiglu_quant_backward", grad_a, h, probs)
    dh, dh_scale, dh_t, dh_t_scale, grad_probs = torch.ops.fp8flow.swiglu_quant_backward(
        grad_a, h, probs, group_end_offsets, score_before_experts, transpose
    )
    column_wise = (dh_t, dh_t_scale) if transpose else (None, None)
    return dh, dh_scale, *column_wise, grad_probs if probs is not None else None
