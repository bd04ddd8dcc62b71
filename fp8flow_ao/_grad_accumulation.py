"""Gradient accumulation in the wgrad epilogue: when a weight gradient may be added into ``w.grad`` in place.

With gradient accumulation a weight already holds a gradient when the next micro-batch's backward runs, and
autograd adds the fresh gradient to it (``AccumulateGrad``: the wgrad writes ``dW``, then an add kernel reads
``w.grad`` and ``dW`` and writes the sum). The FP8 wgrad kernel can add into ``w.grad`` in its epilogue instead
(``grouped_gemm_fp8_wgrad(..., accumulate_into=w.grad)``): one pass over the gradient fewer and no ``dW``
buffer. :func:`fp8flow_ao.fp8_grouped_mm` and the MoE layer (:func:`fp8flow_ao.fp8flow_routed_experts`) do so
where it is exactly what autograd would do; the backward then returns ``None`` for that weight.
"""

from __future__ import annotations

import torch


def grad_leaf(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` if its gradient could be accumulated in the epilogue: a plain leaf tensor or ``Parameter`` that
    requires grad. ``None`` under ``torch.compile`` (a traced backward must not depend on whether ``.grad``
    existed when it was traced) and for anything else: a subclass such as FSDP2's or expert parallelism's
    DTensor parameters, a view, a non-leaf weight. Metadata only: whether the fusion happens is decided in
    backward (:func:`fused_grad_target`)."""
    if torch.compiler.is_compiling() or type(w) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return w if w.is_leaf and w.requires_grad else None


def fused_grad_target(w: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``w``'s existing gradient (contiguous, ``w``'s layout) to add ``dW`` into in the wgrad epilogue (backward
    then returns ``None`` for ``w``), or ``None`` for the plain path. ``w``: from :func:`grad_leaf`, or
    ``None`` where this backward runs under ``create_graph``; ``dtype``: the gradient's dtype.

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
