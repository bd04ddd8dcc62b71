"""quantize_128x128: BF16/FP16/FP32 weights ``[E, N, K]`` -> E4M3 with one scale per 128 x 128 tile,
plus the exact transpose that the dgrad GEMM needs.

One pass per tile: read the 128 x 128 tile once, take its amax, derive the power-of-two scale, cast,
and write the tile to ``data`` and, transposed, to ``data_t``. A 128 x 128 block is symmetric under
transpose, so ``data_t[e] == data[e].T`` bit for bit and ``scale_inv_t[e] == scale_inv[e].T``: the
dgrad operand is the forward operand transposed, never a second quantization. (fp32 weights asking
for both orientations take two passes, one per orientation: a triton 3.6 miscompile, see ``_passes``.)

``w_tail`` quantizes the row concatenation ``cat([w, w_tail], dim=-2)`` without materializing it
(the MoE layer's ``W13 = [w1; w3]``): each program reads its tile from whichever input holds its
rows and writes straight into the joined outputs, so no FP8 ``torch.cat`` follows. Both row counts
are multiples of 128, so no tile spans the two inputs and the result is, bit for bit, the
quantization of the BF16 concatenation.

``quantize_128x128_pair`` quantizes two weights (the layer forward's W13 and w2) in one launch, each with
its own shape and outputs, bit for bit the two calls: one op call and one launch fewer on a host-bound step.

Layouts (all contiguous, row-major): ``w`` ``[E, N, K]`` or ``[N, K]``; ``data`` like ``w``;
``scale_inv`` fp32 ``[E, N/128, K/128]``; ``data_t`` ``[E, K, N]``; ``scale_inv_t`` ``[E, K/128, N/128]``.
``scale_inv`` is the dequantize multiplier: ``w ~= data * scale_inv`` broadcast over each tile.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from fp8flow_ao._checks import (
    check_bool,
    check_contiguous,
    check_multiple,
    check_no_grad,
    check_same_device,
    check_shape,
    check_tensor,
)
from fp8flow_ao._format import BLOCK, FP8_DTYPE, quantize_rows_reference
from fp8flow_ao.kernels._launch import launch_kernel
from fp8flow_ao.kernels._registry import define_op
from fp8flow_ao.kernels._triton_common import quantize_tile

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_128x128_configs() -> list[triton.Config]:
    """Launch configs of the kernel: every one is bit-exact (tests run each); :func:`default_config` picks.

    The tile is fixed by the format: one program owns one whole 128 x 128 tile (the amax needs all
    of it): 32 KiB of bf16 (64 KiB of fp32) read with 16-byte loads, written once or twice as fp8 with
    16-byte stores. Only the occupancy varies. 8 warps need ~103 registers a thread for bf16
    (ptxas, sm_90a): two programs per SM; capped at 80 (~28 spilled bytes) three fit. 16 and 4
    warps are the neighbours.
    """
    return [
        triton.Config({}, num_warps=8),
        triton.Config({}, num_warps=8, maxnreg=80),
        triton.Config({}, num_warps=16),
        triton.Config({}, num_warps=4),
    ]


@functools.cache  # called on every pass: build the config list once
def default_config(with_transpose: bool) -> triton.Config:
    """The config a pass runs with: 4 warps when it writes the transpose, else 8 warps capped at 80
    registers. A fixed rule, not autotuning: Triton's autotuner keyed on (N, K) served the first pass's
    choice to the other orientation, and its per-launch host work is ~2x a plain launch. Measured (H200,
    triton 3.6, bf16 weights, us for configs 8w / 8w-r80 / 16w / 4w): with the transpose W13 [32, 4096,
    7168] 1494 / 1432 / 1521 / 971, w2 [32, 7168, 2048] 744 / 715 / 742 / 484, [128, 1536, 2048] 631 /
    609 / 635 / 409; forward orientation only 703 / 651 / 714 / 665, 358 / 328 / 361 / 338, 304 / 283 /
    309 / 291. fp32 weights: every config within 1%."""
    configs = quantize_128x128_configs()
    return configs[3] if with_transpose else configs[1]


@triton.jit
def _quantize_tile(
    tile,
    w_ptr,
    tail_ptr,
    data_ptr,
    scale_inv_ptr,
    data_t_ptr,
    scale_inv_t_ptr,
    N,
    N_HEAD,
    K,
    WITH_DATA: tl.constexpr,
    WITH_TRANSPOSE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Quantize tile ``tile`` of one weight: (``pid_n``, ``pid_k``) of expert ``e``, the K tile index varying
    fastest so neighbouring programs read neighbouring tiles of the same rows. Rows ``[0, N_HEAD)`` of the
    ``N`` output rows come from ``w_ptr`` ``[E, N_HEAD, K]``, the rest from ``tail_ptr`` ``[E, N - N_HEAD, K]``
    (``N_HEAD == N``: no tail)."""
    tiles_n = N // TILE
    tiles_k = K // TILE
    pid_k = tile % tiles_k
    pid_n = (tile // tiles_k) % tiles_n
    e = (tile // (tiles_k * tiles_n)).to(tl.int64)
    rows = (pid_n * TILE + tl.arange(0, TILE)).to(tl.int64)
    cols = (pid_k * TILE + tl.arange(0, TILE)).to(tl.int64)
    base = e * N * K
    # A whole tile lies in one input (N_HEAD is a multiple of TILE): one scalar branch per program.
    if pid_n * TILE < N_HEAD:
        src = w_ptr + e * N_HEAD * K + rows[:, None] * K + cols[None, :]
    else:
        src = tail_ptr + e * (N - N_HEAD) * K + (rows - N_HEAD)[:, None] * K + cols[None, :]
    w = tl.load(src)
    q, scale_inv = quantize_tile(w)
    if WITH_DATA:
        tl.store(data_ptr + base + rows[:, None] * K + cols[None, :], q)
        tl.store(scale_inv_ptr + (e * tiles_n + pid_n) * tiles_k + pid_k, scale_inv)
    if WITH_TRANSPOSE:
        # data_t[e, k, n] = data[e, n, k]: the same q tile stored through transposed addresses; the
        # compiler's coalescing turns that into one layout change through shared memory. No
        # tl.trans: triton 3.6 on sm_90 mis-lays a transposed tile feeding an fp8 cast (rows came
        # out broadcast for bf16 input, and for fp32 input whole columns of the transpose were
        # wrong: NaN gradients with torchtitan's fp32 weights; seen on an H200).
        tl.store(data_t_ptr + base + cols[None, :] * N + rows[:, None], q)
        tl.store(scale_inv_t_ptr + (e * tiles_k + pid_k) * tiles_n + pid_n, scale_inv)


@triton.jit
def _quantize_128x128_kernel(
    w_ptr,
    tail_ptr,
    data_ptr,
    scale_inv_ptr,
    data_t_ptr,
    scale_inv_t_ptr,
    N,
    N_HEAD,
    K,
    WITH_DATA: tl.constexpr,
    WITH_TRANSPOSE: tl.constexpr,
    TILE: tl.constexpr,
):
    """One program per 128 x 128 tile of one weight (:func:`_quantize_tile`)."""
    _quantize_tile(
        tl.program_id(0), w_ptr, tail_ptr, data_ptr, scale_inv_ptr, data_t_ptr, scale_inv_t_ptr, N, N_HEAD, K,
        WITH_DATA, WITH_TRANSPOSE, TILE,
    )  # fmt: skip


@triton.jit
def _quantize_128x128_pair_kernel(
    w_ptr,
    tail_ptr,
    data_ptr,
    scale_inv_ptr,
    data_t_ptr,
    scale_inv_t_ptr,
    N,
    N_HEAD,
    K,
    second_ptr,
    second_tail_ptr,
    data2_ptr,
    scale_inv2_ptr,
    data_t2_ptr,
    scale_inv_t2_ptr,
    N2,
    N2_HEAD,
    K2,
    TILES_FIRST,
    WITH_DATA: tl.constexpr,
    WITH_TRANSPOSE: tl.constexpr,
    TILE: tl.constexpr,
):
    """One program per 128 x 128 tile of two weights (each with its own shape, tail and outputs): the first
    weight's for programs below ``TILES_FIRST``, the second's above it. Only the scalars are chosen per
    program, then one tile body runs: the single-weight kernel's registers (two inlined bodies spilled 1.5x
    as many instructions). A kernel of its own: its second weight's ten arguments would add host time to
    every single-weight launch (Triton specializes on each one)."""
    tile = tl.program_id(0)
    if tile >= TILES_FIRST:
        tile, N, N_HEAD, K = tile - TILES_FIRST, N2, N2_HEAD, K2
        w_ptr, tail_ptr, data_ptr, scale_inv_ptr = second_ptr, second_tail_ptr, data2_ptr, scale_inv2_ptr
        data_t_ptr, scale_inv_t_ptr = data_t2_ptr, scale_inv_t2_ptr
    _quantize_tile(
        tile, w_ptr, tail_ptr, data_ptr, scale_inv_ptr, data_t_ptr, scale_inv_t_ptr, N, N_HEAD, K,
        WITH_DATA, WITH_TRANSPOSE, TILE,
    )  # fmt: skip


def _joined_shape(w: torch.Tensor, w_tail: torch.Tensor | None) -> tuple[int, ...]:
    """Shape of ``cat([w, w_tail], dim=-2)`` (``w``'s shape without a tail)."""
    *lead, n, k = w.shape
    return (*lead, n + (0 if w_tail is None else w_tail.shape[-2]), k)


def _output_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Shapes of (data, scale_inv, data_t, scale_inv_t) for weights of ``shape`` (``[..., N, K]``)."""
    *lead, n, k = shape
    nb, kb = n // BLOCK, k // BLOCK
    return (*lead, n, k), (*lead, nb, kb), (*lead, k, n), (*lead, kb, nb)


def _allocate(
    w: torch.Tensor, with_transpose: bool, with_data: bool, w_tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Outputs for ``cat([w, w_tail], dim=-2)``; an orientation not asked for is a pair of empty ``(0,)``
    tensors (a custom op cannot return ``None``)."""
    shapes = _output_shapes(_joined_shape(w, w_tail))
    wanted = (with_data, with_data, with_transpose, with_transpose)
    shapes = tuple(shape if want else (0,) for shape, want in zip(shapes, wanted, strict=True))
    dtypes = (FP8_DTYPE, torch.float32, FP8_DTYPE, torch.float32)
    return tuple(w.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True))


def launch_quantize_128x128(
    w: torch.Tensor,
    with_transpose: bool = True,
    with_data: bool = True,
    w_tail: torch.Tensor | None = None,
    config: triton.Config | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Triton launcher (GPU, or CPU under ``TRITON_INTERPRET=1``). Same contract as :func:`quantize_128x128`.

    ``config=None``: each pass takes :func:`default_config`; tests pass each config to prove they agree.
    ``out``: the four outputs to write into, as :func:`_allocate` makes them (unchecked: the caller checks).
    """
    outs = out or _allocate(w, with_transpose, with_data, w_tail)
    _launch(((w, w_tail, outs),), with_transpose, with_data, config)
    return outs


def launch_quantize_128x128_pair(
    w: torch.Tensor,
    second: torch.Tensor,
    with_transpose: bool = True,
    with_data: bool = True,
    w_tail: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> tuple[torch.Tensor, ...]:
    """Triton launcher of :func:`quantize_128x128_pair`: both weights' eight outputs (``w``'s four, then
    ``second``'s), written by one launch. ``config`` as in :func:`launch_quantize_128x128`."""
    outs = _allocate(w, with_transpose, with_data, w_tail), _allocate(second, with_transpose, with_data)
    _launch(((w, w_tail, outs[0]), (second, None, outs[1])), with_transpose, with_data, config)
    return (*outs[0], *outs[1])


def _weight_args(
    w: torch.Tensor, w_tail: torch.Tensor | None, outs: tuple[torch.Tensor, ...], with_transpose: bool, with_data: bool
) -> tuple:
    """One weight's nine kernel arguments (input, tail, four outputs, N, N_HEAD, K)."""
    data, scale_inv, data_t, scale_inv_t = outs
    n, k = _joined_shape(w, w_tail)[-2:]
    # An output not asked for is never touched: any pointer of the right dtype stands in for it.
    return (
        w,
        w if w_tail is None else w_tail,  # without a tail the branch that reads it is never taken
        data if with_data else data_t,
        scale_inv if with_data else scale_inv_t,
        data_t if with_transpose else data,
        scale_inv_t if with_transpose else scale_inv,
        n,
        w.shape[-2],
        k,
    )


def _launch(
    weights: tuple[tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]], ...],
    with_transpose: bool,
    with_data: bool,
    config: triton.Config | None,
) -> None:
    """Quantize one or two ``(w, w_tail, outs)`` in one launch per pass: a program per tile, the first
    weight's tiles first."""
    tiles = [math.prod(_joined_shape(w, w_tail)) // (BLOCK * BLOCK) for w, w_tail, _ in weights]
    if sum(tiles) == 0:
        return
    args = [a for weight in weights for a in _weight_args(*weight, with_transpose, with_data)]
    kernel = _quantize_128x128_kernel
    if len(weights) == 2:
        kernel = _quantize_128x128_pair_kernel
        args.append(tiles[0])
    fp32 = any(w.dtype == torch.float32 for w, _, _ in weights)
    for flags in _passes(fp32, with_data, with_transpose):
        c = config or default_config(flags["WITH_TRANSPOSE"])
        launch_kernel(kernel, (sum(tiles),), *args, **flags, TILE=BLOCK, num_warps=c.num_warps, maxnreg=c.maxnreg)


def _passes(fp32: bool, with_data: bool, with_transpose: bool) -> list[dict[str, bool]]:
    """The kernel launches that write the asked-for orientations: one pass, except fp32 weights asking
    for both. Triton 3.6 on sm_90 miscompiles that case: the transposed copy came out wrong in every
    launch config while each orientation alone is right (fp32 parameters under torchtitan's one-GPU
    mixed precision, NaN gradients with ``recompute_experts``; seen on an H200). Two passes read the
    fp32 tile twice (measured 1.7-1.8x the one-pass time at the fp8flow_gpu and DeepSeek-V3 shapes)
    but are exact; bf16/fp16 weights keep the single pass."""
    if fp32 and with_data and with_transpose:
        return [{"WITH_DATA": True, "WITH_TRANSPOSE": False}, {"WITH_DATA": False, "WITH_TRANSPOSE": True}]
    return [{"WITH_DATA": with_data, "WITH_TRANSPOSE": with_transpose}]


def quantize_128x128_reference(
    w: torch.Tensor, with_transpose: bool = True, with_data: bool = True, w_tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Torch reference (the oracle and the CPU path): each 128 x 128 tile is flattened into one
    16384-wide row block and quantized by :func:`quantize_rows_reference`. A tail is joined in high
    precision first: the definition the fused kernel must match."""
    if w_tail is not None:
        w = torch.cat([w, w_tail], dim=-2)
    *lead, n, k = w.shape
    nb, kb = n // BLOCK, k // BLOCK
    tiles = w.reshape(*lead, nb, BLOCK, kb, BLOCK).transpose(-3, -2).reshape(*lead, nb, kb, BLOCK * BLOCK)
    tile_data, tile_scale = quantize_rows_reference(tiles, BLOCK * BLOCK)
    data = tile_data.reshape(*lead, nb, kb, BLOCK, BLOCK).transpose(-3, -2).reshape(*lead, n, k)
    scale_inv = tile_scale.reshape(*lead, nb, kb)
    # clone, not contiguous(): a transposed 1-tile-wide view is already contiguous and would alias.
    data_t, scale_inv_t = (t.transpose(-1, -2).clone(memory_format=torch.contiguous_format) for t in (data, scale_inv))
    empty = (data.new_empty((0,)), scale_inv.new_empty((0,)))
    return (*((data, scale_inv) if with_data else empty), *((data_t, scale_inv_t) if with_transpose else empty))


@define_op("quantize_128x128")
def _quantize_128x128_op(
    w: torch.Tensor, with_transpose: bool, with_data: bool, w_tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_128x128_reference(w, with_transpose, with_data, w_tail)


_quantize_128x128_op.register_kernel("cuda")(launch_quantize_128x128)


@_quantize_128x128_op.register_fake
def _(
    w: torch.Tensor, with_transpose: bool, with_data: bool, w_tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _allocate(w, with_transpose, with_data, w_tail)


def _check_out(
    out: object, w: torch.Tensor, with_transpose: bool, with_data: bool, w_tail: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """``out`` as the launcher's four tensors (an orientation not asked for: empty stand-ins), or an error
    naming the first output that is not what :func:`quantize_128x128` would return."""
    if torch.compiler.is_compiling():
        raise RuntimeError("quantize_128x128(out=...) writes in place outside autograd: call it eagerly")
    if not (isinstance(out, tuple) and len(out) == 4):
        raise TypeError(f"out must be a tuple (data, scale_inv, data_t, scale_inv_t), got {type(out).__name__}")
    expected = _allocate(w.to("meta"), with_transpose, with_data, None if w_tail is None else w_tail.to("meta"))
    wanted = (with_data, with_data, with_transpose, with_transpose)
    names = ("data", "scale_inv", "data_t", "scale_inv_t")
    for name, t, like, want in zip(names, out, expected, wanted, strict=True):
        if not want:
            if t is not None:
                raise ValueError(f"out {name} must be None: that orientation was not asked for")
            continue
        check_tensor(f"out {name}", t, dtypes=like.dtype, ndim=like.dim())
        check_shape(f"out {name}", t, tuple(like.shape))
        check_contiguous(f"out {name}", t)
        check_same_device(w=w, **{f"out_{name}": t})
    return tuple(
        t if want else w.new_empty((0,), dtype=like.dtype) for t, like, want in zip(out, expected, wanted, strict=True)
    )


def _write_into(
    out: tuple[torch.Tensor, ...], w: torch.Tensor, with_transpose: bool, with_data: bool, w_tail: torch.Tensor | None
) -> None:
    """Quantize into ``out`` (the launcher's four tensors): the kernel on CUDA, else the reference copied in.
    The written tensors' version counters move, so an autograd graph that saved them refuses to run."""
    if w.is_cuda:
        launch_quantize_128x128(w, with_transpose, with_data, w_tail, out=out)
        for t in out:
            torch.autograd.graph.increment_version(t)
        return
    for t, fresh in zip(out, quantize_128x128_reference(w, with_transpose, with_data, w_tail), strict=True):
        if fresh.numel():
            t.copy_(fresh)


def _check_weight(name: str, w: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _INPUT_DTYPES) -> None:
    check_tensor(name, w, dtypes=dtypes, ndim=(2, 3))
    check_contiguous(name, w)
    check_multiple(name, w.shape[-2], what="dim N (-2)")
    check_multiple(name, w.shape[-1], what="dim K (-1)")


def _check_args(op: str, w: torch.Tensor, with_transpose: bool, with_data: bool, w_tail: torch.Tensor | None) -> None:
    """What :func:`quantize_128x128` needs of its arguments (``out`` aside)."""
    _check_weight("w", w)
    check_bool("with_transpose", with_transpose)
    check_bool("with_data", with_data)
    if not (with_data or with_transpose):
        raise ValueError("with_data and with_transpose are both False: nothing to compute")
    if w_tail is not None:
        check_tensor("w_tail", w_tail, dtypes=w.dtype, ndim=w.dim())
        check_contiguous("w_tail", w_tail)
        check_same_device(w=w, w_tail=w_tail)
        if w_tail.shape[:-2] != w.shape[:-2] or w_tail.shape[-1] != w.shape[-1]:
            raise ValueError(
                f"w_tail must match w [..., N, K] in every dim but N (-2): w {tuple(w.shape)}, "
                f"w_tail {tuple(w_tail.shape)}"
            )
        check_multiple("w_tail", w_tail.shape[-2], what="dim N (-2)")
    check_no_grad(op, w, w_tail)


def quantize_128x128(
    w: torch.Tensor,
    with_transpose: bool = True,
    with_data: bool = True,
    w_tail: torch.Tensor | None = None,
    out: tuple[torch.Tensor | None, ...] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Quantize weights to E4M3 with one power-of-two scale per 128 x 128 tile.

    Args:
        w: ``[E, N, K]`` (one matrix per expert) or ``[N, K]``, bf16, fp16 or fp32, contiguous
            (row-major). ``N`` and ``K`` must be multiples of 128.
        with_transpose: also return the transposed copy for the dgrad GEMM (written by the same pass).
        with_data: return the forward orientation; ``False`` with ``with_transpose=True`` gives only the
            transposed copy (the MoE backward re-quantizes weights this way instead of keeping FP8
            copies of every layer's weights alive from forward to backward).
        w_tail: optional ``[E, N2, K]`` (or ``[N2, K]``) rows appended below ``w``: the result is that of
            ``cat([w, w_tail], dim=-2)`` ``[E, N + N2, K]``, bit for bit, written in one pass without
            the concatenation (the MoE layer's ``W13 = [w1; w3]``). Same dtype, device, leading dims
            and ``K`` as ``w``; contiguous; ``N2`` a multiple of 128.
        out: optional ``(data, scale_inv, data_t, scale_inv_t)`` to write into instead of new tensors, each
            exactly as returned (shape, dtype, device, contiguous; ``None`` for an orientation not asked
            for); they are returned. Eager only (not while ``torch.compile`` traces): the writes bypass
            autograd, and the outputs' version counters are bumped. For buffers whose address must not
            change, e.g. the inputs of a CUDA graph (``weight_cache="step"`` under ``compile_mode=
            "reduce-overhead"``).

    Returns:
        ``(data, scale_inv, data_t, scale_inv_t)``, all contiguous (no ``E`` dim for a 2-D ``w``;
        ``N`` below counts the tail's rows too):

        * ``data`` E4M3 ``[E, N, K]``, row-major (K contiguous); ``None`` unless ``with_data``.
        * ``scale_inv`` fp32 ``[E, N/128, K/128]``: the dequantize multiplier of each tile
          (``w ~= data * scale_inv``), a power of two; ``+inf`` for a tile holding ``+-inf``;
          ``None`` unless ``with_data``.
        * ``data_t`` E4M3 ``[E, K, N]`` (N contiguous): bit for bit ``data[e].T``; ``None`` unless
          ``with_transpose``.
        * ``scale_inv_t`` fp32 ``[E, K/128, N/128]``: ``scale_inv[e].T``; ``None`` unless ``with_transpose``.
    """
    _check_args("quantize_128x128", w, with_transpose, with_data, w_tail)
    if out is not None:
        _write_into(_check_out(out, w, with_transpose, with_data, w_tail), w, with_transpose, with_data, w_tail)
        return out
    return _as_asked(
        torch.ops.fp8flow.quantize_128x128(w, with_transpose, with_data, w_tail), with_transpose, with_data
    )


def _as_asked(
    outs: tuple[torch.Tensor, ...], with_transpose: bool, with_data: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The op's four outputs with ``None`` for an orientation not asked for (the op returns empty stand-ins)."""
    data, scale_inv, data_t, scale_inv_t = outs
    forward = (data, scale_inv) if with_data else (None, None)
    return (*forward, *((data_t, scale_inv_t) if with_transpose else (None, None)))


@define_op("quantize_128x128_pair")
def _quantize_128x128_pair_op(
    w: torch.Tensor, w_tail: torch.Tensor | None, second: torch.Tensor, with_transpose: bool, with_data: bool
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    return (
        *quantize_128x128_reference(w, with_transpose, with_data, w_tail),
        *quantize_128x128_reference(second, with_transpose, with_data),
    )


@_quantize_128x128_pair_op.register_kernel("cuda")
def _(
    w: torch.Tensor, w_tail: torch.Tensor | None, second: torch.Tensor, with_transpose: bool, with_data: bool
) -> tuple[torch.Tensor, ...]:
    return launch_quantize_128x128_pair(w, second, with_transpose, with_data, w_tail)


@_quantize_128x128_pair_op.register_fake
def _(
    w: torch.Tensor, w_tail: torch.Tensor | None, second: torch.Tensor, with_transpose: bool, with_data: bool
) -> tuple[torch.Tensor, ...]:
    return (*_allocate(w, with_transpose, with_data, w_tail), *_allocate(second, with_transpose, with_data))


def quantize_128x128_pair(
    w: torch.Tensor,
    second: torch.Tensor,
    with_transpose: bool = True,
    with_data: bool = True,
    w_tail: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]:
    """Two weights quantized by one launch: ``(quantize_128x128(w, with_transpose, with_data, w_tail),
    quantize_128x128(second, with_transpose, with_data))``, bit for bit, each with its own shape and outputs.

    One call and one launch instead of two: the MoE layer's forward quantizes ``W13 = [w1; w3]`` (``w``
    with ``w_tail``) and ``w2`` (``second``) together. ``second`` follows :func:`quantize_128x128`'s rules
    for ``w`` (2 or 3 dims, contiguous, ``N`` and ``K`` multiples of 128; its own shape), with ``w``'s dtype
    and device; it takes no tail. No ``out``: write into existing tensors with :func:`quantize_128x128`.
    """
    _check_args("quantize_128x128_pair", w, with_transpose, with_data, w_tail)
    _check_weight("second", second, dtypes=(w.dtype,))  # one kernel: both weights' pointers share a type
    check_same_device(w=w, second=second)
    check_no_grad("quantize_128x128_pair", second)
    outs = torch.ops.fp8flow.quantize_128x128_pair(w, w_tail, second, with_transpose, with_data)
    return tuple(tuple(_as_asked(outs[i : i + 4], with_transpose, with_data)) for i in (0, 4))
