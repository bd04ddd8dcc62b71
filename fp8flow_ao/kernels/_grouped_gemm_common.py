"""Pieces shared by the two blockwise FP8 grouped GEMMs (forward/dgrad and wgrad).

* The tile -> expert map is computed on the device by the kernels themselves from the int32 group
  END offsets (no host sync, no prep launch): a 128-row tile that starts at row ``r`` belongs to
  the expert whose group holds ``r``, i.e. the number of groups that end at or before ``r``.
* Launch settings: one config list per kernel, autotuned on ``(N, K, E)`` -- never on the token
  count ``M``, which routing changes every step -- and one fixed config under the CPU interpreter,
  where nothing can be timed.
* Persistent grids: one program per SM, each walking tiles with a stride of the grid size.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from fp8flow_ao._checks import check_multiple
from fp8flow_ao._format import BLOCK

# Every tile runs its reduction in 128-wide blocks: one promotion (partial * scale_a * scale_b into
# the fp32 accumulator) per block, the granularity of the 1x128 / 128x128 scales.
BLOCK_K = tl.constexpr(BLOCK)
# Autotune key of both kernels: the static problem dims. M (routed rows) is deliberately absent:
# it changes every step, and re-tuning on it would re-time the kernel every step.
AUTOTUNE_KEY = ["N", "K", "E"]
# Programs per SM of a persistent grid: one 128x128 tile (fp32 accumulator + the fp32 partial of
# one 128-K block) fills most of the register file, so a second resident program cannot fit.
PROGRAMS_PER_SM = 1
# TMA needs 16-byte aligned base addresses and row strides.
_TMA_ALIGN_BYTES = 16
# Under the interpreter: a few programs, so the persistent tile loop still runs several tiles each.
_INTERPRET_PROGRAMS = 3


def gemm_config(
    block_m: int,
    block_n: int,
    *,
    num_warps: int,
    num_stages: int,
    group_m: int = 8,
    programs_per_sm: int = PROGRAMS_PER_SM,
    **constexprs: Any,
) -> triton.Config:
    """One launch configuration of a grouped GEMM kernel (tile shape, warps, pipeline depth).

    ``group_m`` is the number of tile rows walked together for L2 reuse of the other operand;
    ``programs_per_sm`` sizes the persistent grid (more than one only for tiles small enough to
    leave room for a second resident program, whose MMA then overlaps this one's promotion);
    ``constexprs`` are further kernel-specific compile-time switches.
    """
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP_M": group_m, "PROGRAMS_PER_SM": programs_per_sm, **constexprs},
        num_warps=num_warps,
        num_stages=num_stages,
    )


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, the current one for a bare ``cuda``."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    return _sm_count(cuda_index(device))


def persistent_grid(device: torch.device, tiles_of: Callable[[dict[str, Any]], int]) -> Callable:
    """Grid function: ``min(tiles, programs)`` programs, ``programs = SMs * PROGRAMS_PER_SM``."""
    sms = sm_count(device) if device.type == "cuda" else _INTERPRET_PROGRAMS

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (max(1, min(tiles_of(meta), sms * meta["PROGRAMS_PER_SM"])),)

    return grid


def set_tma_workspace_allocator(device: torch.device) -> None:
    """Give ``tl.make_tensor_descriptor`` its global workspace (128 B per descriptor per program).

    Set at launch, not at import: it is Triton-global state and must allocate on the launch's device.
    """

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)


def check_tma_operand(name: str, t: torch.Tensor) -> None:
    """Launch-time check on a real tensor (a FakeTensor has no address): TMA alignment of base and rows."""
    if t.data_ptr() % _TMA_ALIGN_BYTES:
        raise ValueError(
            f"{name} must start on a {_TMA_ALIGN_BYTES}-byte boundary for TMA loads, got {t.data_ptr():#x}"
        )
    check_multiple(f"{name} row stride", t.stride(0) * t.element_size(), _TMA_ALIGN_BYTES, "in bytes")


def launch(
    tuned: triton.runtime.Autotuner,
    grid_of: Callable[[dict[str, Any]], tuple[int]],
    *args: Any,
    config: triton.Config | None = None,
    **kwargs: Any,
) -> None:
    """Launch ``tuned`` with its autotuned config, or the kernel it wraps with ``config`` when given.

    Both paths run the same ``@triton.jit`` function. A fixed ``config`` serves the interpreter
    (which cannot time configs), tests of every config and the benchmark's config sweep.
    """
    if config is None:
        tuned[grid_of](*args, **kwargs)
        return
    meta = {**kwargs, **config.kwargs}
    tuned.fn[grid_of(meta)](*args, **kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def autotuned(
    configs: Sequence[triton.Config], restore_value: Sequence[str] = ()
) -> Callable[[triton.JITFunction], triton.runtime.Autotuner]:
    """``triton.autotune`` keyed on :data:`AUTOTUNE_KEY` (never on ``M``); ``restore_value`` names
    the pointer arguments a kernel may read and write, saved and restored around the trial runs."""
    return triton.autotune(configs=list(configs), key=AUTOTUNE_KEY, restore_value=list(restore_value))


def group_bounds(group_end_offsets: torch.Tensor, m: int) -> list[tuple[int, int]]:
    """The torch references' split of ``m`` rows into the ``E`` groups: each group's ``(start, end)`` rows, a
    group starting where the previous one ends (ends clamped to ``[0, m]`` and made non-decreasing; rows at or
    past the last end belong to none).

    Each reference multiplies a group's rows alone, so it costs its groups' FLOPs rather than ``E`` times the
    whole ``m`` (the CPU path's training step), and slices rather than gathers (a gather's scatter back is slow
    under ``torch.use_deterministic_algorithms``). The ends are read on the host: a sync for a CUDA tensor, where
    only the tests call a reference (the ops' CUDA kernels are the launchers).
    """
    ends = group_end_offsets.long().clamp(0, m).cummax(0).values.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


@triton.jit
def expert_of_row(ends_ptr, row, E, E_POW2: tl.constexpr):
    """Expert owning ``row``: the number of groups that end at or before it (``E`` if past the last)."""
    offs = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + offs, mask=offs < E, other=2147483647)
    return tl.sum((ends <= row).to(tl.int32), axis=0)


@triton.jit
def group_rows(ends_ptr, e):
    """``(start, end)`` rows of expert ``e``'s group (start = the previous group's end, 0 for the first)."""
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    return start, end


@triton.jit
def grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile index -> ``(pid_m, pid_n)``, walking ``GROUP_M`` rows of tiles together (L2 reuse of B)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows_in_group
    pid_n = (tile % per_group) // rows_in_group
    return pid_m, pid_n
