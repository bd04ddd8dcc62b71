"""quantize_dual_1x128: one read of BF16/FP16/FP32 ``g [M, N]`` -> row-wise and column-wise E4M3.

The backward pass needs a gradient twice: row-wise (1 x 128 blocks along N, for the dgrad GEMM) and
column-wise (128 x 1 blocks along M, physically transposed so tokens are contiguous, for the wgrad
GEMM). Each 128 x 128 tile of ``g`` is read once and written both ways.

Layouts (outputs contiguous): ``g`` row-major (last dim contiguous; the row stride is free).
``row_data`` E4M3 ``[M, N]``, ``row_scale`` fp32 ``[M, N/128]`` (COMPACT row-wise).
``col_data`` E4M3 ``[N, M]`` (``col_data[n, m]`` quantizes ``g[m, n]``), ``col_scale`` fp32
``[M/128, N]``: one scale per (128-row block, column). Scales are dequantize multipliers.

Expert groups: with int32 ``group_end_offsets [E]`` (padded ends, multiples of 128) the rows at or
past the last offset are padding: never read, written as data 0 and scale 0 in both outputs. The
last offset is read by the kernel on the device (no host sync). Because every group starts on a
128-row boundary, no 128-row block of the column-wise output crosses an expert boundary.

``src_rows`` (int32 ``[M_out]``) gathers as it quantizes: output row ``r`` is ``g[src_rows[r]]``, and rows
with ``src_rows[r] < 0`` are pad rows (read as 0; data 0 and row-wise scale 0): the padded layout of an
unpadded gradient (``fp8_grouped_mm``'s ``dOut`` on groups it padded) without writing the padded copy.

Kernels: on Hopper the plain form runs a warp-specialized TMA-ring kernel (``launch_quantize_dual_1x128_sm90``:
0.92-0.94x the Triton kernel's device time, 75-81% of copy bandwidth); the gathering form (``src_rows``), other
GPUs and a ``g`` TMA cannot load run the Triton kernel (``launch_quantize_dual_1x128``). Same bits.
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
    check_group_end_offsets,
    check_multiple,
    check_no_grad,
    check_row_major,
    check_row_map,
    check_same_device,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, empty_row_and_column_wise, quantize_rows_reference
from fp8flow_ao.kernels._grouped_gemm_common import check_tma_operand, sm_count
from fp8flow_ao.kernels._launch import launch_kernel
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
    gathered_rows,
    last_group_end,
    pow2_scale_inv_and_scale,
    store_colwise_transposed,
    store_rowwise,
)
from fp8flow_ao.kernels.unpermute_unpad import take_rows_or_zero

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of the one-tile-per-program kernel: warps and a register cap."""

    num_warps: int
    maxnreg: int | None = None


def quantize_dual_1x128_configs() -> list[LaunchConfig]:
    """Launch candidates timed by ``benchmarks/bench_quantize_dual_1x128.py --sweep``; the first is
    :data:`DEFAULT_CONFIG`.

    The tile is fixed by the format: one 128 x 128 tile of ``g`` is 128 row-wise and 128 column-wise
    blocks at once, so every amax is complete inside it (32 KiB of bf16 read with 16-byte loads,
    2 x 16 KiB of fp8 written with 16-byte stores). Registers a thread (triton 3.6, bf16), SASS
    instructions per tile a thread (ptxas sm_90a), and the H200 sweep of 2026-11-27
    (``quantize_dual_1x128_sweep.md``, % of copy bandwidth over the six benchmark cases):

    * 8 warps: 97 registers, two programs per SM, 1208 instructions: **69.6-73.7%** (the default). Holding
      the tile as four 32-row slices for the transposed store (``store_colwise_transposed``) took it from
      1264 instructions with 64 one-byte shared-memory loads a thread (``tl.trans`` of the fp8 tile: ncu
      counted 13 M bank conflicts each way at M=32768, N=7168) to 4-byte ones: 2.6-3.8% less device time;
      before that, the amax that ignores NaN instead of masking it cut ~200 instructions;
    * capped at 80 registers (7 spill instructions), three per SM: 66.6-74.0%, 2% faster on the skewed
      cases, equal to 5% slower on the others; 16 warps: 48.3-53.1%.

    What limits it (ncu, M=32768, N=7168): 62% of DRAM bandwidth with 16 warps an SM (25% occupancy, set by
    registers) and 0.45 instructions issued per scheduler a cycle: loads are in flight only while a
    program loads, and its amaxes, casts and stores wait on them.
    A persistent variant (each program loading its next tile while it quantizes this one) measured
    slower in every form in the same sweep (60.5-66.2% at 8 warps capped at 128, two per SM; 31.7-55.4%
    otherwise) and was removed; its rows stay in the sweep table. What a persistent Triton program could not
    do, warp specialization does: on Hopper the op runs :func:`launch_quantize_dual_1x128_sm90` (a TMA loader
    warp keeping tiles in flight beside two quantizing partitions) for the plain form; these configs serve the
    gathering form and other GPUs.
    """
    return [LaunchConfig(num_warps=8), LaunchConfig(num_warps=8, maxnreg=80), LaunchConfig(num_warps=16)]


DEFAULT_CONFIG = quantize_dual_1x128_configs()[0]


@triton.jit
def _load_row_slice(g_ptr, src_rows_ptr, rows, end, cols, stride_gm, GATHER: tl.constexpr):
    """Rows ``rows`` of ``g`` (gathered through ``src_rows`` with ``GATHER``) in fp32, 0 where not read;
    with which rows were read (rows before ``end`` that are not pad rows)."""
    read_ok, src64 = gathered_rows(src_rows_ptr, rows, rows < end, GATHER)
    x = tl.load(g_ptr + src64[:, None] * stride_gm + cols[None, :], mask=read_ok[:, None], other=0.0)
    return x.to(tl.float32), read_ok


@triton.jit
def _quantize_dual_1x128_kernel(
    g_ptr,
    src_rows_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    offsets_ptr,
    M,
    N,
    stride_gm,
    num_groups,
    HAS_OFFSETS: tl.constexpr,
    GATHER: tl.constexpr,
    TILE: tl.constexpr,
):
    """One ``TILE x TILE`` tile per program (N tiles vary fastest): quantized both ways and stored
    with its scales; rows at or past the last group end are padding: masked off (never read) and
    loaded as 0, so their data is written as +0 and their scales as 0. ``GATHER``: row ``r`` reads
    ``g[src_rows[r]]``, and rows with a negative source are pad rows (read as 0, row-wise scale 0).

    The tile is held as four ``TILE / 4``-row slices (rows ``4q + b``), so that the column-wise data
    is transposed by :func:`~fp8flow_ao.kernels._triton_common.transpose_row_slices` (4 bytes at a time
    through shared memory).
    """
    # The last padded group end, read on the device: rows at or past it are padding.
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    tile = tl.program_id(0)
    tiles_n = N // TILE
    tile_n = tile % tiles_n
    row0 = (tile // tiles_n) * TILE
    cols = tile_n * TILE + tl.arange(0, TILE)
    cols64 = cols.to(tl.int64)
    quads = 4 * tl.arange(0, TILE // 4)
    x0, ok0 = _load_row_slice(g_ptr, src_rows_ptr, row0 + quads, end, cols, stride_gm, GATHER)
    x1, ok1 = _load_row_slice(g_ptr, src_rows_ptr, row0 + quads + 1, end, cols, stride_gm, GATHER)
    x2, ok2 = _load_row_slice(g_ptr, src_rows_ptr, row0 + quads + 2, end, cols, stride_gm, GATHER)
    x3, ok3 = _load_row_slice(g_ptr, src_rows_ptr, row0 + quads + 3, end, cols, stride_gm, GATHER)
    store_rowwise(x0, row0 + quads, ok0, row_data_ptr, row_scale_ptr, cols64, N, tiles_n, tile_n)
    store_rowwise(x1, row0 + quads + 1, ok1, row_data_ptr, row_scale_ptr, cols64, N, tiles_n, tile_n)
    store_rowwise(x2, row0 + quads + 2, ok2, row_data_ptr, row_scale_ptr, cols64, N, tiles_n, tile_n)
    store_rowwise(x3, row0 + quads + 3, ok3, row_data_ptr, row_scale_ptr, cols64, N, tiles_n, tile_n)
    # col_data[n, m] = quantized g[m, n]: tokens contiguous for the wgrad GEMM.
    col_scale_row = col_scale_ptr + (row0 // TILE).to(tl.int64) * N
    store_colwise_transposed(x0, x1, x2, x3, row0, cols64, M, col_data_ptr, col_scale_row, row0 < end)


def _allocate(
    g: torch.Tensor, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return empty_row_and_column_wise(g, g.shape[0] if src_rows is None else src_rows.shape[0], g.shape[1])


def launch_quantize_dual_1x128(
    g: torch.Tensor,
    group_end_offsets: torch.Tensor | None = None,
    src_rows: torch.Tensor | None = None,
    config: LaunchConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`quantize_dual_1x128`.

    Tests pass each of :func:`quantize_dual_1x128_configs` to prove they agree.
    """
    row_data, row_scale, col_data, col_scale = _allocate(g, src_rows)
    m, n = row_data.shape
    num_tiles = (m // BLOCK) * (n // BLOCK)
    if num_tiles == 0:
        return row_data, row_scale, col_data, col_scale
    has_offsets = group_end_offsets is not None
    launch_kernel(
        _quantize_dual_1x128_kernel,
        (num_tiles,),
        g,
        g if src_rows is None else src_rows,  # unread without GATHER
        row_data,
        row_scale,
        col_data,
        col_scale,
        group_end_offsets if has_offsets else row_scale,  # never read without offsets
        m,
        n,
        g.stride(0),
        group_end_offsets.shape[0] if has_offsets else 0,
        HAS_OFFSETS=has_offsets,
        GATHER=src_rows is not None,
        TILE=BLOCK,
        num_warps=config.num_warps,
        maxnreg=config.maxnreg,
    )
    return row_data, row_scale, col_data, col_scale


# The Hopper kernel (TMA ring, warp-specialized) of the plain form (no src_rows: TMA cannot gather rows).
SM90_QUANTIZER_WARPS = gl.constexpr(8)  # warps of each of the two quantizer partitions: 64 values a thread a tile
# Registers a thread of the worker quantizer partition; Triton gives the default one what the SM has left (96 on
# triton 3.6, beside the loader warp group's 40). Neither spills with bf16 / fp16 input.
SM90_QUANTIZER_REGS = gl.constexpr(120)
SM90_MAX_STAGES = 8
# Shared memory besides the ring: two partitions' row-wise and column-wise E4M3 output tiles, and the barriers
# and the reductions' scratch (~8 KiB measured; 9 KiB reserved).
_SM90_FIXED_SMEM = 2 * 2 * BLOCK * BLOCK + 9 * 1024


def sm90_stages(dtype: torch.dtype) -> int:
    """Input tiles the Hopper kernel keeps in flight for ``g`` of ``dtype``: as many 128 x 128 tiles as
    shared memory holds beside the output tiles (bf16/fp16: 4, fp32: 2), at most 8."""
    return min(SM90_MAX_STAGES, (SM90_SMEM_BYTES - _SM90_FIXED_SMEM) // (BLOCK * BLOCK * dtype.itemsize))


@gluon.jit
def _qd_sm90_quantizer(PART: gl.constexpr, PARTS: gl.constexpr, HAS_OFFSETS: gl.constexpr, ring, tensors):
    """8 warps: this partition's landed tiles (the program's tiles ``PART, PART + PARTS, ...``), each
    quantized row-wise and column-wise and TMA-stored through this partition's output tiles, with
    their scales. ``ring = (in_bufs, ready, empty, row_bufs, col_bufs)``; ``tensors = (row_desc,
    col_desc, row_scale_ptr, col_scale_ptr, offsets_ptr, M, N, num_groups)``.

    The slot is read twice, in the layout each half stores well (``gl.bank_conflicts``-style choices
    of the grouped GEMM's weight quantizer): 8 consecutive values of a row a thread for the row-wise
    half (16-byte loads, 8-byte stores), 16 rows x 2 columns a thread for the column-wise half, whose
    permute holds 16 consecutive tokens of a column a thread (16-byte stores of the transposed tile).
    Reading the slot again costs shared-memory bandwidth, which has room; holding one tile in two
    layouts at once would not fit the registers."""
    in_bufs, ready, empty, row_bufs, col_bufs = ring
    row_desc, col_desc, row_scale_ptr, col_scale_ptr, offsets_ptr, M, N, num_groups = tensors
    STAGES: gl.constexpr = in_bufs.type.shape[0]
    row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    col_layout: gl.constexpr = gl.BlockedLayout([16, 2], [1, 32], [8, 1], [1, 0])
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    num_nb = N // SM90_BLOCK
    tiles = gl.cdiv(gl.maximum((M // SM90_BLOCK) * num_nb - gl.program_id(0), 0), gl.num_programs(0))
    rows_r = gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(1, row_layout))
    rows_c = gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(1, col_layout))
    cols_c = gl.arange(0, SM90_BLOCK, layout=gl.SliceLayout(0, col_layout))
    row_out = row_bufs.index(PART)
    col_out = col_bufs.index(PART)
    for it in range(PART, tiles, PARTS):
        t = gl.program_id(0) + it * gl.num_programs(0)
        nb = t % num_nb
        row0 = (t // num_nb) * SM90_BLOCK
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        # Rows at or past the end are zeros (the slot of a tile wholly past it holds whatever was there):
        # data 0, row-wise scale 0, and no say in the column-wise scale.
        x = in_bufs.index(s).load(row_layout).to(gl.float32)
        x = gl.where((row0 + rows_r < end)[:, None], x, gl.zeros_like(x))
        # maxnum: NaN ignored, as nan_ignoring_amax does in the Triton kernel
        row_scale_inv, row_scale = pow2_scale_inv_and_scale(gl.max(gl.abs(x), axis=1))
        q = (x * row_scale[:, None]).to(gl.float8e4nv)
        tma.store_wait(0)  # this partition's previous tile has left both output tiles
        row_out.store(q)
        rows64 = (row0 + rows_r).to(gl.int64)
        gl.store(row_scale_ptr + rows64 * num_nb + nb, gl.where(row0 + rows_r < end, row_scale_inv, 0.0))
        xc = in_bufs.index(s).load(col_layout).to(gl.float32)
        # Every warp has read the slot before it is freed: the barrier of this partition's warps.
        partition_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        xc = gl.where((row0 + rows_c < end)[:, None], xc, gl.zeros_like(xc))
        col_scale_inv, col_scale = pow2_scale_inv_and_scale(gl.max(gl.abs(xc), axis=0))
        qc = (xc * col_scale[None, :]).to(gl.float8e4nv)
        col_out.store(gl.permute(qc, (1, 0)))
        fence_async_shared()
        tma_store(row_desc, [row0, nb * SM90_BLOCK], row_out)
        tma_store(col_desc, [nb * SM90_BLOCK, row0], col_out)
        block_ok = gl.zeros_like(cols_c) + row0 < end
        gl.store(
            col_scale_ptr + (row0 // SM90_BLOCK) * N + nb * SM90_BLOCK + cols_c, gl.where(block_ok, col_scale_inv, 0.0)
        )
    tma.store_wait(0)


@gluon.jit
def _quantize_dual_1x128_sm90_kernel(
    in_desc,
    row_desc,
    col_desc,
    row_scale_ptr,
    col_scale_ptr,
    offsets_ptr,
    M,
    N,
    num_groups,
    HAS_OFFSETS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Persistent: program ``p`` takes tiles ``p, p + programs, ...`` (row tile major, column block minor).
    One loader warp keeps ``STAGES`` tiles in flight (``tile_ring_loader``); two quantizer partitions of 8
    warps (the default one and a worker) take the landed tiles in turn."""
    in_bufs = gl.allocate_shared_memory(in_desc.dtype, [STAGES] + in_desc.block_type.shape, in_desc.layout)
    row_bufs = gl.allocate_shared_memory(row_desc.dtype, [2] + row_desc.block_type.shape, row_desc.layout)
    col_bufs = gl.allocate_shared_memory(col_desc.dtype, [2] + col_desc.block_type.shape, col_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    ring = (in_bufs, ready, empty, row_bufs, col_bufs)
    tensors = (row_desc, col_desc, row_scale_ptr, col_scale_ptr, offsets_ptr, M, N, num_groups)
    # Constexprs (PART, PARTS, HAS_OFFSETS) spelled out: Gluon keeps them only in literal argument tuples.
    gl.warp_specialize(
        [
            (_qd_sm90_quantizer, (0, 2, HAS_OFFSETS, ring, tensors)),
            (_qd_sm90_quantizer, (1, 2, HAS_OFFSETS, ring, tensors)),
            (tile_ring_loader, (((in_desc, 0),), in_bufs, ready, empty, offsets_ptr, M, N, num_groups, HAS_OFFSETS)),
        ],
        [SM90_QUANTIZER_WARPS, 1],
        [SM90_QUANTIZER_REGS, 40],
    )


def build_sm90_quantize_dual_kernel(has_offsets: bool = True, dtype: torch.dtype = torch.bfloat16) -> Any:
    """Compile the Hopper kernel for sm_90a without a GPU (see
    :func:`~fp8flow_ao.kernels._sm90_common.compile_for_sm90`), as a launch on ``g`` of ``dtype`` with or
    without offsets would."""
    signature = {
        "in_desc": descriptor_signature((BLOCK, BLOCK), dtype),
        "row_desc": descriptor_signature((BLOCK, BLOCK), FP8_DTYPE),
        "col_desc": descriptor_signature((BLOCK, BLOCK), FP8_DTYPE),
        "row_scale_ptr": "*fp32",
        "col_scale_ptr": "*fp32",
        # Without offsets the launcher passes row_scale there (unread): an fp32 pointer.
        "offsets_ptr": "*i32" if has_offsets else "*fp32",
        **dict.fromkeys(("M", "N", "num_groups"), "i32"),
        **dict.fromkeys(("HAS_OFFSETS", "STAGES"), "constexpr"),
    }
    constexprs = {"HAS_OFFSETS": has_offsets, "STAGES": sm90_stages(dtype)}
    return compile_for_sm90(
        _quantize_dual_1x128_sm90_kernel, signature, constexprs, num_warps=SM90_QUANTIZER_WARPS.value
    )


def launch_quantize_dual_1x128_sm90(
    g: torch.Tensor, group_end_offsets: torch.Tensor | None = None, stages: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gluon launcher (Hopper GPUs only): the plain form (no ``src_rows``), ``g``'s base and row stride on
    16-byte boundaries (TMA's rule). Same contract and bits as :func:`launch_quantize_dual_1x128`;
    ``stages`` pins the ring's depth (sweeps; default :func:`sm90_stages`).

    One program an SM walks the 128 x 128 tiles; a loader warp keeps ``stages`` of them in flight by TMA,
    two partitions of 8 warps quantize each landed tile both ways and TMA-store it (``_qd_sm90_quantizer``).
    The Triton kernel has one tile in flight per program at 25% occupancy (ncu: 0.45 instructions issued per
    scheduler a cycle, 62% of DRAM bandwidth, ``benchmarks/results/memory_bound_notes.md``). Measured on an H200
    (bf16, the six benchmark cases, same inputs, bits equal, device time): 0.92-0.94x the Triton kernel's time,
    75-81% of copy bandwidth; 2 stages within 1% of 4 (the ring is not what limits it). The op's kernel for the
    plain form on Hopper."""
    if not sm90_supported(g.device):
        raise RuntimeError(f"the sm90 quantize_dual_1x128 needs a Hopper GPU (compute capability 9.x), got {g.device}")
    check_tma_operand("g", g)
    stages = sm90_stages(g.dtype) if stages is None else stages
    smem = stages * BLOCK * BLOCK * g.element_size() + _SM90_FIXED_SMEM
    if stages < 1 or smem > SM90_SMEM_BYTES:
        raise ValueError(
            f"stages={stages}: the ring of {g.dtype} tiles and the output tiles need {smem} bytes of shared "
            f"memory, at most {SM90_SMEM_BYTES}"
        )
    row_data, row_scale, col_data, col_scale = _allocate(g)
    m, n = row_data.shape
    tiles = (m // BLOCK) * (n // BLOCK)
    if tiles == 0:
        return row_data, row_scale, col_data, col_scale
    has_offsets = group_end_offsets is not None
    launch_kernel(
        _quantize_dual_1x128_sm90_kernel,
        (min(tiles, sm_count(g.device)),),
        descriptor(g, (BLOCK, BLOCK)),
        descriptor(row_data, (BLOCK, BLOCK)),
        descriptor(col_data, (BLOCK, BLOCK)),
        row_scale,
        col_scale,
        group_end_offsets if has_offsets else row_scale,  # unread without offsets
        m,
        n,
        group_end_offsets.shape[0] if has_offsets else 0,
        HAS_OFFSETS=has_offsets,
        STAGES=stages,
        num_warps=SM90_QUANTIZER_WARPS.value,
    )
    return row_data, row_scale, col_data, col_scale


def _launch_op_kernel(
    g: torch.Tensor, group_end_offsets: torch.Tensor | None, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's CUDA kernel: the Hopper TMA kernel for the plain form where TMA can load ``g`` (base and
    row stride on 16-byte boundaries), the Triton kernel otherwise (gathering, other GPUs). Same bits."""
    if sm90_takes_plain_form(g, src_rows):
        return launch_quantize_dual_1x128_sm90(g, group_end_offsets)
    return launch_quantize_dual_1x128(g, group_end_offsets, src_rows)


def quantize_dual_1x128_reference(
    g: torch.Tensor, group_end_offsets: torch.Tensor | None = None, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference (the oracle and the CPU path): row-wise blocks of ``g`` (gathered by ``src_rows``,
    0 on pad rows) and of ``g.T``, with rows at or past the last group end zeroed (data 0, scale 0) and
    the pad rows' row-wise scales 0. Reads the offsets on the device."""
    if src_rows is not None:
        g = take_rows_or_zero(g, src_rows, 1)
    m = g.shape[0]
    end = group_end_offsets[-1] if group_end_offsets is not None else m
    row_ok = torch.arange(m, device=g.device) < end
    block_ok = torch.arange(0, m, BLOCK, device=g.device) < end
    g = torch.where(row_ok[:, None], g, torch.zeros((), dtype=g.dtype, device=g.device))
    if src_rows is not None:
        row_ok &= src_rows >= 0
    row_data, row_scale = quantize_rows_reference(g, BLOCK)
    col_data, col_scale_t = quantize_rows_reference(g.t(), BLOCK)
    row_scale = torch.where(row_ok[:, None], row_scale, 0.0)
    col_scale = torch.where(block_ok[:, None], col_scale_t.t(), 0.0).contiguous()
    return row_data, row_scale, col_data, col_scale


@define_op("quantize_dual_1x128")
def _quantize_dual_1x128_op(
    g: torch.Tensor, group_end_offsets: torch.Tensor | None, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_dual_1x128_reference(g, group_end_offsets, src_rows)


_quantize_dual_1x128_op.register_kernel("cuda")(_launch_op_kernel)


@_quantize_dual_1x128_op.register_fake
def _(
    g: torch.Tensor, group_end_offsets: torch.Tensor | None, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _allocate(g, src_rows)


def quantize_dual_1x128(
    g: torch.Tensor, group_end_offsets: torch.Tensor | None = None, src_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``g`` to E4M3 row-wise (1 x 128 blocks) and column-wise (128 x 1 blocks) in one read.

    Args:
        g: ``[M, N]`` bf16, fp16 or fp32, row-major (last dim contiguous). ``M`` and ``N`` must be
            multiples of 128.
        group_end_offsets: optional int32 ``[E]`` padded group end offsets (non-decreasing, multiples
            of 128, last <= M), on ``g``'s device. Rows at or past the last one are not read; their
            outputs are data 0 and scale 0. Values are checked on CPU tensors, on the GPU only with
            ``FP8FLOW_VALIDATE=1``.
        src_rows: optional int32 ``[M_out]`` contiguous row map on ``g``'s device (``M_out`` a multiple of
            128; the offsets then index the ``M_out`` rows): row ``r`` of the outputs is ``g[src_rows[r]]``,
            a pad row (read as 0, row-wise scale 0) where ``src_rows[r] < 0``. Values below ``g``'s row
            count (checked on CPU tensors, on the GPU only with ``FP8FLOW_VALIDATE=1``). ``g``'s own row count is then free.

    Returns:
        ``(row_data, row_scale, col_data, col_scale)``, all contiguous:

        * ``row_data`` E4M3 ``[M, N]`` and ``row_scale`` fp32 ``[M, N/128]``: ``g[m, n] ~=
          row_data[m, n] * row_scale[m, n // 128]`` (the dgrad operand).
        * ``col_data`` E4M3 ``[N, M]`` (physically transposed, M contiguous) and ``col_scale`` fp32
          ``[M/128, N]``: ``g[m, n] ~= col_data[n, m] * col_scale[m // 128, n]`` (the wgrad operand).

        Scales are powers of two (the dequantize multiplier); ``+inf`` for a block holding ``+-inf``.
    """
    check_tensor("g", g, dtypes=_INPUT_DTYPES, ndim=2)
    check_row_major("g", g)
    check_multiple("g", g.shape[1], what="dim N (1)")
    if src_rows is None:
        check_multiple("g", g.shape[0], what="dim M (0)")
        rows = g.shape[0]
    else:
        check_row_map("src_rows", src_rows, -1, g.shape[0])
        check_multiple("src_rows", src_rows.shape[0], what="length (M)")
        check_same_device(g=g, src_rows=src_rows)
        rows = src_rows.shape[0]
    if group_end_offsets is not None:
        check_group_end_offsets("group_end_offsets", group_end_offsets, rows=rows)
        if group_end_offsets.shape[0] == 0:
            raise ValueError("group_end_offsets must hold at least one group, got shape (0,)")
        check_same_device(g=g, group_end_offsets=group_end_offsets)
    check_no_grad("quantize_dual_1x128", g)
    return torch.ops.fp8flow.quantize_dual_1x128(g, group_end_offsets, src_rows)
