"""Registration of the ``fp8flow::`` ops with the dispatcher, leaner on the host than ``custom_op``.

``torch.library.custom_op`` puts six Python frames between a call and the kernel: its autograd kernel
(``autograd_impl`` -> ``forward_no_grad`` -> ``redispatch``), then ``backend_impl``, a
``torch._disable_dynamo`` wrapper and its eval-frame guard. The compiled MoE layer is host-bound at the
Qwen-like shape (23 op calls per forward + backward), so :func:`define_op` makes the same op -- schema
inferred from the Python signature, default kernel, device kernel, fake, autograd formula -- with plain
:class:`torch.library.Library` calls: the dispatcher calls the kernel right after the autograd kernel.
Measured (CPU, torch 2.13, hot loop, a trivial op): 21-28 us per call with ``custom_op``, 18 us here;
7.7 us with no autograd kernel at all, which this module does not use: torch's autograd fallback would
then only warn when a backward runs through an op and could return wrong gradients, where ``custom_op``
raises. So an op with no formula gets one that raises, as ``custom_op``'s does. In the compiled layer
on an H200 the step's host time moved less than its own run-to-run spread (+-20%).

Mutated inputs get no version-counter bump here, so the one op that writes into an argument
(``grouped_gemm_fp8_wgrad_accumulate``) stays a ``custom_op``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "fp8flow"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


class LeanOp:
    """An ``fp8flow::<name>`` op defined by :func:`define_op`; registers kernels like ``CustomOpDef``."""

    def __init__(self, name: str, default: Callable[..., Any]):
        self.qualname = f"{NAMESPACE}::{name}"
        self._name = name
        _LIB.define(name + torch.library.infer_schema(default, mutates_args=()))
        # The default kernel serves every device without its own (the CPU path), as in custom_op.
        _LIB.impl(name, default, "CompositeExplicitAutograd")
        self._backward: Callable[..., Any] | None = None
        self._setup_context: Callable[..., Any] | None = None
        # One autograd kernel per op, registered now and pointing at the formula given later (if any).
        torch.library.register_autograd(
            self.qualname, self._run_backward, setup_context=self._run_setup_context, lib=_LIB
        )

    def register_kernel(self, device_type: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``fn`` is the op's kernel on ``device_type`` (e.g. ``"cuda"``)."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            _LIB.impl(self._name, fn, torch._C._dispatch_key_for_device(device_type))
            return fn

        return register

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``fn`` gives the op's outputs as empty tensors of the right metadata."""
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        """The op's gradient formula, as for :func:`torch.library.register_autograd`."""
        self._backward, self._setup_context = backward, setup_context

    def _run_setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        if self._setup_context is not None:
            self._setup_context(ctx, inputs, output)

    def _run_backward(self, ctx: Any, *grads: Any) -> Any:
        if self._backward is None:
            raise RuntimeError(
                f"{self.qualname} has no gradient formula: FP8-Flow differentiates through it in its own "
                "autograd Functions (fp8flow_ao.moe, fp8flow_ao.grouped_mm); call it on inputs that do not "
                "require grad, or under torch.no_grad()"
            )
        return self._backward(ctx, *grads)


def define_op(name: str) -> Callable[[Callable[..., Any]], LeanOp]:
    """Decorator: define ``fp8flow::<name>`` with the decorated function as its schema (type hints) and
    default kernel; returns a :class:`LeanOp` to register the device kernel, fake and autograd on."""

    def define(default: Callable[..., Any]) -> LeanOp:
        return LeanOp(name, default)

    return define
