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

Kernels: on Hopper the plain form runs a warp-specialized TMA-ring kernel (``launch_scaling_aware_transpose_sm90``,
0.79-0.93x the Triton kernel's device time, 68-78% of copy bandwidth); the gathering form (``src_rows``), other
GPUs and data TMA cannot load run the Triton kernel (``launch_scaling_aware_transpose``). Same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fp8flow_ao._checks import (
    check_contiguous,
    check_fp8,
    check_group_end_offsets,
    check_multiple,
    check_no_grad,
    check_row_map,
    check_same_device,
    check_shape,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, cast_to_fp8, dequantize_rows_reference, quantize_rows_reference
from fp8flow_ao.kernels._grouped_gemm_common import check_tma_operand, sm_count
from fp8flow_ao.kernels._launch import cdiv, launch_kernel
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._sm90_common import (
    SM90_BLOCK,
    SM90_SMEM_BYTES,
    compile_for_sm90,
    descriptor,
    descriptor_signature,
    partition_barrier,
    sm90_supported,
    sm90_takes_plain_form,
    tile_ring_loader,
    tma_store,
)
from fp8flow_ao.kernels._triton_common import (
    MAX_SHIFT,
    exponent_shift_multiplier,
    jit_any_count,
    last_group_end,
    reencode_tile_transposed,
)
from fp8flow_ao.kernels.permute_pad import permute_pad_rows_reference

_TL_BLOCK = tl.constexpr(BLOCK)


@dataclass(frozen=True)
class TransposeConfig:
    """Launch settings of the transpose kernel (they never change the result).

    k_blocks_per_program: 128 x 128 tiles one program walks along K (sharing its row range and the
        group-end read); while one tile is re-encoded and stored, the next one's loads are in flight.
    num_warps: warps per program.
    max_registers: per-thread register cap given to ptxas (``maxnreg``), or ``None``; it sets how
        many programs fit on an SM (65536 registers: 8 warps x 128 -> 2 programs).
    group_m: launch order. Programs are numbered ``group_m`` row tiles at a time: within a group
        the row tile varies fastest, then the K range, then the group (the grouped order of a GEMM).
        ``None``: one group of every row tile (all of M for one K range, then the next K range).
    """

    k_blocks_per_program: int
    num_warps: int
    max_registers: int | None = None
    group_m: int | None = None


def transpose_configs() -> list[TransposeConfig]:
    """The launch configurations ``bench_scaling_aware_transpose.py --sweep`` times; the default
    rule :func:`default_transpose_config` picks among them.

    The tile is 128 x 128, fixed by the format: 128 rows share one output scale, and 128 columns
    are one input scale block, so one max per tile. Every global access is a whole 128-byte line
    of 16-byte vectors (sm_90a PTX: ``ld.global.v4`` / ``st.global.v4``): each input row of the
    tile is 128 contiguous bytes, each output row 128 contiguous tokens.
    Registers (sm_90a, triton 3.6) bound the programs per SM, and each program keeps up to two
    tiles' loads (32 KiB) in flight: 8 warps need 162 registers, capped at 128 without spills, so
    2 programs and up to 64 KiB in flight per SM, above the ~30-50 KiB that 4.2 TB/s x ~1-1.5 us
    loaded latency asks of each of 132 SMs (the old 8-warp kernel without the prefetch: 106
    registers, 2 programs, 32 KiB at most). 4 warps: 255 registers, 1 program (a cap of 168 spills
    464 bytes); 16 warps: 94 registers, 1 program, 8-byte loads. They stay in the sweep as checks.
    group_m: with all of M for one K range (None), the programs running at once read 128 bytes of
    every input row (stride K) and write whole output rows; a group of 8 row tiles across all of
    K reads whole input rows and writes 1 KiB runs of each output row (DRAM page locality on both
    sides); 1: one row tile at a time (whole input rows, 128-byte output runs).
    """
    capped = [
        TransposeConfig(k_blocks_per_program=kbpp, num_warps=8, max_registers=128, group_m=group_m)
        for group_m in (8, None, 1)
        for kbpp in (1, 2, 4, 8)
    ]
    return capped + [TransposeConfig(4, 4, None, 8), TransposeConfig(4, 16, None, 8)]


def default_transpose_config(k: int) -> TransposeConfig:
    """The launch configuration for ``K`` columns (never depends on the token count M): 4 tiles per
    program (a divisor of K/128 at both PERF.md sizes, 7168 and 2048), 8 warps capped at 128
    registers (2 programs per SM), grouped order over 8 row tiles.

    Measured (H200, triton 3.6, ``scaling_aware_transpose_sweep.md``, 2026-11-23): 64-69% of copy
    bandwidth at K=7168, 51-62% at K=2048 (the old autotuned kernel: 40-68% / 16-41%). 8 tiles per
    program is 2-5% faster at K=7168 and at M=32768 K=2048 but 9-17% slower at M=16384 K=2048 (a tail
    of programs), so 4 stays; the launch order (group_m 8 / None / 1) moves results by under 3%."""
    return TransposeConfig(k_blocks_per_program=4, num_warps=8, max_registers=128, group_m=8)


@triton.jit
def _source_rows(src_rows_ptr, row0, quads, b, valid_rows, top_k, GATHER: tl.constexpr):
    """Rows ``r = 4 * q + b`` (q < 32) of the row tile at ``row0``: which row holds each, and (with
    ``GATHER``) which are not pad rows. Without ``GATHER``: ``r`` itself (int32, relative to ``row0``);
    with it: the token row ``src_rows[row0 + r] // top_k`` (int64) and ``src_rows[row0 + r] >= 0``."""
    r = 4 * quads + b
    real = r < valid_rows
    row = r
    if GATHER:
        src = tl.load(src_rows_ptr + row0 + r, mask=real, other=-1)
        row = (tl.maximum(src, 0) // top_k).to(tl.int64)
        real = src >= 0
    return row, real


@triton.jit
def _load_rows(data_rows, scale_rows, row, real, quads, b, limit, kb, K, num_kb, GATHER: tl.constexpr):
    """Scale block ``kb`` of the tile's rows ``r = 4 * q + b`` (held in rows ``row``, see
    :func:`_source_rows`): fp8 ``[32, 128]`` (128 contiguous bytes a row) and their fp32 scales ``[32]``;
    0 (and no read) for ``r >= limit`` and, with ``GATHER``, for pad rows."""
    mask = 4 * quads + b < limit
    if GATHER:
        mask = mask & real
    cols = tl.arange(0, _TL_BLOCK)
    x = tl.load(data_rows + kb * _TL_BLOCK + row[:, None] * K + cols[None, :], mask=mask[:, None], other=0.0)
    s = tl.load(scale_rows + kb + row * num_kb, mask=mask, other=0.0)
    return x, s


@triton.jit
def _load_tile(
    data_rows,
    scale_rows,
    row0,
    row1,
    row2,
    row3,
    real0,
    real1,
    real2,
    real3,
    quads,
    limit,
    kb,
    K,
    num_kb,
    GATHER: tl.constexpr,
):
    """Tile ``kb`` as four 32 x 128 row slices (rows ``4q + b``, b = 0..3) and their scales; rows at or
    past ``limit`` are not read (0)."""
    x0, s0 = _load_rows(data_rows, scale_rows, row0, real0, quads, 0, limit, kb, K, num_kb, GATHER)
    x1, s1 = _load_rows(data_rows, scale_rows, row1, real1, quads, 1, limit, kb, K, num_kb, GATHER)
    x2, s2 = _load_rows(data_rows, scale_rows, row2, real2, quads, 2, limit, kb, K, num_kb, GATHER)
    x3, s3 = _load_rows(data_rows, scale_rows, row3, real3, quads, 3, limit, kb, K, num_kb, GATHER)
    return x0, x1, x2, x3, s0, s1, s2, s3


@jit_any_count("group_m")  # it follows M when group_m is None
def _scaling_aware_transpose_kernel(
    data_ptr,
    scale_inv_ptr,
    group_end_offsets_ptr,
    data_t_ptr,
    scale_inv_t_ptr,
    src_rows_ptr,
    M,
    K,
    num_groups,
    group_m,
    top_k,
    HAS_OFFSETS: tl.constexpr,
    GATHER: tl.constexpr,
    K_BLOCKS_PER_PROGRAM: tl.constexpr,
):
    """One program: the 128 rows of one row tile x ``K_BLOCKS_PER_PROGRAM`` scale blocks; a 1-D grid
    in grouped order (``group_m`` row tiles, see :class:`TransposeConfig`).

    Per 128 x 128 tile: load it as four 32 x 128 slices (rows 4q + b, b = 0..3; loads coalesced
    along K) with their row scales, take the max of the 128 row scales, re-encode each slice with
    its rows' shifts, then interleave the four slices (``tl.join``: register-only) so each thread
    holds 4 consecutive tokens of a column, and store the transposed tile coalesced along M. Triton
    then moves the tile through shared memory 4 bytes at a time (sm_90a: ``stmatrix`` + 16-byte
    ``ld.shared`` at 4 warps, 4-byte ``st/ld.shared`` at 8), where ``tl.trans`` of the plain
    128 x 128 fp8 tile compiles to one 1-byte shared store per element. The next tile's loads are issued before this tile's scale max,
    whose cross-warp reduction is a barrier that later loads could not cross: a program keeps one
    tile in flight while it re-encodes and stores another (the loop is software-pipelined by hand).
    With ``GATHER`` the tile's rows are read from the token rows ``src_rows[r] // top_k`` (a fused
    permute_pad_rows: the gathered rows are never written).
    """
    pid = tl.program_id(0)
    num_kb = K // _TL_BLOCK
    num_pid_k = tl.cdiv(num_kb, K_BLOCKS_PER_PROGRAM)
    per_group = group_m * num_pid_k
    first_m = (pid // per_group) * group_m
    group_rows = tl.minimum(M // _TL_BLOCK - first_m, group_m)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_k = (pid % per_group) // group_rows
    row0 = pid_m * _TL_BLOCK
    idx = tl.arange(0, _TL_BLOCK)  # rows, or columns, of the square tile
    quads = tl.arange(0, _TL_BLOCK // 4)
    # rows at/after the last group end are neither read nor computed
    valid_rows = last_group_end(group_end_offsets_ptr, num_groups, M, HAS_OFFSETS) - row0  # of this row tile
    if GATHER:  # token rows anywhere in data: int64 row offsets from its start
        data_rows = data_ptr
        scale_rows = scale_inv_ptr
    else:  # rows of this tile: an int64 base and int32 offsets (127 * max(M, K) fits)
        data_rows = data_ptr + row0.to(tl.int64) * K
        scale_rows = scale_inv_ptr + row0 * num_kb
    # The tile's source rows, the same for every scale block: found once (with GATHER, read once).
    r0, ok0 = _source_rows(src_rows_ptr, row0, quads, 0, valid_rows, top_k, GATHER)
    r1, ok1 = _source_rows(src_rows_ptr, row0, quads, 1, valid_rows, top_k, GATHER)
    r2, ok2 = _source_rows(src_rows_ptr, row0, quads, 2, valid_rows, top_k, GATHER)
    r3, ok3 = _source_rows(src_rows_ptr, row0, quads, 3, valid_rows, top_k, GATHER)
    kb_first = pid_k * K_BLOCKS_PER_PROGRAM
    kb_end = tl.minimum(kb_first + K_BLOCKS_PER_PROGRAM, num_kb)
    x0, x1, x2, x3, s0, s1, s2, s3 = _load_tile(
        data_rows, scale_rows, r0, r1, r2, r3, ok0, ok1, ok2, ok3, quads, valid_rows, kb_first, K, num_kb, GATHER
    )
    for kb in range(kb_first, kb_end):
        # the next tile of this program (none after the last: 0 rows, nothing read)
        next_rows = tl.where(kb + 1 < kb_end, valid_rows, 0)
        n0, n1, n2, n3, t0, t1, t2, t3 = _load_tile(
            data_rows, scale_rows, r0, r1, r2, r3, ok0, ok1, ok2, ok3, quads, next_rows, kb + 1, K, num_kb, GATHER
        )
        y_t, s_max = reencode_tile_transposed(x0, x1, x2, x3, s0, s1, s2, s3)  # [k, 128 tokens]
        out = data_t_ptr + row0 + kb * _TL_BLOCK * M.to(tl.int64)
        tl.store(out + idx[:, None] * M + idx[None, :], y_t)
        tl.store(scale_inv_t_ptr + pid_m * K + kb * _TL_BLOCK + idx, tl.zeros([_TL_BLOCK], tl.float32) + s_max)
        x0, x1, x2, x3, s0, s1, s2, s3 = n0, n1, n2, n3, t0, t1, t2, t3


# The Hopper kernel (TMA ring, warp-specialized) of the plain form: the op's kernel on sm_90 (_launch_op_kernel).
# The gathering form stays on the Triton kernel (Hopper's TMA cannot gather rows).
SM90_STAGES = 8  # landed input tiles in flight (16 KiB each): ~4x what 4.2 TB/s x ~1 us asks of an SM
# Partitions of 4 warps that take the landed tiles in turn, an output buffer each: 4 (16 warps re-encoding;
# 2 were too few: 1.04-1.17x the Triton kernel's time, memory_bound_notes.md).
SM90_TRANSPOSERS = 4
SM90_TRANSPOSER_REGS = 96


@gluon.jit
def _sat_sm90_transposer(PART: gl.constexpr, PARTS: gl.constexpr, HAS_OFFSETS: gl.constexpr, ring, tensors):
    """4 warps: this partition's landed tiles (the program's tiles ``PART, PART + PARTS, ...``), each
    re-encoded to its scale ``s_max`` and stored transposed through this partition's output buffers
    (``out_bufs[PART]``) by TMA, with its 128 column-wise scales.

    Layout as the grouped GEMM's FP8 transposer (``_sm90_prepare_b``): 16 rows x 4 columns a thread, read
    with ``ldmatrix`` from the swizzled slot and written 16 tokens at a time after the register permute.
    ``ring = (in_bufs, ready, empty, out_bufs)``; ``tensors = (out_desc, scale_ptr, scale_t_ptr, offsets_ptr, M,
    K, num_groups)``."""
    in_bufs, ready, empty, out_bufs = ring
    out_desc, scale_ptr, scale_t_ptr, offsets_ptr, M, K, num_groups = tensors
    STAGES: gl.constexpr = in_bufs.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([16, 4], [1, 32], [4, 1], [1, 0])
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    num_kb = K // SM90_BLOCK
    tiles = gl.cdiv(gl.maximum((M // SM90_BLOCK) * num_kb - gl.program_id(0), 0), gl.num_programs(0))
    idx = gl.arange(0, SM90_BLOCK, layout=vec_layout)
    for it in range(PART, tiles, PARTS):
        t = gl.program_id(0) + it * gl.num_programs(0)
        kb = t % num_kb
        row0 = (t // num_kb) * SM90_BLOCK
        s = it % STAGES
        # One row's scale a thread; rows at or past the end: scale 0 (not read), so multiplier 0 and s_max
        # without them.
        scale = gl.load(scale_ptr + (row0 + idx) * num_kb + kb, mask=row0 + idx < end, other=0.0)
        s_max = gl.max(scale, axis=0)
        mult = gl.convert_layout(exponent_shift_multiplier(scale, s_max).to(gl.float16), gl.SliceLayout(1, layout))
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        x = in_bufs.index(s).load(layout)
        # Every warp has read the slot before it is freed: the barrier of this partition's warps.
        partition_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        if row0 + SM90_BLOCK > end:  # rows past the end may hold anything (NaN times 0 is NaN): zeroed
            rows = row0 + gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(1, layout))
            x = gl.where((rows < end)[:, None], x, gl.zeros_like(x))
        y = (x.to(gl.float16) * mult[:, None]).to(gl.float8e4nv)
        out = out_bufs.index(PART)
        tma.store_wait(0)  # this partition's previous store has left its buffer
        out.store(gl.permute(y, (1, 0)))
        fence_async_shared()
        tma_store(out_desc, [kb * SM90_BLOCK, row0], out)
        gl.store(scale_t_ptr + (row0 // SM90_BLOCK) * K + kb * SM90_BLOCK + idx, gl.zeros_like(scale) + s_max)
    tma.store_wait(0)


@gluon.jit
def _scaling_aware_transpose_sm90_kernel(
    in_desc,
    out_desc,
    scale_ptr,
    scale_t_ptr,
    offsets_ptr,
    M,
    K,
    num_groups,
    HAS_OFFSETS: gl.constexpr,
    STAGES: gl.constexpr,
    TRANSPOSER_REGS: gl.constexpr,
):
    """Persistent: program ``p`` takes tiles ``p, p + programs, ...`` (row tile major, scale block minor).
    One loader warp keeps ``STAGES`` tiles in flight; four transposer partitions of 4 warps (the default one
    and three workers, :data:`SM90_TRANSPOSERS`) take the landed tiles in turn."""
    in_bufs = gl.allocate_shared_memory(in_desc.dtype, [STAGES] + in_desc.block_type.shape, in_desc.layout)
    out_bufs = gl.allocate_shared_memory(out_desc.dtype, [4] + out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    ring = (in_bufs, ready, empty, out_bufs)
    tensors = (out_desc, scale_ptr, scale_t_ptr, offsets_ptr, M, K, num_groups)
    # The partitions spelled out: Gluon keeps constexprs (PART, PARTS, HAS_OFFSETS) only in literal
    # argument tuples.
    gl.warp_specialize(
        [
            (_sat_sm90_transposer, (0, 4, HAS_OFFSETS, ring, tensors)),
            (_sat_sm90_transposer, (1, 4, HAS_OFFSETS, ring, tensors)),
            (_sat_sm90_transposer, (2, 4, HAS_OFFSETS, ring, tensors)),
            (_sat_sm90_transposer, (3, 4, HAS_OFFSETS, ring, tensors)),
            (tile_ring_loader, (((in_desc, 0),), in_bufs, ready, empty, offsets_ptr, M, K, num_groups, HAS_OFFSETS)),
        ],
        [4, 4, 4, 1],
        [TRANSPOSER_REGS, TRANSPOSER_REGS, TRANSPOSER_REGS, 40],
    )


def build_sm90_transpose_kernel(
    has_offsets: bool = True,
    stages: int = SM90_STAGES,
    transposer_regs: int = SM90_TRANSPOSER_REGS,
) -> Any:
    """Compile the Hopper kernel for sm_90a without a GPU (see
    :func:`~fp8flow_ao.kernels._sm90_common.compile_for_sm90`), as a launch with or without offsets would."""
    signature = {
        "in_desc": descriptor_signature((BLOCK, BLOCK), FP8_DTYPE),
        "out_desc": descriptor_signature((BLOCK, BLOCK), FP8_DTYPE),
        "scale_ptr": "*fp32",
        "scale_t_ptr": "*fp32",
        # Without offsets the launcher passes scale_inv there (unread): an fp32 pointer.
        "offsets_ptr": "*i32" if has_offsets else "*fp32",
        **dict.fromkeys(("M", "K", "num_groups"), "i32"),
        **dict.fromkeys(("HAS_OFFSETS", "STAGES", "TRANSPOSER_REGS"), "constexpr"),
    }
    constexprs = {
        "HAS_OFFSETS": has_offsets,
        "STAGES": stages,
        "TRANSPOSER_REGS": transposer_regs,
    }
    return compile_for_sm90(_scaling_aware_transpose_sm90_kernel, signature, constexprs)


def _transposed_rows(data: torch.Tensor, src_rows: torch.Tensor | None) -> int:
    """M: the rows transposed (``data``'s, or the gathered ones ``src_rows`` names)."""
    return data.shape[0] if src_rows is None else src_rows.shape[0]


def launch_scaling_aware_transpose(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None = None,
    src_rows: torch.Tensor | None = None,
    top_k: int = 1,
    config: TransposeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`scaling_aware_transpose`.

    ``config=None`` takes :func:`default_transpose_config` of ``K``.
    """
    m, k = _transposed_rows(data, src_rows), data.shape[1]
    data_t = torch.empty((k, m), dtype=FP8_DTYPE, device=data.device)
    scale_inv_t = torch.empty((m // BLOCK, k), dtype=torch.float32, device=data.device)
    if m == 0 or k == 0:
        return data_t, scale_inv_t
    c = config or default_transpose_config(k)
    row_tiles = m // BLOCK
    programs = row_tiles * cdiv(k // BLOCK, c.k_blocks_per_program)
    launch_kernel(
        _scaling_aware_transpose_kernel,
        (programs,),
        data,
        scale_inv,
        group_end_offsets,
        data_t,
        scale_inv_t,
        src_rows,
        m,
        k,
        group_end_offsets.numel() if group_end_offsets is not None else 0,
        min(c.group_m or row_tiles, row_tiles),
        top_k,
        HAS_OFFSETS=group_end_offsets is not None,
        GATHER=src_rows is not None,
        K_BLOCKS_PER_PROGRAM=c.k_blocks_per_program,
        num_warps=c.num_warps,
        maxnreg=c.max_registers,
    )
    return data_t, scale_inv_t


def launch_scaling_aware_transpose_sm90(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None = None,
    stages: int = SM90_STAGES,
    transposer_regs: int = SM90_TRANSPOSER_REGS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gluon launcher (Hopper GPUs only): the plain form (no ``src_rows``), ``data``'s base on a 16-byte
    boundary. Same contract and bits as :func:`launch_scaling_aware_transpose`; ``stages`` and
    ``transposer_regs`` pin the kernel's settings (sweeps).

    One program an SM walks the 128 x 128 tiles (row tile, then scale block); a loader warp keeps
    ``stages`` of them in flight by TMA, four partitions of 4 warps re-encode each landed tile in
    registers and TMA-store it transposed (``_sat_sm90_transposer``). The Triton kernel keeps one tile in
    flight per program at 25% occupancy, set by registers (ncu: 0.52 instructions issued per scheduler a
    cycle, 50-59% of DRAM bandwidth). Measured on an H200 (same inputs, bits equal, device time): the default
    (8 stages, 4 transposers at 96 registers) 0.88-0.91x the Triton kernel's time at K = 7168 (75-78% of copy
    bandwidth) and 0.79-0.93x at K = 2048 (69-74%); 2 transposers at 128 registers 1.04-1.17x (too few warps for
    the re-encoding). The op's kernel for the plain form on Hopper (``benchmarks/results/memory_bound_notes.md``).
    """
    m, k = data.shape
    if not sm90_supported(data.device):
        raise RuntimeError(
            f"the sm90 scaling_aware_transpose needs a Hopper GPU (compute capability 9.x), got {data.device}"
        )
    check_tma_operand("data", data)
    smem = (stages + 4) * BLOCK * BLOCK  # the ring's slots and 4 output buffers, E4M3 tiles
    if stages < 1 or smem > SM90_SMEM_BYTES:
        raise ValueError(
            f"stages={stages}: the ring and 4 output buffers need {smem} bytes of shared memory, at most {SM90_SMEM_BYTES}"
        )
    data_t = torch.empty((k, m), dtype=FP8_DTYPE, device=data.device)
    scale_inv_t = torch.empty((m // BLOCK, k), dtype=torch.float32, device=data.device)
    if m == 0 or k == 0:
        return data_t, scale_inv_t
    tiles = (m // BLOCK) * (k // BLOCK)
    launch_kernel(
        _scaling_aware_transpose_sm90_kernel,
        (min(tiles, sm_count(data.device)),),
        descriptor(data, (BLOCK, BLOCK)),
        descriptor(data_t, (BLOCK, BLOCK)),
        scale_inv,
        scale_inv_t,
        scale_inv if group_end_offsets is None else group_end_offsets,  # unread without offsets
        m,
        k,
        0 if group_end_offsets is None else group_end_offsets.numel(),
        HAS_OFFSETS=group_end_offsets is not None,
        STAGES=stages,
        TRANSPOSER_REGS=transposer_regs,
        num_warps=4,
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
    round-to-nearest-even cast (see ``_triton_common.reencode_rows``), which the exhaustive every-code x
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
    shift = torch.clamp(e_max - e_r, max=MAX_SHIFT)
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


def gather_transpose_reference(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None,
    src_rows: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the op (the oracle and the CPU path): with ``src_rows``, the rows gathered as
    :func:`~fp8flow_ao.kernels.permute_pad.permute_pad_rows` gathers them, then transposed."""
    if src_rows is not None:
        data, scale_inv = permute_pad_rows_reference(data, scale_inv, src_rows, top_k)
    return scaling_aware_transpose_reference(data, scale_inv, group_end_offsets)


_scaling_aware_transpose_op = define_op("scaling_aware_transpose")(gather_transpose_reference)


def _launch_op_kernel(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None,
    src_rows: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's CUDA kernel: the Hopper TMA kernel for the plain form where ``data``'s base and row stride
    lie on 16-byte boundaries (TMA's rule, ``sm90_takes_plain_form``), the Triton kernel otherwise (the gathering form: TMA cannot gather
    rows; other GPUs). Same bits either way."""
    if sm90_takes_plain_form(data, src_rows):
        return launch_scaling_aware_transpose_sm90(data, scale_inv, group_end_offsets)
    return launch_scaling_aware_transpose(data, scale_inv, group_end_offsets, src_rows, top_k)


_scaling_aware_transpose_op.register_kernel("cuda")(_launch_op_kernel)


@_scaling_aware_transpose_op.register_fake
def _(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None,
    src_rows: torch.Tensor | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = _transposed_rows(data, src_rows), data.shape[1]
    return data.new_empty((k, m), dtype=FP8_DTYPE), data.new_empty((m // BLOCK, k), dtype=torch.float32)


def scaling_aware_transpose(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    group_end_offsets: torch.Tensor | None = None,
    src_rows: torch.Tensor | None = None,
    top_k: int = 1,
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
        src_rows: optional int32 ``[M]`` contiguous row map of
            :func:`~fp8flow_ao.kernels.permute_pad.permute_pad_rows` (``t * top_k + j`` per row, -1 on
            pad rows): then ``data`` ``[T, K]`` / ``scale_inv`` ``[T, K / 128]`` are token rows and the
            op transposes their gathered rows ``permute_pad_rows(data, scale_inv, src_rows, top_k)``
            (the same bits) without writing them, reading each token row from L2 ``top_k`` times.
        top_k: rows per token of ``src_rows`` (ignored without it).

    Returns:
        ``(data_t, scale_inv_t)``: ``data_t`` E4M3 ``[K, M]`` contiguous (column-wise: tokens
        contiguous, K-major for the wgrad GEMM); ``scale_inv_t`` fp32 ``[M / 128, K]`` contiguous,
        the dequantize multiplier (``data[r, k] * scale_inv[r, k // 128] ==
        data_t[k, r] * scale_inv_t[r // 128, k]`` wherever the re-encoded value did not underflow).
    """
    check_fp8("data", data, ndim=2)
    check_contiguous("data", data)
    rows, k = data.shape
    check_multiple("data", k, what="columns (K)")
    check_tensor("scale_inv", scale_inv, dtypes=torch.float32, ndim=2)
    check_shape("scale_inv", scale_inv, (rows, k // BLOCK))
    check_contiguous("scale_inv", scale_inv)
    if src_rows is None:
        check_multiple("data", rows, what="rows (M)")
        m = rows
    else:
        m = src_rows.shape[0]
        check_multiple("src_rows", m, what="length (M)")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        check_row_map("src_rows", src_rows, -1, rows * top_k)
    if group_end_offsets is not None:
        check_group_end_offsets("group_end_offsets", group_end_offsets, rows=m)
        if group_end_offsets.numel() == 0:
            raise ValueError("group_end_offsets must hold at least one group end, got an empty tensor")
    check_same_device(data=data, scale_inv=scale_inv, group_end_offsets=group_end_offsets, src_rows=src_rows)
    check_no_grad("scaling_aware_transpose", data, scale_inv)
    return torch.ops.fp8flow.scaling_aware_transpose(data, scale_inv, group_end_offsets, src_rows, top_k)
