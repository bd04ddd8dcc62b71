"""FSDP2 all-gathers the expert weights in FP8: each rank quantizes its own shard, the tiles travel.

Under FSDP2 each rank holds a shard of every expert weight ``[E, N, K]`` and all-gathers the rest
before use. With ``FP8FlowConfig(fsdp_fp8_all_gather=True)`` the expert weights are
:class:`~fp8flow_ao.tensor.FP8FlowExpertWeight` parameters whose FSDP2 hooks (the tensor-subclass
all-gather extension, ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) call this module:

* pre-all-gather: :func:`pre_all_gather` quantizes the local shard into 128x128 E4M3 tiles and their
  fp32 power-of-two scales (``quantize_128x128``, no transpose): ``1/world`` of each weight per
  all-gather, where the BF16 all-gather path quantizes the whole unsharded weight in forward and its
  transpose again in backward;
* the all-gather moves ``N * K`` bytes of data + ``4 * N * K / 128**2`` bytes of scales per expert
  instead of BF16's ``2 * N * K``: 0.5001x;
* post-all-gather: a :class:`~fp8flow_ao.tensor.Float8BlockwiseWeight` -- the unsharded weight as FP8 tiles -- which
  the FP8-Flow layer uses as is: its forward GEMM operand, and the exact transposes for the dgrads
  (:meth:`~fp8flow_ao.tensor.Float8BlockwiseWeight.transposed`, a byte transpose of the gathered tiles, never a second
  quantization from BF16).

Gradients come back as plain tensors of the parameter dtype and FSDP2 reduce-scatters them in its
``reduce_dtype``, as without the extension. The result equals quantizing the unsharded weight bit for
bit, because no 128x128 tile straddles a shard boundary: FSDP2 shards dim 0 (whole experts; ``E`` must
divide evenly over the shard ranks: FSDP2 pads an uneven last shard, and its extension API requires every
all-gather input at the padded shard's shape, which the scales cannot have) or, with torchtitan's
``Shard(1)`` placement (when ``efsdp * ep > E``), rows of ``N``, where every shard must hold a multiple
of 128 rows -- :func:`check_shard_tiles` raises a ``ValueError`` naming the sizes otherwise.

On a one-rank shard mesh (torchtitan's expert mesh when ``expert_parallel_degree`` equals
``data_parallel_shard_degree``) FSDP2 gathers nothing: it hands its first all-gather input over as the
unsharded weight and drops the rest. There the BF16 (``param_dtype``) shard is that input, and
:func:`post_all_gather` quantizes it: the same tiles, no communication either way.
"""

from __future__ import annotations

import torch

from fp8flow_ao._format import BLOCK
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128
from fp8flow_ao.tensor import Float8BlockwiseWeight, refresh_unsharded, unsharded_target


def check_shard_tiles(shard_shape: tuple[int, ...], full_shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless every 128x128 tile of the full weight lies inside one shard."""
    if len(shard_shape) != 3 or len(full_shape) != 3:
        raise ValueError(f"expert weights are [E, N, K]; got shard {shard_shape} of {full_shape}")
    _, n, k = shard_shape
    if k != full_shape[2]:
        raise ValueError(
            f"FP8 all-gather of expert weights: FSDP sharded the K dim ({k} of {full_shape[2]}); "
            "shard dim 0 (experts) or dim 1 in multiples of 128 rows"
        )
    if n % BLOCK or k % BLOCK:
        raise ValueError(
            f"FP8 all-gather of expert weights needs shards of whole 128x128 tiles; a shard is {shard_shape} "
            f"of {full_shape} (FSDP2 Shard(1) splits N={full_shape[1]} unevenly or not in multiples of 128). "
            "Choose sizes where N / shards is a multiple of 128, or set fsdp_fp8_all_gather=False"
        )


def pre_all_gather(
    shard: torch.Tensor, full_shape: tuple[int, ...], param_dtype: torch.dtype, ranks: int
) -> tuple[torch.Tensor, ...]:
    """``fsdp_pre_all_gather`` of a blockwise expert weight: the FP8 tiles of one shard ``[E_s, N_s, K]``.

    Returns ``(data E4M3 [E_s, N_s, K], scale_inv fp32 [E_s, N_s/128, K/128])``, quantized from the shard
    in ``param_dtype`` (what a BF16 all-gather would move), so the gathered tiles equal the BF16
    gather's quantization bit for bit; on a one-rank shard mesh (``ranks`` 1) the shard itself in
    ``param_dtype`` (module docstring). Quantized at every all-gather (forward, and backward's
    re-gather when FSDP2 reshards after forward): a shard is ``1/world`` of the weight, and nothing
    here can tell that the optimizer changed it (FSDP2's optimizer updates bump the version counter
    of the sharded DTensor parameter only, not of the local shard this hook sees), so no cache.
    Raises ``ValueError`` (on every rank alike) where ``E`` does not divide over ``ranks``.
    """
    experts = full_shape[0]
    if tuple(shard.shape[1:]) == tuple(full_shape[1:]) and experts % ranks:
        raise ValueError(
            f"FP8 all-gather of expert weights needs the experts to divide evenly over the FSDP shard ranks: "
            f"E={experts} over {ranks} ranks (FSDP2 pads the last shard, and the all-gathered scales cannot be "
            "padded to its shape). Choose E divisible by the shard degree, or set fsdp_fp8_all_gather=False"
        )
    check_shard_tiles(tuple(shard.shape), tuple(full_shape))
    if ranks == 1:
        return (shard.to(param_dtype),)
    data, scale_inv, _, _ = quantize_128x128(shard.to(param_dtype).contiguous(), with_transpose=False)
    return data, scale_inv


def post_all_gather(
    outputs: tuple[torch.Tensor, ...], param_dtype: torch.dtype, out: torch.Tensor | None
) -> tuple[Float8BlockwiseWeight, tuple[torch.Tensor, ...]] | None:
    """``fsdp_post_all_gather``: the gathered tiles as a :class:`~fp8flow_ao.tensor.Float8BlockwiseWeight`.

    After the first all-gather FSDP2 refills the same output buffers (``out`` given), which the
    unsharded weight already wraps; a different buffer is copied in. One output (a one-rank shard mesh:
    the whole weight in ``param_dtype``, :func:`pre_all_gather`) is quantized here, into ``out``'s tiles
    where given.
    """
    if len(outputs) == 1:
        held = None if out is None else (*unsharded_target(out, Float8BlockwiseWeight).data_and_scale(), None, None)
        outputs = quantize_128x128(outputs[0].contiguous(), with_transpose=False, out=held)[:2]
    data, scale_inv = outputs
    if out is None:
        return Float8BlockwiseWeight(data, scale_inv, param_dtype), (data, scale_inv)
    refresh_unsharded(out, Float8BlockwiseWeight, outputs, Float8BlockwiseWeight.data_and_scale)
    return None
