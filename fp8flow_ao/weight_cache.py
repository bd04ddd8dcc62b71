"""FP8 expert weights of the FP8-Flow MoE layer: when they are quantized, and a cache that reuses them.

Each step the layer needs its expert weights as 128 x 128 FP8 tiles twice: ``W13 = [w1; w3]``
``[E, 2H, D]`` and ``w2`` ``[E, D, H]`` for the forward GEMMs, and their exact transposes ``[E, D, 2H]``,
``[E, H, D]`` for the backward dgrads (:func:`~fp8flow_ao.kernels.quantize_128x128.quantize_128x128`
writes both orientations in one pass, and W13 straight into one buffer), or the GEMMs quantize each
tile themselves as they load it from the BF16 weights (the same bits: :class:`ExpertWeightsHP`, where
:func:`~fp8flow_ao.kernels.grouped_gemm_fp8_blockwise.quantize_in_gemm_pays`: experts with few rows).
``weight_cache`` chooses how often the FP8 tiles are made, trading memory for speed:

* ``"off"``: forward quantizes the forward orientation, backward quantizes the transposes again from
  the same high-precision weights (the same bits), or each GEMM quantizes as it loads. Nothing FP8 of
  the weights outlives its GEMM: the least memory; each BF16 weight byte is read twice per micro-batch.
* ``"forward"``: forward writes both orientations in one pass and keeps the transposes for backward
  (and W13 itself with ``recompute_experts``): those of the dgrads that run in FP8, so none of W13's where
  the layer's input needs no gradient (FC1's dgrad does not run) and none at all where ``w2`` alone trains.
  Reads the BF16 weights once per micro-batch, saves one ``quantize_128x128`` launch per weight; costs
  ``3*E*H*D`` bytes per layer (half the BF16 weight bytes; + ``2*E*H*D`` for W13 with recompute) held from
  the layer's forward to its backward, i.e. every layer's at once at the forward/backward boundary. Works under ``torch.compile``.
* ``"step"``: both orientations are cached across micro-batches and steps (:class:`FP8WeightCache`,
  :data:`EXPERT_WEIGHT_CACHE`) and re-quantized on the first use after the weights change: with
  gradient accumulation micro-batches 2..n quantize nothing. Costs ``6*E*H*D`` bytes per layer (as
  many bytes as the BF16 weights) for as long as the weights live. Works eagerly and with the layer's
  own compiled path (``compile_backend``; torchtitan's ``fp8flow.compile_experts``), also replayed as CUDA
  graphs (``compile_mode="reduce-overhead"``: the cache then re-quantizes into the same tensors, so the
  graphs read them in place, :func:`step_cached_weights`); where a caller's ``torch.compile`` traces the
  layer itself it acts as ``"forward"`` (see below).

Measured on one H200 (``bench_moe_layer.py``, torch.compile, median of 3 interleaved repetitions, torch 2.11,
triton 3.6). On 2026-11-29 (session 50, ``moe_layer_deepseek_qwen_s50_wt_forward.md``): DeepSeek-like (T=4096,
D=7168, H=2048, E=32, top-8) ``"off"`` 11.99 / 12.50 ms (balanced / skewed), ``"forward"`` 11.72 / 12.09 ms (1.02x /
1.03x faster; 1.58x / 1.65x BF16's 18.50 / 19.96 ms that run): activations held 22% -> 99.5% of BF16's, peak 3.13 ->
3.19 GiB (BF16: 3.31 GiB). Qwen3-30B-A3B-like (T=8192, D=2048, H=768, E=128, top-8) 3.91 / 4.09 ms -> 3.75 / 3.83 ms
(1.04x / 1.07x): activations 30% -> 83% of BF16's, peak 1.50 -> 1.54 GiB (BF16: 1.64 GiB). The first measurement,
on 2026-11-24: DeepSeek-like (T=4096, D=7168, H=2048, E=32, top-8) ``"off"`` 13.15 / 13.75 ms (balanced / skewed),
``"forward"`` 12.50 / 13.26 ms (1.05x / 1.04x faster): activations held 22% -> 99.5% of BF16's, peak
3.21 -> 3.26 GiB (BF16: 3.39 GiB). Qwen3-30B-A3B-like (T=8192, D=2048, H=768, E=128, top-8) 4.50 / 4.67
ms -> 4.33 / 4.59 ms: activations 30% -> 83% of BF16's, peak 1.50 -> 1.54 GiB (BF16: 1.64 GiB). The gain is
the backward's second read of the BF16 weights (with the transpose, ``quantize_128x128`` moves 4 bytes a
weight in one pass against 6 in two). An earlier measurement (2026-11-23) saw no gain, most likely
because its variants shared one process and the autotuner, keyed on (N, K) only, had tuned on
``"off"``'s forward-only pass (8 warps best) and served that to ``"forward"``'s transposing pass, which
runs 1.5x faster with 4 warps (``quantize_128x128.default_config`` now picks per pass).

``"step"``, a micro-batch that finds its weights cached (the experts run as torchtitan runs them: the
block compiled, the routed path compiled on its own with the lookup outside; same H200, same day, one
run of every variant): DeepSeek-like 11.27 / 11.90 ms against ``"off"``'s 13.21 / 13.80 (1.17x / 1.16x;
1.63x / 1.67x BF16), the cache holding 2.63 GiB (``6*E*H*D`` bytes), activations and peak as ``"off"``.
Qwen-like: device time per step 4.06 -> 3.22 ms (steps back to back), but this arrangement (a graph break
at the experts, the path's own graph and guards, the lookup) costs ~1 ms of host time, and the step is
host-bound there (5.5 ms of host for 3.2 of device): 5.24 / 5.47 ms against ``"off"``'s 4.61 / 5.14 under
the whole-block compile. The first micro-batch after an optimizer step pays what ``"forward"`` does.
Replayed as CUDA graphs (``compile_mode="reduce-overhead"``, the tiles read in place; 2026-11-25, one run,
median of 3, ``moe_layer_deepseek_qwen_wt_step_cudagraph.md``): Qwen-like 3.38 / 3.67 ms, **1.90x / 2.00x
BF16** (every repetition 1.90-2.01x; the path under CUDA graphs without the cache: 1.53x / 1.63x);
DeepSeek-like 11.52 / 12.27 ms, 1.63x / 1.63x (device-bound: graphs add nothing there).

When is a cached entry stale? An entry is keyed on each source tensor's storage (a weak reference to
the storage object, not to the tensor: ``torch.utils.swap_tensors``, which ``load_state_dict`` and
``Module.to`` use under ``torch.__future__.set_swap_module_params_on_conversion(True)``, refuses a tensor
that has weak references), ``data_ptr``, shape, strides, dtype, device and autograd version counter
(``_version``). Every in-place write that goes through the dispatcher bumps the version: ``copy_``,
``load_state_dict``, ``nn.init``, edits under ``torch.no_grad()``, the for-loop and foreach optimizers.
Rebinding ``param.data = new`` changes the storage; a dead storage never matches, so a new tensor at the
same address cannot hit an old entry. Writes that bypass the version counter:

* ``torch.optim``'s fused optimizers (``AdamW(fused=True)``, torchtitan's default ``implementation =
  "fused"``): their kernels leave ``_version`` as it was (torch 2.13). So the first ``"step"`` lookup
  registers a hook after every ``torch.optim`` optimizer's ``step()``
  (``torch.optim.optimizer.register_optimizer_step_post_hook``) that marks every entry stale: the cache
  holds a weight's tiles for one optimizer step at most, whichever optimizer ran.
* writes through ``param.data`` (a fresh version counter by design), optimizers outside ``torch.optim``
  (apex's or DeepSpeed's fused Adam write through raw pointers) and FSDP2's all-gather into the unsharded
  parameters (it runs under ``torch.autograd._unsafe_preserve_version_counter``, so a re-gather into the
  same storage looks unchanged): call :meth:`FP8WeightCache.invalidate` after them. (An in-place write to a
  DTensor parameter, expert parallelism's, bumps the DTensor's counter and not its local shard's, which the
  layer reads: :func:`step_cached_weights` keys on the DTensor's too, found through ``to_local``'s autograd
  edge, so where the parameter requires grad.) Forwards with grad mode
  off never use the cache (:func:`step_cached_weights`), so weights swapped in through ``param.data`` for an
  evaluation under ``torch.no_grad()`` (EMA utilities) and swapped back before training need no call; a
  ``param.data`` write that training micro-batches should see does.

The torchtitan converter also invalidates after every optimizer step (``post_optimizer_hook``; under CUDA
graphs, where FSDP2 is refused, it marks the entries stale and keeps their tensors, which the next lookup
re-quantizes in place); with FSDP2 outside torchtitan call ``EXPERT_WEIGHT_CACHE.invalidate()`` after
``optimizer.step()``. Under FSDP2 the cache is meant to sit on the sharded side instead: keyed on the
local shard (the tensor the optimizer updates, whose version does bump), fed to the FP8 all-gather;
:meth:`FP8WeightCache.get` takes any sources and any producer for that reason.

``torch.compile``: the lookup is Python state (a dict, weak references, version counters) that
dynamo cannot trace into a reusable graph, and a compiled graph may reuse the memory of a buffer it
believes it owns, which a cached tensor handed out of a custom op would be. So the lookup
(:func:`step_cached_weights`) runs before the graph and hands the tiles in as graph inputs, which a
graph never owns: :func:`~fp8flow_ao.moe.fp8flow_routed_experts` with ``compile_backend`` compiles only
the path after its checks and this lookup (the torchtitan converter's compiled experts run that way).
Where a caller's ``torch.compile`` traces the layer, the lookup is inside the trace: ``"step"`` then
quantizes both orientations in the forward (``"forward"``'s graph, the same bits). Activation
checkpointing and ``recompute_experts`` see the same bits either way: quantization is deterministic
and a cache hit returns the tensors a fresh quantization makes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves

from fp8flow_ao._grad_accumulation import dtensor_of_local
from fp8flow_ao.kernels.grouped_gemm_fp8_blockwise import quantize_in_gemm_pays
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128, quantize_128x128_pair

WEIGHT_CACHE_MODES = ("off", "forward", "step")

T = TypeVar("T")


class ExpertWeightsFP8(NamedTuple):
    """One MoE layer's expert weights as 128 x 128 E4M3 tiles; ``None`` where not made (or not kept).

    ``w13`` ``[E, 2H, D]`` (FC1's RHS, ``[w1; w3]``), ``w13_t`` ``[E, D, 2H]`` (FC1 dgrad), ``w2``
    ``[E, D, H]`` (FC2), ``w2_t`` ``[E, H, D]`` (FC2 dgrad); each ``*_scale`` the fp32 ``scale_inv`` of
    its tiles, ``[E, rows/128, cols/128]``. Transposes are bit for bit the forward tiles transposed.
    """

    w13: torch.Tensor | None
    w13_scale: torch.Tensor | None
    w13_t: torch.Tensor | None
    w13_t_scale: torch.Tensor | None
    w2: torch.Tensor | None
    w2_scale: torch.Tensor | None
    w2_t: torch.Tensor | None
    w2_t_scale: torch.Tensor | None

    def fc1(self) -> WeightOperand:
        """FC1's B operand (``W13``)."""
        return WeightOperand(self.w13, self.w13_scale)

    def fc2(self) -> WeightOperand:
        """FC2's B operand (``w2``)."""
        return WeightOperand(self.w2, self.w2_scale)

    def fc1_dgrad(self) -> WeightOperand:
        """FC1 dgrad's B operand (``W13``'s exact transpose)."""
        return WeightOperand(self.w13_t, self.w13_t_scale)

    def fc2_dgrad(self) -> WeightOperand:
        """FC2 dgrad's B operand (``w2``'s exact transpose)."""
        return WeightOperand(self.w2_t, self.w2_t_scale)


NOTHING = ExpertWeightsFP8(*(None,) * len(ExpertWeightsFP8._fields))


class WeightOperand(NamedTuple):
    """One GEMM's B operand as :func:`~fp8flow_ao.kernels.grouped_gemm_fp8_blockwise.grouped_gemm_fp8_blockwise`
    takes it: FP8 tiles (``b``, ``b_scale``) or a high-precision weight the GEMM quantizes (``b_scale``
    None; ``b_tail`` joined below it; ``transpose_b`` for a dgrad)."""

    b: torch.Tensor
    b_scale: torch.Tensor | None = None
    b_tail: torch.Tensor | None = None
    transpose_b: bool = False


class ExpertWeightsHP(NamedTuple):
    """One MoE layer's expert weights as they are (bf16), for GEMMs that quantize each 128 x 128 tile as
    they load it: no FP8 weight copy is made or kept (same bits as :class:`ExpertWeightsFP8`'s tiles)."""

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor

    def fc1(self) -> WeightOperand:
        """FC1's B operand: ``w1`` with ``w3`` joined below it (``W13``), quantized by the GEMM."""
        return WeightOperand(self.w1, None, self.w3)

    def fc2(self) -> WeightOperand:
        """FC2's B operand: ``w2``, quantized by the GEMM."""
        return WeightOperand(self.w2)

    def fc1_dgrad(self) -> WeightOperand:
        """FC1 dgrad's B operand: ``W13``, each tile quantized and transposed by the GEMM."""
        return WeightOperand(self.w1, None, self.w3, transpose_b=True)

    def fc2_dgrad(self) -> WeightOperand:
        """FC2 dgrad's B operand: ``w2``, each tile quantized and transposed by the GEMM."""
        return WeightOperand(self.w2, None, None, transpose_b=True)


def quantized_in_gemm(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, rows: int, mode: str) -> bool:
    """Whether the layer's GEMMs over ``rows`` routed rows take the weights as they are and quantize them
    while loading (``weight_cache="off"``, plain contiguous tensors -- not FSDP2's FP8 all-gathered tiles --
    and :func:`~fp8flow_ao.kernels.grouped_gemm_fp8_blockwise.quantize_in_gemm_pays`). Static: the same
    answer in forward, backward and recompute."""
    from fp8flow_ao.tensor import Float8BlockwiseWeight

    return (
        mode == "off"
        and not any(isinstance(w, Float8BlockwiseWeight) for w in (w1, w2, w3))
        and all(w.is_contiguous() for w in (w1, w2, w3))
        and w1.dtype == w2.dtype == w3.dtype
        and quantize_in_gemm_pays(rows, w1.shape[0], w1.dtype, aligned=False)  # routed rows, padded per expert
    )


def quantize_expert_weights(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    with_w13: bool,
    with_w2: bool,
    with_w13_t: bool,
    with_w2_t: bool,
    out: ExpertWeightsFP8 | None = None,
) -> ExpertWeightsFP8:
    """Quantize ``W13 = [w1; w3]`` (one pass, one buffer: no FP8 concatenation) and ``w2`` (in the same
    launch where both are asked for the same orientations and no ``out`` is given).

    ``w1``, ``w3`` ``[E, H, D]``, ``w2`` ``[E, D, H]``, bf16/fp32. ``with_w13``/``with_w2`` ask for the
    forward orientations, ``with_w13_t``/``with_w2_t`` for the transposes (a weight's two orientations
    are written by the same pass; a weight asked for in neither is not read). ``out``: tensors of an
    earlier result with the same flags, written in place and returned (eager only:
    :func:`~fp8flow_ao.kernels.quantize_128x128.quantize_128x128`'s ``out``).
    Weights that arrive as FP8 tiles (FSDP2's FP8 all-gather: :class:`~fp8flow_ao.tensor.Float8BlockwiseWeight`)
    are not quantized again: W13 joins their tiles and the transposes are byte transposes of them.
    """
    from fp8flow_ao.tensor import Float8BlockwiseWeight

    gathered = [isinstance(w, Float8BlockwiseWeight) for w in (w1, w2, w3)]
    if any(gathered):
        if not all(gathered):
            raise TypeError("w1, w2, w3 must all be FP8 all-gathered (Float8BlockwiseWeight) or all high precision")
        if out is not None:
            raise ValueError(
                "out is not supported for FP8 all-gathered weights (their tiles are joined, not quantized)"
            )
        return _from_tiles(w1, w2, w3, with_w13, with_w2, with_w13_t, with_w2_t)
    if out is None and (with_w13, with_w13_t) == (with_w2, with_w2_t) != (False, False) and w2.dtype == w1.dtype:
        # Both weights with the same orientations (the forward's): one call, one launch.
        w13, w2_q = quantize_128x128_pair(
            w1.contiguous(), w2.contiguous(), with_w13_t, with_w13, w_tail=w3.contiguous()
        )
        return ExpertWeightsFP8(*w13, *w2_q)
    none = (None,) * 4
    out13, out2 = (None, None) if out is None else (tuple(out[:4]), tuple(out[4:]))
    w13 = (
        quantize_128x128(w1.contiguous(), with_w13_t, with_w13, w_tail=w3.contiguous(), out=out13)
        if with_w13 or with_w13_t
        else none
    )
    w2_q = quantize_128x128(w2.contiguous(), with_w2_t, with_w2, out=out2) if with_w2 or with_w2_t else none
    return ExpertWeightsFP8(*w13, *w2_q)


def _from_tiles(w1, w2, w3, with_w13: bool, with_w2: bool, with_w13_t: bool, with_w2_t: bool) -> ExpertWeightsFP8:
    """:func:`quantize_expert_weights` for weights already in FP8 tiles: joins and byte transposes only."""
    from fp8flow_ao.tensor import byte_transpose

    w13 = w13_t = (None, None)
    if with_w13 or with_w13_t:
        (d1, s1), (d3, s3) = w1.data_and_scale(), w3.data_and_scale()
        w13 = (torch.cat([d1, d3], dim=1), torch.cat([s1, s3], dim=1))
        w13_t = tuple(byte_transpose(t) for t in w13) if with_w13_t else (None, None)
    w2_t = w2.transposed() if with_w2_t else (None, None)
    return ExpertWeightsFP8(
        *(w13 if with_w13 else (None, None)), *w13_t, *(w2.data_and_scale() if with_w2 else (None, None)), *w2_t
    )


def _owner(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage whose lifetime bounds a value made from ``t`` (the same Python object for every tensor
    and view on it while it lives, e.g. a DTensor's ``to_local()``, a new view object per call). Not the
    tensor: ``torch.utils.swap_tensors`` refuses a tensor that has weak references."""
    return t.untyped_storage()


def _state(t: torch.Tensor) -> tuple:
    """What must be unchanged for a value made from ``t`` to hold (identity is checked separately)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


def _layout(state: tuple) -> tuple:
    """A :func:`_state` less the address and version: what a value made from the tensor depends on for its shapes."""
    return state[1:5]


class _Entry(NamedTuple):
    owners: tuple[weakref.ref, ...]  # to the sources' storages
    states: tuple[tuple, ...]
    value: object
    stale: bool = False  # invalidate(keep_values=True): never a hit, its tensors kept for a refresh
    versions: tuple = ()  # get's ``versions``


class FP8WeightCache:
    """Values derived from tensors (e.g. their FP8 quantization), reused while those tensors are unchanged.

    :meth:`get` returns the stored value when every source is on the same live storage, at the same
    address, shape, strides, dtype, device and version counter as when the value was made; otherwise it calls ``produce`` and stores the result in place of the old one (the old
    value is freed once nothing else holds it). An entry dies with its sources. See the module
    docstring for the writes the version counter does not see (``param.data``, optimizers outside
    ``torch.optim``, FSDP2's all-gather): call :meth:`invalidate` after those (``torch.optim``'s steps do it
    for :data:`EXPERT_WEIGHT_CACHE`).

    Stored values must never be written to by callers: they share them. With ``refresh``, :meth:`get` itself
    rewrites a stale value in place (same tensors, same addresses) instead of making a new one.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], _Entry] = {}
        self.hits = 0
        self.misses = 0

    def get(
        self,
        sources: Sequence[torch.Tensor],
        produce: Callable[[], T],
        refresh: Callable[[T], T] | None = None,
        versions: tuple = (),
    ) -> T:
        """The value made by ``produce()`` from ``sources``: cached, or made now and cached.

        ``versions``: more state that must be unchanged for a hit, e.g. the version counters of the DTensor
        parameters whose local shards ``sources`` are (an in-place write to a DTensor bumps its own counter,
        not its local tensor's).

        ``refresh(old)``: remake a stale value into ``old``'s own tensors, kept at their addresses (for the
        inputs of CUDA graphs); used when the same sources changed only in content or address (same shapes,
        strides, dtypes, devices), else ``produce()`` makes a new value. Whoever still holds the old value
        sees the new contents; an autograd graph that saved its tensors refuses to run (their versions moved).
        """
        if any(t.is_inference() for t in sources):  # no version counter to key on: never cache
            return produce()
        owners = tuple(_owner(t) for t in sources)
        key = tuple(id(o) for o in owners)
        states = tuple(_state(t) for t in sources)
        entry = self._entries.get(key)
        same_sources = entry is not None and all(ref() is o for ref, o in zip(entry.owners, owners, strict=True))
        if same_sources and not entry.stale and entry.states == states and entry.versions == versions:
            self.hits += 1
            return entry.value  # type: ignore[return-value]
        self.misses += 1
        if refresh is not None and same_sources and list(map(_layout, entry.states)) == list(map(_layout, states)):
            value = refresh(entry.value)
            self._entries[key] = _Entry(entry.owners, states, value, versions=versions)
            return value
        self._entries.pop(key, None)  # free the stale value before making the new one
        value = produce()
        refs = tuple(weakref.ref(o, self._forget(key)) for o in owners)
        self._entries[key] = _Entry(refs, states, value, versions=versions)
        return value

    def _forget(self, key: tuple[int, ...]) -> Callable[[weakref.ref], None]:
        """Weak-reference callback: drop the entry when one of its sources dies (ids may then be reused)."""
        cache = weakref.ref(self)  # the callback must not keep the cache alive

        def forget(ref: weakref.ref) -> None:
            live = cache()
            entry = None if live is None else live._entries.get(key)
            if entry is not None and any(r is ref for r in entry.owners):  # not a newer entry's
                del live._entries[key]

        return forget

    def invalidate(self, keep_values: bool = False) -> None:
        """Drop every entry (after writes the version counter cannot see: ``param.data``, FSDP2 gathers).

        ``keep_values``: mark every entry stale instead, keeping its tensors for :meth:`get`'s ``refresh``
        (which rewrites them in place: CUDA graphs keep reading the same addresses); a lookup without
        ``refresh`` replaces a stale entry as it would a changed one."""
        if keep_values:
            self._entries = {key: entry._replace(stale=True) for key, entry in self._entries.items()}
        else:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes held by the cached tensors."""
        return sum(
            t.untyped_storage().nbytes()
            for e in self._entries.values()
            for t in tree_leaves(e.value)
            if isinstance(t, torch.Tensor)
        )


EXPERT_WEIGHT_CACHE = FP8WeightCache()
"""The process-wide cache the MoE layers use with ``weight_cache="step"`` (keyed by their weights)."""


def _stale_after_optimizer_step(*_: object) -> None:
    """After any ``torch.optim`` optimizer's ``step()``: every cached tile may be stale (the fused optimizers
    do not bump version counters). Marked stale, tensors kept: a lookup under CUDA graphs rewrites them in place,
    any other replaces them."""
    EXPERT_WEIGHT_CACHE.invalidate(keep_values=True)


@functools.cache
def _watch_optimizer_steps() -> torch.utils.hooks.RemovableHandle:
    """Register :func:`_stale_after_optimizer_step` after every ``torch.optim`` step, once per process."""
    return register_optimizer_step_post_hook(_stale_after_optimizer_step)


def check_weight_cache_mode(mode: object) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`WEIGHT_CACHE_MODES`."""
    if mode not in WEIGHT_CACHE_MODES:
        raise ValueError(f"weight_cache must be one of {WEIGHT_CACHE_MODES}, got {mode!r}")


def _both_orientations(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, out: ExpertWeightsFP8 | None = None
) -> ExpertWeightsFP8:
    return quantize_expert_weights(w1, w2, w3, True, True, with_w13_t=True, with_w2_t=True, out=out)


def step_cached_weights(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, mode: str, static_addresses: bool = False
) -> ExpertWeightsFP8:
    """``weight_cache="step"``'s FP8 weights (both orientations) from :data:`EXPERT_WEIGHT_CACHE`, made now on
    a miss; :data:`NOTHING` for any other mode, and while dynamo traces (the lookup is Python state a graph
    cannot hold: a traced ``"step"`` quantizes in the graph, as ``"forward"``). Call it outside the graph
    and hand the tensors in: as inputs of a compiled graph they are never memory the graph may reuse.

    Also :data:`NOTHING` with grad mode off (``torch.no_grad()``, ``torch.inference_mode()``: evaluation):
    the cache serves training micro-batches, and a forward that trains nothing neither reads nor fills it
    (it quantizes afresh, as ``"off"``). So an evaluation never leaves inference tensors in the cache for
    the next training step to save for backward, and the usual EMA evaluation (the averaged weights copied
    in through ``param.data``, which no version counter sees, then the training weights copied back) runs
    on the averaged weights and leaves the training weights' tiles as they were.

    ``static_addresses``: for CUDA graphs (``compile_mode="reduce-overhead"``). A stale entry is re-quantized
    into its own tensors, so they keep their addresses for as long as the weights keep their shapes, and
    each is marked with ``torch._dynamo.mark_static_address(guard=False)``: a graph reads them where they
    are instead of copying them into its input buffers on every replay (the weights' bytes again), and
    records anew (no recompile) only if an address does change. The tiles are marked when they are made or
    remade (once per optimizer step), not on every lookup: a hit is the hot path of a host-bound step."""
    if mode != "step" or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return NOTHING
    _watch_optimizer_steps()

    def make(old: ExpertWeightsFP8 | None = None) -> ExpertWeightsFP8:
        """New tiles (``old`` None: the cache's ``produce``), or ``old``'s rewritten (its ``refresh``)."""
        tiles = _both_orientations(w1, w2, w3, out=old)
        if static_addresses:
            from torch._dynamo import mark_static_address  # only here: the module loads most of the compiler

            for t in tiles:
                mark_static_address(t, guard=False)
        return tiles

    # Local shards of DTensor parameters (expert parallelism, FSDP2): an in-place write to the parameter bumps
    # the DTensor's version counter, not the shard's.
    parents = (dtensor_of_local(w) for w in (w1, w2, w3))
    versions = tuple(None if p is None else p._version for p in parents)
    with torch.no_grad():  # FP8 tiles are constants to the layer's autograd graph
        return EXPERT_WEIGHT_CACHE.get((w1, w2, w3), make, make if static_addresses else None, versions)


def weights_for_forward(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    mode: str,
    rows: int,
    cached: ExpertWeightsFP8 = NOTHING,
    transposes: tuple[bool, bool] = (True, True),
) -> ExpertWeightsFP8 | ExpertWeightsHP:
    """The weights a forward over ``rows`` routed rows uses: ``cached`` (:func:`step_cached_weights`) when
    given; the weights themselves where the GEMMs quantize them (:func:`quantized_in_gemm`); else FP8
    tiles made now: the forward orientation (``"off"``), or with it (``"forward"``, a traced ``"step"``) the
    transposes that backward's FP8 dgrads will read, ``transposes`` = (``W13^T``, ``w2^T``): none is made
    for a dgrad that will not run (an input that needs no gradient, frozen layers before this one)."""
    if cached.w13 is not None:
        return cached
    if quantized_in_gemm(w1, w2, w3, rows, mode):
        return ExpertWeightsHP(w1, w2, w3)
    with_w13_t, with_w2_t = transposes if mode != "off" else (False, False)
    return quantize_expert_weights(w1, w2, w3, True, True, with_w13_t=with_w13_t, with_w2_t=with_w2_t)


def kept_for_backward(q: ExpertWeightsFP8 | ExpertWeightsHP, recompute: bool, mode: str) -> ExpertWeightsFP8:
    """What of the forward's FP8 weights backward keeps: nothing with ``mode`` ``"off"``; else the transposes
    made (+ W13 to recompute FC1)."""
    if isinstance(q, ExpertWeightsHP) or mode == "off":
        return NOTHING
    w13 = (q.w13, q.w13_scale) if recompute else (None, None)
    return ExpertWeightsFP8(*w13, q.w13_t, q.w13_t_scale, None, None, q.w2_t, q.w2_t_scale)


def split_kept(saved: Sequence[torch.Tensor | None]) -> tuple[ExpertWeightsFP8, Sequence[torch.Tensor | None]]:
    """Backward's ``saved_tensors`` after the leading ones: (what :func:`kept_for_backward` kept, the rest)."""
    n = len(ExpertWeightsFP8._fields)
    return ExpertWeightsFP8(*saved[:n]), saved[n:]


def weights_for_backward(
    kept: ExpertWeightsFP8,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    recompute: bool,
    weight: str,
    transpose: bool = True,
    in_gemm: bool = False,
) -> ExpertWeightsFP8 | ExpertWeightsHP:
    """The weights one backward GEMM needs: the weights themselves where the GEMMs quantize them
    (``in_gemm``: the forward's :func:`quantized_in_gemm`), what forward kept where it holds them all, or
    (``"off"``, or what forward did not make) the transpose quantized again from the same weights -- the same
    bits. ``weight`` is ``"w2"`` (FC2 dgrad's ``w2^T``) or ``"w13"`` (FC1 dgrad's ``W13^T``, plus W13 itself
    when FC1 is recomputed; ``transpose=False``: W13 only, for a FC1 dgrad that does not run in FP8). One at a
    time, so the layer can drop each transpose after its GEMM, before the weight gradients are written."""
    if in_gemm:
        return ExpertWeightsHP(w1, w2, w3)
    if weight not in ("w2", "w13"):
        raise ValueError(f"weight must be 'w2' or 'w13', got {weight!r}")
    w13 = weight == "w13"
    wanted = {"w13": w13 and recompute, "w13_t": w13 and transpose, "w2_t": not w13}
    if all(getattr(kept, name) is not None for name, want in wanted.items() if want):
        return kept
    return quantize_expert_weights(
        w1, w2, w3, wanted["w13"], False, with_w13_t=wanted["w13_t"], with_w2_t=wanted["w2_t"]
    )
