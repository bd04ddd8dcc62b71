"""grouped_gemm_fp8_blockwise: ``out[m] = A[m] @ B[e(m)]^T`` for E4M3 1x128 x 128x128 blockwise FP8.

The forward and dgrad GEMM of the routed experts. ``a`` holds the permuted, padded rows of all
experts (1x128 scales, COMPACT ``[M, K/128]``, read as they are); ``b`` holds one weight per expert,
K-major ``[E, N, K]`` with 128x128 scales ``[E, N/128, K/128]``. For dgrad the caller passes the
exact FP8 transpose of the forward weight (``[E, K, N]`` data, ``[E, K/128, N/128]`` scales: 128x128
blocks are symmetric under transpose), so the same op serves both.

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
  benchmarks/results/grouped_gemm_notes.md).
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
    check_contiguous,
    check_fp8,
    check_group_end_offsets,
    check_multiple,
    check_row_major,
    check_same_device,
    check_shape,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, dequantize_rows_reference
from fp8flow_ao.kernels._grouped_gemm_common import (
    BLOCK_K,
    autotuned,
    check_tma_operand,
    expert_of_row,
    gemm_config,
    grouped_tile,
    interpreting,
    launch,
    persistent_grid,
    set_tma_workspace_allocator,
    sm_count,
)
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._sm90_common import (
    SM90_BLOCK,
    WG_ROWS,
    Sm90Config,
    check_sm90_launch,
    compile_for_sm90,
    descriptor,
    descriptor_signature,
    sm90_first_mma,
    sm90_or,
    sm90_ring_barriers,
    sm90_second_mma,
    sm90_store,
    sm90_store_halves,
    tma_load,
)

OUT_DTYPES = (torch.bfloat16, torch.float32)

# Launch configs, from the sweeps in benchmarks/results/grouped_gemm_notes.md (H200):
# * 128x128 tiles, 8 warps = 2 consumer warpgroups of 64 rows: the fp32 accumulator and the fp32
#   partial of one K block take 64 + 64 registers per thread (180 in all). A 128x256 tile needs 256
#   and spills (496 bytes of stack); 5 stages or GROUP_M = 16 measured within noise of this one.
# * 64x128 tiles, 4 warps, 2 programs per SM (171 registers x 128 threads, 113 KiB of shared memory
#   each): one program's MMAs overlap the other's promotion, at 1.5x the L2->SM bytes per FLOP; it
#   wins on some dgrad shapes. 5 stages would leave no room for the second program.
FORWARD_CONFIGS = [
    gemm_config(128, 128, num_warps=8, num_stages=4),
    gemm_config(64, 128, num_warps=4, num_stages=4, programs_per_sm=2),
]
INTERPRET_CONFIG = gemm_config(128, 128, num_warps=8, num_stages=1, group_m=2)


@triton.jit
def _grouped_gemm_fp8_blockwise_kernel(
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
    stride_am,
    stride_asm,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,  # sizes the grid only
):
    """Persistent blockwise FP8 grouped GEMM; a tile spans one 128-column weight block (one scale_b).

    a ``[M, K]`` (row stride ``stride_am``), a_scale ``[M, K/128]`` (row stride ``stride_asm``),
    b ``[E, N, K]`` contiguous, b_scale ``[E, N/128, K/128]`` contiguous, out ``[M, N]`` contiguous,
    ends ``[E]`` int32 group end offsets.
    """
    tl.static_assert(BLOCK_N == BLOCK_K, "one 128-column weight block per tile: one scale_b per K block")
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    k_blocks = K // BLOCK_K
    n_scale_blocks = N // BLOCK_K
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
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(k_blocks):
            a = a_desc.load([m0, kb * BLOCK_K])
            b = b_desc.load([e * N + n0, kb * BLOCK_K])
            sa = tl.load(a_scale_rows + kb, mask=rows < M, other=0.0)
            sb = tl.load(b_scale_row + (n0 // BLOCK_K) * k_blocks + kb)
            acc = tl.dot(a, b.T) * (sa[:, None] * sb) + acc
        out_desc.store([m0, n0], acc.to(out_ptr.dtype.element_ty))
    # Tiles at or past the last group end: zeros, so the whole output is defined; nothing is read.
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    for tile in range(live_m * num_n + tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        out_desc.store([(tile // num_n) * BLOCK_M, (tile % num_n) * BLOCK_N], zeros)


_grouped_gemm_fp8_blockwise_tuned = autotuned(FORWARD_CONFIGS)(_grouped_gemm_fp8_blockwise_kernel)


def _output_and_dims(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Both launchers' start: the uninitialized output, ``(M, N, K, E)``, TMA checks when M > 0."""
    m, k = a.shape
    e, n, _ = b.shape
    if m:
        check_tma_operand("a", a)
        check_tma_operand("b", b)
    return torch.empty((m, n), dtype=out_dtype, device=a.device), (m, n, k, e)


def launch_grouped_gemm_fp8_blockwise_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`grouped_gemm_fp8_blockwise`.

    ``config`` pins one launch config (tests, config sweeps); by default the GPU autotunes over
    :data:`FORWARD_CONFIGS` and the interpreter runs :data:`INTERPRET_CONFIG`.
    """
    out, (m, n, k, e) = _output_and_dims(a, b, out_dtype)
    if m == 0:
        return out
    set_tma_workspace_allocator(a.device)
    grid = persistent_grid(a.device, lambda meta: triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]))
    launch(
        _grouped_gemm_fp8_blockwise_tuned,
        grid,
        a,
        a_scale,
        b,
        b_scale,
        out,
        group_end_offsets,
        m,
        n,
        k,
        e,
        a.stride(0),
        a_scale.stride(0),
        E_POW2=triton.next_power_of_2(e),
        config=INTERPRET_CONFIG if config is None and interpreting() else config,
    )
    return out


# ---------------------------------------------------------------------------------------------
# sm90: the warp-specialized Gluon kernel.

# Sweep candidates (benchmarks/results/grouped_gemm_fp8_blockwise_sweep.md, H200); the first two
# are the defaults (sm90_default_config).
SM90_CONFIGS = [
    Sm90Config(256, 3, 16, ordered=True),
    Sm90Config(128, 4, 8),
    Sm90Config(256, 3, 16),
    Sm90Config(256, 4, 8),
    Sm90Config(128, 4, 8, ordered=True),
]


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
def _sm90_producer(E_POW2: gl.constexpr, GROUP_M: gl.constexpr, a_desc, b_desc, ring, problem):
    """One warp: TMA loads of the A and B tiles of every K block of every live tile into the ring."""
    a_bufs, b_bufs, ready, empty, _ = ring
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
            tma_load(b_desc, [e * N + pid_n * BLOCK_N, kb * SM90_BLOCK], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _sm90_consumer(
    WG: gl.constexpr, E_POW2: gl.constexpr, GROUP_M: gl.constexpr, ORDERED: gl.constexpr, ring, out, scales, problem
):
    """One warpgroup: rows ``[64 WG, 64 WG + 64)`` of every tile -- MMAs, promotion, TMA stores.

    A 128x256 tile is computed as two 128-column halves, one after the other (two 64x128 fp32
    accumulators plus one partial: 192 registers; a single 64x256 partial would not fit)."""
    a_bufs, b_bufs, ready, empty, turn = ring
    out_desc, out_bufs = out
    a_scale_ptr, stride_as, b_scale_ptr = scales
    ends_ptr, M, N, K, E = problem
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALVES: gl.constexpr = BLOCK_N // SM90_BLOCK
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SM90_BLOCK, 32]
    )
    out_s = out_bufs.index(WG)
    live_m, num_m, num_n = _sm90_tiles(ends_ptr, M, N, E, BLOCK_N)
    k_blocks = K // SM90_BLOCK
    it = 0
    for tile in range(gl.program_id(0), live_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, live_m, num_n, GROUP_M)
        e = _sm90_expert_of_row(ends_ptr, pid_m * SM90_BLOCK, E, E_POW2, 4)
        m0 = pid_m * SM90_BLOCK + WG * WG_ROWS
        rows = m0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, mma))
        sa_ptrs = a_scale_ptr + rows.to(gl.int64) * stride_as
        sb_ptr0 = b_scale_ptr + (e.to(gl.int64) * (N // SM90_BLOCK) + pid_n * HALVES) * k_blocks
        sb_ptr1 = sb_ptr0 + (HALVES - 1) * k_blocks
        # Row mask: only unvalidated, malformed offsets (a last end past M) can put rows past M here.
        sa = gl.load(sa_ptrs, mask=rows < M, other=0.0)
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
            sb0_next = gl.load(sb_ptr0 + nxt)
            sb1_next = gl.load(sb_ptr1 + nxt)
            part = warpgroup_mma_wait(0, deps=(part,))
            if HALVES == 1:
                mbarrier.arrive(empty.index(s), count=1)
            acc0 = part * (sa * sb0)[:, None] + acc0
            if HALVES == 2:
                acc0, part = sm90_second_mma(a_bufs, b_bufs, s, acc0, mma, WG)
                part = warpgroup_mma_wait(0, deps=(part,))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = part * (sa * sb1)[:, None] + acc1
            sa = sa_next
            sb0 = sb0_next
            sb1 = sb1_next
            it += 1
        sm90_store_halves(out_desc, out_s, acc0, acc1, m0, pid_n * BLOCK_N, HALVES)
    # Tiles at or past the last group end: zeros, so the whole output is defined; nothing is read.
    zero = gl.zeros([WG_ROWS, SM90_BLOCK], out_desc.dtype, mma)
    for tile in range(live_m * num_n + gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        for half in gl.static_range(HALVES):
            col = (tile % num_n) * BLOCK_N + half * SM90_BLOCK
            sm90_store(out_desc, out_s, zero, (tile // num_n) * SM90_BLOCK + WG * WG_ROWS, col)
    tma.store_wait(0)


@gluon.jit
def _grouped_gemm_fp8_blockwise_sm90_kernel(
    a_desc,
    b_desc,
    out_desc,
    a_scale_ptr,
    stride_as,
    b_scale_ptr,
    ends_ptr,
    M,
    N,
    K,
    E,
    E_POW2: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    ORDERED: gl.constexpr,
):
    """Warp-specialized persistent blockwise FP8 grouped GEMM (Hopper).

    a_desc: ``[M, K]`` E4M3 rows, 128x128 boxes; b_desc: ``[E * N, K]`` E4M3 (the ``[E, N, K]``
    weights flattened), BLOCK_N x 128 boxes (BLOCK_N 128 or 256); out_desc: ``[M, N]``, 64x128
    boxes (one per consumer and half); a_scale ``[M, K/128]`` (row stride ``stride_as``), b_scale ``[E, N/128, K/128]`` contiguous,
    ends ``[E]`` int32. Partitions: two consumer warpgroups (the default one and a worker, 232
    registers each) and one producer warp (40 registers).
    """
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    ready, empty, turn = sm90_ring_barriers(STAGES)
    ring = (a_bufs, b_bufs, ready, empty, turn)
    problem = (ends_ptr, M, N, K, E)
    scales = (a_scale_ptr, stride_as, b_scale_ptr)
    out = (out_desc, out_bufs)
    gl.warp_specialize(
        [
            (_sm90_consumer, (0, E_POW2, GROUP_M, ORDERED, ring, out, scales, problem)),
            (_sm90_consumer, (1, E_POW2, GROUP_M, ORDERED, ring, out, scales, problem)),
            (_sm90_producer, (E_POW2, GROUP_M, a_desc, b_desc, ring, problem)),
        ],
        [4, 1],
        [232, 40],
    )


def sm90_smem_bytes(config: Sm90Config, out_dtype: torch.dtype) -> int:
    """Shared memory of the sm90 forward kernel with ``config`` and ``out_dtype``."""
    return config.smem_bytes(out_dtype)


def sm90_default_config(n: int) -> Sm90Config:
    """The config the op runs with for ``N`` output columns: a fixed rule from the sweep, no timing at
    run time (so nothing re-tunes when routing changes M). 128x256 tiles where N allows (a quarter
    less L2->SM traffic per FLOP than 128x128: +3-7% on the anchor shapes), 3 stages (4 measured
    the same, and 3 leave room for fp32 output: both output dtypes fit), consumers ordered (+1-7% at 128x256 on all six
    anchor cases; -1-5% at 128x128); 128x128 tiles, unordered, otherwise."""
    return SM90_CONFIGS[0] if n % 256 == 0 else SM90_CONFIGS[1]


def launch_grouped_gemm_fp8_blockwise_sm90(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Sm90Config | None = None,
) -> torch.Tensor:
    """Gluon launcher (Hopper GPUs only). Same contract as :func:`grouped_gemm_fp8_blockwise`.

    ``config`` pins the launch settings (tests, sweeps); by default :func:`sm90_default_config`.
    """
    config = config or sm90_default_config(b.shape[1])
    check_sm90_launch(a.device, config, b.shape[1], out_dtype, sm90_smem_bytes(config, out_dtype))
    out, (m, n, k, e) = _output_and_dims(a, b, out_dtype)
    if m == 0:
        return out
    tiles = triton.cdiv(m, BLOCK) * (n // config.block_n)
    _grouped_gemm_fp8_blockwise_sm90_kernel[(min(tiles, sm_count(a.device)),)](
        descriptor(a, (BLOCK, BLOCK)),
        descriptor(b.view(e * n, k), (config.block_n, BLOCK)),
        descriptor(out, (64, BLOCK)),
        a_scale,
        a_scale.stride(0),
        b_scale,
        group_end_offsets,
        m,
        n,
        k,
        e,
        E_POW2=triton.next_power_of_2(e),
        GROUP_M=config.group_m,
        STAGES=config.stages,
        ORDERED=config.ordered,
        num_warps=4,
    )
    return out


def build_sm90_kernel(config: Sm90Config, out_dtype: torch.dtype, num_experts: int = 8) -> Any:
    """Compile the sm90 kernel for sm_90a without a GPU (see :func:`compile_for_sm90`), with the
    specialization a launch with ``config``, ``out_dtype`` and ``num_experts`` would have."""
    fp8 = torch.float8_e4m3fn
    signature = {
        "a_desc": descriptor_signature((BLOCK, BLOCK), fp8),
        "b_desc": descriptor_signature((config.block_n, BLOCK), fp8),
        "out_desc": descriptor_signature((64, BLOCK), out_dtype),
        "a_scale_ptr": "*fp32",
        "stride_as": "i32",
        "b_scale_ptr": "*fp32",
        "ends_ptr": "*i32",
        **dict.fromkeys(("M", "N", "K", "E"), "i32"),
        **dict.fromkeys(("E_POW2", "GROUP_M", "STAGES", "ORDERED"), "constexpr"),
    }
    constexprs = {
        "E_POW2": triton.next_power_of_2(num_experts),
        "GROUP_M": config.group_m,
        "STAGES": config.stages,
        "ORDERED": config.ordered,
    }
    return compile_for_sm90(_grouped_gemm_fp8_blockwise_sm90_kernel, signature, constexprs)


# The op's CUDA kernel (same contract as :func:`grouped_gemm_fp8_blockwise`): the sm90 Gluon kernel on
# Hopper, the Triton kernel on other GPUs.
launch_grouped_gemm_fp8_blockwise = sm90_or(
    launch_grouped_gemm_fp8_blockwise_sm90, launch_grouped_gemm_fp8_blockwise_triton
)


def _expert_of_rows(group_end_offsets: torch.Tensor, m: int) -> torch.Tensor:
    """Expert of each row (``E`` for rows at or past the last group end), without a host sync."""
    rows = torch.arange(m, device=group_end_offsets.device, dtype=torch.int32)
    return torch.searchsorted(group_end_offsets, rows, right=True)


def grouped_gemm_fp8_blockwise_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Torch reference (the oracle and the CPU path): dequantize, then an fp32 matmul per group.

    Rows at or past the last group end are zero.
    """
    a32 = dequantize_rows_reference(a, a_scale, BLOCK)
    b32 = b.float() * b_scale.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    owner = _expert_of_rows(group_end_offsets, a.shape[0])
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    for e in range(b.shape[0]):
        rows = (owner == e)[:, None]
        out = torch.where(rows, a32 @ b32[e].T, out)
    return out.to(out_dtype)


@define_op("grouped_gemm_fp8_blockwise")
def _grouped_gemm_fp8_blockwise_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return grouped_gemm_fp8_blockwise_reference(a, a_scale, b, b_scale, group_end_offsets, out_dtype)


_grouped_gemm_fp8_blockwise_op.register_kernel("cuda")(launch_grouped_gemm_fp8_blockwise)


@_grouped_gemm_fp8_blockwise_op.register_fake
def _(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _check_inputs(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> None:
    check_fp8("a", a, ndim=2)
    check_fp8("b", b, ndim=3)
    check_tensor("a_scale", a_scale, dtypes=torch.float32, ndim=2)
    check_tensor("b_scale", b_scale, dtypes=torch.float32, ndim=3)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    m, k = a.shape
    e, n, kb = b.shape
    check_multiple("a", k, what="K (dim 1)")
    check_multiple("b", n, what="N (dim 1)")
    if kb != k:
        raise ValueError(f"b must have K = {k} (a's dim 1) in dim 2, got shape {tuple(b.shape)}")
    check_group_end_offsets("group_end_offsets", group_end_offsets, rows=m)
    if group_end_offsets.shape[0] != e or e == 0:
        raise ValueError(
            f"group_end_offsets must hold one end per expert (b has E = {e} >= 1), got {group_end_offsets.shape[0]}"
        )
    check_shape("a_scale", a_scale, (m, k // BLOCK))
    check_shape("b_scale", b_scale, (e, n // BLOCK, k // BLOCK))
    check_row_major("a", a)  # K-major: the tensor cores read both operands along K
    check_row_major("a_scale", a_scale)
    check_contiguous("b", b)  # K-major [E, N, K]; for dgrad pass the transposed copy, never a .mT view
    check_contiguous("b_scale", b_scale)
    check_same_device(a=a, a_scale=a_scale, b=b, b_scale=b_scale, group_end_offsets=group_end_offsets)


def grouped_gemm_fp8_blockwise(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_end_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Blockwise FP8 grouped GEMM: ``out[m] = dequant(a)[m] @ dequant(b)[e]^T`` for rows ``m`` of group ``e``.

    Forward (``a`` = activations, ``b`` = weights ``[E, N, K]``) and dgrad (``a`` = output
    gradient, ``b`` = the exactly transposed weight ``[E, K, N]`` from ``quantize_128x128``'s
    ``data_t`` / ``scale_inv_t``) are the same call.

    Args:
        a: E4M3 ``[M, K]``, row-major (K contiguous; row stride a multiple of 16), ``K % 128 == 0``.
        a_scale: fp32 ``[M, K/128]`` row-major, COMPACT 1x128 ``scale_inv`` (dequantize multiplier)
            of ``a``; read as it is.
        b: E4M3 ``[E, N, K]`` contiguous (K-major), ``N % 128 == 0``.
        b_scale: fp32 ``[E, N/128, K/128]`` contiguous, 128x128 ``scale_inv`` of ``b``.
        group_end_offsets: int32 ``[E]`` on ``a``'s device: padded group END offsets, non-decreasing
            multiples of 128 (so each group starts on a 128-row boundary), last ``<= M``. Values are
            checked only with ``FP8FLOW_VALIDATE=1`` (the check syncs the device).
        out_dtype: ``torch.bfloat16`` (default) or ``torch.float32``.

    Returns:
        ``[M, N]`` contiguous ``out_dtype``. Accumulation is fp32 with the partial product of each
        128-wide K block promoted by ``a_scale[m, kb] * b_scale[e, n // 128, kb]``. Rows at or past
        the last group end are zero (never read from ``a``).
    """
    _check_inputs(a, a_scale, b, b_scale, group_end_offsets, out_dtype)
    return torch.ops.fp8flow.grouped_gemm_fp8_blockwise(a, a_scale, b, b_scale, group_end_offsets, out_dtype)
