"""Expert parallelism with FP8 dispatch: token rows travel to the experts' ranks as FP8 bytes + scales.

The routed experts are split over the ranks of an expert-parallel (EP) process group: rank ``p`` of
``P`` owns the ``L = E / P`` experts ``[p * L, (p + 1) * L)`` (torchtitan's ``Shard(0)`` of the
``[E, ...]`` expert weights). One MoE layer then runs (DESIGN.md, "Several GPUs")::

    sender (every rank, its T tokens)            receiver (every rank, its L experts)
    x -Q1-> x8 + scales [T, D]
    sort (token, slot) pairs by expert,
    gather FP8 rows + probs     --all-to-all-->  R rows in (source rank, local expert) order
                                                  permute_pad (k = 1) -> FC1 -> SwiGLU x prob -> FC2
                                                  -> unpermute_unpad (k = 1) -> BF16 rows [R, D]
    k-sum of each token's rows  <--all-to-all--
    backward: dy -Q2-> FP8 rows --all-to-all-->  same expert backward -> BF16 grad rows + grad probs
    k-sum -> dx, grad probs     <--all-to-all--

Each (token, slot) pair is one row on the wire, as in torchtitan's BF16 expert parallelism, so the
bytes compare one to one: ``D + 4 * (D / 128 + 1)`` bytes per row (FP8 data, fp32 scales, the fp32
prob) against BF16's ``2 * D``; 0.517x at D = 7168. Every payload crosses the collective as
``uint8`` rows (``view(torch.uint8)``): NCCL and gloo move bytes of any dtype, FP8 included.

Host syncs: one per layer and step, in forward: the split sizes of the all-to-alls (how many rows
go to and come from each rank) must be host integers for ``all_to_all_single``; the receiver's row
count sizes its buffers. torchtitan's BF16 ``ExpertParallel`` makes the same sync (``.tolist()`` of
its splits). Backward reuses the forward's plan and syncs nothing. Everything else (the sort, the
maps, the receiver's local expert ids, padding) is computed on the device.

The expert-parallel path runs eagerly: the split sizes are host integers, so it does not trace
into one ``torch.compile(fullgraph=True)`` graph (a layer set to compile its routed path, as the
torchtitan converter's ``fp8flow.compile_experts`` does, runs it eagerly once it has an EP group; the
one-GPU path compiles fullgraph).

This module is torchtitan-free; :mod:`fp8flow_ao.torchtitan.expert_parallel` plugs it into
torchtitan's ``expert_parallel_degree``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from fp8flow_ao._checks import validate_index_range, validation_enabled
from fp8flow_ao.kernels.permute_pad import permute_pad_rows
from fp8flow_ao.kernels.unpermute_unpad import unpermute_unpad


@dataclass(frozen=True)
class DispatchPlan:
    """Where each (token, slot) row of one MoE layer goes and comes back from (forward and backward).

    ``order`` lists the send rows: row ``i`` carries the flattened pair ``order[i] = t * k + j``, rows
    sorted by global expert (so by destination rank, then local expert). ``send_row`` is its inverse.
    """

    group: dist.ProcessGroup
    top_k: int
    order: torch.Tensor
    """int32 ``[T * k]``: flattened ``t * k + j`` of each send row."""
    send_row: torch.Tensor
    """int32 ``[T * k]``: send row of pair ``t * k + j`` (the inverse of ``order``)."""
    input_splits: list[int]
    """Rows this rank sends to each rank."""
    output_splits: list[int]
    """Rows this rank receives from each rank."""
    local_expert: torch.Tensor
    """int32 ``[R, 1]``: local expert of each received row (``R = sum(output_splits)``)."""


def _all_to_all_rows(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of a 1-D/2-D tensor's rows, moved as bytes (any dtype, FP8 included)."""
    rows = rows.contiguous()
    as_bytes = rows.view(rows.shape[0], math.prod(rows.shape[1:])).view(torch.uint8)
    out = as_bytes.new_empty((sum(output_splits), as_bytes.shape[1]))
    dist.all_to_all_single(out, as_bytes, output_splits, input_splits, group=group)
    return out.view(rows.dtype).view(out.shape[0], *rows.shape[1:])


def plan_dispatch(expert_indices: torch.Tensor, num_experts: int, group: dist.ProcessGroup) -> DispatchPlan:
    """Exchange the per-expert row counts and build the :class:`DispatchPlan` (the one host sync).

    Args:
        expert_indices: int32/int64 ``[T, k]`` global expert ids in ``[0, num_experts)``.
        num_experts: ``E``, a multiple of the group's size ``P``; rank ``p`` owns experts
            ``[p * E / P, (p + 1) * E / P)``.
        group: the expert-parallel process group.
    """
    ranks = dist.get_world_size(group)
    if num_experts % ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the expert-parallel degree {ranks}")
    if validation_enabled(expert_indices):  # an id out of range would leave the split sizes short of the rows sent
        validate_index_range("expert_indices", expert_indices, 0, num_experts)
    local = num_experts // ranks
    top_k = expert_indices.shape[1]
    flat = expert_indices.reshape(-1).to(torch.int32)
    # A stable sort keeps each expert's rows in (token, slot) order: deterministic on every rank.
    sorted_ids, order = torch.sort(flat, stable=True)
    order = order.to(torch.int32)
    positions = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    send_row = torch.empty_like(order).scatter_(0, order.long(), positions)
    # Rows per global expert by binary search in the sorted ids: no bincount (which syncs the host
    # for its size on CUDA) and no atomics (deterministic mode accepts it).
    experts = torch.arange(num_experts, dtype=torch.int32, device=flat.device)
    counts = torch.diff(
        torch.searchsorted(sorted_ids, experts, right=True), prepend=experts.new_zeros(1, dtype=torch.int64)
    )
    # recv_counts[q * L + l]: rows rank q sends to my local expert l.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    splits = torch.stack([counts.view(ranks, local).sum(1), recv_counts.view(ranks, local).sum(1)]).cpu()
    input_splits, output_splits = splits.tolist()
    local_ids = torch.arange(local, dtype=torch.int32, device=flat.device).repeat(ranks)
    local_expert = torch.repeat_interleave(local_ids, recv_counts, output_size=sum(output_splits))
    return DispatchPlan(group, top_k, order, send_row, input_splits, output_splits, local_expert.view(-1, 1))


def dispatch(
    data: torch.Tensor, scale_inv: torch.Tensor, plan: DispatchPlan, probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Send each token's FP8 row (and prob) to the rank of each of its experts.

    Args:
        data: E4M3 ``[T, D]`` token rows (quantized once, before dispatch), row-major.
        scale_inv: fp32 COMPACT ``[T, D / 128]`` 1x128 dequantize multipliers of ``data``.
        plan: from :func:`plan_dispatch` for these tokens.
        probs: optional ``[T, k]`` router probabilities (travel as fp32 beside the scales).

    Returns:
        ``(data [R, D], scale_inv [R, D / 128], probs [R, 1] fp32 or None)`` on the receiving rank, in
        (source rank, local expert) order; ``plan.local_expert`` names each row's expert.
    """
    rows, row_scale = permute_pad_rows(data, scale_inv, plan.order, plan.top_k)
    # Scales and probs share one fp32 payload: one collective fewer for a few bytes per row.
    meta = row_scale
    if probs is not None:
        meta = torch.cat([row_scale, probs.reshape(-1).float().index_select(0, plan.order)[:, None]], dim=1)
    splits = (plan.output_splits, plan.input_splits, plan.group)
    recv_rows, recv_meta = _all_to_all_rows(rows, *splits), _all_to_all_rows(meta, *splits)
    if probs is None:
        return recv_rows, recv_meta, None
    return recv_rows, recv_meta[:, :-1].contiguous(), recv_meta[:, -1:].contiguous()


def combine(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Return expert output rows ``[R, D]`` to their tokens' ranks and sum each token's ``k`` rows: ``[T, D]``."""
    back = _all_to_all_rows(rows, plan.input_splits, plan.output_splits, plan.group)
    return unpermute_unpad(back, plan.send_row, plan.top_k)


def combine_probs_grad(grad_probs: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Return the received rows' prob gradients ``[R]`` to their tokens: fp32 ``[T, k]``."""
    back = _all_to_all_rows(grad_probs.float().reshape(-1), plan.input_splits, plan.output_splits, plan.group)
    return back.index_select(0, plan.send_row.long()).view(-1, plan.top_k)


def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Expert parallelism for an FP8-Flow experts module: split its experts over ``ep_mesh``, FP8 dispatch on.

    ``w1``, ``w2``, ``w3`` (``[E, ...]``) become ``Shard(0)`` DTensor parameters over the 1-D
    ``ep_mesh`` (torchtitan's placement, so its FSDP2 wrapping and DCP checkpoints apply unchanged:
    the keys and global shapes stay those of the unsharded model), and the module's forward
    dispatches FP8 rows over the mesh's process group. In place; returns ``experts``.

    Raises:
        TypeError: ``experts`` is not a converted FP8-Flow experts module (see
            :func:`fp8flow_ao.moe.convert_moe_layer`) or ``ep_mesh`` is not 1-D.
        ValueError: the expert count is not a multiple of the mesh size.
    """
    if not hasattr(experts, "fp8flow_ep_group"):
        raise TypeError(
            f"shard_experts needs an FP8-Flow experts module (convert the MoE layer first), got {type(experts).__name__}"
        )
    if ep_mesh.ndim != 1:
        raise TypeError(f"ep_mesh must be a 1-D DeviceMesh (the expert-parallel dim), got {ep_mesh.ndim} dims")
    num_experts, ranks = experts.w1.shape[0], ep_mesh.size()
    if num_experts % ranks:
        raise ValueError(
            f"expert parallel degree {ranks} must divide the number of experts {num_experts} "
            "(each rank owns an equal share of whole experts)"
        )
    for name, param in list(experts.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    experts.fp8flow_ep_group = ep_mesh.get_group()
    return experts
