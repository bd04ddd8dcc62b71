"""Gradient accumulation in the wgrad epilogue: when a weight gradient may be added into ``w.grad`` in place.

With gradient accumulation a weight already holds a gradient when the next micro-batch's backward runs, and
autograd adds the fresh gradient to it (``AccumulateGrad``: the wgrad writes ``dW``, then an add kernel reads
``w.grad`` and ``dW`` and writes the sum). The FP8 wgrad kernel can add into ``w.grad`` in its epilogue instead
(``grouped_gemm_fp8_wgrad(..., accumulate_into=w.grad)``): one pass over the gradient fewer and no ``dW``
buffer. :func:`fp8flow_ao.fp8_grouped_mm` and the MoE layer (:func:`fp8flow_ao.fp8flow_routed_experts`) do so
where it is exactly what autograd would do; the backward then returns ``None`` for that weight.
"""

from __future__ import annotations

import sys

import torch


def grad_leaf(w: torch.Tensor) -> torch.Tensor | None:
    """The leaf whose gradient ``w``'s could be accumulated into in the epilogue: ``w`` itself where it is a
    plain leaf tensor or ``Parameter`` that requires grad, or the ``DTensor`` parameter whose local shard ``w``
    is (``w = p.to_local()``: expert parallelism's weights, ``shard_experts``). ``None`` under ``torch.compile``
    (a traced backward must not depend on whether ``.grad`` existed when it was traced) and for anything else:
    another subclass, a view, a non-leaf weight. Metadata only: whether the fusion happens is decided in
    backward (:func:`fused_grad_target`)."""
    if torch.compiler.is_compiling() or type(w) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if w.is_leaf:
        return w if w.requires_grad else None
    return dtensor_of_local(w)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor``."""
    # Without importing torch.distributed.tensor (~0.9 s): no tensor is a DTensor before that module is loaded.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def dtensor_of_local(w: torch.Tensor) -> torch.Tensor | None:
    """The leaf ``DTensor`` ``p`` with ``w = p.to_local()`` (its autograd edge: ``to_local``'s backward, whose
    ``None`` gradient it passes on as ``None``, to ``p``'s ``AccumulateGrad``), else ``None``."""
    node = w.grad_fn
    if node is None or type(node).__name__ != "_ToTorchTensorBackward" or not node.next_functions:
        return None
    p = getattr(node.next_functions[0][0], "variable", None)
    if not is_dtensor(p) or not (p.is_leaf and p.requires_grad):
        return None
    return p if p._local_tensor.shape == w.shape else None


def fused_grad_target(w: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``w``'s existing gradient (contiguous, ``w``'s layout; of a ``DTensor`` ``w``, the local shard) to add
    ``dW`` into in the wgrad epilogue (backward then returns ``None`` for ``w``), or ``None`` for the plain
    path. ``w``: from :func:`grad_leaf`, or ``None`` where this backward runs under ``create_graph``;
    ``dtype``: the gradient's dtype.

    Fused only when it is exactly what autograd would do: this backward is a ``.backward()`` that
    will run the weight's ``AccumulateGrad`` (not ``torch.autograd.grad``, which hands the gradient
    to its caller, nor ``.backward(inputs=...)`` without the weight), without ``create_graph``
    (``AccumulateGrad`` adds in place then too), and the weight has a plain contiguous gradient of its
    dtype already and no tensor hooks (a hook would see ``None`` instead of this contribution).
    ``AccumulateGrad`` still runs for the ``None``, so post-accumulate hooks (and DDP's hooks on the
    node) fire after this addition and see the sum, as they would otherwise. Not detectable, hence
    unsupported: pre-hooks registered on the ``AccumulateGrad`` node itself. The cheap tests come
    first: without a gradient to add into (``torch.autograd.grad``, a first micro-batch) nothing else
    is asked.
    """
    if w is None or torch.compiler.is_compiling():  # (a compiled-autograd backward of an eager forward)
        return None
    grad = w.grad
    if is_dtensor(w):  # its gradient's local shard, where laid out as the parameter's
        if not is_dtensor(grad) or grad.placements != w.placements or grad.device_mesh != w.device_mesh:
            return None
        grad = grad._local_tensor
    if grad is None or type(grad) is not torch.Tensor or grad.requires_grad or w._backward_hooks:
        return None
    if grad.dtype != dtype or not grad.is_contiguous():
        return None
    try:
        if not torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(w).node):
            return None
    except RuntimeError:  # raised for leaves under torch.autograd.grad(): the caller takes the gradient
        return None
    return grad
