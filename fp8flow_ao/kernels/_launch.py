"""``launch_kernel(kernel, grid, *args, **constexprs)``: ``kernel[grid](*args, **constexprs)`` with less host work.

Triton's ``JITFunction.run`` does, on every launch, what only changes when the kernel's specialization
does: it reads the current device and stream through the driver proxy, binds the arguments, builds a
string cache key from the specialization and the options, checks the kernel's globals and builds the
launch-metadata dict for the launch hooks. The compiled MoE layer is host-bound at fine-grained shapes
(a step makes ~50 launches), so this module keys its own cache on exactly what Triton specializes a
kernel on -- ``native_specialize_impl`` of every runtime argument (dtype and 16-byte alignment of a
tensor, ``== 1`` / multiple of 16 / 32- or 64-bit of an int, a descriptor's type, block and layout),
plus every constexpr and launch option -- and calls the compiled kernel's launcher directly. The first
launch of each key goes through ``kernel[grid]`` (compiling if needed), so Triton stays the single
source of the compiled kernel; the key is at least as fine as Triton's own (every argument fully
specialized), so one entry never serves two of Triton's specializations.

Where the compiled kernel's launcher has Triton 3.6's form (a C ``launch`` taking the base arguments
``iiiKKppOOOOOO``, behind ``CudaLauncher.__call__`` and, for kernels with TMA descriptors, a Python
wrapper that encodes each descriptor), the cache entry holds that C function and the descriptors'
encoding parameters, and a launch calls it directly, skipping ``CudaLauncher.__call__`` (two closures and
scratch checks per call) and the wrapper's per-argument loop (five dict lookups per descriptor): about 15 us
a launch on an H200 machine's host (``fp8_grouped_mm`` forward + backward, six launches: 1569 -> 1486 us
at E=128; ``benchmarks/results/grouped_gemm_notes.md``, session 34). A descriptor is encoded with the same driver call (``fill_tma_descriptor``)
and parameters Triton's wrapper would use. Other launcher forms (other Triton versions, kernels with
global or profile scratch, FP4-padded descriptors) go through ``CompiledKernel.run`` as before.

Not taken (``kernel[grid]`` is called as is): under ``TRITON_INTERPRET=1``; while a Triton launch hook
is installed (e.g. the proton profiler, which needs the launch metadata); for kernels that are not
plain ``JITFunction`` s (autotuners); on a Triton whose ``CompiledKernel`` lacks the launcher fields
this module calls (checked at each first launch of a key). Changing Triton knobs that enter the compile options
(``TRITON_DEBUG``, instrumentation) after a kernel's first launch is not seen by the cache.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import JITFunction

try:  # Triton's own specializer (C++; triton 3.4+)
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # pragma: no cover - older Triton: every launch takes kernel[grid]
    native_specialize_impl = None

# (id of the kernel, device, specialization of each runtime argument, constexprs and options) -> _Entry.
# Keyed by id: hashing a JITFunction hashes its source key in Python; the entry holds the kernel (and every
# layout keyed by id, see _descriptor_key) so that an id in a key is never another object's.
_ENTRIES: dict[tuple[Any, ...], _Entry] = {}
# torch.cuda.current_device() without its Python lazy-init checks: CUDA is up once a kernel gets tensors
# (a CPU-only torch has neither, and never gets here with a JITFunction to launch).
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The base arguments of Triton 3.6's C launcher: grid x/y/z, stream, function, cooperative, PDL, global and
# profile scratch, kernel metadata, launch metadata, enter and exit hooks; the kernel's arguments follow.
_C_LAUNCH_BASE_FORMAT = "iiiKKppOOOOOO"


class _Entry:
    """How one specialization of a kernel is launched: ``c_launch`` (Triton 3.6's C launcher, called directly;
    ``None``: through ``run``, the ``CompiledKernel``'s Python launcher) and, for its TMA descriptors in
    argument order, ``encodings``: (swizzle, element size, host element type, box) as Triton encodes them."""

    __slots__ = ("run", "c_launch", "fill", "encodings", "function", "metadata", "cooperative", "pdl", "tail", "pins")

    def __init__(self, compiled: Any, args: Sequence[Any], tail: tuple[Any, ...], pins: tuple[Any, ...]):
        self.run = run = compiled.run
        self.function, self.metadata = compiled.function, compiled.packed_metadata
        self.tail, self.pins = tail, pins
        self.cooperative = getattr(run, "launch_cooperative_grid", False)
        self.pdl = getattr(run, "launch_pdl", False)
        self.encodings = _tma_encodings(compiled, args)
        self.fill = _tma_fill() if self.encodings else None
        fast = self.encodings == () or self.fill is not None
        self.c_launch = _c_launcher(run) if fast and not _has_scratch(run) else None


def _c_launcher(run: Any) -> Callable[..., Any] | None:
    """The C ``launch`` behind a Triton 3.6 ``CudaLauncher`` (its ``launch`` itself, or the one its descriptor
    wrapper closes over); ``None`` for any other launcher form."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return None
    if getattr(driver, "_BASE_ARGS_FORMAT", None) != _C_LAUNCH_BASE_FORMAT:
        return None
    launch = getattr(run, "launch", None)
    for candidate in (launch, *(cell.cell_contents for cell in getattr(launch, "__closure__", None) or ())):
        if isinstance(candidate, types.BuiltinFunctionType) and candidate.__name__ == "launch":
            return candidate
    return None


def _tma_fill() -> Callable[..., Any] | None:
    """Triton 3.6's driver call that encodes a TMA descriptor (``None`` where the driver has no such call)."""
    import triton

    return getattr(triton.runtime.driver.active.utils, "fill_tma_descriptor", None)


def _has_scratch(run: Any) -> bool:
    # Scratch is allocated per launch by CudaLauncher.__call__: such kernels keep that path.
    return bool(getattr(run, "global_scratch_size", 1)) or bool(getattr(run, "profile_scratch_size", 1))


def _tma_encodings(compiled: Any, args: Sequence[Any]) -> tuple[tuple[Any, ...], ...] | None:
    """(swizzle, element size, host element type, box) of each TMA descriptor among ``args``, read from the
    compiled kernel's metadata as Triton 3.6's ``make_tensordesc_arg`` reads them; ``()`` without
    descriptors; ``None`` where this module cannot encode them as Triton would (no per-descriptor metadata,
    FP4-padded boxes, a descriptor type it does not know, another Triton's driver)."""
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if signature is None:
        return None
    in_signature = sum(isinstance(t, str) and t.startswith("tensordesc") for t in signature.values())
    ours = sum(isinstance(a, TensorDescriptor) for a in args)
    if in_signature != ours:
        return None
    if ours == 0:
        return ()
    metas = getattr(compiled.metadata, "tensordesc_meta", None)
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:  # pragma: no cover
        return None
    if not metas or len(metas) != ours or any(m is None or m.get("fp4_padded") for m in metas):
        return None
    return tuple(
        (m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]], m["block_size"]) for m in metas
    )


def _with_tma_maps(args: Sequence[Any], encodings: tuple[tuple[Any, ...], ...], fill: Callable[..., Any]) -> list:
    """``args`` as the C launcher takes them: each descriptor replaced by its encoded TMA map, shape and strides
    (what Triton 3.6's ``make_tensordesc_arg`` returns for it)."""
    flat: list[Any] = []
    descriptors = iter(encodings)
    for a in args:
        if isinstance(a, TensorDescriptor):
            swizzle, elem_size, elem_type, box = next(descriptors)
            nan = 1 if a.padding == "nan" else 0
            flat.append(fill(a.base.data_ptr(), swizzle, elem_size, elem_type, box, a.shape, a.strides, nan))
            flat += a.shape
            flat += a.strides
        else:
            flat.append(a)
    return flat


# (device index, raw stream) -> int32 [1] at zero between launches: see stream_tile_counter.
_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
# Made under a lock: two threads on one stream (forward and the autograd engine's) must not both make one, or
# the one dropped could be freed while its zeroing is still queued on that stream.
_TILE_COUNTERS_LOCK = threading.Lock()


def stream_tile_counter(device: torch.device) -> torch.Tensor:
    """An int32 ``[1]`` tile counter at zero for a kernel launched next on ``device``'s current stream, which
    must leave it at zero when it ends (the sm90 wgrad's programs take tiles from it: an atomic add each,
    and the last taker zeroes it). One per stream, kept across launches: no allocation and no zeroing
    launch per call. Launches on one stream run in order, so each sees its predecessor's zero; other
    streams get their own. While a CUDA graph is being captured, a fresh zeroed tensor: the graph's
    replays may run on any stream, next to other users of a shared counter."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else _current_device()
    key = (index, _raw_stream(index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        with _TILE_COUNTERS_LOCK:
            counter = _TILE_COUNTERS.get(key)
            if counter is None:
                counter = _TILE_COUNTERS[key] = _new_counter(torch.device("cuda", index))
    return counter


def _new_counter(device: torch.device) -> torch.Tensor:
    """An int32 ``[1]`` allocated by a thread of its own, zeroed on the current stream. Not by this thread:
    torch.compile's CUDA graph trees send every allocation of the thread that warms a graph up to their
    private pool, and refuse a tensor alive there that no graph output accounts for."""
    allocated = []
    thread = threading.Thread(target=lambda: allocated.append(torch.empty(1, dtype=torch.int32, device=device)))
    thread.start()
    thread.join()
    return allocated[0].zero_()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: ``triton.cdiv`` on the host is a ``ConstexprFunction`` (~3 us a call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0), as ``triton.next_power_of_2`` but a plain function."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _hooks_installed() -> bool:
    hook = knobs.runtime.launch_enter_hook
    # triton 3.6+: a HookChain (installed hooks in ``.calls``); older: None or a callable
    return hook is not None and bool(getattr(hook, "calls", True))


def _descriptor_key(arg: TensorDescriptor) -> tuple[Any, ...]:
    # What Triton's specialization of a descriptor holds (its dtype, block and layout), without the
    # string it formats from them (the layout's repr made a descriptor 5x a tensor's cost) nor the layout's
    # Python __hash__: the layout by id, which the entry pins (see _ENTRIES).
    return (arg.base.dtype, *arg.block_shape, id(arg.layout), arg.padding)


def _constexpr_tail(kernel: JITFunction, n_args: int, constexprs: dict[str, Any]) -> tuple[Any, ...]:
    """The values of the kernel's parameters after its ``n_args`` runtime ones, in declaration order
    (the launcher takes every parameter and ignores the constexpr ones)."""
    name, params = kernel.fn.__name__, kernel.params[n_args:]
    runtime = [p.name for p in params if not p.is_constexpr]
    if runtime:  # as keywords they would key the cache by value: one entry per call
        raise TypeError(f"launch_kernel({name}): pass the runtime parameters {runtime} positionally")
    missing = [p.name for p in params if p.name not in constexprs and not p.has_default]
    if missing:
        raise TypeError(f"launch_kernel({name}): missing constexpr parameters {missing}")
    return tuple(constexprs.get(p.name, p.default) for p in params)


def launch_kernel(kernel: Any, grid: Sequence[int], *args: Any, **constexprs: Any) -> None:
    """Launch ``kernel`` (a ``triton.jit`` or ``gluon.jit`` function) on ``grid``, as ``kernel[grid](*args,
    **constexprs)`` would.

    Args:
        kernel: the jit function.
        grid: one to three ints (no callable grids).
        args: the kernel's runtime parameters, in order, positionally (tensors, ints, floats, TMA
            descriptors).
        constexprs: every parameter after them (its constexprs, by name) and the launch options
            (``num_warps``, ``num_stages``, ``maxnreg``, ...).
    """
    # The interpreter's kernels (TRITON_INTERPRET=1) are not JITFunctions.
    if native_specialize_impl is None or not isinstance(kernel, JITFunction) or _hooks_installed():
        kernel[grid](*args, **constexprs)
        return
    device = _current_device()
    # Inline, not a helper per argument: a launch takes 10-20 arguments and the frames add up.
    specs = [
        _descriptor_key(a)
        if isinstance(a, TensorDescriptor)
        else native_specialize_impl(BaseBackend, a, False, True, True)
        for a in args
    ]
    key = (id(kernel), device, *specs, *constexprs.items())
    entry = _ENTRIES.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **constexprs)
        if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            pins = (kernel, *(a.layout for a in args if isinstance(a, TensorDescriptor)))
            _ENTRIES[key] = _Entry(compiled, args, _constexpr_tail(kernel, len(args), constexprs), pins)
        return
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    stream = _raw_stream(device)
    c_launch = entry.c_launch
    if c_launch is None:
        entry.run(grid[0], grid_y, grid_z, stream, entry.function, entry.metadata, None, None, None, *args, *entry.tail)
        return
    if entry.encodings:
        args = _with_tma_maps(args, entry.encodings, entry.fill)
    c_launch(
        grid[0],
        grid_y,
        grid_z,
        stream,
        entry.function,
        entry.cooperative,
        entry.pdl,
        None,
        None,
        entry.metadata,
        None,
        None,
        None,
        *args,
        *entry.tail,
    )
