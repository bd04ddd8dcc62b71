"""Run torchtitan 0.2.2 models and its trainer on a machine with no GPU (smoke tests, CI, the CPU demo).

Two things stop torchtitan on the CPU, and both are patched here for the duration of a ``with`` block:

1. Its MoE router and reorderer count tokens per expert with ``torch.histc`` on int64 expert ids,
   which CUDA implements and the CPU does not ("histogram_cpu" not implemented for 'Long').
   :func:`integer_histc` counts them in fp32 and returns the input's dtype, as CUDA does.
2. The trainer takes its device from ``torchtitan.tools.utils.device_type``, which is ``"cuda"``
   when no accelerator is found, and calls ``torch.cuda``-style functions (set_device, memory_stats,
   get_device_properties) through ``device_module``; model args ask ``has_cuda_capability`` whether
   to use CUDA-only kernels (``torch._grouped_mm`` behind a Triton permute kernel), which is true on
   a GPU machine even for a CPU run. :func:`torchtitan_on_cpu` rebinds those three names in every
   loaded torchtitan module to ``"cpu"``, a stub module and "no"; gloo serves the one-process group.
3. Its token-group padding (``generate_permute_indices``) launches a Triton kernel unless told
   ``use_cpu=True``; on a GPU machine that kernel refuses CPU tensors, so the block passes it.
4. Under ``torchrun`` (several CPU processes, e.g. FSDP2 or expert parallelism over gloo) its
   ``disable_fsdp_gradient_division`` makes FSDP2 reduce-scatter with ``PREMUL_SUM``, which gloo
   lacks: the block forces a plain sum (the factor is 1). The launcher's rank variables are kept.

``python -m fp8flow_ao.torchtitan.cpu --job.config_file torchtitan_configs/deepseek_v3_debug_fp8flow.toml
--training.steps 2 --training.seq_len 64 --training.local_batch_size 2`` trains on the CPU (``--record PATH``
first: and writes what :func:`main` says).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import types
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def integer_histc() -> Iterator[None]:
    """Within the block, ``torch.histc`` accepts integer CPU tensors (result in the input's dtype).

    Dynamo knows each torch function by the object its name resolves to when it first builds its rule map
    (once per process; torch 2.11 at the first compile, 2.13 at import). Built inside this block, the map
    would hold the wrapper instead of ``torch.histc``, and every later compile that reached ``torch.histc``
    would fail ("marked as skipped") for the rest of the process, in the block or not: the map is built
    before the name is rebound.
    """
    from torch._dynamo import trace_rules

    trace_rules.get_torch_obj_rule_map()
    original = torch.histc

    def histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
        if input.is_floating_point() or input.device.type != "cpu":
            return original(input, bins, min, max)
        return original(input.float(), bins, min, max).to(input.dtype)

    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = original


def _cpu_device_module() -> types.SimpleNamespace:
    """The subset of ``torch.cuda``'s API that torchtitan's trainer calls, answered for the CPU."""
    return types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        is_available=lambda: True,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(
            total_memory=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        ),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        synchronize=lambda device=None: None,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rebind_in_torchtitan(
    overrides: dict[str, object], source: types.ModuleType
) -> list[tuple[types.ModuleType, str, object]]:
    """Set each name of ``overrides`` in every loaded torchtitan module that bound ``source``'s object."""
    originals = {name: getattr(source, name) for name in overrides}
    saved = []
    for module in [m for n, m in sys.modules.items() if n == "torchtitan" or n.startswith("torchtitan.")]:
        for name, value in overrides.items():
            if vars(module).get(name, None) is originals[name]:
                saved.append((module, name, originals[name]))
                setattr(module, name, value)
    return saved


@contextlib.contextmanager
def torchtitan_on_cpu(model_name: str | None = None) -> Iterator[None]:
    """Within the block, torchtitan's trainer runs as one CPU process (gloo); everything is restored after.

    ``model_name`` (e.g. ``"deepseek_v3"``) is imported first, so its modules are patched too.
    """
    import torchtitan.train  # noqa: F401  (loads the modules that bind the device names)

    if model_name is not None:
        from torchtitan.protocols.train_spec import get_train_spec

        get_train_spec(model_name)
    # Under torchrun the launcher's rank variables stand (several gloo processes); alone, one process.
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env = {k: os.environ.get(k, v) for k, v in env.items()}
    env["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(free_port())
    saved_env = {k: os.environ.get(k) for k in env}
    overrides = {"device_type": "cpu", "device_module": _cpu_device_module(), "has_cuda_capability": _no_capability}
    from torchtitan.models.llama3.infra import parallelize as tt_fsdp
    from torchtitan.models.moe import utils as moe_utils
    from torchtitan.tools import utils as tt_utils

    saved = [(moe_utils, "generate_permute_indices", moe_utils.generate_permute_indices)]
    try:
        os.environ.update(env)
        moe_utils.generate_permute_indices = functools.partial(saved[0][2], use_cpu=True)
        saved += _rebind_in_torchtitan(overrides, tt_utils)
        saved += _rebind_in_torchtitan({"disable_fsdp_gradient_division": _fsdp_sum_without_division}, tt_fsdp)
        with integer_histc():
            yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _fsdp_sum_without_division(model: torch.nn.Module) -> None:
    """torchtitan's ``disable_fsdp_gradient_division`` for gloo: a divide factor of 1 becomes a
    ``PREMUL_SUM`` reduce-scatter, which gloo lacks; a plain sum is the same reduction."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _no_capability(major: int, minor: int) -> bool:
    return False


def train(args: list[str], init_logging: bool = True) -> list[float]:
    """Parse torchtitan command-line ``args``, train on the CPU; return the loss of every logged step."""
    return train_recorded_on_cpu(args, init_logging).losses


def train_recorded_on_cpu(
    args: list[str], init_logging: bool = True, probe_every: int = 0, grad_norm_parts: bool = False
):
    """Parse torchtitan command-line ``args``, train on the CPU; return the :class:`~fp8flow_ao.torchtitan.record.RunRecord`.

    ``probe_every``, ``grad_norm_parts``: :func:`~fp8flow_ao.torchtitan.record.train_recorded`'s.
    """
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from fp8flow_ao.torchtitan.record import train_recorded

    if init_logging:
        init_logger()
    config = ConfigManager().parse_args(args)
    with torchtitan_on_cpu(config.model.name):
        return train_recorded(config, probe_every, grad_norm_parts)


def main(argv: list[str]) -> None:
    """``python -m fp8flow_ao.torchtitan.cpu [--record PATH] ARGS``: train on the CPU with torchtitan's command-line
    ``ARGS``; with ``--record``, also record every part's gradient norm and have rank 0 write the
    :class:`~fp8flow_ao.torchtitan.record.RunRecord` to ``PATH`` as JSON."""
    import json

    if argv[:1] != ["--record"]:
        train(argv)
        return
    if len(argv) < 2:
        raise SystemExit("--record needs a path")
    record = train_recorded_on_cpu(argv[2:], grad_norm_parts=True)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(argv[1], "w") as f:
            json.dump(record.to_json(), f)


if __name__ == "__main__":
    main(sys.argv[1:])
