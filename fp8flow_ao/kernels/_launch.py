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

Not taken (``kernel[grid]`` is called as is): under ``TRITON_INTERPRET=1``; while a Triton launch hook
is installed (e.g. the proton profiler, which needs the launch metadata); for kernels that are not
plain ``JITFunction`` s (autotuners); on a Triton whose ``CompiledKernel`` lacks the launcher fields
this module calls (checked at each first launch of a key). Changing Triton knobs that enter the compile options
(``TRITON_DEBUG``, instrumentation) after a kernel's first launch is not seen by the cache.
"""

from __future__ import annotations

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

# (id of the kernel, device, specialization of each runtime argument, constexprs and options) -> launch
# entry, which holds the kernel itself so that its id stays its own. Keyed by id: hashing a JITFunction
# hashes its source key in Python.
_ENTRIES: dict[tuple[Any, ...], tuple[Callable[..., Any], Any, Any, tuple[Any, ...], JITFunction]] = {}
# torch.cuda.current_device() without its Python lazy-init checks: CUDA is up once a kernel gets tensors
# (a CPU-only torch has neither, and never gets here with a JITFunction to launch).
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


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
    # string it formats from them: the layout's repr made a descriptor 5x a tensor's cost.
    return (arg.base.dtype, *arg.block_shape, arg.layout, arg.padding)


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
            _ENTRIES[key] = (
                compiled.run,
                compiled.function,
                compiled.packed_metadata,
                _constexpr_tail(kernel, len(args), constexprs),
                kernel,
            )
        return
    run, function, metadata, tail, _ = entry
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    run(grid[0], grid_y, grid_z, _raw_stream(device), function, metadata, None, None, None, *args, *tail)
