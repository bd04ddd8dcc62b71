"""One rank of the multi-process tests (``test_expert_parallel.py``): run the cases, save the results.

Started by ``torch.multiprocessing.spawn`` (gloo on the CPU, NCCL on GPUs). Inputs come from the
parent as a file (the full token batch and the full expert weights); rank ``r`` takes its tokens (``[r * T,
(r + 1) * T)``, or the ``r``-th of a routed case's ``token_splits``) and experts ``[r * L, (r + 1) * L)``. Nothing
is compared here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from fp8flow_ao.debug import FP8FlowOpCounter
from fp8flow_ao.moe import convert_moe_layer, fp8flow_routed_experts
from fp8flow_ao.torchtitan.cpu import integer_histc

FSDP_STEPS = 4


def _local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = t.shape[0] // world
    return t[rank * size : (rank + 1) * size]


def run_routed_case(case: dict, rank: int, world: int, device: str) -> dict:
    """The functional routed path with ``ep_group``: this rank's tokens (``token_splits[rank]`` of them), this
    rank's experts."""
    x, probs, indices, grad = (
        case[n].split(case["token_splits"])[rank].to(device) for n in ("x", "probs", "indices", "grad")
    )
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    weights = [_local_slice(case[n], rank, world).to(device, copy=True).requires_grad_() for n in ("w1", "w2", "w3")]
    with FP8FlowOpCounter() as counter:
        out = fp8flow_routed_experts(x, probs, indices, *weights, ep_group=dist.group.WORLD, **case["options"])
        out.backward(grad)
    grads = {n: w.grad for n, w in zip(("w1", "w2", "w3"), weights, strict=True)}
    return {"out": out, "x": x.grad, "probs": probs.grad, "casts": counter.activation_casts} | grads


def run_layer_case(case: dict, rank: int, world: int, device: str) -> dict:
    """torchtitan's MoE layer, converted, its experts parallelized by torchtitan's ``ExpertParallel`` style."""
    from test_moe import make_moe
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    moe = make_moe(**case["make"], device=device)
    convert_moe_layer(moe)
    mesh = torch.distributed.device_mesh.init_device_mesh(device, (world,))
    # What torchtitan's apply_moe_ep_tp does for expert_parallel_degree > 1; a BF16 layer beside it
    # must keep torchtitan's BF16 style (its dispatch/combine hooks), the converted one gets FP8 dispatch.
    bf16 = make_moe(**case["make"], device=device)
    for layer in (moe, bf16):
        parallelize_module(layer.experts, mesh, ExpertParallel())
    styles = {"fp8flow_hooks": len(moe.experts._forward_pre_hooks) + len(moe.experts._forward_hooks)}
    styles["bf16_hooks"] = len(bf16.experts._forward_pre_hooks) + len(bf16.experts._forward_hooks)
    x = _local_slice(case["x"], rank, world).to(device, copy=True)[None].requires_grad_()  # [batch 1, T, D]
    with integer_histc():
        out = moe(x)
        out.backward(_local_slice(case["grad"], rank, world).to(device)[None])
    grads = {n: p.grad for n, p in moe.named_parameters()}
    grads = {n: g.to_local() if hasattr(g, "to_local") else g for n, g in grads.items()}
    return {"out": out[0], "x": x.grad[0]} | grads | styles


def run_fsdp_case(case: dict, rank: int, world: int, device: str) -> dict:
    """Data parallel under FSDP2 (this rank's tokens, all experts sharded): FSDP_STEPS steps of fused AdamW with clipping."""
    from test_moe import make_moe
    from torch.distributed.fsdp import fully_shard

    moe = make_moe(**case["make"], device=device)
    convert_moe_layer(moe, fsdp_fp8_all_gather=case["fsdp_fp8_all_gather"])
    mesh = torch.distributed.device_mesh.init_device_mesh(device, (world,))
    fully_shard(moe.experts, mesh=mesh)
    fully_shard(moe, mesh=mesh)
    # As torchtitan trains: fused AdamW (its default implementation) after clipping the gradient norm,
    # for FSDP_STEPS steps, so that every re-gather after an update is compared.
    optimizer = torch.optim.AdamW(moe.parameters(), lr=1e-2, fused=True)
    results: dict = {}
    for step in range(FSDP_STEPS):
        x = _local_slice(case["x"], rank, world).to(device, copy=True)[None].requires_grad_()
        with FP8FlowOpCounter() as counter, integer_histc():
            out = moe(x)
            out.backward(_local_slice(case["grad"], rank, world).to(device)[None])
        grads = {f"{n}@{step}": p.grad.to_local().clone() for n, p in moe.named_parameters()}
        results |= {
            f"out@{step}": out[0],
            f"x@{step}": x.grad[0],
            f"quantize_128x128@{step}": counter.counts["quantize_128x128"],
            f"weight_quantizations@{step}": counter.weight_quantizations,
        }
        results |= grads
        torch.nn.utils.clip_grad_norm_(list(moe.parameters()), max_norm=1e-3)  # always active
        optimizer.step()
        optimizer.zero_grad()
    for name, value in moe.state_dict().items():  # this rank's shards after the last update
        local = value.to_local() if hasattr(value, "to_local") else value
        results[f"weight:{name}"] = getattr(local, "_data", local).clone()
    return results


def _full(state: dict) -> dict:
    """A copy of a state dict with every DTensor gathered (to compare across placements and steps)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in state.items()}


def run_dcp_case(case: dict, rank: int, world: int, device: str) -> dict:
    """DCP under expert parallelism: save after step 1, resume in a fresh model, and load into a BF16 model."""
    import torch.distributed.checkpoint as dcp
    from test_moe import make_moe
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    mesh = torch.distributed.device_mesh.init_device_mesh(device, (world,))
    batches = [(_local_slice(case[f"x{i}"], rank, world), _local_slice(case[f"grad{i}"], rank, world)) for i in (0, 1)]

    def build(convert: bool, seed: int):
        moe = make_moe(**case["make"], device=device, seed=seed)
        if convert:
            convert_moe_layer(moe)
        parallelize_module(moe.experts, mesh, ExpertParallel())
        # foreach=False: the experts are DTensors and the rest plain tensors here (torchtitan always adds
        # FSDP2, which makes every parameter a DTensor); foreach ops refuse such a mix on CUDA.
        return moe, torch.optim.AdamW(moe.parameters(), lr=1e-2, foreach=False)

    def step(moe, optimizer, batch) -> torch.Tensor:
        x, grad = (t.to(device)[None] for t in batch)
        with integer_histc():
            out = moe(x)
            out.backward(grad)
        for p in moe.parameters():  # data parallel over the replicated (non-expert) weights, as DDP/FSDP do
            if not hasattr(p, "to_local"):
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        return out[0].detach()

    def state(moe, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(moe, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    moe, optimizer = build(True, seed=0)
    step(moe, optimizer, batches[0])
    dcp.save(state(moe, optimizer), checkpoint_id=case["checkpoint_dir"])
    step1_weights = _full(moe.state_dict())
    uninterrupted = step(moe, optimizer, batches[1])
    resumed_moe, resumed_optimizer = build(True, seed=1)  # other initial weights: the load must replace them
    loaded = state(resumed_moe, resumed_optimizer)
    dcp.load(loaded, checkpoint_id=case["checkpoint_dir"])
    set_state_dict(resumed_moe, resumed_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    resumed = step(resumed_moe, resumed_optimizer, batches[1])
    # The same checkpoint, model only, into an unconverted BF16 layer under torchtitan's own EP style.
    bf16, _ = build(False, seed=2)
    bf16_state = {"model": bf16.state_dict()}
    dcp.load(bf16_state, checkpoint_id=case["checkpoint_dir"])
    in_bf16 = _full(bf16_state["model"])
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "same_keys": sorted(in_bf16) == sorted(step1_weights),
        "bf16_has_step1_weights": all(torch.equal(in_bf16[k], step1_weights[k]) for k in step1_weights),
    }


def worker(rank: int, world: int, device: str, folder: str) -> None:
    """Entry point of one spawned rank."""
    path = Path(folder)
    if device == "cuda":
        torch.cuda.set_device(rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{path / 'rendezvous'}", rank=rank, world_size=world)
    try:
        cases = torch.load(path / "cases.pt")
        results = {}
        for name, case in cases.items():
            if "checkpoint_dir" in case:
                run = run_dcp_case
            elif "fsdp_fp8_all_gather" in case:
                run = run_fsdp_case
            else:
                run = run_layer_case if "make" in case else run_routed_case
            results[name] = {
                k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in run(case, rank, world, device).items()
            }
        torch.save(results, path / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
