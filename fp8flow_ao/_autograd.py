"""Backward passes that are not themselves differentiable, and say so when differentiated."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _functions


def first_order_only(what: str) -> Callable[[Callable[..., tuple]], Callable[..., tuple]]:
    """Decorate an ``autograd.Function`` backward (``fn(ctx, *args) -> tuple``) that runs without grad mode.

    Like ``torch.autograd.function.once_differentiable``, but under ``create_graph=True`` every gradient it
    returns gets a node that raises when differentiated, naming ``what``. ``once_differentiable`` adds that
    node only where an argument of the backward requires grad; the incoming gradient of a gradient penalty
    usually does not, while the gradients depend on saved tensors that do (the weights). Without the node
    those gradients came back as constants: a second-order term silently zero.
    """

    def decorate(fn: Callable[..., tuple]) -> Callable[..., tuple]:
        @functools.wraps(fn)
        def wrapper(ctx: Any, *args: Any) -> tuple:
            with torch.no_grad():
                outputs = fn(ctx, *args)
            if not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return outputs
            raise_later = _functions.DelayedError(
                f"{what}: its backward is not differentiable (no double backward, e.g. a gradient penalty "
                "through it with create_graph=True)".encode(),
                len(outputs),
            )
            return raise_later(*[None if g is None else g.detach().requires_grad_() for g in outputs])

        return wrapper

    return decorate
