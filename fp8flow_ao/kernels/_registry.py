"""Registration of the ``fp8flow::`` ops with the dispatcher, leaner on the host than ``custom_op``.

``torch.library.custom_op`` puts six Python frames between a call and the kernel: its autograd kernel
(``autograd_impl`` -> ``forward_no_grad`` -> ``redispatch``), then ``backend_impl``, a
``torch._disable_dynamo`` wrapper and its eval-frame guard. The compiled MoE layer is host-bound at the
Qwen-like shape (23 op calls per forward + backward), so :func:`define_op` makes the same op -- schema
inferred from the Python signature, default kernel, device kernel, fake, autograd formula -- with plain
:class:`torch.library.Library` calls: the dispatcher calls the kernel directly.

No op gets an autograd kernel: torch's Python one (``custom_op``'s) is over half an op call's dispatch
cost (CPU, torch 2.13, hot loop, a trivial op: 6.8 us a call with it, 3.0 without; the Python of each call is
4-5x slower on the GPU machines' hosts), and it runs on every call, with grad mode off too -- inside the
MoE layer's own autograd Function and its compiled graphs, where nothing is differentiated op by op.
An op with a gradient formula (:meth:`LeanOp.register_autograd`: route_pad, permute_pad_rows,
unpermute_unpad) keeps it in an autograd Function that the op's public function applies, through
:meth:`LeanOp.__call__`, only where grad mode is on and an input requires grad. The others -- quantizers,
GEMMs, transposes: FP8-Flow differentiates through them in its own autograd Functions -- have no formula;
their public functions refuse inputs that would need a gradient (:func:`fp8flow_ao._checks.check_no_grad`)
with a clear error. Calling any op through ``torch.ops.fp8flow`` directly on inputs that require grad,
with grad mode on, gets torch's own autograd fallback: it warns when a backward runs through the op and
gives its inputs no gradient; the public functions are the differentiable entry points.

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
        self._op = getattr(getattr(torch.ops, NAMESPACE), name).default
        self._function: type[torch.autograd.Function] | None = None

    def __call__(self, *args: Any) -> Any:
        """Call the op: through its gradient formula's autograd Function where grad mode is on and a tensor
        argument requires grad, else straight to the dispatcher (no autograd kernel on the way)."""
        function = self._function
        wants_grad = function is not None and torch.is_grad_enabled()
        if wants_grad and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function.apply(*args)
        return self._op(*args)

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
        """The op's gradient formula, with :func:`torch.library.register_autograd`'s arguments (``setup_context(ctx,
        inputs, output)``, ``backward(ctx, *grads)`` returning one gradient or ``None`` per input), applied by
        :meth:`__call__` through an autograd Function, not as an autograd kernel of the op (module docstring)."""
        op = self._op

        def forward(*args: Any) -> Any:
            return op(*args)

        methods = {"forward": forward, "setup_context": setup_context, "backward": backward}
        namespace = {name: staticmethod(fn) for name, fn in methods.items()}
        self._function = type(f"{self._name}_autograd", (torch.autograd.Function,), namespace)


def define_op(name: str) -> Callable[[Callable[..., Any]], LeanOp]:
    """Decorator: define ``fp8flow::<name>`` with the decorated function as its schema (type hints) and
    default kernel; returns a :class:`LeanOp` to register the device kernel, fake and autograd on."""

    def define(default: Callable[..., Any]) -> LeanOp:
        return LeanOp(name, default)

    return define
