"""Where an FP8-Flow run's loss gap comes from: per-layer SQNR of the routed experts and expert grad norms.

:class:`ExpertProbe` watches a torchtitan model's MoE layers while the ``Trainer`` trains it
(:func:`fp8flow_ao.torchtitan.record.train_recorded` with ``probe_every``), and records two series:

* **SQNR along the run.** On probe steps (step 1 and every ``every``-th step) a forward hook on the
  ``experts`` module of each converted FP8-Flow layer keeps a detached copy of the step's last
  training input of the routed experts: tokens ``x [T, D]``, router scores ``[T, k]``, top-k expert
  ids ``[T, k]`` (one per layer, held only from the probe step's forward until the step ends).
  After the step (optimizer update included) :func:`measure_routed_experts` runs that input,
  with the layer's current weights, through :func:`~fp8flow_ao.moe.fp8flow_routed_experts` and
  through :func:`routed_experts_reference` (torchtitan's experts in fp32 on the same routing),
  forward and backward against one fixed random output gradient, and records the SQNR of the
  output, dx, d(scores), dw1, dw2 and dw3.
* **Expert gradient norms, every step.** A post-accumulate-grad hook on ``w1``, ``w2``, ``w3`` of
  every MoE layer (converted or not, so a BF16 run gives the trace to compare with) takes the
  gradient's L2 norm before torchtitan clips it; the norms stay on the device (no host sync) and
  are read once, by :meth:`ExpertProbe.grad_norms`.

The probe leaves training unchanged, bit for bit: it draws nothing from the global RNG (the output
gradient comes from a private ``torch.Generator``), differentiates detached copies with
``torch.autograd.grad`` (no parameter's ``.grad`` is touched), never reads the data iterator, runs
the FP8 path with ``weight_cache="off"`` (bit-identical to every mode, and it leaves the step cache
alone), and runs between steps.

Cost per probe and layer: one FP8-Flow forward + backward and one fp32 forward + backward of the
routed experts on ``T * k`` rows (fp32 matmuls: ~6 * 3 * T * k * D * H flops); per step: one norm
read of the expert gradients (4 bytes per fp32 expert weight).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from fp8flow_ao.debug import sqnr_db
from fp8flow_ao.moe import FP8FlowMoE, _local, fp8flow_routed_experts, is_moe_layer

EXPERT_WEIGHTS = ("w1", "w2", "w3")
# What measure_routed_experts compares: the output, then the gradient of each differentiable input.
QUANTITIES = ("out", "dx", "dscores", "dw1", "dw2", "dw3")
GRAD_SEED = 0
"""Seed of the probe's private generator for the random output gradient (the same at every probe)."""


def routed_experts_reference(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    score_before_experts: bool = False,
) -> torch.Tensor:
    """torchtitan 0.2.2's routed experts with the top-k combine, in fp32, on a given routing.

    The same function as :func:`~fp8flow_ao.moe.fp8flow_routed_experts` (same arguments and shapes:
    ``x [T, D]``, ``top_scores`` and ``selected_experts_indices [T, k]``, ``w1, w3 [E, H, D]``,
    ``w2 [E, D, H]``): the rows are sorted by expert as torchtitan's ``TokenReorderer`` does, run
    through its ``_run_experts_for_loop`` (one fp32 matmul per expert; one host sync), and combined as
    its ``MoE.forward`` does. Every input is cast to fp32 first; the result is fp32 ``[T, D]``,
    differentiable in ``x``, ``top_scores``, ``w1``, ``w2``, ``w3``.
    """
    from torchtitan.models.moe.moe import _run_experts_for_loop

    x, scores, w1, w2, w3 = (t.float() for t in (x, top_scores, w1, w2, w3))
    tokens, top_k = selected_experts_indices.shape
    flat = selected_experts_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routed row i is token order[i] // k's slot order[i] % k
    rows = x[order // top_k]
    if score_before_experts:
        rows = rows * scores.reshape(-1)[order].unsqueeze(-1)
    routed = _run_experts_for_loop(w1, w2, w3, rows, torch.bincount(flat, minlength=w1.shape[0]))
    per_slot = routed[torch.argsort(order)].view(tokens, top_k, -1)  # back to [T, k, D]
    if score_before_experts:
        return per_slot.sum(dim=1)
    return torch.bmm(scores.unsqueeze(1), per_slot).squeeze(1)


def measure_routed_experts(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    score_before_experts: bool = False,
    seed: int = GRAD_SEED,
) -> dict[str, float]:
    """SQNR in dB of FP8-Flow's routed experts against :func:`routed_experts_reference`, by :data:`QUANTITIES`.

    Arguments as :func:`~fp8flow_ao.moe.fp8flow_routed_experts` (which gets them in their own dtypes;
    the reference gets them in fp32). The output gradient is ``randn`` from a private generator
    seeded with ``seed``, in ``x``'s dtype; the inputs are differentiated as detached copies, so
    nothing reaches a parameter's ``.grad`` and the global RNG is not drawn from.
    """
    generator = torch.Generator(device=x.device).manual_seed(seed)
    grad_out = torch.randn(x.shape, generator=generator, device=x.device).to(x.dtype)

    def forward_backward(fn, dtype: torch.dtype | None) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, top_scores, w1, w2, w3)]
        out = fn(leaves[0], leaves[1], selected_experts_indices, *leaves[2:], score_before_experts=score_before_experts)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]

    with torch.enable_grad():
        ours = forward_backward(fp8flow_routed_experts, None)  # weight_cache "off": the step cache is left alone
        ref = forward_backward(routed_experts_reference, torch.float32)
    return {name: sqnr_db(r, o) for name, r, o in zip(QUANTITIES, ref, ours, strict=True)}


class ExpertProbe:
    """Per-layer SQNR of the FP8-Flow routed experts every ``every`` steps, expert grad norms every step.

    Hooks ``model``'s MoE layers on construction (:meth:`remove` takes the hooks off). The training
    loop calls :meth:`before_step` and :meth:`after_step` around each optimizer step (the trainer's
    step number: 1, 2, ...). Results: :attr:`probes` (``[{"step": s, "layers": {fqn: {quantity:
    dB}}}]``) and :meth:`grad_norms`. One process only (the weights must be whole, not sharded).
    """

    def __init__(self, model: nn.Module, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every}")
        self.every = every
        self.layers = {fqn: m for fqn, m in model.named_modules() if is_moe_layer(m)}
        if not self.layers:
            raise ValueError(f"the model ({type(model).__name__}) has no MoE layer to probe")
        self.converted = [fqn for fqn, m in self.layers.items() if isinstance(m, FP8FlowMoE)]
        self.probes: list[dict[str, Any]] = []
        self._capturing = False
        self._samples: dict[str, tuple[torch.Tensor, ...]] = {}
        self._norms_now: dict[tuple[str, str], torch.Tensor] = {}
        self._norms: list[torch.Tensor] = []  # one [layers * 3] device tensor per step
        # A weight that got no gradient this step (an unused layer) reads NaN in the trace.
        self._missing_norm = torch.full((), math.nan, device=next(iter(self.layers.values())).experts.w1.device)
        self._handles = [
            self.layers[fqn].experts.register_forward_hook(functools.partial(self._capture, fqn))
            for fqn in self.converted
        ]
        for fqn, layer in self.layers.items():
            for name in EXPERT_WEIGHTS:
                hook = functools.partial(self._grad_norm, (fqn, name))
                self._handles.append(getattr(layer.experts, name).register_post_accumulate_grad_hook(hook))

    def is_probe_step(self, step: int) -> bool:
        """Step 1 and every ``every``-th step."""
        return step == 1 or step % self.every == 0

    def before_step(self, step: int) -> None:
        """Arm the input capture when ``step`` is a probe step."""
        self._capturing = self.is_probe_step(step)
        self._norms_now.clear()

    def after_step(self, step: int) -> None:
        """Keep this step's grad norms; on a probe step measure every captured layer and drop its input."""
        norms = [self._norms_now.get((fqn, n), self._missing_norm) for fqn in self.layers for n in EXPERT_WEIGHTS]
        self._norms.append(torch.stack(norms))
        if not self._capturing:
            return
        self._capturing = False
        layers = {}
        for fqn in self.converted:
            if fqn in self._samples:
                experts = self.layers[fqn].experts
                weights = (_local(getattr(experts, n)) for n in EXPERT_WEIGHTS)
                sample = self._samples.pop(fqn)
                layers[fqn] = measure_routed_experts(
                    *sample, *weights, score_before_experts=experts.fp8flow_score_before_experts
                )
        if layers:  # a model with no converted layer (BF16) records grad norms only
            self.probes.append({"step": step, "layers": layers})

    def grad_norms(self) -> dict[str, dict[str, list[float]]]:
        """Per MoE layer and expert weight, the gradient's L2 norm before clipping at every step so far."""
        steps = torch.stack(self._norms).cpu().tolist() if self._norms else []
        columns = [(fqn, n) for fqn in self.layers for n in EXPERT_WEIGHTS]
        out: dict[str, dict[str, list[float]]] = {fqn: {} for fqn in self.layers}
        for i, (fqn, name) in enumerate(columns):
            out[fqn][name] = [row[i] for row in steps]
        return out

    def remove(self) -> None:
        """Take every hook off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _capture(self, fqn: str, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        # Training forwards only (validation runs under no_grad): the step's last micro-batch wins.
        if self._capturing and torch.is_grad_enabled():
            self._samples[fqn] = tuple(a.detach().clone() for a in args)

    def _grad_norm(self, key: tuple[str, str], param: torch.Tensor) -> None:
        # Fires once per micro-batch after the gradient is accumulated: the last one is the step's.
        self._norms_now[key] = torch.linalg.vector_norm(param.grad.detach(), dtype=torch.float32)
