"""Pieces shared by the Hopper (sm90) Gluon grouped GEMMs: forward/dgrad and wgrad.

Both kernels are warp-specialized the same way: one producer warp fills a ring of ``stages``
shared-memory slots by TMA (``ready`` mbarriers), two consumer warpgroups each own 64 rows of the
128-row tile, multiply with asynchronous wgmma, promote each 128-wide reduction block's partial into
fp32 accumulators with the block's scales, and release the slot with their own arrival on the
slot's ``empty`` mbarrier (count 2). No barrier spans both consumers, so one's promotion (FFMAs on
the CUDA cores) runs under the other's MMAs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp8flow_ao._format import BLOCK
from fp8flow_ao.kernels._grouped_gemm_common import cuda_index
from fp8flow_ao.kernels._triton_common import last_group_end

# Rows of the tile each consumer warpgroup owns: one m64 wgmma row block.
WG_ROWS = gl.constexpr(64)
SM90_BLOCK = gl.constexpr(BLOCK)  # tile rows, reduction block, output half-tile width
# Triton 3.6 names the TMA copies async_copy_global_to_shared / _shared_to_global; 3.7+ renamed
# them async_load / async_store and turned the old names into errors. (A constexpr branch inside
# the kernel does not help: 3.6 resolves every attribute of a kernel's source when hashing it.)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# Shared memory one CTA may use on Hopper (227 KiB), for the stage-count check.
SM90_SMEM_BYTES = 227 * 1024
_GL_DTYPES = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float32: gl.float32,
}


def _shared_reinterpret(reinterpret_name: str) -> Any:
    """:func:`shared_reinterpret` for a Triton whose shared-memory views reinterpret by ``reinterpret_name``
    (3.6: ``_reinterpret``; 3.9: ``reinterpret``): one jit function per name, picked once at import."""
    if reinterpret_name == "reinterpret":

        @gluon.jit
        def view(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf.reinterpret(dtype, shape, layout)

    else:

        @gluon.jit
        def view(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf._reinterpret(dtype, shape, layout)

    return view


# shared_reinterpret(buf, dtype, shape, layout): the bytes of shared memory ``buf`` seen as ``dtype[shape]``
# in shared layout ``layout`` (no copy; the caller makes the byte positions agree).
shared_reinterpret = _shared_reinterpret(
    "reinterpret" if hasattr(gl.shared_memory_descriptor, "reinterpret") else "_reinterpret"
)


@gluon.jit
def fp8_view_of_slots(bufs, layout: gl.constexpr):
    """Ring slots ``[STAGES, R, C]`` of any dtype seen as E4M3 ``[STAGES, R * itemsize, C]`` (``layout``: the
    E4M3 view's shared layout), each slot's bytes where they were, so an E4M3 tile can be written over the
    first bytes of the slot it was made from."""
    STAGES: gl.constexpr = bufs.type.shape[0]
    ROWS: gl.constexpr = bufs.type.shape[1] * bufs.dtype.primitive_bitwidth // 8
    COLS: gl.constexpr = bufs.type.shape[2]
    return shared_reinterpret(bufs, gl.float8e4nv, [STAGES, ROWS, COLS], layout)


# A barrier of the calling partition's warps: gl.thread_barrier on triton 3.6, renamed gl.barrier later.
partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def tile_ring_loader(sources, in_bufs, ready, empty, offsets_ptr, M, N, num_groups, HAS_OFFSETS: gl.constexpr):
    """One warp of a persistent memory-bound kernel: TMA loads of this program's 128 x 128 tiles of an
    ``[M, N]`` grid (program ``p`` takes tiles ``p, p + programs, ...``, row tile major, column block
    minor) into the ring ``in_bufs`` (``ready`` / ``empty`` mbarriers a slot, one arrival each).

    ``sources``: a tuple of ``(desc, col)``, one box per source a tile (boxes of one shape and dtype): tile
    ``(r, c)``'s box of source ``i`` is ``desc``'s at ``[128 r, col + 128 c]``, landing in ``in_bufs.index(slot *
    len(sources) + i)`` (a slot is ``len(sources)`` buffers). A tile wholly at or past the last group end is
    not read: its slot is marked ready without bytes."""
    SOURCES: gl.constexpr = len(sources)
    STAGES: gl.constexpr = in_bufs.type.shape[0] // SOURCES
    end = last_group_end(offsets_ptr, num_groups, M, HAS_OFFSETS)
    num_nb = N // SM90_BLOCK
    for t in range(gl.program_id(0), (M // SM90_BLOCK) * num_nb, gl.num_programs(0)):
        it = t // gl.num_programs(0)  # this program's tile count so far
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        row0 = (t // num_nb) * SM90_BLOCK
        if row0 < end:
            mbarrier.expect(ready.index(s), SOURCES * sources[0][0].block_type.nbytes)
            for i in gl.static_range(SOURCES):
                desc, col = sources[i]
                tma_load(desc, [row0, col + (t % num_nb) * SM90_BLOCK], ready.index(s), in_bufs.index(s * SOURCES + i))
        else:
            mbarrier.arrive(ready.index(s), count=1)


@dataclass(frozen=True)
class Sm90Config:
    """Launch settings of an sm90 kernel: tiles of 128 rows x ``block_n`` (128 or 256) columns,
    ``stages`` operand slots in the TMA ring, ``group_m`` row tiles walked together (L2 reuse of
    the other operand's tiles), ``ordered``: consumer 1 issues a block's MMA only after consumer 0
    issued its own, so the tensor cores finish consumer 0's first and its promotion runs under
    consumer 1's MMA (without it both may be released by the same ``ready`` flip, multiply
    interleaved, and promote at the same time while the tensor cores idle). ``out_buffers``
    (forward/dgrad and wgrad kernels, 128x256 tiles): output staging tiles per consumer; with 2, a tile's second
    half is written to shared memory while the first half's TMA store may still be reading its own, so
    the epilogue never waits on a store it just issued (1: it waits once per tile)."""

    block_n: int = 128
    stages: int = 4
    group_m: int = 8
    ordered: bool = False
    out_buffers: int = 1

    def smem_bytes(self, out_dtype: torch.dtype, scale_bytes_per_stage: int = 0) -> int:
        """Shared memory of one CTA: the operand ring (plus any scales carried in it) and the two
        consumers' 64x128 output staging tiles (``out_buffers`` each)."""
        out_bytes = 2 * self.out_buffers * 64 * BLOCK * out_dtype.itemsize
        return self.stages * ((BLOCK + self.block_n) * BLOCK + scale_bytes_per_stage) + out_bytes


@gluon.jit
def sm90_mma(a_bufs, b_bufs, s, layout: gl.constexpr, WG: gl.constexpr, HALF: gl.constexpr, into=None):
    """Start (asynchronously) the MMA of this warpgroup's 64 rows of ring slot ``s``'s A tile by the
    128 rows ``[128 HALF, 128 HALF + 128)`` of its B tile, over one 128-wide reduction block. ``into``: a
    dead partial whose registers the result takes (its values are not read)."""
    a = a_bufs.index(s).slice(WG * WG_ROWS, WG_ROWS)
    b = b_bufs.index(s).slice(HALF * SM90_BLOCK, SM90_BLOCK).permute((1, 0))
    # use_acc=False: the accumulator operand is a placeholder (no zeros are held across the loop).
    if into is None:
        into = gl.zeros([WG_ROWS, SM90_BLOCK], gl.float32, layout)
    return warpgroup_mma(a, b, into, use_acc=False, is_async=True)


@gluon.jit
def sm90_ring_barriers(STAGES: gl.constexpr, RELEASERS: gl.constexpr):
    """The ring's mbarriers, initialized: ``ready`` (TMA bytes landed), ``empty`` (the slot released by
    ``RELEASERS`` partitions: both consumers, and a partition whose TMA store reads the slot) and ``turn``
    (consumer 0 issued the slot's first MMA)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=RELEASERS)
        mbarrier.init(turn.index(i), count=1)
    return ready, empty, turn


@gluon.jit
def sm90_first_mma(a_bufs, b_bufs, ready, turn, it, layout: gl.constexpr, WG: gl.constexpr, ORDERED: gl.constexpr):
    """Wait for ring slot ``it % STAGES`` and start its first MMA (``sm90_mma`` half 0); with
    ``ORDERED``, consumer 1 first waits until consumer 0 has issued its own (``Sm90Config.ordered``)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = it % STAGES
    phase = (it // STAGES) & 1
    mbarrier.wait(ready.index(s), phase)
    if ORDERED and WG == 1:
        mbarrier.wait(turn.index(s), phase)
    part = sm90_mma(a_bufs, b_bufs, s, layout, WG, 0)
    if ORDERED and WG == 0:
        mbarrier.arrive(turn.index(s), count=1)
    return part


@gluon.jit
def sm90_second_mma(a_bufs, b_bufs, s, first_acc, layout: gl.constexpr, WG: gl.constexpr, into=None):
    """Start ring slot ``s``'s second MMA (B half 1) once ``first_acc``, the accumulator the first
    half was just promoted into, exists; returns ``(first_acc, token)``. Threading ``first_acc``
    through a wait keeps ptxas from hoisting this MMA above that promotion, which would hold both
    partials live (256 registers: spills)."""
    first_acc = warpgroup_mma_wait(0, deps=(first_acc,))
    return first_acc, sm90_mma(a_bufs, b_bufs, s, layout, WG, 1, into)


@gluon.jit
def sm90_store_halves(out_desc, out_s0, out_s1, acc0, acc1, row, col, HALVES: gl.constexpr, PENDING: gl.constexpr):
    """TMA-store a tile's one or two 64x128 halves (``acc1`` only when ``HALVES == 2``) through this
    warpgroup's staging buffers, half ``h`` through ``out_s<h>``: one buffer (``PENDING`` 0: each
    store waits for the previous one to have left it) or two used in turn (``PENDING`` 1: each store
    waits only for the one before the previous, which read the same buffer; stores complete in order)."""
    gl.static_assert(PENDING == 0 or HALVES == 2, "two staging buffers serve the two halves of a 128x256 tile")
    sm90_store(out_desc, out_s0, acc0, row, col, PENDING)
    if HALVES == 2:
        sm90_store(out_desc, out_s1, acc1, row, col + SM90_BLOCK, PENDING)


@gluon.jit
def sm90_store(out_desc, out_s, tile, row, col, pending: gl.constexpr = 0):
    """TMA-store a 64x128 tile through the staging buffer ``out_s`` once at most ``pending`` of this
    warpgroup's stores are still reading their buffers (0: its previous store has left; 1 with two
    buffers used in turn: the one before it, which read ``out_s``, has)."""
    tma.store_wait(pending)
    out_s.store(tile.to(out_desc.dtype))
    fence_async_shared()
    tma_store(out_desc, [row, col], out_s)


def sm90_supported(device: torch.device) -> bool:
    """True on a Hopper GPU (compute capability 9.x), where the sm90 kernels' wgmma exists."""
    return device.type == "cuda" and _is_hopper(cuda_index(device))


@functools.cache
def _is_hopper(device_index: int) -> bool:
    # Cached: asked on every grouped GEMM launch, and torch's query is Python on a host-bound step.
    return torch.cuda.get_device_capability(device_index)[0] == 9


def sm90_takes_plain_form(t: torch.Tensor, src_rows: torch.Tensor | None) -> bool:
    """Whether a memory-bound op with a Hopper TMA kernel of its plain form (``quantize_dual_1x128``,
    ``scaling_aware_transpose``) runs it on input ``t``: no row gather (TMA cannot gather rows), a Hopper GPU,
    and ``t``'s base and row stride on 16-byte boundaries (TMA's rule). Else the op runs its Triton kernel."""
    return (
        src_rows is None
        and sm90_supported(t.device)
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * t.element_size()) % 16 == 0
    )


def sm90_or(sm90_launcher: Callable[..., Any], other_launcher: Callable[..., Any]) -> Callable[..., Any]:
    """An op's CUDA kernel: ``sm90_launcher`` where the first argument lives on a Hopper GPU,
    ``other_launcher`` (the Triton kernel) on any other GPU. Both take the op's arguments."""

    def launch(*args: Any, **kwargs: Any) -> Any:
        return (sm90_launcher if sm90_supported(args[0].device) else other_launcher)(*args, **kwargs)

    return launch


def check_sm90_launch(
    device: torch.device, config: Sm90Config, n: int, out_dtype: torch.dtype, smem: int, split_epilogue: bool = False
) -> None:
    """Clear errors before any launch: a tile width that does not divide ``n``, staging buffers the kernel
    cannot use (``split_epilogue``: it stages a 128x256 tile's halves through a buffer each, so
    ``out_buffers`` may be 2 there), a kernel whose shared memory (``smem`` bytes, the op's
    ``sm90_smem_bytes``) does not fit, a device without wgmma."""
    if config.block_n not in (128, 256) or n % config.block_n:
        raise ValueError(f"{config}: block_n must be 128 or 256 and divide the output width {n}")
    if config.out_buffers != 1 and not (split_epilogue and config.out_buffers == 2 and config.block_n == 256):
        allowed = ", or 2 with block_n=256 (one per half)" if split_epilogue else " (one buffer per consumer)"
        raise ValueError(f"{config}: out_buffers must be 1{allowed} for this kernel's output staging")
    if smem > SM90_SMEM_BYTES:
        raise ValueError(
            f"{config} needs {smem} bytes of shared memory with {out_dtype} out, more than Hopper's {SM90_SMEM_BYTES}"
        )
    if not sm90_supported(device):
        raise RuntimeError(f"the sm90 grouped GEMMs need a Hopper GPU (compute capability 9.x), got {device}")


@functools.cache
def tile_smem_layout(shape: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared layout (swizzled for TMA and wgmma) of a ``dtype[shape]`` box that :func:`descriptor` loads."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), _GL_DTYPES[dtype])


class _LaunchDescriptor(TensorDescriptor):
    """A ``TensorDescriptor`` built without Triton's Python re-validation (2/3 of its ~2.5 us): the launchers
    check their operands' TMA alignment first (``check_tma_operand``; outputs are fresh contiguous
    tensors), blocks are fixed powers of two, and the driver's ``cuTensorMapEncodeTiled`` still rejects a
    bad one at launch."""

    def __post_init__(self) -> None:
        pass


def descriptor(t: torch.Tensor, block: tuple[int, ...]) -> TensorDescriptor:
    """Host TMA descriptor of a tensor (last dim contiguous, TMA-aligned: see ``_LaunchDescriptor``) with
    ``block`` boxes."""
    return _LaunchDescriptor(t, list(t.shape), list(t.stride()), list(block), tile_smem_layout(block, t.dtype))


def descriptor_signature(block: tuple[int, ...], dtype: torch.dtype) -> str:
    """The signature type a launch with ``descriptor(t, block)`` specializes the kernel on."""
    dims = ", ".join(map(str, block))
    return f"tensordesc<{_GL_DTYPES[dtype]}[{dims}],{tile_smem_layout(block, dtype)!r}>"


def compile_for_sm90(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int = 4,
    aligned: tuple[str, ...] = (),
    **options: Any,
) -> Any:
    """Compile a Gluon or Triton kernel for sm_90a without a GPU (Triton's bundled ptxas): a build check
    (the CPU interpreter runs kernels without compiling them), and the cubin and SASS for inspection
    (``.asm["cubin"]``). ``num_warps``: a Gluon kernel's default partition, a Triton kernel's warps;
    ``aligned``: the parameters a launch specializes as multiples of 16 (pointers of torch's allocations,
    integers such as a row count that is a multiple of 128), so the build vectorizes as the launch does;
    ``options``: other launch options the launcher passes (``enable_fp_fusion``, ...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    source_type = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = source_type(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})
