"""grouped_gemm_fp8_blockwise: ``out[m] = A[m] @ B[e(m)]^T`` for E4M3 1x128 x 128x128 blockwise FP8.

The forward and dgrad GEMM of the routed experts. ``a`` holds the permuted, padded rows of all
experts (1x128 scales, COMPACT ``[M, K/128]``, read as they are); ``b`` holds one weight per expert,
K-major ``[E, N, K]`` with 128x128 scales ``[E, N/128, K/128]``. For dgrad the caller passes the
exact FP8 transpose of the forward weight (``[E, K, N]`` data, ``[E, K/128, N/128]`` scales: 128x128
blocks are symmetric under transpose), or the forward weight itself with ``transpose_b=True`` (the
kernel transposes each tile as it loads it), so the same op serves both.

Or ``b`` is the high-precision weight itself (bf16/fp32 ``W [E, Nw, Kw]``, optionally with ``b_tail``
rows joined below it: the MoE layer's ``W13 = [w1; w3]``), and the kernel quantizes each 128x128 tile
of ``W`` as it loads it (``transpose_b=True``: ``W``'s tiles transposed, the dgrad operand): the same
scale rule and rounding as :func:`~fp8flow_ao.kernels.quantize_128x128.quantize_128x128`, so the result
is bit for bit that of ``quantize_128x128`` followed by the FP8 call, without the FP8 weight copy
ever existing in memory. That trades weight bytes for GEMM work: the high-precision tile is read once
per 128-row M tile (2 bytes for bf16 where the FP8 path reads 1, but no separate quantize pass that
reads 2 and writes 1-2), and every M tile quantizes its tiles again. It pays where experts have few
rows (fine-grained experts: each weight tile serves one or two M tiles, the GEMM is bound by weight
bytes) and costs where they have many (see ``benchmarks/results/grouped_gemm_notes.md``). With
``keep_b=True`` (a training forward) the GEMM also writes the E4M3 tiles and scales it made (those of
every expert with rows, from the first M tile of its group) for the dgrad, which transposes them as it
loads them: the weight is read once in high precision per step and never quantized by a separate pass.

Two kernels share one contract. Both walk (128-row M tile, N tile) pairs on a persistent
grid; groups start on multiples of 128, so an M tile never straddles two experts, and each tile finds
its expert from the group end offsets on the device (no host sync). Operands arrive by TMA; per
128-wide K block the tensor-core partial product is promoted into the fp32 accumulator with
``scale_a[m] * scale_b`` (the per-128-K promotion that keeps FP8 accumulation error bounded). Tiles at
or past the last group end read nothing and store zeros, so the whole output is defined.

* ``sm90`` (Gluon, Hopper only, the CUDA default there): warp-specialized (``_sm90_common``). One
  producer warp issues the TMA loads into a ring of ``stages`` shared-memory slots; two consumer
  warpgroups each own 64 rows of a 128x256 (or 128x128) tile and release a slot on their own
  mbarrier arrival, consumer 1 issuing each block's MMA after consumer 0, so one's promotion (FFMAs
  on the CUDA cores) runs under the other's MMAs -- the overlap the Triton kernel cannot express
  (its CTA-wide barriers and wait-for-every-MMA promotion serialize the tensor cores;
  benchmarks/results/grouped_gemm_notes.md). With a high-precision ``b`` a fourth partition, one
  quantizer warpgroup, turns each landed weight tile into E4M3 in place (the FP8 tile is written over
  the first bytes of its own staging slot, and its scale beside it) before the consumers are
  released: tiles of 128x128, whose scale is one number. With an FP8 ``b`` and ``transpose_b`` (the dgrad on
  the forward's tiles, no transposed copy in memory) two such warpgroups take the landed tiles in turn and
  write each one transposed into a slot of its own.
* ``triton`` (``tl.dot``): any TMA-capable GPU and the CPU interpreter; autotuned.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from fp8flow_ao._checks import (
    check_bool,
    check_contiguous,
    check_fp8,
    check_group_end_offsets,
    check_multiple,
    check_no_grad,
    check_row_major,
    check_same_device,
    check_shape,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, dequantize_rows_reference
from fp8flow_ao.kernels._grouped_gemm_common import (
    BLOCK_K,
    autotuned,
    check_tma_operand,
    expert_of_row,
    gemm_config,
    group_bounds,
    group_rows,
    grouped_tile,
    interpreting,
    launch,
    persistent_grid,
    set_tma_workspace_allocator,
    sm_count,
)
from fp8flow_ao.kernels._launch import cdiv, launch_kernel, next_pow2
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._sm90_common import (
    SM90_BLOCK,
    SM90_SMEM_BYTES,
    WG_ROWS,
    Sm90Config,
    check_sm90_launch,
    compile_for_sm90,
    descriptor,
    descriptor_signature,
    fp8_view_of_slots,
    sm90_first_mma,
    sm90_or,
    sm90_ring_barriers,
    sm90_second_mma,
    sm90_store_halves,
    tma_load,
    tma_store,
)
from fp8flow_ao.kernels._triton_common import pow2_scale_inv_and_scale, quantize_tile
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128_reference

OUT_DTYPES = (torch.bfloat16, torch.float32)
# High-precision weights the kernels quantize as they load them.
HP_B_DTYPES = (torch.bfloat16, torch.float32)
# Rows per expert (on average, 128-aligned groups) up to which a bf16 weight is quantized inside the GEMMs
# rather than by quantize_128x128 before them: one M tile per expert. Measured on an H200
# (grouped_gemm_weights.md, balanced aligned groups): at 128 rows per expert the in-kernel path takes
# 0.60-0.61x the separate one's time for forward and 0.73-0.74x for dgrad (Qwen3-30B-A3B FC1 / FC2 dims);
# at 256 (two M tiles) 0.89-0.95x for forward but 1.3x for dgrad, and at 512 and up it loses in both
# passes (1.35-1.76x): every M tile quantizes its weight tiles again, and the quantizer warpgroup, not the
# tensor cores, sets the pace. Groups that are not 128-aligned start a tile at every expert's start, about
# half a tile more per expert, so for them the rule asks for half the rows. fp8_grouped_mm's fwd+bwd with the
# forward keeping its tiles for the dgrad (keep_b), against quantize_128x128 first (H200, 2026-11-24, device
# time, .scratch probe): 893 vs 950 us at E=128, 128 rows per expert, K=2048 N=1536; 493 vs 528 at K=768
# N=2048; but 6424 vs 5392 at E=64 with 256 rows per expert, and 1535 vs 1480 on unaligned groups of 128
# rows per expert on average (207 padded): the same threshold holds with the kept tiles. Releasing a kept
# tile's slot one tile later instead of waiting for its store before the consumers (same probe, later run):
# 886 vs 954 and 500 vs 531 (unchanged: the forward is bound by the weight bytes it reads and writes), 2972
# vs 2803 at E=64 K=2048 N=7168 with 256 rows per expert (was 3298 vs 2793) and 1361 vs 1314 unaligned (was
# 1535 vs 1480): closer where experts have two M tiles, still behind. With the tile's expert found once per
# tile instead of once per K block: 887 vs 950, 497 vs 526, unaligned 1299 vs 1315 (a tie within run-to-run
# spread, so the rule still leaves unaligned groups to quantize_128x128 at 128 rows per expert).
IN_GEMM_MAX_ROWS_PER_EXPERT = 128
# The same for a forward with no dgrad to come (no_grad, or an input without a gradient): nothing kept, so
# the quantizing forward alone against quantize_128x128 + the FP8 forward (H200, 2026-11-24, device time,
# .scratch probe of fp8_grouped_mm under no_grad): at 256 rows per expert 2146 vs 2250 us (E=64 K=7168
# N=4096), 1063 vs 1125 (E=64 K=2048 N=7168), 1289 vs 1366 (E=128 skewed, K=4096 N=2048); unaligned groups
# of 128 rows per expert on average 430 vs 546; at 512 rows 270 vs 202 and at 1024 2213 vs 1366.
FORWARD_IN_GEMM_MAX_ROWS_PER_EXPERT = 256


def quantize_in_gemm_pays(
    rows: int, experts: int, w_dtype: torch.dtype, aligned: bool, forward_only: bool = False
) -> bool:
    """Whether grouped GEMMs over ``rows`` real rows (not the padded bound) of ``experts`` experts are faster
    given their ``w_dtype`` weight to quantize tile by tile as they load it (``b`` high precision) than given
    ``quantize_128x128``'s tiles made before them. Both give the same bits; the in-kernel path skips the
    separate pass over the weight but quantizes each weight tile once per 128-row M tile, so it wins where
    experts have about one M tile each: at most :data:`IN_GEMM_MAX_ROWS_PER_EXPERT` rows per expert on
    average when the groups are 128-aligned (``aligned``), half that when each group is padded to 128 rows
    on its own (routed tokens); ``forward_only`` (a forward whose weight no dgrad will read: neither kept
    tiles nor a transposed copy to write) up to :data:`FORWARD_IN_GEMM_MAX_ROWS_PER_EXPERT`. bf16 weights only
    (fp32 ones fit 2 ring stages). Static shapes only: no host sync."""
    per_expert = FORWARD_IN_GEMM_MAX_ROWS_PER_EXPERT if forward_only else IN_GEMM_MAX_ROWS_PER_EXPERT
    return w_dtype == torch.bfloat16 and _at_most_rows_per_expert(rows, experts, aligned, per_expert)


# Rows per expert (on average, 128-aligned groups) up to which a dgrad reads the forward's FP8 weight tiles
# and transposes them in the kernel (``transpose_b``) rather than a transposed copy written beside them.
# Measured on an H200 (2026-11-24, dgrad GEMM + quantize_128x128, device time): the transposing kernel runs
# at 690-760 TFLOP/s against the copy's 1045-1160 (two transposing warpgroups; the 128x128 tiles, their
# transposes and the wgmma reads share the SM's shared-memory bandwidth), while quantize_128x128 without
# the transposed copy saves a quarter of its bytes. At 256 rows per expert (E=64-128, DeepSeek/Qwen widths)
# that nets +89 to +144 us per dgrad; at 512, -40 to -69 us; at 1024 (DeepSeek-like), -271 to -678 us.
TRANSPOSE_IN_GEMM_MAX_ROWS_PER_EXPERT = 256


def transpose_in_gemm_pays(rows: int, experts: int, aligned: bool) -> bool:
    """Whether a dgrad over ``rows`` real rows of ``experts`` experts is faster given the forward's FP8 tiles
    to transpose as it loads them (``transpose_b=True``) than given their transposed copy, counting the
    copy's cost in ``quantize_128x128``: the same bits either way; the weight bytes saved outweigh the
    slower GEMM where experts have few rows (:data:`TRANSPOSE_IN_GEMM_MAX_ROWS_PER_EXPERT`, halved for
    groups padded one by one, as in :func:`quantize_in_gemm_pays`)."""
    return _at_most_rows_per_expert(rows, experts, aligned, TRANSPOSE_IN_GEMM_MAX_ROWS_PER_EXPERT)


def _at_most_rows_per_expert(rows: int, experts: int, aligned: bool, per_expert: int) -> bool:
    """``rows <= per_expert * experts``, with half of ``per_expert`` for unaligned groups (padding each one
    starts about half a tile more per expert)."""
    return rows <= (per_expert if aligned else per_expert // 2) * experts


# Launch configs, from the sweeps in benchmarks/results/grouped_gemm_notes.md (H200):
# * 128x128 tiles, 8 warps = 2 consumer warpgroups of 64 rows: the fp32 accumulator and the fp32
#   partial of one K block take 64 + 64 registers per thread (180 in all). A 128x256 tile needs 256
#   and spills (496 bytes of stack); 5 stages or GROUP_M = 16 measured within noise of this one.
# * 64x128 tiles, 4 warps, 2 programs per SM (171 registers x 128 threads, 113 KiB of shared memory
#   each): one program's MMAs overlap the other's promotion, at 1.5x the L2->SM bytes per FLOP; it
#   wins on some dgrad shapes. 5 stages would leave no room for the second program.
# * 128x128 tiles, 2 stages: the only one whose pipelined operands fit when B is an fp32 weight quantized in
#   the kernel (64 KiB per stage for its tile; the autotuner skips configs that do not fit).
FORWARD_CONFIGS = [
    gemm_config(128, 128, num_warps=8, num_stages=4),
    gemm_config(64, 128, num_warps=4, num_stages=4, programs_per_sm=2),
    gemm_config(128, 128, num_warps=8, num_stages=2),
]
INTERPRET_CONFIG = gemm_config(128, 128, num_warps=8, num_stages=1, group_m=2)


@triton.jit
def _quantized_weight_tile(w_ptr, tail_ptr, e, r, c, N_HEAD, N_TAIL, KW, TILE: tl.constexpr):
    """The 128x128 tile of ``W = cat([w, tail], 1)`` (``[E, N_HEAD + N_TAIL, KW]``) at rows ``r``, columns
    ``c`` of expert ``e``, quantized as ``quantize_128x128`` does: ``(E4M3 tile, scale_inv)``. A tile lies in
    one input (``N_HEAD`` is a multiple of 128): one scalar branch."""
    rows = (tl.arange(0, TILE) + r).to(tl.int64)
    cols = (tl.arange(0, TILE) + c).to(tl.int64)
    if r < N_HEAD:
        src = w_ptr + e.to(tl.int64) * N_HEAD * KW + rows[:, None] * KW + cols[None, :]
    else:
        src = tail_ptr + e.to(tl.int64) * N_TAIL * KW + (rows - N_HEAD)[:, None] * KW + cols[None, :]
    return quantize_tile(tl.load(src))


@triton.jit
def _grouped_gemm_fp8_blockwise_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    tail_ptr,
    out_ptr,
    kept_ptr,
    kept_scale_ptr,
    ends_ptr,
    M,
    N,
    K,
    E,
    N_HEAD,
    N_TAIL,
    stride_am,
    stride_asm,
    E_POW2: tl.constexpr,
    QUANTIZE_B: tl.constexpr,
    TRANSPOSE_B: tl.constexpr,
    KEEP_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # sizes the grid only
):
    """Persistent blockwise FP8 grouped GEMM; a tile spans one 128-column weight block (one scale_b).

    a ``[M, K]`` (row stride ``stride_am``), a_scale ``[M, K/128]`` (row stride ``stride_asm``), out
    ``[M, N]`` contiguous, ends ``[E]`` int32 group end offsets. FP8 ``b`` ``[E, N, K]`` contiguous with
    b_scale ``[E, N/128, K/128]`` (``TRANSPOSE_B``: ``W [E, K, N]`` with its scales ``[E, K/128, N/128]``,
    whose ``[k, n]`` tiles are the dot's RHS as they are); or (``QUANTIZE_B``) the high-precision weight ``W = cat([b, tail], 1)``,
    ``b`` ``[E, N_HEAD, KW]`` and ``tail`` ``[E, N_TAIL, KW]`` contiguous, whose tiles (transposed with
    ``TRANSPOSE_B``) are quantized here; b_scale is then unused. ``KEEP_B`` (quantized, not transposed):
    the first M tile of each expert's group also stores the E4M3 tiles ``[E, N, K]`` at ``kept_ptr`` and
    their scales ``[E, N/128, K/128]`` at ``kept_scale_ptr`` (the experts with rows: see :func:`_kept_b`).
    """
    tl.static_assert(BLOCK_N == BLOCK_K, "one 128-column weight block per tile: one scale_b per K block")
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if not QUANTIZE_B and TRANSPOSE_B:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    elif not QUANTIZE_B:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    k_blocks = K // BLOCK_K
    n_scale_blocks = N // BLOCK_K
    kw = K if not TRANSPOSE_B else N  # W's row length
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Only M tiles before the last group end do work; their count is read on the device. (Flattening
    # the tile and K loops -- tl.range(flatten=True), possible since the K loop's bound is invariant --
    # measured 4-12% slower on an H200: the fused loop carries the scale pointers, 205 vs 164 registers.)
    live_m = tl.minimum(tl.cdiv(tl.load(ends_ptr + E - 1), BLOCK_M), num_m)
    for tile in range(tl.program_id(0), live_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, live_m, num_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        e = tl.minimum(expert_of_row(ends_ptr, m0, E, E_POW2), E - 1)
        rows = m0 + tl.arange(0, BLOCK_M)
        a_scale_rows = a_scale_ptr + rows.to(tl.int64) * stride_asm
        b_scale_row = b_scale_ptr + e.to(tl.int64) * n_scale_blocks * k_blocks
        if KEEP_B:
            keep = m0 == group_rows(ends_ptr, e)[0]
            kept_rows = (e * N + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
            kept_tiles = kept_ptr + kept_rows[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(k_blocks):
            a = a_desc.load([m0, kb * BLOCK_K])
            sa = tl.load(a_scale_rows + kb, mask=rows < M, other=0.0)
            if QUANTIZE_B:
                # W's tile [n, k] (forward), or [k, n] of the transposed operand, already the dot's RHS.
                if TRANSPOSE_B:
                    b_t, sb = _quantized_weight_tile(b_ptr, tail_ptr, e, kb * BLOCK_K, n0, N_HEAD, N_TAIL, kw, BLOCK_K)
                else:
                    b, sb = _quantized_weight_tile(b_ptr, tail_ptr, e, n0, kb * BLOCK_K, N_HEAD, N_TAIL, kw, BLOCK_K)
                    b_t = b.T
                    if KEEP_B:  # noqa: SIM102 (keep exists only with KEEP_B: the constexpr test comes first)
                        if keep:
                            tl.store(kept_tiles + kb * BLOCK_K, b)
                            tl.store(kept_scale_ptr + (e * n_scale_blocks + n0 // BLOCK_K) * k_blocks + kb, sb)
            elif TRANSPOSE_B:
                b_t = b_desc.load([e * K + kb * BLOCK_K, n0])
                sb = tl.load(b_scale_row + kb * n_scale_blocks + n0 // BLOCK_K)
            else:
                b_t = b_desc.load([e * N + n0, kb * BLOCK_K]).T
                sb = tl.load(b_scale_row + (n0 // BLOCK_K) * k_blocks + kb)
            acc = tl.dot(a, b_t) * (sa[:, None] * sb) + acc
        out_desc.store([m0, n0], acc.to(out_ptr.dtype.element_ty))
    # Tiles at or past the last group end: zeros, so the whole output is defined; nothing is read.
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    for tile in range(live_m * num_n + tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        out_desc.store([(tile // num_n) * BLOCK_M, (tile % num_n) * BLOCK_N], zeros)


_grouped_gemm_fp8_blockwise_tuned = autotuned(FORWARD_CONFIGS)(_grouped_gemm_fp8_blockwise_kernel)


def _b_dims(b: torch.Tensor, b_tail: torch.Tensor | None, transpose_b: bool) -> tuple[int, int, int, int, int]:
    """``(E, N, K, N_HEAD, N_TAIL)`` of the operand ``B [E, N, K]``: ``b`` itself when FP8; for a
    high-precision ``W = cat([b, b_tail], 1)`` ``[E, N_HEAD + N_TAIL, KW]``, ``W`` or (``transpose_b``) ``W^T``.
    Without a tail ``N_TAIL = 0``."""
    e, n_head, kw = b.shape
    n_tail = 0 if b_tail is None else b_tail.shape[1]
    nw = n_head + n_tail
    n, k = (kw, nw) if transpose_b else (nw, kw)
    return e, n, k, n_head, n_tail


def _output_and_dims(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, b_tail: torch.Tensor | None, transpose_b: bool
) -> tuple[torch.Tensor, tuple[int, int, int, int, int, int]]:
    """Both launchers' start: the uninitialized output, ``(M, N, K, E, N_HEAD, N_TAIL)``, TMA checks when M > 0."""
    m = a.shape[0]
    e, n, k, n_head, n_tail = _b_dims(b, b_tail, transpose_b)
    if m:
        check_tma_operand("a", a)
        check_tma_operand("b", b)
        if b_tail is not None:
            check_tma_operand("b_tail", b_tail)
    return torch.empty((m, n), dtype=out_dtype, device=a.device), (m, n, k, e, n_head, n_tail)


def launch_grouped_gemm_fp8_blockwise_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    b_tail: torch.Tensor | None = None,
    transpose_b: bool = False,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`grouped_gemm_fp8_blockwise`;
    ``kept``: the ``(data, scale)`` outputs the forward quantizing path writes its tiles into (:func:`_kept_b`).

    ``config`` pins one launch config (tests, config sweeps); by default the GPU autotunes over
    :data:`FORWARD_CONFIGS` and the interpreter runs :data:`INTERPRET_CONFIG`.
    """
    out, (m, n, k, e, n_head, n_tail) = _output_and_dims(a, b, out_dtype, b_tail, transpose_b)
    if m == 0:
        return out
    set_tma_workspace_allocator(a.device)
    grid = persistent_grid(a.device, lambda meta: cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]))
    quantize_b = b.dtype != FP8_DTYPE
    launch(
        _grouped_gemm_fp8_blockwise_tuned,
        grid,
        a,
        a_scale,
        b,
        a_scale if b_scale is None else b_scale,  # unread when the kernel quantizes b
        b if b_tail is None else b_tail,  # without a tail the branch that reads it is never taken
        out,
        *((out, a_scale) if kept is None else kept),  # written only with KEEP_B
        group_end_offsets,
        m,
        n,
        k,
        e,
        n_head,
        n_tail,
        a.stride(0),
        a_scale.stride(0),
        E_POW2=next_pow2(e),
        QUANTIZE_B=quantize_b,
        TRANSPOSE_B=transpose_b,
        KEEP_B=kept is not None,
        config=INTERPRET_CONFIG if config is None and interpreting() else config,
    )
    return out


# ---------------------------------------------------------------------------------------------
# sm90: the warp-specialized Gluon kernel.

# Sweep candidates (benchmarks/results/grouped_gemm_fp8_blockwise_sweep.md, H200); the first three
# are the defaults (sm90_default_config).
SM90_CONFIGS = [
    Sm90Config(256, 3, 16, out_buffers=2),
    Sm90Config(128, 4, 8),
    Sm90Config(256, 3, 16),
    Sm90Config(256, 3, 16, ordered=True),
    Sm90Config(256, 4, 8),
    Sm90Config(128, 4, 8, ordered=True),
]

# With a high-precision B (quantized in the kernel): 128x128 tiles, the stages that fit (sm90_default_config).
HP_B_CONFIGS = [Sm90Config(128, 4, 8), Sm90Config(128, 3, 8), Sm90Config(128, 2, 8)]


@gluon.jit
def _sm90_expert_of_row(ends_ptr, row, E, E_POW2: gl.constexpr, WARPS: gl.constexpr):
    """Expert owning ``row``, clamped to ``E - 1``: :func:`expert_of_row` with the explicit layout
    Gluon needs (the Triton helpers without tensors, ``grouped_tile``, Gluon calls as they are)."""
    offs = gl.arange(0, E_POW2, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    ends = gl.load(ends_ptr + offs, mask=offs < E, other=2147483647)
    return gl.minimum(gl.sum((ends <= row).to(gl.int32), axis=0), E - 1)


@gluon.jit
def _sm90_tiles(ends_ptr, M, N, E, BLOCK_N: gl.constexpr):
    """``(live_m, num_m, num_n)``: M tiles before the last group end, all M tiles, N tiles."""
    num_m = gl.cdiv(M, SM90_BLOCK)
    live_m = gl.minimum(gl.cdiv(gl.load(ends_ptr + E - 1), SM90_BLOCK), num_m)
    return live_m, num_m, N // BLOCK_N


@gluon.jit
def _sm90_producer(
    E_POW2: gl.constexpr,
    GROUP_M: gl.constexpr,
    QUANTIZE_B: gl.constexpr,
    TRANSPOSE_B: gl.constexpr,
    a_desc,
    b_descs,
    ring,
    problem,
):
    """One warp: TMA loads of the A and B tiles of every K block of every live tile into the ring.

    ``b_descs = (b_desc, tail_desc, N_HEAD, N_TAIL)``. FP8 B: ``b_desc`` over ``[E * N, K]``, BLOCK_N x
    128 boxes (``tail_desc`` unused). A weight ``W = cat([b, tail], 1)`` the kernel prepares
    (``QUANTIZE_B``: high precision; or ``TRANSPOSE_B``: FP8 ``W`` without a tail, ``N_TAIL = 0``):
    ``b_desc`` over ``[E * N_HEAD, KW]`` and ``tail_desc`` over ``[E * N_TAIL, KW]``, 128x128 boxes; the
    tile at W rows ``r`` and columns ``c`` is this tile's ``[n, k]`` (``[k, n]`` with ``TRANSPOSE_B``)."""
    a_bufs, b_bufs, ready, empty, _ = ring
    b_desc, tail_desc, N_HEAD, N_TAIL = b_descs
    ends_ptr, M, N, K, E = problem
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    live_m, num_m, num_n = _sm90_tiles(ends_ptr, M, N, E, BLOCK_N)
    it = 0
    for tile in range(gl.program_id(0), live_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, live_m, num_n, GROUP_M)
        e = _sm90_expert_of_row(ends_ptr, pid_m * SM90_BLOCK, E, E_POW2, 1)
        for kb in range(K // SM90_BLOCK):
            s = it % STAGES
            # Slot s is free once both consumers released its previous use (first pass: free).
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [pid_m * SM90_BLOCK, kb * SM90_BLOCK], ready.index(s), a_bufs.index(s))
            if not TRANSPOSE_B and not QUANTIZE_B:
                tma_load(b_desc, [e * N + pid_n * BLOCK_N, kb * SM90_BLOCK], ready.index(s), b_bufs.index(s))
            else:
                r = kb * SM90_BLOCK if TRANSPOSE_B else pid_n * SM90_BLOCK
                c = pid_n * SM90_BLOCK if TRANSPOSE_B else kb * SM90_BLOCK
                # A tile lies in one input (N_HEAD is a multiple of 128): one scalar branch.
                if r < N_HEAD:
                    tma_load(b_desc, [e * N_HEAD + r, c], ready.index(s), b_bufs.index(s))
                else:
                    tma_load(tail_desc, [e * N_TAIL + r - N_HEAD, c], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _sm90_kept_tile(ends_ptr, tile, live_m, num_n, E, GROUP_M: gl.constexpr, E_POW2: gl.constexpr, WARPS: gl.constexpr):
    """``(keep, tile_index)`` for this program's ``tile``-th live tile (the producer's order): whether its M
    tile is the first of its expert's group (the one M tile that writes the expert's FP8 tiles out), and
    the index of its weight tile row ``e * N/128 + n / 128`` in ``W``'s FP8 tiles."""
    pid_m, pid_n = grouped_tile(gl.program_id(0) + tile * gl.num_programs(0), live_m, num_n, GROUP_M)
    m0 = pid_m * SM90_BLOCK
    e = _sm90_expert_of_row(ends_ptr, m0, E, E_POW2, WARPS)
    start = gl.load(ends_ptr + gl.maximum(e - 1, 0))
    return m0 == gl.where(e > 0, start, 0), e * num_n + pid_n


@gluon.jit
def _sm90_release_kept_slot(empty, s, pending, keep):
    """The quantizer's release of ring slots under ``KEEP_B`` (its ``empty`` arrival, one per slot use):
    slot ``s`` at once when no kept tile's store reads it, else one tile later; the previous slot
    (``pending``) once its store has read it (stores complete in order: with this tile's own store issued,
    all but the newest are done). Returns the slot now pending, or -1."""
    if pending >= 0:
        if keep:
            tma.store_wait(1)
        else:
            tma.store_wait(0)
        mbarrier.arrive(empty.index(pending), count=1)
    if keep:
        return s
    mbarrier.arrive(empty.index(s), count=1)
    return -1


@gluon.jit
def _sm90_prepare_b(
    QUANTIZE_B: gl.constexpr,
    TRANSPOSE_B: gl.constexpr,
    KEEP_B: gl.constexpr,
    WARPS: gl.constexpr,
    PART: gl.constexpr,
    PARTS: gl.constexpr,
    GROUP_M: gl.constexpr,
    E_POW2: gl.constexpr,
    w_bufs,
    ready,
    prepared,
    problem,
    kept,
):
    """``WARPS`` warps that turn each landed 128x128 weight tile into the consumers' E4M3 B tile, then
    release them on ``bready``. ``prepared = (b_bufs, q_scales, bready)``.

    ``kept = (kept_desc, kept_scale_ptr, empty)``: with ``KEEP_B`` (forward quantizing only) the first M tile
    of each expert's group also stores its E4M3 tiles and scales to global memory (``kept_desc`` over
    ``[E * N, K]``, scales ``[E, N/128, K/128]``): ``quantize_128x128``'s output for every expert with rows,
    from the pass that reads the weight anyway. The consumers are released at once; the slot goes back to
    the producer (``empty``, a third arrival) only once the store has read it, waited for one tile later, so
    the store runs under the next tile's quantization instead of in front of the consumers.

    ``QUANTIZE_B`` (high-precision weight): E4M3 with one power-of-two scale, as ``quantize_128x128``
    computes it, written (transposed with ``TRANSPOSE_B``) over the first bytes of its own staging slot
    (``b_bufs`` views the slots) and its scale into ``q_scales``. The writes may overwrite the slot in place:
    the tile's amax is a reduction over every thread's loaded values, so no thread stores before all have
    read. Else (FP8 weight, ``TRANSPOSE_B``): the tile transposed into ``b_bufs``, slots of their own (no
    reduction orders the reads before the writes); its scale stays in global memory for the consumers.

    Register layouts chosen with ``gl.bank_conflicts`` (triton 3.6, sm_90a): bf16 forward, 16-byte loads
    and 8-byte stores with no conflicts; bf16 transposed, ``ldmatrix`` loads (no conflicts) and 16-byte
    stores with one extra wavefront each, where the forward layout would store single bytes 16-way
    conflicted; E4M3 transposed, 8 ``ldmatrix`` loads, 96 byte permutes and 8 16-byte stores per thread
    and tile (152 SASS instructions in all; the other layouts tried take 144-480 with more conflicts)."""
    b_bufs, q_scales, bready = prepared
    ends_ptr, M, N, K, E = problem
    kept_desc, kept_scale_ptr, empty = kept
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    if not QUANTIZE_B:
        layout: gl.constexpr = gl.BlockedLayout([16, 4], [1, 32], [WARPS, 1], [1, 0])
    elif TRANSPOSE_B:
        layout: gl.constexpr = gl.BlockedLayout([16, 2], [1, 32], [WARPS, 1], [1, 0])
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    scale_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    live_m, num_m, num_n = _sm90_tiles(ends_ptr, M, N, E, SM90_BLOCK)
    # The ring's slots in the producer's order: this program's live tiles times their K blocks.
    tiles = gl.cdiv(gl.maximum(live_m * num_n - gl.program_id(0), 0), gl.num_programs(0))
    # PARTS partitions take the slots in turn (this one: slots PART, PART + PARTS, ...), so one's loads
    # and permutes run while another waits on its stores and fence.
    k_blocks = K // SM90_BLOCK
    pending = -1  # KEEP_B: the slot whose kept tile's store may still be reading it
    keep = gl.program_id(0) < 0  # KEEP_B: this tile's, found once per tile (at its first K block)
    kept_tile = gl.program_id(0) * 0
    for it in range(PART, tiles * k_blocks, PARTS):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        q = w_bufs.index(s).load(layout)
        if QUANTIZE_B:
            # The amax in the weight's own dtype (a max is exact in any precision), so the tile stays packed
            # in registers; max skips NaN (maxnum), and pow2_scale_inv_and_scale floors an all-NaN tile like
            # a zero one: the scale quantize_128x128's nan_free_abs gives. Over both axes at once: each thread
            # reduces all its values, then one shuffle tree and one value per warp (an axis at a time took
            # 64 shuffles per thread, or a 128-wide cross-warp exchange: 2-3x the time per tile on an H200).
            amax = gl.max(gl.abs(q)).to(gl.float32)
            scale_inv, scale = pow2_scale_inv_and_scale(amax)
            q = (q.to(gl.float32) * scale).to(gl.float8e4nv)
            q_scales.index(s).store(gl.zeros([1], gl.float32, scale_layout) + scale_inv)
        if TRANSPOSE_B:
            q = gl.permute(q, (1, 0))
        b_bufs.index(s).slice(0, SM90_BLOCK).store(q)
        fence_async_shared()  # the generic-proxy stores, before the consumers' wgmma reads them
        if KEEP_B:
            kb = it % k_blocks
            if kb == 0:
                keep, kept_tile = _sm90_kept_tile(ends_ptr, it // k_blocks, live_m, num_n, E, GROUP_M, E_POW2, WARPS)
            if keep:
                tma_store(kept_desc, [kept_tile * SM90_BLOCK, kb * SM90_BLOCK], b_bufs.index(s).slice(0, SM90_BLOCK))
                one = gl.zeros([1], gl.int32, scale_layout)
                gl.store(kept_scale_ptr + kept_tile * k_blocks + kb + one, scale_inv + one.to(gl.float32))
            mbarrier.arrive(bready.index(s), count=1)
            pending = _sm90_release_kept_slot(empty, s, pending, keep)
        else:
            mbarrier.arrive(bready.index(s), count=1)
    if KEEP_B:  # noqa: SIM102 (the constexpr test first: Gluon folds it, the runtime one stays a branch)
        if pending >= 0:
            tma.store_wait(0)
            mbarrier.arrive(empty.index(pending), count=1)


@gluon.jit
def _sm90_consumer(
    WG: gl.constexpr,
    E_POW2: gl.constexpr,
    GROUP_M: gl.constexpr,
    ORDERED: gl.constexpr,
    QUANTIZE_B: gl.constexpr,
    TRANSPOSE_B: gl.constexpr,
    ring,
    out,
    scales,
    problem,
    q_scales,
):
    """One warpgroup: rows ``[64 WG, 64 WG + 64)`` of every tile -- MMAs, promotion, TMA stores.

    A 128x256 tile is computed as two 128-column halves, one after the other (two 64x128 fp32
    accumulators plus one partial: 192 registers; a single 64x256 partial would not fit). B's scales
    come from ``b_scale`` in global memory (``[E, N/128, K/128]``, or with ``TRANSPOSE_B`` the FP8 weight's
    own ``[E, K/128, N/128]``), or (``QUANTIZE_B``) from the quantizer's ``q_scales`` slot, which ``ready``
    (here :func:`_sm90_prepare_b`'s ``bready``) guarantees written; ``b_bufs`` then holds 128-row tiles at
    the start of taller slots."""
    a_bufs, b_bufs, ready, empty, turn = ring
    out_desc, out_bufs = out
    a_scale_ptr, stride_as, b_scale_ptr = scales
    ends_ptr, M, N, K, E = problem
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    if QUANTIZE_B:
        BLOCK_N: gl.constexpr = SM90_BLOCK
    else:
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALVES: gl.constexpr = BLOCK_N // SM90_BLOCK
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SM90_BLOCK, 32]
    )
    # This warpgroup's staging buffers: one, or one per half of a 128x256 tile (Sm90Config.out_buffers).
    BUFS: gl.constexpr = out_bufs.type.shape[0] // 2
    out_s0 = out_bufs.index(WG * BUFS)
    out_s1 = out_bufs.index(WG * BUFS + BUFS - 1)
    live_m, num_m, num_n = _sm90_tiles(ends_ptr, M, N, E, BLOCK_N)
    k_blocks = K // SM90_BLOCK
    it = 0
    for tile in range(gl.program_id(0), live_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, live_m, num_n, GROUP_M)
        m0 = pid_m * SM90_BLOCK + WG * WG_ROWS
        rows = m0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, mma))
        sa_ptrs = a_scale_ptr + rows.to(gl.int64) * stride_as
        # Row mask: only unvalidated, malformed offsets (a last end past M) can put rows past M here.
        sa = gl.load(sa_ptrs, mask=rows < M, other=0.0)
        if not QUANTIZE_B:
            e = _sm90_expert_of_row(ends_ptr, pid_m * SM90_BLOCK, E, E_POW2, 4)
            if TRANSPOSE_B:  # the scales of W [E, K, N], the tile's [n, k] block at [k, n]
                step_n, step_k = 1, N // SM90_BLOCK
            else:
                step_n, step_k = k_blocks, 1
            sb_ptr0 = b_scale_ptr + e.to(gl.int64) * (N // SM90_BLOCK) * k_blocks + pid_n * HALVES * step_n
            sb_ptr1 = sb_ptr0 + (HALVES - 1) * step_n
            sb0 = gl.load(sb_ptr0)
            sb1 = gl.load(sb_ptr1)
        acc0 = gl.zeros([WG_ROWS, SM90_BLOCK], gl.float32, mma)
        acc1 = gl.zeros([WG_ROWS, SM90_BLOCK], gl.float32, mma)
        for kb in range(k_blocks):
            s = it % STAGES
            part = sm90_first_mma(a_bufs, b_bufs, ready, turn, it, mma, WG, ORDERED)
            # The next block's scales load while this block multiplies (clamped on the last block).
            nxt = gl.minimum(kb + 1, k_blocks - 1)
            sa_next = gl.load(sa_ptrs + nxt, mask=rows < M, other=0.0)
            if QUANTIZE_B:
                sb0 = gl.max(q_scales.index(s).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)
            else:
                sb0_next = gl.load(sb_ptr0 + nxt * step_k)
                sb1_next = gl.load(sb_ptr1 + nxt * step_k)
            part = warpgroup_mma_wait(0, deps=(part,))
            if HALVES == 1:
                mbarrier.arrive(empty.index(s), count=1)
            acc0 = part * (sa * sb0)[:, None] + acc0
            if HALVES == 2:
                # Into the first partial's registers (dead once promoted): ptxas then keeps one partial
                # range and spills nothing (with a fresh placeholder it moved a 64-bit value through
                # local memory every block).
                acc0, part = sm90_second_mma(a_bufs, b_bufs, s, acc0, mma, WG, part)
                part = warpgroup_mma_wait(0, deps=(part,))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = part * (sa * sb1)[:, None] + acc1
            sa = sa_next
            if not QUANTIZE_B:
                sb0 = sb0_next
                sb1 = sb1_next
            it += 1
        sm90_store_halves(out_desc, out_s0, out_s1, acc0, acc1, m0, pid_n * BLOCK_N, HALVES, BUFS - 1)
    # Tiles at or past the last group end: zeros, so the whole output is defined; nothing is read.
    zero = gl.zeros([WG_ROWS, SM90_BLOCK], out_desc.dtype, mma)
    for tile in range(live_m * num_n + gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        row = (tile // num_n) * SM90_BLOCK + WG * WG_ROWS
        sm90_store_halves(out_desc, out_s0, out_s1, zero, zero, row, (tile % num_n) * BLOCK_N, HALVES, BUFS - 1)
    tma.store_wait(0)


@gluon.jit
def _grouped_gemm_fp8_blockwise_sm90_kernel(
    a_desc,
    b_desc,
    tail_desc,
    out_desc,
    kept_desc,
    a_scale_ptr,
    stride_as,
    b_scale_ptr,
    kept_scale_ptr,
    ends_ptr,
    M,
    N,
    K,
    E,
    N_HEAD,
    N_TAIL,
    E_POW2: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    ORDERED: gl.constexpr,
    OUT_BUFFERS: gl.constexpr,
    QUANTIZE_B: gl.constexpr,
    TRANSPOSE_B: gl.constexpr,
    KEEP_B: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    QUANTIZER_REGS: gl.constexpr,
    QUANTIZER_WARPS: gl.constexpr,
    PREPARERS: gl.constexpr,
):
    """Warp-specialized persistent blockwise FP8 grouped GEMM (Hopper).

    a_desc: ``[M, K]`` E4M3 rows, 128x128 boxes; out_desc: ``[M, N]``, 64x128 boxes (one per consumer
    and half); a_scale ``[M, K/128]`` (row stride ``stride_as``), ends ``[E]`` int32. B: b_desc over
    ``[E * N, K]`` E4M3 (the ``[E, N, K]`` weights flattened), BLOCK_N x 128 boxes (BLOCK_N 128 or 256),
    b_scale ``[E, N/128, K/128]`` contiguous; or (``QUANTIZE_B``) a high-precision weight (128x128 boxes, ``tail_desc`` and ``N_HEAD``/``N_TAIL`` as in :func:`_sm90_producer`), quantized in
    the kernel, b_scale unused. Partitions: two consumer warpgroups (the default one and a worker,
    ``CONSUMER_REGS`` registers each), one producer warp (40 registers) and, for a B the kernel prepares
    (high precision: quantized; FP8 with ``TRANSPOSE_B``: transposed), ``PREPARERS`` partitions of
    ``QUANTIZER_WARPS`` warps (``QUANTIZER_REGS`` each; :func:`_sm90_prepare_b`). ``KEEP_B`` (a
    high-precision B, forward): the quantizer also stores the E4M3 tiles of every expert with rows through
    ``kept_desc`` (``[E * N, K]``, 128x128 boxes) and their scales at ``kept_scale_ptr`` (``[E, N/128,
    K/128]``); both unused otherwise.
    """
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2 * OUT_BUFFERS] + out_desc.block_type.shape, out_desc.layout)
    # With KEEP_B the quantizer releases each slot too, once its kept tile's TMA store has read it.
    ready, empty, turn = sm90_ring_barriers(STAGES, 3 if KEEP_B else 2)
    ring = (a_bufs, b_bufs, ready, empty, turn)
    problem = (ends_ptr, M, N, K, E)
    scales = (a_scale_ptr, stride_as, b_scale_ptr)
    out = (out_desc, out_bufs)
    b_descs = (b_desc, tail_desc, N_HEAD, N_TAIL)
    kept = (kept_desc, kept_scale_ptr, empty)
    if not QUANTIZE_B and not TRANSPOSE_B:
        gl.warp_specialize(
            [
                (_sm90_consumer, (0, E_POW2, GROUP_M, ORDERED, False, False, ring, out, scales, problem, None)),
                (_sm90_consumer, (1, E_POW2, GROUP_M, ORDERED, False, False, ring, out, scales, problem, None)),
                (_sm90_producer, (E_POW2, GROUP_M, False, False, a_desc, b_descs, ring, problem)),
            ],
            [4, 1],
            [CONSUMER_REGS, 40],
        )
    else:
        if QUANTIZE_B:
            # The E4M3 tile of each slot lies over the first 16 KiB of the slot's high-precision tile.
            rows_per_slot: gl.constexpr = SM90_BLOCK * b_desc.dtype.primitive_bitwidth // 8
            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([rows_per_slot, SM90_BLOCK], gl.float8e4nv)
            ready_bufs = fp8_view_of_slots(b_bufs, q_layout)
        else:
            # An FP8 W's transposed tiles: slots of their own, as the landed tiles' (16 KiB each).
            ready_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, SM90_BLOCK, SM90_BLOCK], b_desc.layout)
        # One scale per slot (unused for an FP8 W, whose scales the consumers read); 4 slots (shapes are
        # powers of 2).
        gl.static_assert(STAGES <= 4, "q_scales holds 4 slots")
        q_scales = gl.allocate_shared_memory(gl.float32, [4, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        bready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bready.index(i), count=1)
        prepared = (ready_bufs, q_scales, bready)
        b_ring = (a_bufs, ready_bufs, bready, empty, turn)
        # Two lists spelled out (Gluon keeps constexprs only in literal argument tuples): one preparer,
        # or two taking turns.
        if PREPARERS == 1:
            gl.warp_specialize(
                [
                    (
                        _sm90_consumer,
                        (0, E_POW2, GROUP_M, ORDERED, QUANTIZE_B, TRANSPOSE_B, b_ring, out, scales, problem, q_scales),
                    ),
                    (
                        _sm90_consumer,
                        (1, E_POW2, GROUP_M, ORDERED, QUANTIZE_B, TRANSPOSE_B, b_ring, out, scales, problem, q_scales),
                    ),
                    (_sm90_producer, (E_POW2, GROUP_M, QUANTIZE_B, TRANSPOSE_B, a_desc, b_descs, ring, problem)),
                    (
                        _sm90_prepare_b,
                        (
                            QUANTIZE_B,
                            TRANSPOSE_B,
                            KEEP_B,
                            QUANTIZER_WARPS,
                            0,
                            1,
                            GROUP_M,
                            E_POW2,
                            b_bufs,
                            ready,
                            prepared,
                            problem,
                            kept,
                        ),
                    ),
                ],
                [4, 1, QUANTIZER_WARPS],
                [CONSUMER_REGS, 40, QUANTIZER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (
                        _sm90_consumer,
                        (0, E_POW2, GROUP_M, ORDERED, QUANTIZE_B, TRANSPOSE_B, b_ring, out, scales, problem, q_scales),
                    ),
                    (
                        _sm90_consumer,
                        (1, E_POW2, GROUP_M, ORDERED, QUANTIZE_B, TRANSPOSE_B, b_ring, out, scales, problem, q_scales),
                    ),
                    (_sm90_producer, (E_POW2, GROUP_M, QUANTIZE_B, TRANSPOSE_B, a_desc, b_descs, ring, problem)),
                    (
                        _sm90_prepare_b,
                        (
                            QUANTIZE_B,
                            TRANSPOSE_B,
                            False,
                            QUANTIZER_WARPS,
                            0,
                            2,
                            GROUP_M,
                            E_POW2,
                            b_bufs,
                            ready,
                            prepared,
                            problem,
                            kept,
                        ),
                    ),
                    (
                        _sm90_prepare_b,
                        (
                            QUANTIZE_B,
                            TRANSPOSE_B,
                            False,
                            QUANTIZER_WARPS,
                            1,
                            2,
                            GROUP_M,
                            E_POW2,
                            b_bufs,
                            ready,
                            prepared,
                            problem,
                            kept,
                        ),
                    ),
                ],
                [4, 1, QUANTIZER_WARPS, QUANTIZER_WARPS],
                [CONSUMER_REGS, 40, QUANTIZER_REGS, QUANTIZER_REGS],
            )


# Registers per thread of the consumer and quantizer partitions (setmaxnreg; the producer warp keeps 40),
# by B's dtype. Two consumer warpgroups + the quantizer's warpgroup(s) + the producer's
# warpgroup share 64K registers: their per-thread counts sum to <= 512. FP8 B: 232 per consumer (two
# 64x128 accumulators + a partial at 128x256 tiles). High-precision B: the consumers (128x128 tiles: one
# accumulator + a partial) give the quantizer its share; a bf16 tile stays packed in the quantizer's
# registers (64 per thread), an fp32 one takes 128. ptxas (triton 3.6, sm_90a) spills nothing at these
# (fp32 at 168 / 136: 44 bytes). Eight quantizer warps (half a tile each) spill 64-320 bytes at every split
# tried (consumers 144-168 / quantizer 64-88), so there is no 8-warp entry. An FP8 weight transposed in the
# kernel: 128x128 tiles as for bf16, two transposing warpgroups taking turns, each holding a 16 KiB tile
# (32 per thread): 176 / 56, where triton 3.6's ptxas spills nothing (at 168 / 64 it moved one value a tile
# through local memory, at 160 / 72 and 152 / 80 more; 3.9's spills 4-12 instructions at 176 / 56, ~50 at
# 168 / 64) and the dgrad took 1.4-2.8% less time than at 168 / 64 (H200 A/B on four fine-grained shapes,
# 2026-11-27, same bits). One warpgroup quantizes (see SM90_REGS).
QUANTIZER_WARPS = 4
SM90_REGS = {FP8_DTYPE: (232, 0), torch.bfloat16: (184, 104), torch.float32: (160, 152)}
SM90_REGS_FP8_TRANSPOSED = (176, 56)


def _sm90_regs(b_dtype: torch.dtype, transpose_b: bool) -> tuple[int, int]:
    """``(consumer, quantizer)`` registers per thread for B of ``b_dtype`` (see :data:`SM90_REGS`)."""
    return SM90_REGS_FP8_TRANSPOSED if b_dtype == FP8_DTYPE and transpose_b else SM90_REGS[b_dtype]


def _sm90_preparers(b_dtype: torch.dtype, transpose_b: bool) -> int:
    """Warpgroups that prepare B tiles: two take turns transposing an FP8 weight's tiles (one alone is
    latency-bound: a tile's loads, permutes, stores and fence in series); one quantizes (registers)."""
    return 2 if b_dtype == FP8_DTYPE and transpose_b else 1


def sm90_smem_bytes(
    config: Sm90Config, out_dtype: torch.dtype, b_dtype: torch.dtype = FP8_DTYPE, transpose_b: bool = False
) -> int:
    """Shared memory of the sm90 forward kernel with ``config``, ``out_dtype`` and B of ``b_dtype``
    (a high-precision B's slots hold its 128x128 tile, the E4M3 tile written over it, plus its scale; an
    FP8 B transposed in the kernel (``transpose_b``) has a second 16 KiB slot per stage for the transpose)."""
    if b_dtype != FP8_DTYPE:
        return config.smem_bytes(out_dtype, BLOCK * BLOCK * (b_dtype.itemsize - 1))
    return config.smem_bytes(out_dtype, BLOCK * BLOCK if transpose_b else 0)


def sm90_default_config(
    n: int, b_dtype: torch.dtype = FP8_DTYPE, out_dtype: torch.dtype = torch.bfloat16, transpose_b: bool = False
) -> Sm90Config:
    """The config the op runs with for ``N`` output columns: a fixed rule from the sweep, no timing at
    run time (so nothing re-tunes when routing changes M). FP8 B: 128x256 tiles where N allows (a quarter
    less L2->SM traffic per FLOP than 128x128: +3-7% on the anchor shapes), 3 stages (4 measured
    the same or slower, and 3 leave room for fp32 output: both output dtypes fit), consumers unordered:
    since the second half's MMA writes into the first half's partial (no spill), ordered consumers lose
    1-4% on all six anchor cases (H200 sweep, 2026-11-27; before that fix they won 1-7%, 2026-11-22),
    and one output staging buffer per half where the output dtype leaves room (bf16: 208 KiB; fp32 does
    not fit): the second half no longer waits for the first half's store, 0.2-2.7% less time on all 12
    forward and dgrad rows of the six shapes (median 0.6%, same bits; H200 A/B, 2026-11-27);
    128x128 tiles, unordered, otherwise. A B the kernel prepares
    (high precision, quantized; or FP8 with ``transpose_b``, transposed): 128x128 tiles (a tile is one
    weight block) and as many stages as fit, up to 4."""
    if b_dtype == FP8_DTYPE and not transpose_b:
        if n % 256:
            return SM90_CONFIGS[1]
        fits = sm90_smem_bytes(SM90_CONFIGS[0], out_dtype) <= SM90_SMEM_BYTES
        return SM90_CONFIGS[0] if fits else SM90_CONFIGS[2]
    for stages in (4, 3, 2):
        config = Sm90Config(128, stages, 8)
        if sm90_smem_bytes(config, out_dtype, b_dtype, transpose_b) <= SM90_SMEM_BYTES:
            return config
    raise ValueError(f"no sm90 config fits {b_dtype} weights (transpose_b={transpose_b}) with {out_dtype} output")


def launch_grouped_gemm_fp8_blockwise_sm90(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    b_tail: torch.Tensor | None = None,
    transpose_b: bool = False,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    config: Sm90Config | None = None,
) -> torch.Tensor:
    """Gluon launcher (Hopper GPUs only). Same contract as :func:`grouped_gemm_fp8_blockwise`; ``kept``:
    the ``(data, scale)`` outputs the forward quantizing path writes its tiles into (see :func:`_kept_b`).

    ``config`` pins the launch settings (tests, sweeps); by default :func:`sm90_default_config`.
    """
    quantize_b = b.dtype != FP8_DTYPE
    out, (m, n, k, e, n_head, n_tail) = _output_and_dims(a, b, out_dtype, b_tail, transpose_b)
    config = config or sm90_default_config(n, b.dtype, out_dtype, transpose_b)
    if (quantize_b or transpose_b) and config.block_n != BLOCK:
        raise ValueError(f"{config}: b is quantized or transposed in 128x128 tiles, so block_n must be 128")
    smem = sm90_smem_bytes(config, out_dtype, b.dtype, transpose_b)
    check_sm90_launch(a.device, config, n, out_dtype, smem, split_epilogue=True)
    if m == 0:
        return out
    if quantize_b or transpose_b:
        b_desc = descriptor(b.view(e * n_head, b.shape[2]), (BLOCK, BLOCK))
        tail_desc = b_desc if b_tail is None else descriptor(b_tail.view(e * n_tail, b.shape[2]), (BLOCK, BLOCK))
    else:
        b_desc = tail_desc = descriptor(b.view(e * n, k), (config.block_n, BLOCK))
    consumer_regs, quantizer_regs = _sm90_regs(b.dtype, transpose_b)
    tiles = cdiv(m, BLOCK) * (n // config.block_n)
    a_desc = descriptor(a, (BLOCK, BLOCK))
    launch_kernel(
        _grouped_gemm_fp8_blockwise_sm90_kernel,
        (min(tiles, sm_count(a.device)),),
        a_desc,
        b_desc,
        tail_desc,
        descriptor(out, (64, BLOCK)),
        a_desc if kept is None else descriptor(kept[0].view(e * n, k), (BLOCK, BLOCK)),  # unused without kept
        a_scale,
        a_scale.stride(0),
        a_scale if b_scale is None else b_scale,  # unread when the kernel quantizes b
        a_scale if kept is None else kept[1],
        group_end_offsets,
        m,
        n,
        k,
        e,
        n_head,
        n_tail,
        E_POW2=next_pow2(e),
        GROUP_M=config.group_m,
        STAGES=config.stages,
        ORDERED=config.ordered,
        OUT_BUFFERS=config.out_buffers,
        QUANTIZE_B=quantize_b,
        TRANSPOSE_B=transpose_b,
        KEEP_B=kept is not None,
        CONSUMER_REGS=consumer_regs,
        QUANTIZER_REGS=quantizer_regs,
        QUANTIZER_WARPS=QUANTIZER_WARPS,
        PREPARERS=_sm90_preparers(b.dtype, transpose_b),
        num_warps=4,
    )
    return out


def build_sm90_kernel(
    config: Sm90Config,
    out_dtype: torch.dtype,
    num_experts: int = 8,
    b_dtype: torch.dtype = FP8_DTYPE,
    transpose_b: bool = False,
    keep_b: bool = False,
) -> Any:
    """Compile the sm90 kernel for sm_90a without a GPU (see :func:`compile_for_sm90`), with the
    specialization a launch with ``config``, ``out_dtype``, ``num_experts``, B of ``b_dtype``,
    ``transpose_b`` and ``keep_b`` (kept FP8 tiles) would have."""
    fp8 = torch.float8_e4m3fn
    quantize_b = b_dtype != fp8
    b_box = (BLOCK, BLOCK) if quantize_b or transpose_b else (config.block_n, BLOCK)
    consumer_regs, quantizer_regs = _sm90_regs(b_dtype, transpose_b)
    signature = {
        "a_desc": descriptor_signature((BLOCK, BLOCK), fp8),
        "b_desc": descriptor_signature(b_box, b_dtype),
        "tail_desc": descriptor_signature(b_box, b_dtype),
        "out_desc": descriptor_signature((64, BLOCK), out_dtype),
        "kept_desc": descriptor_signature((BLOCK, BLOCK), fp8),
        "a_scale_ptr": "*fp32",
        "stride_as": "i32",
        "b_scale_ptr": "*fp32",
        "kept_scale_ptr": "*fp32",
        "ends_ptr": "*i32",
        **dict.fromkeys(("M", "N", "K", "E", "N_HEAD", "N_TAIL"), "i32"),
        **dict.fromkeys(_SM90_CONSTEXPRS, "constexpr"),
    }
    constexprs = {
        "E_POW2": next_pow2(num_experts),
        "GROUP_M": config.group_m,
        "STAGES": config.stages,
        "ORDERED": config.ordered,
        "OUT_BUFFERS": config.out_buffers,
        "QUANTIZE_B": quantize_b,
        "TRANSPOSE_B": transpose_b,
        "KEEP_B": keep_b,
        "CONSUMER_REGS": consumer_regs,
        "QUANTIZER_REGS": quantizer_regs,
        "QUANTIZER_WARPS": QUANTIZER_WARPS,
        "PREPARERS": _sm90_preparers(b_dtype, transpose_b),
    }
    return compile_for_sm90(_grouped_gemm_fp8_blockwise_sm90_kernel, signature, constexprs)


_SM90_CONSTEXPRS = (
    "E_POW2",
    "GROUP_M",
    "STAGES",
    "ORDERED",
    "OUT_BUFFERS",
    "QUANTIZE_B",
    "TRANSPOSE_B",
    "KEEP_B",
    "CONSUMER_REGS",
    "QUANTIZER_REGS",
    "QUANTIZER_WARPS",
    "PREPARERS",
)


# The op's CUDA kernel (same contract as :func:`grouped_gemm_fp8_blockwise`): the sm90 Gluon kernel on
# Hopper, the Triton kernel on other GPUs.
launch_grouped_gemm_fp8_blockwise = sm90_or(
    launch_grouped_gemm_fp8_blockwise_sm90, launch_grouped_gemm_fp8_blockwise_triton
)


def grouped_gemm_fp8_blockwise_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    b_tail: torch.Tensor | None = None,
    transpose_b: bool = False,
) -> torch.Tensor:
    """Torch reference (the oracle and the CPU path): a high-precision ``b`` quantized by
    :func:`~fp8flow_ao.kernels.quantize_128x128.quantize_128x128_reference` (the orientation asked for),
    then dequantize and an fp32 matmul per group. Rows at or past the last group end are zero.
    """
    if b.dtype != FP8_DTYPE:
        data, scale, data_t, scale_t = quantize_128x128_reference(
            b, with_transpose=transpose_b, with_data=not transpose_b, w_tail=b_tail
        )
        b, b_scale = (data_t, scale_t) if transpose_b else (data, scale)
    elif transpose_b:  # 128x128 blocks are symmetric under transpose: the scales transpose with the data
        b, b_scale = b.transpose(1, 2), b_scale.transpose(1, 2)
    a32 = dequantize_rows_reference(a, a_scale, BLOCK)
    b32 = b.float() * b_scale.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    for e, (start, end) in enumerate(group_bounds(group_end_offsets, a.shape[0])):
        out[start:end] = a32[start:end] @ b32[e].T
    return out.to(out_dtype)


@define_op("grouped_gemm_fp8_blockwise")
def _grouped_gemm_fp8_blockwise_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    b_tail: torch.Tensor | None = None,
    transpose_b: bool = False,
) -> torch.Tensor:
    return grouped_gemm_fp8_blockwise_reference(
        a, a_scale, b, b_scale, group_end_offsets, out_dtype, b_tail, transpose_b
    )


_grouped_gemm_fp8_blockwise_op.register_kernel("cuda")(launch_grouped_gemm_fp8_blockwise)


@_grouped_gemm_fp8_blockwise_op.register_fake
def _(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    b_tail: torch.Tensor | None = None,
    transpose_b: bool = False,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], _b_dims(b, b_tail, transpose_b)[1]), dtype=out_dtype)


def _kept_b(b: torch.Tensor, b_tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``(data, scale)`` for the 128x128 E4M3 tiles of a high-precision ``W = cat([b, b_tail],
    1)`` ``[E, N, K]``: data E4M3 ``[E, N, K]``, scale fp32 ``[E, N/128, K/128]``, as ``quantize_128x128``
    lays them out. The forward GEMM quantizing ``W`` (``keep_b``) fills in the experts that have rows."""
    e, n, k, _, _ = _b_dims(b, b_tail, False)
    return b.new_empty((e, n, k), dtype=FP8_DTYPE), b.new_empty((e, n // BLOCK, k // BLOCK), dtype=torch.float32)


def launch_grouped_gemm_fp8_blockwise_keep_b(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    b_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CUDA kernel of ``grouped_gemm_fp8_blockwise(..., keep_b=True)``: ``(out, b_data, b_scale)``."""
    kept = _kept_b(b, b_tail)
    out = launch_grouped_gemm_fp8_blockwise(a, a_scale, b, None, group_end_offsets, out_dtype, b_tail, False, kept)
    return out, *kept


def grouped_gemm_fp8_blockwise_keep_b_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    b_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of ``keep_b=True``: ``quantize_128x128_reference`` of every expert's ``W``, then the FP8
    GEMM on those tiles."""
    data, scale, _, _ = quantize_128x128_reference(b, with_transpose=False, with_data=True, w_tail=b_tail)
    return grouped_gemm_fp8_blockwise_reference(a, a_scale, data, scale, group_end_offsets, out_dtype), data, scale


@define_op("grouped_gemm_fp8_blockwise_keep_b")
def _grouped_gemm_fp8_blockwise_keep_b_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    b_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grouped_gemm_fp8_blockwise_keep_b_reference(a, a_scale, b, group_end_offsets, out_dtype, b_tail)


_grouped_gemm_fp8_blockwise_keep_b_op.register_kernel("cuda")(launch_grouped_gemm_fp8_blockwise_keep_b)


@_grouped_gemm_fp8_blockwise_keep_b_op.register_fake
def _(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    b_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return a.new_empty((a.shape[0], _b_dims(b, b_tail, False)[1]), dtype=out_dtype), *_kept_b(b, b_tail)


def _check_b(b: torch.Tensor, b_scale: torch.Tensor | None, b_tail: torch.Tensor | None, transpose_b: bool) -> None:
    """``b`` FP8 with its scales, or high precision (quantized by the kernel) with an optional tail."""
    check_bool("transpose_b", transpose_b)
    check_tensor("b", b, dtypes=(FP8_DTYPE, *HP_B_DTYPES), ndim=3)
    check_contiguous("b", b)  # row-major as stored; a dgrad passes the weight with transpose_b, never a .mT view
    e, n, k = b.shape
    check_multiple("b", n, what="dim 1")
    check_multiple("b", k, what="dim 2")
    if b.dtype == FP8_DTYPE:
        if b_tail is not None:
            raise ValueError("b_tail applies to a high-precision b only (an FP8 b is one tensor)")
        check_tensor("b_scale", b_scale, dtypes=torch.float32, ndim=3)
        check_contiguous("b_scale", b_scale)
        return
    if b_scale is not None:
        raise ValueError(f"b_scale must be None for a high-precision b ({b.dtype}): the kernel quantizes b itself")
    if b_tail is not None:
        check_tensor("b_tail", b_tail, dtypes=b.dtype, ndim=3)
        check_contiguous("b_tail", b_tail)
        if b_tail.shape[0] != e or b_tail.shape[2] != k:
            raise ValueError(
                f"b_tail must be [E={e}, N2, {k}] like b {tuple(b.shape)} but for dim 1, got {tuple(b_tail.shape)}"
            )
        check_multiple("b_tail", b_tail.shape[1], what="dim 1")


def _check_inputs(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    b_tail: torch.Tensor | None,
    transpose_b: bool,
) -> None:
    check_fp8("a", a, ndim=2)
    check_tensor("a_scale", a_scale, dtypes=torch.float32, ndim=2)
    _check_b(b, b_scale, b_tail, transpose_b)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    m, k = a.shape
    e, n, kb, _, _ = _b_dims(b, b_tail, transpose_b)
    check_multiple("a", k, what="K (dim 1)")
    if kb != k:
        raise ValueError(
            f"the B operand must have K = {k} (a's dim 1), got {kb} (b {tuple(b.shape)}, transpose_b={transpose_b})"
        )
    check_group_end_offsets("group_end_offsets", group_end_offsets, rows=m)
    if group_end_offsets.shape[0] != e or e == 0:
        raise ValueError(
            f"group_end_offsets must hold one end per expert (b has E = {e} >= 1), got {group_end_offsets.shape[0]}"
        )
    check_shape("a_scale", a_scale, (m, k // BLOCK))
    if b_scale is not None:  # W's own block grid, whether or not the kernel transposes it
        check_shape("b_scale", b_scale, (e, b.shape[1] // BLOCK, b.shape[2] // BLOCK))
    check_row_major("a", a)  # K-major: the tensor cores read both operands along K
    check_row_major("a_scale", a_scale)
    check_same_device(a=a, a_scale=a_scale, b=b, b_scale=b_scale, b_tail=b_tail, group_end_offsets=group_end_offsets)


def grouped_gemm_fp8_blockwise(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    b_tail: torch.Tensor | None = None,
    transpose_b: bool = False,
    keep_b: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blockwise FP8 grouped GEMM: ``out[m] = dequant(a)[m] @ dequant(B)[e]^T`` for rows ``m`` of group ``e``.

    Forward (``a`` = activations, ``B`` = weights ``[E, N, K]``) and dgrad (``a`` = output gradient,
    ``B`` = the exactly transposed weight ``[E, K, N]``) are the same call. ``B`` is given either as
    FP8 tiles (``b`` + ``b_scale``: for dgrad the forward's tiles with ``transpose_b=True``, which the
    kernel transposes as it loads them, or ``quantize_128x128``'s ``data_t`` / ``scale_inv_t``) or as the
    high-precision weight itself (``b`` bf16/fp32, ``b_scale=None``), which the kernel quantizes tile by
    tile as it loads it -- bit for bit what ``quantize_128x128`` followed by the FP8 call gives, without
    an FP8 copy of the weight in memory (see the module docstring for when that pays).

    Args:
        a: E4M3 ``[M, K]``, row-major (K contiguous; row stride a multiple of 16), ``K % 128 == 0``.
        a_scale: fp32 ``[M, K/128]`` row-major, COMPACT 1x128 ``scale_inv`` (dequantize multiplier)
            of ``a``; read as it is.
        b: ``W [E, Nw, Kw]`` contiguous (row-major), both dims multiples of 128: E4M3, or bf16/fp32 (then
            quantized by the kernel). ``B = W`` (``N = Nw + N2``, ``K = Kw``: ``W`` K-major) or, with
            ``transpose_b``, ``B = W^T`` per expert (``N = Kw``, ``K = Nw + N2``).
        b_scale: fp32 ``[E, Nw/128, Kw/128]`` contiguous, the 128x128 ``scale_inv`` of an FP8 ``W`` (as
            stored, with or without ``transpose_b``); ``None`` for a high-precision ``b``.
        group_end_offsets: int32 ``[E]`` on ``a``'s device: padded group END offsets, non-decreasing
            multiples of 128 (so each group starts on a 128-row boundary), last ``<= M``. Values are
            checked on CPU tensors, on the GPU only with ``FP8FLOW_VALIDATE=1`` (the check syncs the device).
        out_dtype: ``torch.bfloat16`` (default) or ``torch.float32``.
        b_tail: high-precision ``b`` only: ``[E, N2, Kw]`` rows joined below ``b`` (``W = cat([b, b_tail],
            1)``, never materialized: FC1's ``W13 = [w1; w3]``), same dtype, contiguous, ``N2 % 128 == 0``.
        transpose_b: multiply by ``W[e]`` instead of ``W[e]^T`` (the dgrad). The kernel transposes each
            128x128 tile in shared memory (exact: a block's scale is the same either way), so the
            transposed FP8 copy need not exist; on Hopper such a B takes 128x128 tiles.
        keep_b: high-precision ``b`` without ``transpose_b`` only (a forward): also return the E4M3
            tiles the kernel made of ``W``, for a later dgrad with ``transpose_b=True``: one pass over
            the high-precision weight gives the forward and both FP8 operands. Only the experts whose
            group has rows get their tiles written (by the first M tile of the group); the tiles of
            experts with empty groups are left uninitialized, which a dgrad over the same offsets never reads.

    Returns:
        ``[M, N]`` contiguous ``out_dtype``. Accumulation is fp32 with the partial product of each
        128-wide K block promoted by ``a_scale[m, kb] * scale_B[e, n // 128, kb]``. Rows at or past
        the last group end are zero (never read from ``a``). With ``keep_b``: ``(out, b_data, b_scale)``,
        ``b_data`` E4M3 ``[E, N, K]`` and ``b_scale`` fp32 ``[E, N/128, K/128]`` (``scale_inv``),
        bit for bit ``quantize_128x128(W)``'s on the experts with rows.
    """
    _check_inputs(a, a_scale, b, b_scale, group_end_offsets, out_dtype, b_tail, transpose_b)
    check_no_grad("grouped_gemm_fp8_blockwise", a, a_scale, b, b_scale, b_tail)
    check_bool("keep_b", keep_b)
    if keep_b:
        if b.dtype == FP8_DTYPE or transpose_b:
            raise ValueError(
                f"keep_b needs a high-precision b without transpose_b (a forward that quantizes W), got b of "
                f"{b.dtype} with transpose_b={transpose_b}"
            )
        return torch.ops.fp8flow.grouped_gemm_fp8_blockwise_keep_b(a, a_scale, b, group_end_offsets, out_dtype, b_tail)
    return torch.ops.fp8flow.grouped_gemm_fp8_blockwise(
        a, a_scale, b, b_scale, group_end_offsets, out_dtype, b_tail, transpose_b
    )
