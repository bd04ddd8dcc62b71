"""Input checks shared by every public op: one place, clear messages, never ``assert``.

Each check raises ``TypeError`` (wrong dtype) or ``ValueError`` (wrong rank, shape, stride or
value) naming the argument, what was given and the rule it breaks. Checks here only read shapes,
strides and dtypes, so they cost nothing under ``torch.compile`` and never sync the device. Checks
that must read data (offsets monotone, indices in range) live in :func:`validate_group_end_offsets`
and run on CPU tensors (free) or, on a GPU, only when asked for (``FP8FLOW_VALIDATE=1``), since they sync
(:func:`validation_enabled`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from fp8flow_ao._format import BLOCK, FP8_DTYPE


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | torch.dtype,
    ndim: int | Iterable[int] | None = None,
) -> None:
    """Raise unless ``t`` is a tensor of one of ``dtypes`` with ``ndim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if t.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in {allowed}, got {t.dtype}")
    if ndim is not None:
        ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in ndims:
            raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dims, got shape {tuple(t.shape)}")


def check_fp8(name: str, t: object, ndim: int | Iterable[int] | None = None) -> None:
    """Raise unless ``t`` is an E4M3 (``torch.float8_e4m3fn``) tensor."""
    check_tensor(name, t, dtypes=FP8_DTYPE, ndim=ndim)


def check_row_major(name: str, t: torch.Tensor) -> None:
    """Raise unless the last dim of ``t`` is contiguous (stride 1); other strides are free. An empty ``t``
    has no element out of place: e.g. the expanded (stride 0) gradient of ``out.sum()`` for zero tokens."""
    if t.dim() and t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be row-major (last dim contiguous), got shape {tuple(t.shape)} stride {t.stride()}"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` is contiguous (row-major, no gaps)."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} stride {t.stride()}")


def check_multiple(name: str, value: int, multiple: int = BLOCK, what: str = "size") -> None:
    """Raise unless ``value`` is a multiple of ``multiple``."""
    if value % multiple:
        raise ValueError(f"{name} {what} must be a multiple of {multiple}, got {value}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless ``t.shape == shape``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise unless every given tensor lives on one device."""
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_group_end_offsets(name: str, offsets: object, rows: int | None = None) -> None:
    """Raise unless ``offsets`` is a 1-D int32 tensor of group *end* offsets.

    Only metadata is checked here (dtype, rank, contiguity). Values (monotone, multiples of 128,
    last <= rows) are checked by :func:`validate_group_end_offsets` when validation is enabled.
    """
    check_tensor(name, offsets, dtypes=torch.int32, ndim=1)
    check_contiguous(name, offsets)
    if rows is not None and validation_enabled(offsets):
        validate_group_end_offsets(name, offsets, rows)


def check_row_map(name: str, rows: object, low: int | None = None, high: int | None = None) -> None:
    """Raise unless ``rows`` is a contiguous 1-D int32 row map; with bounds given and
    :func:`validation_enabled`, also unless its values lie in ``[low, high)`` (``-1`` marks a pad row where ``low`` is -1)."""
    check_tensor(name, rows, dtypes=torch.int32, ndim=1)
    check_contiguous(name, rows)
    if high is not None and validation_enabled(rows):
        validate_index_range(name, rows, low, high)


def validation_enabled(t: torch.Tensor | None = None) -> bool:
    """Whether to run the checks that read a tensor's values: always for a CPU tensor ``t`` (reading it costs
    no device sync), on a GPU only with ``FP8FLOW_VALIDATE=1`` (they sync the device: opt-in); never while
    dynamo traces."""
    if torch.compiler.is_compiling():
        return False
    return (t is not None and t.device.type == "cpu") or os.environ.get("FP8FLOW_VALIDATE", "0") == "1"


def validate_group_end_offsets(name: str, offsets: torch.Tensor, rows: int, align: int = BLOCK) -> None:
    """Check the values of group end offsets (reads the device: opt-in, never on the hot path).

    Rules: non-decreasing, each a multiple of ``align`` (so every group starts on a 128-row
    boundary), first >= 0 and last <= ``rows``.
    """
    o = offsets.detach().to("cpu", torch.int64)
    if o.numel() == 0:
        raise ValueError(f"{name} must hold at least one group, got an empty tensor")
    if bool((o < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {o.tolist()}")
    if bool((o[1:] < o[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (group end offsets), got {o.tolist()}")
    if bool((o % align != 0).any()):
        raise ValueError(f"{name} must be multiples of {align} (128-aligned expert groups), got {o.tolist()}")
    if int(o[-1]) > rows:
        raise ValueError(f"{name} last offset {int(o[-1])} is past the end of the {rows} rows")


def validate_index_range(name: str, indices: torch.Tensor, low: int, high: int) -> None:
    """Check that every value of ``indices`` lies in ``[low, high)`` (reads the device: opt-in).

    Used for router expert indices (``[0, num_experts)``) and the row maps of permute/unpermute, whose
    out-of-range values would otherwise trip a device-side assert or read out of bounds.
    """
    if indices.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(indices.detach()))
    if lo < low or hi >= high:
        raise ValueError(f"{name} values must lie in [{low}, {high}), got min {lo} and max {hi}")


def check_bool(name: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is a Python ``bool`` (a truthy string or int is a mistake here)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_positive_int(name: str, value: object) -> None:
    """Raise unless ``value`` is a positive Python ``int`` (``bool`` excluded)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_no_grad(op: str, *tensors: torch.Tensor | None) -> None:
    """Raise where autograd would have to differentiate through ``fp8flow::<op>``, an op without a
    gradient formula (see :mod:`fp8flow_ao.kernels._registry`): grad mode on and an input requiring grad.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"fp8flow::{op} has no gradient formula: FP8-Flow differentiates through it in its own autograd "
            "Functions (fp8flow_ao.moe, fp8flow_ao.grouped_mm); call it on inputs that do not require grad, "
            "or under torch.no_grad()"
        )
