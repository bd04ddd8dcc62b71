"""Tensor subclasses of the FP8-Flow layer.

* :class:`Float8BlockwiseActivation`: an activation (or output gradient) already in FP8 -- E4M3
  ``data [M, K]`` with its COMPACT 1x128 ``scale_inv [M, ceil(K/128)]`` -- that looks like the
  ``[M, K]`` BF16 tensor it encodes. The operations a token takes on its way to the experts (row
  gather / ``index_select`` / permutation, slicing and splitting along rows, ``cat`` of row chunks,
  ``detach``/``clone``, device moves, the all-to-all payload of expert parallelism) move data and
  scales together, bit for bit, and ``torch._grouped_mm`` runs the FP8 grouped GEMM on it directly.
  Anything else raises ``NotImplementedError`` naming the op: the subclass never dequantizes
  silently (call :meth:`Float8BlockwiseActivation.dequantize` to do it on purpose).
  :func:`to_fp8_blockwise` makes one from a BF16 tensor (differentiable, straight-through).
* :class:`Float8BlockwiseWeight`: an expert weight ``[E, N, K]`` as 128x128 FP8 tiles + scales, what
  FSDP2's FP8 all-gather of the expert weights hands the FP8-Flow layer (:mod:`fp8flow_ao.parallel.fsdp`).
* :class:`FP8FlowExpertWeight`: the expert-weight wrapper. ``torch._grouped_mm(A, w.transpose(-2, -1),
  offs=...)`` on it runs :func:`fp8flow_ao.grouped_mm.fp8_grouped_mm` (like torchao's training
  weight wrapper); for everything else (optimizer updates, ``.to``, ``detach``, FSDP2) it is the
  plain tensor it wraps. :func:`wrap_expert_weights` installs it on a module and makes the module's
  ``state_dict`` hold plain tensors.

Both define ``__tensor_flatten__`` / ``__tensor_unflatten__`` so ``torch.compile`` traces through them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fp8flow_ao._checks import check_bool, check_fp8, check_shape, check_tensor
from fp8flow_ao._format import BLOCK
from fp8flow_ao.kernels.dequantize import dequantize
from fp8flow_ao.kernels.grouped_gemm_fp8_blockwise import OUT_DTYPES
from fp8flow_ao.kernels.permute_pad import permute_pad_rows
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128

aten = torch.ops.aten


def _route_grouped_mm(args: tuple, kwargs: dict) -> torch.Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None)`` with a subclass operand."""
    from fp8flow_ao.grouped_mm import fp8_grouped_mm  # grouped_mm imports this module

    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    call = dict(zip(names, args, strict=False)) | kwargs
    a, b, offs = call["mat_a"], call["mat_b"], call.get("offs")
    if offs is None or a.dim() != 2 or b.dim() != 3 or call.get("bias") is not None:
        raise NotImplementedError(
            "fp8flow_ao routes only torch._grouped_mm(A [M, K], B_t [E, K, N], offs=...) without bias to FP8; "
            f"got A {tuple(a.shape)}, B {tuple(b.shape)}, offs {'given' if offs is not None else 'None'}"
        )
    recipe, aligned = "blockwise", False
    if isinstance(b, FP8FlowExpertWeight):
        recipe, aligned = b.recipe, b.offs_aligned
        b = _UnwrapWeight.apply(b)
    # torch._grouped_mm's default: A's dtype (an FP8 activation reports the dtype it was quantized from)
    out_dtype = call.get("out_dtype") or (a.dtype if a.dtype in OUT_DTYPES else torch.bfloat16)
    return fp8_grouped_mm(a, b, offs, recipe=recipe, out_dtype=out_dtype, offs_aligned=aligned)


def _subclass_torch_function(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """Shared ``__torch_function__``: FP8 ``torch._grouped_mm``, everything else straight to dispatch."""
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():
        if func is torch._grouped_mm:
            return _route_grouped_mm(args, kwargs)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------
# FP8 blockwise activation
# ---------------------------------------------------------------------------------------------------


class Float8BlockwiseActivation(torch.Tensor):
    """FP8 activation: E4M3 ``data [M, K]`` + fp32 COMPACT ``scale_inv [M, ceil(K/128)]`` (1x128 blocks).

    Behaves as an ``[M, K]`` tensor of ``orig_dtype`` (the dtype it was quantized from) for the
    row operations listed in the module docstring; ``x ~= data * scale_inv`` (dequantize multiplier).
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _orig_dtype: torch.dtype

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        orig_dtype: torch.dtype = torch.bfloat16,
        requires_grad: bool = False,
    ):
        check_fp8("data", data, ndim=2)
        check_tensor("scale_inv", scale_inv, dtypes=torch.float32, ndim=2)
        check_shape("scale_inv", scale_inv, (data.shape[0], -(-data.shape[1] // BLOCK)))
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=orig_dtype, device=data.device, requires_grad=requires_grad
        )

    def __init__(
        self,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        orig_dtype: torch.dtype = torch.bfloat16,
        requires_grad: bool = False,
    ):
        self._data = data
        self._scale_inv = scale_inv
        self._orig_dtype = orig_dtype

    def __repr__(self) -> str:
        return (
            f"Float8BlockwiseActivation(shape={tuple(self.shape)}, orig_dtype={self._orig_dtype}, device={self.device})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data", "_scale_inv"], (self._orig_dtype,)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride) -> Float8BlockwiseActivation:
        return Float8BlockwiseActivation(inner["_data"], inner["_scale_inv"], meta[0])

    def data_and_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data [M, K] E4M3, scale_inv [M, ceil(K/128)] fp32)``: the FP8 payload, no copy."""
        return self._data, self._scale_inv

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The explicit (non-differentiable) way back to high precision: ``data * scale_inv`` in ``dtype``."""
        return dequantize(self._data, self._scale_inv, "rowwise", dtype or self._orig_dtype)

    def permute_pad_rows(self, src_rows: torch.Tensor, top_k: int) -> Float8BlockwiseActivation:
        """Padded expert-major rows (``fp8flow::permute_pad_rows``): row ``r`` = token ``src_rows[r] // top_k``."""
        data, scale = permute_pad_rows(self._data, self._scale_inv, src_rows, top_k)
        return Float8BlockwiseActivation(data, scale, self._orig_dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _subclass_torch_function(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _ACTIVATION_OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"Float8BlockwiseActivation does not support {func}: it would have to dequantize the FP8 "
                "activation. Supported: row gather/index_select/slice/split/cat along dim 0, detach, clone, "
                "device moves, all-to-all, torch._grouped_mm. Call .dequantize() to convert explicitly."
            )
        return handler(func, *args, **(kwargs or {}))


def _wrap_like(x: Float8BlockwiseActivation, data: Any, scale: Any) -> Any:
    """Pair results of one op applied to data and scales back into activations (lists stay lists)."""
    if isinstance(data, list | tuple):
        return [Float8BlockwiseActivation(d, s, x._orig_dtype) for d, s in zip(data, scale, strict=True)]
    return Float8BlockwiseActivation(data, scale, x._orig_dtype)


def _check_row_dim(func, dim: int) -> None:
    if dim not in (0, -2):
        raise NotImplementedError(
            f"Float8BlockwiseActivation supports {func} only along rows (dim 0): 1x128 blocks span the columns"
        )


def _same_on_both(func, x, *args, **kwargs):
    """An op that treats rows independently: apply it with the same arguments to data and scales."""
    return _wrap_like(x, func(x._data, *args, **kwargs), func(x._scale_inv, *args, **kwargs))


def _rows_op(func, x, dim=0, *args, **kwargs):
    _check_row_dim(func, dim)
    return _same_on_both(func, x, dim, *args, **kwargs)


def _split_op(func, x, split, dim=0):
    _check_row_dim(func, dim)
    return _same_on_both(func, x, split, dim)


def _index_op(func, x, indices):
    if len(indices) != 1 or indices[0] is None or indices[0].dtype == torch.bool:
        raise NotImplementedError(f"Float8BlockwiseActivation supports {func} only as x[row_index] (one integer index)")
    return _same_on_both(func, x, indices)


def _cat_op(func, tensors, dim=0):
    _check_row_dim(func, dim)
    if not all(isinstance(t, Float8BlockwiseActivation) for t in tensors):
        raise NotImplementedError(f"{func}: every tensor must be a Float8BlockwiseActivation (no implicit quantize)")
    data = func([t._data for t in tensors], dim)
    scale = func([t._scale_inv for t in tensors], dim)
    return _wrap_like(tensors[0], data, scale)


def _to_copy_op(func, x, dtype=None, **kwargs):
    if dtype is not None and dtype != x.dtype:
        raise NotImplementedError(
            f"Float8BlockwiseActivation cannot be cast to {dtype} by {func}; call .dequantize({dtype}) explicitly"
        )
    return _wrap_like(x, func(x._data, **kwargs), func(x._scale_inv, **kwargs))


def _clone_op(func, x, **kwargs):
    return _wrap_like(x, x._data.clone(), x._scale_inv.clone())


def _all_to_all_op(func, x, output_split_sizes, input_split_sizes, group_name):
    # FP8 travels as raw bytes (every backend moves uint8); the scales go with their rows.
    data = func(x._data.view(torch.uint8), output_split_sizes, input_split_sizes, group_name)
    scale = func(x._scale_inv, output_split_sizes, input_split_sizes, group_name)
    return _wrap_like(x, data.view(x._data.dtype), scale)


def _wait_op(func, x):
    # Also serves eager funcol's _wrap_tensor_autograd (which would defer the wait into an
    # AsyncCollectiveTensor): the FP8 payload is waited for right away instead.
    wait = torch.ops._c10d_functional.wait_tensor.default
    return _wrap_like(x, wait(x._data), wait(x._scale_inv))


_ACTIVATION_OPS: dict[Any, Callable] = {
    aten.detach.default: _same_on_both,
    aten.alias.default: _same_on_both,
    aten.clone.default: _clone_op,
    aten._to_copy.default: _to_copy_op,
    aten.index_select.default: _rows_op,
    aten.slice.Tensor: _rows_op,
    aten.index.Tensor: _index_op,
    aten.split.Tensor: _split_op,
    aten.split_with_sizes.default: _split_op,
    aten.cat.default: _cat_op,
}
if torch.distributed.is_available():
    # Importing the functional collectives registers _c10d_functional._wrap_tensor_autograd.
    import torch.distributed._functional_collectives  # noqa: F401

    _ACTIVATION_OPS[torch.ops._c10d_functional.all_to_all_single.default] = _all_to_all_op
    _ACTIVATION_OPS[torch.ops._c10d_functional.wait_tensor.default] = _wait_op
    _ACTIVATION_OPS[torch.ops._c10d_functional._wrap_tensor_autograd.default] = _wait_op


class _QuantizeActivation(torch.autograd.Function):
    """BF16 -> :class:`Float8BlockwiseActivation` (one explicit 1x128 cast); straight-through gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> Float8BlockwiseActivation:
        data, scale = quantize_1x128(x)
        return Float8BlockwiseActivation(data, scale, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def to_fp8_blockwise(x: torch.Tensor) -> Float8BlockwiseActivation:
    """Quantize ``x [M, K]`` (bf16/fp32, row-major) 1x128 into a :class:`Float8BlockwiseActivation`.

    Differentiable: the gradient passes straight through to ``x`` (the usual FP8 training rule), so
    the FP8 tensor can be gathered, split, sent and fed to ``torch._grouped_mm`` inside autograd.
    """
    return _QuantizeActivation.apply(x)


def unsharded_target(out: torch.Tensor, cls: type) -> torch.Tensor:
    """The ``cls`` that FSDP2's unsharded ``out`` (``fsdp_post_all_gather(out=...)``) is or wraps in a DTensor."""
    target = out._local_tensor if hasattr(out, "_local_tensor") else out
    if not isinstance(target, cls):
        raise TypeError(f"fsdp_post_all_gather: out must wrap a {cls.__name__}, got {type(target).__name__}")
    return target


def refresh_unsharded(out: torch.Tensor, cls: type, gathered: tuple, held: Callable) -> None:
    """``fsdp_post_all_gather(out=...)``: FSDP2 refills the all-gather buffers that the unsharded
    ``out`` (a ``cls``, possibly inside a DTensor) already wraps; copy in only a buffer that differs."""
    for new, old in zip(gathered, held(unsharded_target(out, cls)), strict=True):
        if new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr():
            old.copy_(new)


# ---------------------------------------------------------------------------------------------------
# FP8 expert weight (what FSDP2's FP8 all-gather hands the layer)
# ---------------------------------------------------------------------------------------------------


def byte_transpose(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dims swapped, contiguous (FP8 moves as bytes): exact for every value."""
    raw = t.view(torch.uint8) if t.dtype.itemsize == 1 else t
    out = raw.transpose(-1, -2).contiguous()
    return out.view(t.dtype) if t.dtype.itemsize == 1 else out


class Float8BlockwiseWeight(torch.Tensor):
    """An unsharded expert weight as FP8 tiles: E4M3 ``data [E, N, K]`` + fp32 ``scale_inv [E, N/128, K/128]``.

    What FSDP2's FP8 all-gather hands the layer. Looks like an ``[E, N, K]`` tensor of ``orig_dtype``
    (the parameter dtype); ``w ~= data * scale_inv`` broadcast over each 128x128 tile (the dequantize
    multiplier). Only the ops FSDP2 and autograd apply to an unsharded parameter (detach, alias,
    identity views) are supported; anything else raises ``NotImplementedError`` instead of
    dequantizing silently.
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, orig_dtype: torch.dtype, requires_grad: bool = False):
        check_fp8("data", data, ndim=3)
        check_tensor("scale_inv", scale_inv, dtypes=torch.float32, ndim=3)
        e, n, k = data.shape
        check_shape("scale_inv", scale_inv, (e, n // BLOCK, k // BLOCK))
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=orig_dtype, device=data.device, requires_grad=requires_grad
        )

    def __init__(
        self, data: torch.Tensor, scale_inv: torch.Tensor, orig_dtype: torch.dtype, requires_grad: bool = False
    ):
        self._data, self._scale_inv = data, scale_inv

    def __repr__(self) -> str:
        return f"Float8BlockwiseWeight(shape={tuple(self.shape)}, orig_dtype={self.dtype}, device={self.device})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data", "_scale_inv"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride) -> Float8BlockwiseWeight:
        return Float8BlockwiseWeight(inner["_data"], inner["_scale_inv"], meta[0])

    def data_and_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data [E, N, K] E4M3, scale_inv [E, N/128, K/128] fp32)``, the forward GEMM operand; no copy."""
        return self._data, self._scale_inv

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact transpose ``(data_t [E, K, N], scale_inv_t [E, K/128, N/128])``, contiguous (K-major).

        A 128x128 tile transposed is the transposed tile's quantization, so this equals
        ``quantize_128x128``'s ``data_t, scale_inv_t`` of the BF16 weight bit for bit.
        """
        return byte_transpose(self._data), byte_transpose(self._scale_inv)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _FP8_WEIGHT_OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"Float8BlockwiseWeight (an FP8 all-gathered expert weight) does not support {func}; the "
                "FP8-Flow layer reads its tiles directly. Turn off FP8FlowConfig.fsdp_fp8_all_gather to "
                "all-gather the weights in their own dtype."
            )
        return handler(args[0], *args[1:], **(kwargs or {}))


def _same(w: Float8BlockwiseWeight, *args: Any, **kwargs: Any) -> Float8BlockwiseWeight:
    return Float8BlockwiseWeight(w._data, w._scale_inv, w.dtype)


def _identity_view(w: Float8BlockwiseWeight, size, stride=None, storage_offset=0) -> Float8BlockwiseWeight:
    # FSDP2 re-views the unsharded tensor with its own (contiguous) size; anything else would reorder tiles.
    contiguous = tuple(torch._prims_common.make_contiguous_strides_for(w.shape))
    if tuple(size) != tuple(w.shape) or (stride is not None and tuple(stride) != contiguous) or storage_offset:
        raise NotImplementedError(f"Float8BlockwiseWeight supports only identity views, got size {tuple(size)}")
    return _same(w)


_FP8_WEIGHT_OPS: dict[Any, Callable] = {
    aten.detach.default: _same,
    aten.alias.default: _same,
    aten.as_strided.default: _identity_view,
    aten.view.default: _identity_view,
}


# ---------------------------------------------------------------------------------------------------
# Expert-weight wrapper
# ---------------------------------------------------------------------------------------------------

# Ops whose result is still "the weight" (a view, copy or move of it): the result stays wrapped so
# a later torch._grouped_mm on it still takes the FP8 route. Everything else returns plain tensors.
_WEIGHT_PRESERVING_OPS = {
    aten.alias.default,
    aten.as_strided.default,
    aten.clone.default,
    aten.empty_like.default,
    aten.new_zeros.default,  # FSDP2 builds each shard as new_zeros(...).narrow(...).copy_(chunk)
    aten.narrow.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.t.default,
    aten.transpose.int,
    aten.view.default,
    aten._to_copy.default,  # .to(dtype/device), e.g. torchtitan's w.bfloat16()
    aten._pin_memory.default,
}


class _UnwrapWeight(torch.autograd.Function):
    """The wrapped tensor as a plain one, keeping the autograd edge to the parameter."""

    @staticmethod
    def forward(ctx, w: FP8FlowExpertWeight) -> torch.Tensor:
        return w._data.detach()  # a fresh alias: autograd attaches its history to it, not to _data

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class FP8FlowExpertWeight(torch.Tensor):
    """Expert weight ``[E, N, K]`` whose ``torch._grouped_mm`` runs in FP8 (``recipe``); plain otherwise.

    ``offs_aligned``: the model pads every expert's token group to a multiple of 128 rows before
    ``torch._grouped_mm`` (torchtitan with ``set_token_group_alignment_size_m(128)``, which the
    row-wise conversion sets), so the FP8 op skips its own padding (``fp8_grouped_mm(offs_aligned=True)``).
    """

    _data: torch.Tensor
    recipe: str
    offs_aligned: bool

    @staticmethod
    def __new__(cls, data: torch.Tensor, recipe: str = "blockwise", offs_aligned: bool = False):
        # Types only: shapes and dtypes are the GEMM's to check (FSDP2 and views rewrap flat or sliced data).
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"data must be a torch.Tensor, got {type(data).__name__}")
        check_bool("offs_aligned", offs_aligned)
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, recipe: str = "blockwise", offs_aligned: bool = False):
        from fp8flow_ao.grouped_mm import RECIPES

        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        self._data = data
        self.recipe = recipe
        self.offs_aligned = offs_aligned

    def __repr__(self) -> str:
        return f"FP8FlowExpertWeight(recipe={self.recipe!r}, offs_aligned={self.offs_aligned}, data={self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data"], (self.recipe, self.offs_aligned)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride) -> FP8FlowExpertWeight:
        return FP8FlowExpertWeight(inner["_data"], *meta)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _subclass_torch_function(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        routes = {(t.recipe, t.offs_aligned) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)}
        if len(routes) != 1:
            raise ValueError(f"{func}: FP8FlowExpertWeight operands must share recipe and offs_aligned, got {routes}")
        (route,) = routes
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable and isinstance(args[0], cls):
            return args[0]  # in-place (optimizer step, load_state_dict's copy_): the weight itself
        if func is aten.detach.default or func in _WEIGHT_PRESERVING_OPS:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, *route), out)
        return out

    # FSDP2's all-gather extension. "rowwise": the plain data travels and the wrapper is rebuilt around
    # the unsharded tensor. "blockwise": the shard's 128x128 FP8 tiles + scales travel and the layer
    # gets a Float8BlockwiseWeight (fp8flow_ao.parallel.fsdp).
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2 hook: what this shard contributes to the all-gather (see the comment above)."""
        param_dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None else self._data.dtype
        if self.recipe == "blockwise":
            from fp8flow_ao.parallel.fsdp import pre_all_gather

            return pre_all_gather(self._data, tuple(outer_size), param_dtype, mesh.size()), None
        return (self._data.to(param_dtype),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: wrap the unsharded tensor (step 0) or refresh the one FSDP keeps (``out``)."""
        if self.recipe == "blockwise":
            from fp8flow_ao.parallel.fsdp import post_all_gather

            return post_all_gather(tuple(all_gather_outputs), param_dtype, out)
        (data,) = all_gather_outputs
        if out is None:
            return FP8FlowExpertWeight(data, self.recipe, self.offs_aligned), (data,)
        refresh_unsharded(out, FP8FlowExpertWeight, (data,), lambda w: (w._data,))
        return None


def _plain_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """Checkpoints hold plain tensors (under FSDP2 / expert parallelism: DTensors of plain local shards), loadable
    into a model that was never converted; each shares its storage with the weight, so an in-place load (DCP)
    writes the weight."""
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        if isinstance(value, FP8FlowExpertWeight):
            state_dict[key] = value._data
        elif isinstance(getattr(value, "_local_tensor", None), FP8FlowExpertWeight):  # a DTensor
            state_dict[key] = type(value).from_local(
                value._local_tensor._data,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )


def wrap_expert_weights(
    module: nn.Module,
    recipe: str = "blockwise",
    names: tuple[str, ...] = ("w1", "w2", "w3"),
    offs_aligned: bool = False,
) -> nn.Module:
    """Wrap ``module``'s expert weights (``[E, N, K]`` parameters ``names``) in :class:`FP8FlowExpertWeight`.

    Each ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` on them then runs in FP8 (any group
    offsets; ``offs_aligned=True`` when the model already pads every group to 128 rows, see
    :mod:`fp8flow_ao.grouped_mm`). Parameter objects are replaced (build the
    optimizer afterwards); ``module.state_dict()`` keeps its keys and holds plain tensors. Raises
    ``ValueError`` if a weight is already wrapped or is not 3-D.
    """
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of parameter names, got the string {names!r}")
    for name in names:
        param = getattr(module, name)
        if isinstance(param, FP8FlowExpertWeight):
            raise ValueError(f"{type(module).__name__}.{name} is already an FP8FlowExpertWeight (converted twice?)")
        if not isinstance(param, torch.Tensor) or param.dim() != 3:
            raise ValueError(f"{type(module).__name__}.{name} must be a 3-D expert weight [E, N, K], got {param!r:.80}")
        wrapped = FP8FlowExpertWeight(param.data, recipe, offs_aligned)
        setattr(module, name, nn.Parameter(wrapped, requires_grad=param.requires_grad))
    module.register_state_dict_post_hook(_plain_state_dict_hook)
    return module
