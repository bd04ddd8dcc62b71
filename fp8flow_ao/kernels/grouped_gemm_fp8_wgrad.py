"""grouped_gemm_fp8_wgrad: per expert ``dW_e = dY_e^T @ X_e`` from column-wise (transposed) 1x128 FP8.

The weight-gradient GEMM of the routed experts. Both operands are column-wise FP8, i.e. the data
physically transposed so the token dim (the reduction dim here) is contiguous, as Hopper's FP8
tensor cores need: ``a_t`` = dY^T ``[N, M]`` with scales ``[M/128, N]``, ``b_t`` = X^T ``[K, M]``
with scales ``[M/128, K]`` (one scale per 128 tokens x 1 feature). The reduction over expert
``e``'s rows runs in 128-row blocks; each block's tensor-core partial is promoted into the fp32
accumulator with the outer product ``a_t_scale[mb, n] * b_t_scale[mb, k]``. Where ``b_t`` comes from
:func:`~fp8flow_ao.kernels.scaling_aware_transpose.scaling_aware_transpose` (the MoE layer's X^T and a^T,
``fp8_grouped_mm``'s A^T), its scales are one per 128 x 128 tile, repeated over the tile's columns:
``b_tile_scales=True`` reads one per tile, so the promotion is one multiply-add per element with no
per-column scale vector in registers.

Two kernels share one contract; both walk (expert, N tile, K tile) output tiles on a persistent
grid, each tile reading its expert's rows from the group end offsets on the device (no host sync).
An empty expert runs no block and stores zeros. A tile's time is its expert's token count, so under
skewed routing a fixed round-robin split of the tiles leaves some SMs with the long ones: the sm90
kernel's programs take their next tile from a counter instead (an atomic add by the producer warp, handed
to the consumers through shared memory), in the same order; one counter per stream, which each launch
leaves at zero for the next. H200, same inputs, same bits
(``grouped_gemm_notes.md``, session 38): 0.81-0.99x the time under Zipf-like routing (Qwen3-like FC2
0.81x, FC1 0.91x; DeepSeek-like 0.95-0.97x), 0.87-0.90x at 128 tokens per expert; 1.01-1.02x on balanced
groups of 512-2048 tokens, where every tile costs the same and the fixed split kept the SMs in step.

The output is written in its final dtype by the epilogue (fp32 or bf16: the weight's dtype, so no
cast kernel follows), or -- with ``accumulate_into`` -- added to an existing gradient there: the
epilogue adds the fp32 accumulator to the stored tile and stores the sum in the tensor's dtype
(gradient accumulation without a separate wgrad output and add kernel, as TE/Megatron's fused
wgrad accumulation does). That form is its own op, ``fp8flow::grouped_gemm_fp8_wgrad_accumulate``,
declared as mutating ``accumulate_into``.

``n_chunks`` splits the output's N rows into equal chunks stored one after another, each holding
every expert: ``[n_chunks, E, N / n_chunks, K]``. FC1's gradient ``[E, 2H, D]`` written as
``[2, E, H, D]`` gives w1's and w3's gradients as two contiguous tensors (``unbind(0)``): a view
of ``[E, 2H, D]`` halves is strided, and autograd copies a strided gradient into the parameter's
layout (~2 ms per DeepSeek-like step, measured in the layer's profile).

* ``sm90`` (Gluon, Hopper only, the CUDA default there): warp-specialized like the forward's sm90
  kernel (``_sm90_common``), 128x256 (or 128x128) tiles: a producer warp loads the operand tiles
  AND each block's two scale rows by TMA into the ring, so the consumers read scales from shared
  memory right before each promotion -- no global-load latency, no prefetch registers. Accumulating,
  each consumer TMA-loads the stored tile into its output staging buffer before the tile's reduction
  and adds it in the epilogue.
* ``triton`` (``tl.dot``): any TMA-capable GPU and the CPU interpreter; autotuned.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from fp8flow_ao._checks import (
    check_bool,
    check_contiguous,
    check_fp8,
    check_group_end_offsets,
    check_multiple,
    check_no_grad,
    check_positive_int,
    check_same_device,
    check_shape,
    check_tensor,
    validation_enabled,
)
from fp8flow_ao._format import BLOCK
from fp8flow_ao.kernels._grouped_gemm_common import (
    BLOCK_K,
    autotuned,
    check_tma_operand,
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
from fp8flow_ao.kernels._launch import cdiv, launch_kernel, stream_tile_counter
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
    partition_barrier,
    sm90_first_mma,
    sm90_or,
    sm90_ring_barriers,
    sm90_second_mma,
    sm90_store,
    sm90_store_halves,
    tma_load,
)

OUT_DTYPES = (torch.float32, torch.bfloat16)
# Tile indices in flight from the sm90 kernel's producer to its consumers: the producer takes the next tile
# while the consumers still reduce the current one.
TILE_SLOTS = gl.constexpr(2)
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
def _out_row(e, n, E, N_CHUNK):
    """Row of output row ``n`` of expert ``e`` in the ``[N / N_CHUNK, E, N_CHUNK, K]`` output."""
    return ((n // N_CHUNK) * E + e) * N_CHUNK + n % N_CHUNK


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
    N_CHUNK,
    stride_a,
    stride_b,
    ACCUMULATE: tl.constexpr,
    B_TILE_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # sizes the grid only
):
    """Persistent blockwise FP8 grouped weight-gradient GEMM.

    a = dY^T ``[N, M]`` (row stride ``stride_a``), a_scale ``[M/128, N]`` contiguous,
    b = X^T ``[K, M]`` (row stride ``stride_b``), b_scale ``[M/128, K]`` contiguous,
    out contiguous ``[N / N_CHUNK, E, N_CHUNK, K]`` (``[E, N, K]`` when ``N_CHUNK == N``), ends ``[E]``
    int32 group end offsets. Output tile = BLOCK_M rows of N x BLOCK_N columns of K (BLOCK_M divides
    N_CHUNK). ``ACCUMULATE``: out holds a gradient; store out + the tile's sum. ``B_TILE_SCALES``: each
    column takes its 128-column block's first scale (``b_tile_scales``).
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
        scale_cols = cols_k // BLOCK_K * BLOCK_K if B_TILE_SCALES else cols_k
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for mb in range(first_block, last_block):
            a = a_desc.load([n0, mb * BLOCK_K])
            b = b_desc.load([k0, mb * BLOCK_K])
            # Scales by pointer loads, which the compiler pipelines like the operands. (By TMA, the
            # [1, BLOCK] scale rows were loaded synchronously every block: 2x slower.)
            sa = tl.load(a_scale_ptr + mb * N + cols_n, mask=cols_n < N, other=0.0)
            sb = tl.load(b_scale_ptr + mb * K + scale_cols, mask=cols_k < K, other=0.0)
            acc = tl.dot(a, b.T) * (sa[:, None] * sb[None, :]) + acc
        row = _out_row(e, n0, E, N_CHUNK)
        if ACCUMULATE:
            acc += out_desc.load([row, k0]).to(tl.float32)
        out_desc.store([row, k0], acc.to(out_ptr.dtype.element_ty))


# restore_value: autotuning runs the kernel once per config; with ACCUMULATE each run would add into
# the gradient again, so the autotuner saves and restores the output around its trial runs.
_grouped_gemm_fp8_wgrad_tuned = autotuned(WGRAD_CONFIGS, restore_value=["out_ptr"])(_grouped_gemm_fp8_wgrad_kernel)


def _out_shape(e: int, n: int, k: int, n_chunks: int) -> tuple[int, ...]:
    return (e, n, k) if n_chunks == 1 else (n_chunks, e, n // n_chunks, k)


def _output_and_dims(
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    accumulate_into: torch.Tensor | None,
    n_chunks: int,
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Both launchers' start: the output (``accumulate_into`` when given; else zeros when there are
    no tokens, uninitialized otherwise), ``(M, N, K, E)``, and the operands' TMA checks when M > 0."""
    n, m = a_t.shape
    k = b_t.shape[0]
    e = group_end_offsets.shape[0]
    if accumulate_into is not None:
        out = accumulate_into
    else:
        out = (torch.zeros if m == 0 else torch.empty)(
            _out_shape(e, n, k, n_chunks), dtype=out_dtype, device=a_t.device
        )
    if m > 0:
        check_tma_operand("a_t", a_t)
        check_tma_operand("b_t", b_t)
    return out, (m, n, k, e)


def launch_grouped_gemm_fp8_wgrad_triton(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    config: triton.Config | None = None,
    accumulate_into: torch.Tensor | None = None,
    n_chunks: int = 1,
    b_tile_scales: bool = False,
) -> torch.Tensor:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`grouped_gemm_fp8_wgrad`
    (``out_dtype`` must be ``accumulate_into``'s dtype when that is given; it is returned, updated).

    ``config`` pins one launch config (tests, config sweeps); by default the GPU autotunes over
    :data:`WGRAD_CONFIGS` and the interpreter runs :data:`INTERPRET_CONFIG`.
    """
    out, (m, n, k, e) = _output_and_dims(a_t, b_t, group_end_offsets, out_dtype, accumulate_into, n_chunks)
    if m == 0:
        return out
    set_tma_workspace_allocator(a_t.device)
    grid = persistent_grid(a_t.device, lambda meta: e * cdiv(n, meta["BLOCK_M"]) * cdiv(k, meta["BLOCK_N"]))
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
        n // n_chunks,
        a_t.stride(0),
        b_t.stride(0),
        config=INTERPRET_CONFIG if config is None and interpreting() else config,
        ACCUMULATE=accumulate_into is not None,
        B_TILE_SCALES=b_tile_scales,
    )
    return out


# ---------------------------------------------------------------------------------------------
# sm90: the warp-specialized Gluon kernel.


# Sweep candidates (benchmarks/results/grouped_gemm_fp8_blockwise_sweep.md, H200); the first three are
# the defaults (sm90_wgrad_default_config): 128x256 with a staging buffer per half where the output dtype
# leaves room (bf16; consumers unordered), else one (ordered). 128x128: GROUP_M 16, 4 stages, within noise
# of the other 128x128 candidates and best or second on every anchor shape; ordering the consumers costs
# 1-7% there, as at 128x128 forward. 5 stages fit only with bf16 output. No unordered one-buffer 128x256: the
# two-buffer form replaces it for bf16 (every config here is compiled by the CPU suite's build test, so the
# list stays short).
SM90_WGRAD_CONFIGS = [
    Sm90Config(256, 3, 16, out_buffers=2),
    Sm90Config(256, 3, 16, ordered=True),
    Sm90Config(128, 4, 16),
    Sm90Config(128, 4, 8),
    Sm90Config(128, 3, 8),
    Sm90Config(128, 5, 16),
    Sm90Config(128, 4, 16, ordered=True),
]


def sm90_smem_bytes(config: Sm90Config, out_dtype: torch.dtype) -> int:
    """Shared memory of the sm90 wgrad kernel: the ring also carries each block's scale rows
    (128 + ``block_n`` floats per stage)."""
    return config.smem_bytes(out_dtype, (BLOCK + config.block_n) * 4)


def sm90_wgrad_default_config(
    k: int, accumulate: bool = False, b_tile_scales: bool = False, out_dtype: torch.dtype = torch.bfloat16
) -> Sm90Config:
    """The config the op runs with for ``K`` output columns, writing ``out_dtype`` or adding into a stored
    gradient of it (``accumulate``). A fixed rule from H200 measurements, no timing at run time:

    * 128x256 tiles where ``K`` allows and B has per-tile scales (``b_tile_scales``):
      with one B scale per half and the second partial in the first's registers, 128x256 ran 979-1055
      TFLOP/s against 908-982 at 128x128 (``grouped_gemm_fp8_blockwise_sweep.md``, 2026-11-27). With
      per-column B scales its 32 more live registers make ptxas spill (19-81 local-memory instructions,
      triton 3.6-3.9): 128x128 then (798-854 TFLOP/s against 732-857).
    * A staging buffer per 128x256 half where the output dtype leaves room (bf16: 212.5 KiB of shared
      memory; fp32 does not fit): a half's store no longer waits for the other half's, and an
      accumulating tile loads both halves' stored values under its reduction. Against one buffer, same
      bits (H200 A/B, 2026-11-28, ``grouped_gemm_notes.md`` session 35): writing, 0.906-1.000x the time
      on ten shapes (0.91-0.93x at 256 tokens per expert, where a tile is two reduction blocks and its
      epilogue weighs most); accumulating, 0.87-1.00x the 128x128 config that accumulated before. With two
      buffers the consumers run unordered: 0.964-0.985x the ordered form's time writing and 0.979-0.988x
      accumulating where tiles have 8 or more reduction blocks, 1.003-1.008x at 1-2 blocks.
    * Otherwise (fp32 gradients, ``K`` an odd multiple of 128): one buffer, consumers ordered, and 128x128
      when accumulating, where a 128x256 tile's second half would wait for its stored values after the first
      half's store (session 22: bf16 0.2-4.9% faster than 128x256 with one buffer, fp32 -3.5% to +2.4%).
    """
    if not (k % 256 == 0 and b_tile_scales):
        return SM90_WGRAD_CONFIGS[2]
    if sm90_smem_bytes(SM90_WGRAD_CONFIGS[0], out_dtype) <= SM90_SMEM_BYTES:
        return SM90_WGRAD_CONFIGS[0]
    return SM90_WGRAD_CONFIGS[2] if accumulate else SM90_WGRAD_CONFIGS[1]


@gluon.jit
def _wgrad_tile(tile, N, K, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile index -> ``(expert, pid_n, pid_k)``: experts one after another, ``GROUP_M`` N tiles together."""
    num_n = N // SM90_BLOCK
    num_k = K // BLOCK_N
    pid_n, pid_k = grouped_tile(tile % (num_n * num_k), num_n, num_k, GROUP_M)
    return tile // (num_n * num_k), pid_n, pid_k


@gluon.jit
def _wgrad_tiles(N, K, E, BLOCK_N: gl.constexpr):
    """How many output tiles the launch has: the bound both the producer and the consumers stop at."""
    return E * (N // SM90_BLOCK) * (K // BLOCK_N)


@gluon.jit
def _wgrad_blocks(ends_ptr, e, M):
    """``[first, last)`` 128-token blocks of expert ``e`` (clamped to the tokens that exist). The
    arithmetic twin of :func:`group_rows`'s masked load, kept because the masked form changes the
    compiled kernel and this one is the form measured on the GPU."""
    start = gl.load(ends_ptr + gl.maximum(e - 1, 0)) * (e > 0).to(gl.int32)
    end = gl.minimum(gl.load(ends_ptr + e), M)
    return start // SM90_BLOCK, end // SM90_BLOCK


@gluon.jit
def _tile_queue():
    """The tiles this program takes, in flight from the producer to the consumers: ``TILE_SLOTS`` tile
    indices in shared memory, each with a ``full`` barrier (the producer wrote it) and a ``free`` one (both
    consumers read it)."""
    ids = gl.allocate_shared_memory(gl.int32, [TILE_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(TILE_SLOTS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    return ids, full, free


@gluon.jit
def _push_tile(queue, j, tile):
    """Producer: hand tile ``tile`` (``>= tiles``: no more) to the consumers as the program's ``j``-th."""
    ids, full, free = queue
    s = j % TILE_SLOTS
    mbarrier.wait(free.index(s), ((j // TILE_SLOTS) & 1) ^ 1)
    ids.index(s).store(gl.full([1], tile, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    partition_barrier()  # every lane's store before the arrival that publishes it
    mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def _pop_tile(queue, j):
    """Consumer (one warpgroup): the program's ``j``-th tile index, its slot released once read."""
    ids, full, free = queue
    s = j % TILE_SLOTS
    mbarrier.wait(full.index(s), (j // TILE_SLOTS) & 1)
    tile = gl.max(ids.index(s).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)
    partition_barrier()  # every thread's read before the release
    mbarrier.arrive(free.index(s), count=1)
    return tile


@gluon.jit
def _wgrad_producer(GROUP_M: gl.constexpr, descs, ring, problem, queue, next_tile_ptr):
    """One warp: takes the next tile from the launch's counter (``next_tile_ptr``) when it starts a tile,
    passes its index to the consumers (``queue``), and TMA-loads both operand tiles and both scale rows of
    each of its blocks."""
    a_desc, b_desc, sa_desc, sb_desc = descs
    a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, _ = ring
    ends_ptr, M, N, K, E = problem
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    nbytes: gl.constexpr = (
        a_desc.block_type.nbytes + b_desc.block_type.nbytes + sa_desc.block_type.nbytes + sb_desc.block_type.nbytes
    )
    tiles = _wgrad_tiles(N, K, E, BLOCK_N)
    it = 0
    j = 0
    tile = gl.atomic_add(next_tile_ptr, 1, sem="relaxed")
    while tile < tiles:
        # The next index, asked for before this tile is handed out (the result is shared across the warp at
        # once, so the wait is here; handing out first and asking after measured 0.1-0.7% slower).
        next_tile = gl.atomic_add(next_tile_ptr, 1, sem="relaxed")
        _push_tile(queue, j, tile)
        e, pid_n, pid_k = _wgrad_tile(tile, N, K, BLOCK_N, GROUP_M)
        first, last = _wgrad_blocks(ends_ptr, e, M)
        for mb in range(first, last):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma_load(a_desc, [pid_n * SM90_BLOCK, mb * SM90_BLOCK], ready.index(s), a_bufs.index(s))
            tma_load(b_desc, [pid_k * BLOCK_N, mb * SM90_BLOCK], ready.index(s), b_bufs.index(s))
            tma_load(sa_desc, [mb * N + pid_n * SM90_BLOCK], ready.index(s), sa_bufs.index(s))
            tma_load(sb_desc, [mb * K + pid_k * BLOCK_N], ready.index(s), sb_bufs.index(s))
            it += 1
        j += 1
        tile = next_tile
    _push_tile(queue, j, tile)
    # Every program's last fetch is past the end, so the launch's fetches return 0 .. tiles + programs - 1,
    # each once. The program that got the last one knows no fetch follows: it leaves the counter at 0 for
    # the next launch on the stream (``stream_tile_counter``: no zeroing launch, no allocation a call).
    if tile == tiles + gl.num_programs(0) - 1:
        gl.atomic_xchg(next_tile_ptr, 0, sem="relaxed")


@gluon.jit
def _load_stored(out_desc, out_s0, out_s1, HALVES: gl.constexpr, bar, row, col):
    """Start the TMA loads of the output's stored 64x128 values at ``(row, col)`` into the staging buffer
    ``out_s0`` and, for ``HALVES == 2``, of the next 128 columns into ``out_s1`` (once this warpgroup's
    stores have read them), all landing on ``bar``. By TMA, not per-thread loads: the stored tiles arrive
    through L2 like the operands, and the consumer's registers stay free."""
    tma.store_wait(0)
    mbarrier.expect(bar, HALVES * out_desc.block_type.nbytes)
    tma_load(out_desc, [row, col], bar, out_s0)
    if HALVES == 2:
        tma_load(out_desc, [row, col + SM90_BLOCK], bar, out_s1)


@gluon.jit
def _column_scales(sb_bufs, s, HALF: gl.constexpr, cols_layout: gl.constexpr, B_TILE_SCALES: gl.constexpr):
    """Ring slot ``s``'s column scales of output half ``HALF``: the ``[128]`` vector in ``cols_layout``, or
    with ``B_TILE_SCALES`` the half's one scale (its first column's: every thread reads the same word,
    a broadcast) as a scalar."""
    if B_TILE_SCALES:
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        sb = gl.max(sb_bufs.index(s).slice(HALF * SM90_BLOCK, 1).load(one), axis=0)
    else:
        sb = sb_bufs.index(s).slice(HALF * SM90_BLOCK, SM90_BLOCK).load(cols_layout)
    return sb


@gluon.jit
def _promote(acc, part, sa, sb, B_TILE_SCALES: gl.constexpr):
    """``acc + part * (sa outer sb)``; with ``B_TILE_SCALES`` ``sb`` is a scalar, folded into the rows' scales
    first: one FFMA per element instead of an FMUL and an FFMA (power-of-two scales: the same bits)."""
    return part * (sa * sb)[:, None] + acc if B_TILE_SCALES else part * sa[:, None] * sb[None, :] + acc


@gluon.jit
def _wgrad_consumer(
    WG: gl.constexpr,
    GROUP_M: gl.constexpr,
    ORDERED: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    B_TILE_SCALES: gl.constexpr,
    ring,
    out,
    problem,
    queue,
):
    """One warpgroup: output rows ``[64 WG, 64 WG + 64)`` of every tile the producer hands it (``queue``); the
    promotion scale is the outer product of the block's row scales (N) and column scales (K), read from the
    ring just before each use (a 128x256 tile's column scales are never all held in registers); with
    ``B_TILE_SCALES`` one column scale per 128-column half (:func:`_column_scales`)."""
    a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, turn = ring
    out_desc, out_bufs, N_CHUNK, stored_bars = out
    ends_ptr, M, N, K, E = problem
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALVES: gl.constexpr = BLOCK_N // SM90_BLOCK
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SM90_BLOCK, 32]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
    # This warpgroup's staging buffers: one, or one per half of a 128x256 tile (Sm90Config.out_buffers).
    BUFS: gl.constexpr = out_bufs.type.shape[0] // 2
    out_s0 = out_bufs.index(WG * BUFS)
    out_s1 = out_bufs.index(WG * BUFS + BUFS - 1)
    # Halves whose stored values load before the reduction (ACCUMULATE): each half that has its own buffer.
    EARLY: gl.constexpr = HALVES if BUFS == 2 else 1
    stored_bar = stored_bars.index(WG)
    it = 0
    loads = 0  # ACCUMULATE: stored tiles loaded so far (the phase of stored_bar)
    tiles = _wgrad_tiles(N, K, E, BLOCK_N)
    j = 0
    tile = _pop_tile(queue, j)
    while tile < tiles:
        e, pid_n, pid_k = _wgrad_tile(tile, N, K, BLOCK_N, GROUP_M)
        first, last = _wgrad_blocks(ends_ptr, e, M)
        n0 = pid_n * SM90_BLOCK  # tiles never straddle a chunk: N_CHUNK is a multiple of 128
        row = ((n0 // N_CHUNK) * E + e) * N_CHUNK + n0 % N_CHUNK + WG * WG_ROWS
        col = pid_k * BLOCK_N
        if ACCUMULATE:
            # The gradient to add into, loaded before the reduction: the load runs under its MMAs
            # instead of in front of the epilogue's store (short reductions are mostly epilogue).
            _load_stored(out_desc, out_s0, out_s1, EARLY, stored_bar, row, col)
        acc0 = gl.zeros([WG_ROWS, SM90_BLOCK], gl.float32, mma)
        acc1 = gl.zeros([WG_ROWS, SM90_BLOCK], gl.float32, mma)
        for _ in range(first, last):
            s = it % STAGES
            part = sm90_first_mma(a_bufs, b_bufs, ready, turn, it, mma, WG, ORDERED)
            sa = sa_bufs.index(s).slice(WG * WG_ROWS, WG_ROWS).load(rows_layout)
            sb = _column_scales(sb_bufs, s, 0, cols_layout, B_TILE_SCALES)
            part = warpgroup_mma_wait(0, deps=(part,))
            if HALVES == 1:
                mbarrier.arrive(empty.index(s), count=1)
            acc0 = _promote(acc0, part, sa, sb, B_TILE_SCALES)
            if HALVES == 2:
                # With tile scales the second partial takes the first's registers (ptxas otherwise puts it
                # in a second range: 236 registers with both accumulators, and spills); per-column scales
                # hold 32 more registers, where reusing spills more than it saves.
                acc0, part = sm90_second_mma(a_bufs, b_bufs, s, acc0, mma, WG, part if B_TILE_SCALES else None)
                sb = _column_scales(sb_bufs, s, 1, cols_layout, B_TILE_SCALES)
                part = warpgroup_mma_wait(0, deps=(part,))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = _promote(acc1, part, sa, sb, B_TILE_SCALES)
            it += 1
        if ACCUMULATE:
            mbarrier.wait(stored_bar, loads & 1)
            loads += 1
            acc0 = acc0 + out_s0.load(mma).to(gl.float32)
            if EARLY == 2:
                acc1 = acc1 + out_s1.load(mma).to(gl.float32)
        if ACCUMULATE and EARLY < HALVES:
            # One staging buffer: the second half's stored values only once the first half left it.
            sm90_store(out_desc, out_s0, acc0, row, col)
            _load_stored(out_desc, out_s0, out_s0, 1, stored_bar, row, col + SM90_BLOCK)
            mbarrier.wait(stored_bar, loads & 1)
            loads += 1
            acc1 = acc1 + out_s0.load(mma).to(gl.float32)
            sm90_store(out_desc, out_s0, acc1, row, col + SM90_BLOCK)
        else:
            sm90_store_halves(out_desc, out_s0, out_s1, acc0, acc1, row, col, HALVES, BUFS - 1)
        j += 1
        tile = _pop_tile(queue, j)
    tma.store_wait(0)


@gluon.jit
def _grouped_gemm_fp8_wgrad_sm90_kernel(
    a_desc,
    b_desc,
    sa_desc,
    sb_desc,
    out_desc,
    ends_ptr,
    next_tile_ptr,
    M,
    N,
    K,
    E,
    N_CHUNK,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    ORDERED: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    B_TILE_SCALES: gl.constexpr,
    OUT_BUFFERS: gl.constexpr,
):
    """Warp-specialized persistent blockwise FP8 grouped weight-gradient GEMM (Hopper).

    a_desc: dY^T ``[N, M]`` E4M3, 128x128 boxes; b_desc: X^T ``[K, M]`` E4M3, BLOCK_Nx128 boxes;
    sa_desc / sb_desc: their scales ``[M/128, N]`` / ``[M/128, K]`` fp32 flattened, 128 / BLOCK_N boxes; out_desc:
    ``[E * N, K]`` (the ``[N / N_CHUNK, E, N_CHUNK, K]`` output flattened), 64x128 boxes, also read
    when ``ACCUMULATE`` (each tile's stored values, loaded by TMA into the consumer's staging buffer on
    its ``stored_bars`` barrier before the reduction; out + the tile's sum stored); ends ``[E]`` int32.
    ``B_TILE_SCALES``: the consumers read one B scale per 128-column half, its first column's.
    ``OUT_BUFFERS``: output staging buffers per consumer (2: one per half of a 128x256 tile, so a half's
    store never waits for the other half's, and with ``ACCUMULATE`` both halves' stored values load
    under the reduction). ``next_tile_ptr``: int32 ``[1]``, zero at launch: the tile counter every program
    takes its tiles from (see :func:`_wgrad_producer`), zero again when the launch ends.
    """
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    sa_bufs = gl.allocate_shared_memory(sa_desc.dtype, [STAGES] + sa_desc.block_type.shape, sa_desc.layout)
    sb_bufs = gl.allocate_shared_memory(sb_desc.dtype, [STAGES] + sb_desc.block_type.shape, sb_desc.layout)
    out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2 * OUT_BUFFERS] + out_desc.block_type.shape, out_desc.layout)
    ready, empty, turn = sm90_ring_barriers(STAGES, 2)
    ring = (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, turn)
    problem = (ends_ptr, M, N, K, E)
    # One barrier per consumer for its stored tiles' TMA loads (ACCUMULATE; set up at any rate: 2 words).
    stored_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(stored_bars.index(i), count=1)
    out = (out_desc, out_bufs, N_CHUNK, stored_bars)
    queue = _tile_queue()
    gl.warp_specialize(
        [
            (_wgrad_consumer, (0, GROUP_M, ORDERED, ACCUMULATE, B_TILE_SCALES, ring, out, problem, queue)),
            (_wgrad_consumer, (1, GROUP_M, ORDERED, ACCUMULATE, B_TILE_SCALES, ring, out, problem, queue)),
            (_wgrad_producer, (GROUP_M, (a_desc, b_desc, sa_desc, sb_desc), ring, problem, queue, next_tile_ptr)),
        ],
        [4, 1],
        [232, 40],
    )


def launch_grouped_gemm_fp8_wgrad_sm90(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    config: Sm90Config | None = None,
    accumulate_into: torch.Tensor | None = None,
    n_chunks: int = 1,
    b_tile_scales: bool = False,
) -> torch.Tensor:
    """Gluon launcher (Hopper GPUs only). Same contract as :func:`launch_grouped_gemm_fp8_wgrad_triton`.

    ``config`` pins the launch settings (tests, sweeps); by default :func:`sm90_wgrad_default_config`.
    """
    k = b_t.shape[0]
    config = config or sm90_wgrad_default_config(k, accumulate_into is not None, b_tile_scales, out_dtype)
    check_sm90_launch(a_t.device, config, k, out_dtype, sm90_smem_bytes(config, out_dtype), split_epilogue=True)
    out, (m, n, k, e) = _output_and_dims(a_t, b_t, group_end_offsets, out_dtype, accumulate_into, n_chunks)
    if m == 0:
        return out
    check_tma_operand("a_t_scale", a_t_scale)  # the scales arrive by TMA too
    check_tma_operand("b_t_scale", b_t_scale)
    tiles = e * (n // BLOCK) * (k // config.block_n)
    launch_kernel(
        _grouped_gemm_fp8_wgrad_sm90_kernel,
        (min(tiles, sm_count(a_t.device)),),
        descriptor(a_t, (BLOCK, BLOCK)),
        descriptor(b_t, (config.block_n, BLOCK)),
        # The scales as flat vectors: a 1-D box of one block's scales lands as a 1-D ring slot.
        descriptor(a_t_scale.view(-1), (BLOCK,)),
        descriptor(b_t_scale.view(-1), (config.block_n,)),
        descriptor(out.view(e * n, k), (64, BLOCK)),
        group_end_offsets,
        # The tile counter the programs take their tiles from (see _wgrad_producer), at 0 and left at 0.
        stream_tile_counter(a_t.device),
        m,
        n,
        k,
        e,
        n // n_chunks,
        GROUP_M=config.group_m,
        STAGES=config.stages,
        ORDERED=config.ordered,
        ACCUMULATE=accumulate_into is not None,
        B_TILE_SCALES=b_tile_scales,
        OUT_BUFFERS=config.out_buffers,
        num_warps=4,
    )
    return out


def build_sm90_wgrad_kernel(
    config: Sm90Config, out_dtype: torch.dtype, accumulate: bool = False, b_tile_scales: bool = False
) -> Any:
    """Compile the sm90 wgrad kernel for sm_90a without a GPU (see ``compile_for_sm90``), with the
    specialization a launch with ``config``, ``out_dtype``, ``accumulate_into`` given or not
    (``accumulate``) and ``b_tile_scales`` would have."""
    fp8 = torch.float8_e4m3fn
    signature = {
        "a_desc": descriptor_signature((BLOCK, BLOCK), fp8),
        "b_desc": descriptor_signature((config.block_n, BLOCK), fp8),
        "sa_desc": descriptor_signature((BLOCK,), torch.float32),
        "sb_desc": descriptor_signature((config.block_n,), torch.float32),
        "out_desc": descriptor_signature((64, BLOCK), out_dtype),
        "ends_ptr": "*i32",
        "next_tile_ptr": "*i32",
        **dict.fromkeys(("M", "N", "K", "E", "N_CHUNK"), "i32"),
        **dict.fromkeys(("GROUP_M", "STAGES", "ORDERED", "ACCUMULATE", "B_TILE_SCALES", "OUT_BUFFERS"), "constexpr"),
    }
    constexprs = {
        "GROUP_M": config.group_m,
        "STAGES": config.stages,
        "ORDERED": config.ordered,
        "ACCUMULATE": accumulate,
        "B_TILE_SCALES": b_tile_scales,
        "OUT_BUFFERS": config.out_buffers,
    }
    return compile_for_sm90(_grouped_gemm_fp8_wgrad_sm90_kernel, signature, constexprs)


# The op's CUDA kernel (same contract as :func:`grouped_gemm_fp8_wgrad`): the sm90 Gluon kernel on
# Hopper, the Triton kernel on other GPUs.
launch_grouped_gemm_fp8_wgrad = sm90_or(launch_grouped_gemm_fp8_wgrad_sm90, launch_grouped_gemm_fp8_wgrad_triton)


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
    accumulate_into: torch.Tensor | None = None,
    n_chunks: int = 1,
    b_tile_scales: bool = False,
) -> torch.Tensor:
    """Torch reference (the oracle and the CPU path): dequantize, then one fp32 matmul per expert;
    with ``accumulate_into``, plus its values in fp32, rounded once (a new tensor: it is not mutated);
    with ``n_chunks > 1``, laid out ``[n_chunks, E, N / n_chunks, K]``; with ``b_tile_scales``, every
    column of ``b_t`` dequantized by its 128-column block's first scale.

    Rows of each operand outside every group (at or past the last end) are masked out, so they are
    never part of any expert's sum.
    """
    if b_tile_scales:
        b_t_scale = b_t_scale[:, ::BLOCK].repeat_interleave(BLOCK, dim=1)
    a32 = _dequantize_columns(a_t, a_t_scale)
    b32 = _dequantize_columns(b_t, b_t_scale)
    total = a32.new_zeros(group_end_offsets.shape[0], a32.shape[0], b32.shape[0])
    for e, (start, end) in enumerate(group_bounds(group_end_offsets, a_t.shape[1])):
        total[e] = a32[:, start:end] @ b32[:, start:end].T  # only the group's rows: NaN elsewhere never leaks in
    if accumulate_into is not None:
        total = total + accumulate_into.float()
    if n_chunks > 1:
        e, n, k = total.shape
        total = total.view(e, n_chunks, n // n_chunks, k).transpose(0, 1).contiguous()
    return total.to(out_dtype)


@define_op("grouped_gemm_fp8_wgrad")
def _grouped_gemm_fp8_wgrad_op(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    n_chunks: int = 1,
    b_tile_scales: bool = False,
) -> torch.Tensor:
    args = (a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, out_dtype)
    return grouped_gemm_fp8_wgrad_reference(*args, n_chunks=n_chunks, b_tile_scales=b_tile_scales)


@_grouped_gemm_fp8_wgrad_op.register_kernel("cuda")
def _(a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, out_dtype, n_chunks=1, b_tile_scales=False) -> torch.Tensor:
    args = (a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, out_dtype)
    return launch_grouped_gemm_fp8_wgrad(*args, n_chunks=n_chunks, b_tile_scales=b_tile_scales)


@_grouped_gemm_fp8_wgrad_op.register_fake
def _(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    n_chunks: int = 1,
    b_tile_scales: bool = False,
) -> torch.Tensor:
    shape = _out_shape(group_end_offsets.shape[0], a_t.shape[0], b_t.shape[0], n_chunks)
    return a_t.new_empty(shape, dtype=out_dtype)


# A custom_op, not define_op: it writes into accumulate_into, whose version counter custom_op bumps.
@torch.library.custom_op("fp8flow::grouped_gemm_fp8_wgrad_accumulate", mutates_args=("accumulate_into",))
def _grouped_gemm_fp8_wgrad_accumulate_op(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    accumulate_into: torch.Tensor,
    b_tile_scales: bool = False,
) -> None:
    """``accumulate_into += wgrad`` in place (a custom op may not return an alias of its input)."""
    args = (a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, accumulate_into.dtype)
    accumulate_into.copy_(grouped_gemm_fp8_wgrad_reference(*args, accumulate_into, b_tile_scales=b_tile_scales))


@_grouped_gemm_fp8_wgrad_accumulate_op.register_kernel("cuda")
def _(a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, accumulate_into, b_tile_scales=False) -> None:
    args = (a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, accumulate_into.dtype)
    launch_grouped_gemm_fp8_wgrad(*args, accumulate_into=accumulate_into, b_tile_scales=b_tile_scales)


@_grouped_gemm_fp8_wgrad_accumulate_op.register_fake
def _(a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, accumulate_into, b_tile_scales=False) -> None:
    return None


def _check_inputs(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    accumulate_into: torch.Tensor | None,
    n_chunks: int,
    b_tile_scales: bool,
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
    check_positive_int("n_chunks", n_chunks)
    if n % (n_chunks * BLOCK):
        raise ValueError(f"n_chunks={n_chunks} must split N = {n} (a_t's dim 0) into multiples of {BLOCK} rows")
    if n_chunks > 1 and accumulate_into is not None:
        raise ValueError("accumulate_into takes the [E, N, K] layout only: pass n_chunks=1 with it")
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
    if accumulate_into is not None:
        check_tensor("accumulate_into", accumulate_into, dtypes=out_dtype, ndim=3)
        check_shape("accumulate_into", accumulate_into, (group_end_offsets.shape[0], n, k))
        check_contiguous("accumulate_into", accumulate_into)  # the epilogue's TMA store writes [E * N, K] rows
    check_same_device(
        a_t=a_t,
        a_t_scale=a_t_scale,
        b_t=b_t,
        b_t_scale=b_t_scale,
        group_end_offsets=group_end_offsets,
        accumulate_into=accumulate_into,
    )
    check_bool("b_tile_scales", b_tile_scales)
    if b_tile_scales and validation_enabled(b_t_scale):
        _validate_tile_scales(b_t_scale)


def _validate_tile_scales(b_t_scale: torch.Tensor) -> None:
    """Raise unless every 128-column block of ``b_t_scale`` repeats its first value (reads the device)."""
    blocks, k = b_t_scale.shape
    tiles = b_t_scale.view(blocks, k // BLOCK, BLOCK)
    same = (tiles == tiles[..., :1]) | (tiles.isnan() & tiles[..., :1].isnan())
    if not bool(same.all()):
        bad = (~same).nonzero()[0].tolist()
        raise ValueError(
            "b_tile_scales=True needs b_t_scale constant over each 128-column block (one scale per 128x128 "
            f"tile); block ({bad[0]}, {bad[1]}) differs at column {bad[1] * BLOCK + bad[2]}"
        )


def grouped_gemm_fp8_wgrad(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    accumulate_into: torch.Tensor | None = None,
    n_chunks: int = 1,
    b_tile_scales: bool = False,
) -> torch.Tensor:
    """Blockwise FP8 grouped weight gradient: ``out[e] = dequant(a_t)[:, rows_e] @ dequant(b_t)[:, rows_e]^T``.

    With ``a_t`` = dY^T and ``b_t`` = X^T this is ``dW_e = dY_e^T X_e`` for every expert ``e``,
    where ``rows_e = [end[e-1], end[e])``; with ``accumulate_into``, ``accumulate_into[e] += dW_e``
    in place, in the kernel's epilogue (fp32 sum of the stored value and the accumulator, rounded
    once to ``accumulate_into``'s dtype).

    Args:
        a_t: E4M3 ``[N, M]`` contiguous (column-wise dY: tokens contiguous), ``N % 128 == 0``,
            ``M % 16 == 0`` (TMA row alignment).
        a_t_scale: fp32 ``[ceil(M/128), N]`` contiguous: one ``scale_inv`` per 128 tokens x 1 column.
        b_t: E4M3 ``[K, M]`` contiguous (column-wise X), ``K % 128 == 0``.
        b_t_scale: fp32 ``[ceil(M/128), K]`` contiguous.
        group_end_offsets: int32 ``[E]`` on the operands' device: padded group END offsets,
            non-decreasing multiples of 128, last ``<= M``. Values are checked on CPU tensors, on the GPU
            only with ``FP8FLOW_VALIDATE=1`` (the check syncs the device).
        out_dtype: ``torch.float32`` or ``torch.bfloat16`` (the weight's dtype: the epilogue writes
            it, no cast follows). ``None``: ``accumulate_into``'s dtype, else fp32.
        accumulate_into: optional ``[E, N, K]`` contiguous ``out_dtype`` tensor (an existing weight
            gradient) to add the result into, in place (``fp8flow::grouped_gemm_fp8_wgrad_accumulate``).
        n_chunks: store the N rows as this many equal chunks, ``[n_chunks, E, N / n_chunks, K]``
            (each chunk a multiple of 128 rows; not with ``accumulate_into``): 2 for FC1's
            ``[w1; w3]`` gradient, so that ``out.unbind(0)`` gives each weight's contiguous gradient.
        b_tile_scales: ``b_t_scale`` holds one scale per 128 x 128 tile of ``b_t``, repeated over the
            tile's 128 columns, as :func:`~fp8flow_ao.kernels.scaling_aware_transpose.scaling_aware_transpose`
            writes it. The kernels then read one scale per block (the first column's) and promote each
            partial with one multiply-add per element. The result is defined as if every column of a block
            had its first column's scale, whatever the others hold; ``FP8FLOW_VALIDATE=1`` checks that they
            repeat it.

    Returns:
        ``[E, N, K]`` (``[n_chunks, E, N / n_chunks, K]``) contiguous ``out_dtype``: fp32 accumulation, each 128-token block's partial
        promoted by ``a_t_scale[mb, n] * b_t_scale[mb, k]`` (``b_t_scale[mb, k // 128 * 128]`` with
        ``b_tile_scales``). An empty expert yields zeros (with
        ``accumulate_into``: leaves it unchanged); tokens at or past the last group end are never
        read. With ``accumulate_into``, that tensor itself, updated.
    """
    if out_dtype is None:
        out_dtype = accumulate_into.dtype if isinstance(accumulate_into, torch.Tensor) else torch.float32
    _check_inputs(
        a_t, a_t_scale, b_t, b_t_scale, group_end_offsets, out_dtype, accumulate_into, n_chunks, b_tile_scales
    )
    args = (a_t, a_t_scale, b_t, b_t_scale, group_end_offsets)
    if accumulate_into is not None:
        torch.ops.fp8flow.grouped_gemm_fp8_wgrad_accumulate(*args, accumulate_into, b_tile_scales)
        return accumulate_into
    check_no_grad("grouped_gemm_fp8_wgrad", a_t, a_t_scale, b_t, b_t_scale)
    return torch.ops.fp8flow.grouped_gemm_fp8_wgrad(*args, out_dtype, n_chunks, b_tile_scales)
