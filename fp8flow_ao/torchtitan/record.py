"""Run torchtitan 0.2.2's ``Trainer`` in this process and record what a benchmark needs.

:func:`train_recorded` trains one parsed job config and returns a :class:`RunRecord`: the loss and
gradient norm of every logged step, each step's wall time (synchronized on CUDA, so it is the
step's device time plus the data loading of that step), the held-out losses, the peak memory, and
with ``probe_every`` the series of :mod:`fp8flow_ao.torchtitan.probe` (per-layer SQNR of the FP8-Flow
experts along the run, expert grad norms; measured between the timed steps, except the norms).

Validation: torchtitan's ``Validator`` runs when ``validation.enable`` is set, but 0.2.2's
``deepseek_v3`` train spec has no ``build_validator_fn`` (the Trainer asserts on it), so the model is
built with validation off and torchtitan's own ``build_validator`` is attached afterwards with the
trainer's parts (and the trainer's input processing, see :func:`_attach_validator`). Each validation restarts the held-out stream, so every evaluation scores the same
``validation.steps`` batches (torchtitan's validator otherwise continues where the last one stopped
and compares losses on different text at each step).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8flow_ao._grad_accumulation import is_dtensor
from fp8flow_ao.torchtitan.probe import ExpertProbe

# Wrappers whose names torch.compile, activation checkpointing and FSDP1 put into parameter names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass
class RunRecord:
    """What one training run measured (one entry per logged step unless said otherwise)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """Wall time of every step (all steps, logged or not)."""
    validation: dict[int, float] = field(default_factory=dict)
    """Held-out loss by step."""
    tokens_per_step: int = 0
    peak_mem_gib: float | None = None
    """``torch.cuda.max_memory_allocated`` over the run; None on the CPU."""
    probe_every: int = 0
    """0, or the period of the :class:`~fp8flow_ao.torchtitan.probe.ExpertProbe` that filled the two fields below."""
    probes: list[dict[str, Any]] = field(default_factory=list)
    """Per probe step, per converted MoE layer: SQNR (dB) of the FP8-Flow routed experts vs fp32."""
    expert_grad_norms: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Per MoE layer and expert weight (w1, w2, w3): every step's gradient norm before clipping."""
    max_losses: list[float] = field(default_factory=list)
    """Per logged step: the largest of the ranks' own losses (torchtitan's ``global_max_loss``)."""
    grad_norm_parts: dict[str, list[float]] = field(default_factory=dict)
    """With ``grad_norm_parts``: per part of the model (:func:`parameter_part`), every step's gradient norm
    before clipping, over all ranks; the parts' squares sum to the step's ``grad_norms`` squared."""

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready data (validation keys become strings, as JSON needs)."""
        out = dataclasses.asdict(self)
        out["validation"] = {str(k): v for k, v in self.validation.items()}
        return out


def _attach_validator(trainer: Any, config: Any) -> None:
    """Give ``trainer`` torchtitan's own validator (its train spec has none) that restarts the held-out stream."""
    from torchtitan.components.validate import build_validator

    if trainer.parallel_dims.world_size != 1:
        raise ValueError("validation.enable: the validator is attached for one-process runs only")
    validator = build_validator(
        job_config=config,
        dp_world_size=1,
        dp_rank=0,
        tokenizer=trainer.tokenizer,
        parallel_dims=trainer.parallel_dims,
        loss_fn=trainer.loss_fn,
        validation_context=trainer.train_context,
        maybe_enable_amp=trainer.maybe_enable_amp,
        metrics_processor=trainer.metrics_processor,
    )
    # 0.2.2's Validator always builds flex-attention masks, which sdpa models (deepseek_v3's default)
    # refuse (``assert attention_masks is None``); the trainer's own step asks the model's attn_type.
    validator.post_dataloading_process = lambda input_dict, labels, model_parts: trainer.post_dataloading_process(
        input_dict, labels
    )
    validate, dataset = validator.validate, validator.validation_dataloader.dataset

    def validate_from_start(model_parts: list, step: int) -> None:
        dataset._sample_idx, dataset._token_buffer = 0, []  # the same held-out batches every time
        validate(model_parts, step)

    validator.validate = validate_from_start
    trainer.validator = validator
    config.validation.enable = True


def _build_trainer(config: Any) -> Any:
    """torchtitan's Trainer for ``config``, with a validator attached when ``validation.enable`` asks for one."""
    from torchtitan.train import Trainer

    validate = config.validation.enable
    config.validation.enable = False  # the deepseek_v3 spec has no validator builder; attached below
    trainer = Trainer(config)
    if validate:
        _attach_validator(trainer, config)
    return trainer


def parameter_part(name: str) -> str:
    """The part of a torchtitan model that the parameter ``name`` belongs to, for per-part gradient norms: its
    module path (wrapper prefixes and the parameter's own name dropped) cut to ``layers.<i>.<child>``
    (``layers.3.attention``), to ``layers.<i>.moe.<child>`` inside a MoE layer (``layers.3.moe.experts``,
    ``.router``, ``.shared_experts``), and to its first component outside the layers (``tok_embeddings``,
    ``norm``, ``output``)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    path = name.split(".")[:-1] or [name]
    if path[0] == "layers":
        return ".".join(path[: 4 if path[2:3] == ["moe"] else 3])
    return path[0]


class _PartNorms:
    """Every step's gradient norm of each :func:`parameter_part`, over all ranks, before clipping.

    Each rank sums its local shards' squares, divided by how many ranks hold the same elements (a DTensor's
    replicated mesh dims, and the copies of its mesh when it spans fewer ranks than the world; a plain tensor:
    every rank), and one all-reduce adds the ranks' sums. Pipeline parallelism (stages hold different
    parameters) is refused. The sums stay on the device (no host read a step) until :meth:`finish` writes the
    norms into ``series``."""

    def __init__(self, model_parts: list[torch.nn.Module], world: int, series: dict[str, list[float]]) -> None:
        named = [(n, p) for m in model_parts for n, p in m.named_parameters()]
        part = {id(p): parameter_part(n) for n, p in named}
        self.parts = list(dict.fromkeys(part.values()))  # in the model's order
        self.index = {pid: self.parts.index(name) for pid, name in part.items()}
        first = named[0][1] if named else torch.empty(0)
        self.device = (first._local_tensor if is_dtensor(first) else first).device
        self.world, self.series, self.steps = world, series, []

    def __call__(self, parameters: list[torch.Tensor]) -> None:
        grads = [(self.index[id(p)], p.grad) for p in parameters if p.grad is not None and id(p) in self.index]
        # Every rank all-reduces every step, with or without gradients of its own (no rank may skip a collective).
        squares = torch.zeros(len(self.parts), dtype=torch.float64, device=self.device)
        if grads:
            local = [g._local_tensor if is_dtensor(g) else g for _, g in grads]
            norms = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32)).double()
            share = torch.tensor([1.0 / self._copies(g) for _, g in grads], dtype=torch.float64, device=self.device)
            squares.index_add_(0, torch.tensor([i for i, _ in grads], device=self.device), norms.square() * share)
        if self.world > 1:
            torch.distributed.all_reduce(squares)
        self.steps.append(squares)

    def finish(self) -> None:
        """Write the recorded steps' norms into ``series`` (one host read for the run)."""
        norms = torch.stack(self.steps).sqrt().T.tolist() if self.steps else [[] for _ in self.parts]
        self.series.update(zip(self.parts, norms, strict=True))

    def _copies(self, grad: torch.Tensor) -> int:
        """How many ranks hold each element of ``grad``'s local tensor."""
        if not is_dtensor(grad):
            return self.world
        mesh = grad.device_mesh
        replicated = math.prod(mesh.size(d) for d, p in enumerate(grad.placements) if p.is_replicate())
        return replicated * self.world // mesh.size()


def _hook(trainer: Any, record: RunRecord, sync: Callable[[], None], probe: ExpertProbe | None) -> None:
    """Wrap the trainer's step (timed; the probe, if any, around it, untimed) and metric logging (recorded) in place."""
    train_step, log, log_validation = (
        trainer.train_step,
        trainer.metrics_processor.log,
        trainer.metrics_processor.log_validation,
    )

    def timed_step(data_iterator) -> None:
        if probe is not None:
            probe.before_step(trainer.step)  # the trainer counts the step before running it
        sync()
        start = time.perf_counter()
        train_step(data_iterator)
        sync()
        record.step_seconds.append(time.perf_counter() - start)
        if probe is not None:
            probe.after_step(trainer.step)

    def log_step(step: int, loss: float, max_loss: float, grad_norm: float, *rest, **kwargs) -> None:
        record.losses.append(float(loss))
        record.max_losses.append(float(max_loss))
        record.grad_norms.append(float(grad_norm))
        log(step, loss, max_loss, grad_norm, *rest, **kwargs)

    def log_held_out(loss: float, step: int, *rest, **kwargs) -> None:
        record.validation[int(step)] = float(loss)
        log_validation(loss, step, *rest, **kwargs)

    trainer.train_step = timed_step
    trainer.metrics_processor.log = log_step
    trainer.metrics_processor.log_validation = log_held_out


def _record_part_norms(trainer: Any, record: RunRecord) -> Callable[[], None]:
    """Record the parts' norms where the trainer clips (torchtitan's ``dist_utils.clip_grad_norm_``, which its
    ``train_step`` looks up on the module each step); returns what puts the original back."""
    from torchtitan.distributed import utils as dist_utils

    if trainer.parallel_dims.pp_enabled:
        raise ValueError("grad_norm_parts: pipeline stages hold different parameters; not supported")
    part_norms = _PartNorms(trainer.model_parts, trainer.parallel_dims.world_size, record.grad_norm_parts)
    clip = dist_utils.clip_grad_norm_

    def clip_recorded(parameters, *args, **kwargs):
        parameters = list(parameters)
        part_norms(parameters)
        return clip(parameters, *args, **kwargs)

    dist_utils.clip_grad_norm_ = clip_recorded

    def restore() -> None:
        dist_utils.clip_grad_norm_ = clip
        part_norms.finish()

    return restore


def train_recorded(config: Any, probe_every: int = 0, grad_norm_parts: bool = False) -> RunRecord:
    """Train the parsed torchtitan ``JobConfig`` ``config`` in this process; return what it measured.

    ``probe_every > 0`` also watches the MoE layers with an :class:`~fp8flow_ao.torchtitan.probe.ExpertProbe`
    (per-layer SQNR of the FP8-Flow experts at step 1 and every ``probe_every`` steps, expert grad
    norms every step; the losses are unchanged). ``grad_norm_parts`` records every step's gradient norm of
    each part of the model (:attr:`RunRecord.grad_norm_parts`), on any number of ranks but pipeline
    parallelism: where a step's total norm jumps, the parts say where. On the CPU call it inside
    :func:`fp8flow_ao.torchtitan.cpu.torchtitan_on_cpu`.
    """
    trainer = _build_trainer(config)
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    record = RunRecord(tokens_per_step=config.training.local_batch_size * config.training.seq_len)
    probe = None
    if probe_every:
        if trainer.parallel_dims.world_size != 1 or len(trainer.model_parts) != 1:
            raise ValueError("probe_every: the expert probe runs on one-process runs only (whole weights)")
        probe = ExpertProbe(trainer.model_parts[0], probe_every)
        record.probe_every = probe_every
    _hook(trainer, record, sync, probe)
    restore = _record_part_norms(trainer, record) if grad_norm_parts else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    finally:
        restore()
        trainer.close()
        if probe is not None:
            probe.remove()
            record.probes, record.expert_grad_norms = probe.probes, probe.grad_norms()
    if cuda:
        record.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
    return record
