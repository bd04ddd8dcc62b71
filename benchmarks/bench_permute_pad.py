"""Benchmark permute_pad: route + fused gather of FP8 rows and their 1x128 scales into 128-aligned groups.

Cases: DeepSeek-V3-like (D = 7168, E = 32) and Qwen3-30B-A3B-like (D = 2048, E = 128) experts, top-8,
T*k = 32768 and 65536 routed rows, balanced and skewed (Zipf, some experts empty) routing.

Timed (inputs rotated past L2):
* ``permute_pad`` end to end (``route_pad`` on the router ids + the row kernel, scattering where rows are
  >= 4 KiB, + permuted probs),
  against ``torch.compile(fullgraph=True)`` of ``permute_pad_reference`` and against the unfused eager
  sequence a user would write (argsort, index_select gather, then a copy into the zeroed padded buffer,
  for data, scales and probs);
* the quantizing row kernel (``permute_pad_rows(quantize=True)``: BF16 tokens read once, quantized 1x128,
  scattered; with and without the token-order FP8 copy the FP8-Flow layer keeps) against the two ops it
  replaces (``quantize_1x128`` then ``permute_pad_rows``), device time of both in ``device_us`` /
  ``baseline_device_us``;
* the row kernel alone, both forms: gathering (``permute_pad_rows`` given ``src_rows``) and scattering (given
  ``dst_rows`` too), against ``torch.compile`` of ``permute_pad_rows_reference``.

Bytes at the algorithmic minimum (each input read once, each output written once):
* end to end: read x ``T*D`` (1 B) + scales ``T*D/128*4`` + ids ``T*k*8`` + probs ``T*k*4``; write data
  ``M_pad*D`` + scales ``M_pad*D/128*4`` + probs ``M_pad*4`` + src_rows ``M_pad*4`` + dst_rows ``T*k*4`` + offsets;
* gather / scatter: read x + scales + src_rows; write data + scales (the scatter's dst_rows, T*k*4, not counted).
``M_pad`` is the static bound the kernel writes in full (pad rows and the unused tail are zeroed).
Each token row is read once at the minimum, and once by the scatter, but fetched k times by the gather
(from L2 when it stays there); ``gbps_rows_fetched`` (gather rows) counts those k fetches.
``device_us`` (ours, both row kinds) is the call's device time with the host excluded (``_bench.device_us``):
``ours_us`` of the 5-launch end-to-end call follows the host CPU wherever the host is the slower.
"""

from __future__ import annotations

import sys

import torch
from _bench import DEVICE_NOTE, bench_us, device_us, n_rotations, routed_expert_ids, row, write_results

from fp8flow_ao._format import BLOCK, FP8_DTYPE
from fp8flow_ao.kernels.permute_pad import (
    launch_permute_pad_rows,
    launch_quantize_permute_pad_rows,
    padded_rows_bound,
    permute_pad,
    permute_pad_reference,
    permute_pad_rows,
    permute_pad_rows_reference,
    route_pad,
    scatter_pays,
)
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128
from fp8flow_ao.shapes import BENCH_DISPATCH_ROWS, DEEPSEEK_V3, QWEN3_30B_A3B


def unfused_permute_pad(x, x_scale, expert_indices, probs, num_experts):
    """The eager sequence without the fused kernel: sort rows by expert, gather them, then copy each
    expert's rows into its 128-aligned slot of a zeroed padded buffer (data, scales and probs)."""
    n, top_k = expert_indices.numel(), expert_indices.shape[1]
    flat = expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    data = x.view(torch.uint8).index_select(0, tokens)  # FP8 rows as bytes
    scale = x_scale.index_select(0, tokens)
    p = probs.reshape(-1).index_select(0, order)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    sorted_ids = flat.index_select(0, order)
    dest = (
        torch.arange(n, device=x.device)
        + ((torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts))[sorted_ids]
    )
    m_pad = padded_rows_bound(n, num_experts)
    out = torch.zeros((m_pad, x.shape[1]), dtype=torch.uint8, device=x.device).index_copy_(0, dest, data)
    out_scale = torch.zeros((m_pad, x_scale.shape[1]), device=x.device).index_copy_(0, dest, scale)
    out_probs = torch.zeros(m_pad, device=x.device).index_copy_(0, dest, p)
    return out.view(FP8_DTYPE), out_scale, out_probs, torch.cumsum(padded, 0)


def _gather(x, x_scale, src_rows, dst_rows, top_k):
    return permute_pad_rows(x, x_scale, src_rows, top_k)


def _scatter(x, x_scale, src_rows, dst_rows, top_k):
    """The scattering form pinned (the op scatters only where ``scatter_pays``): timed at every shape."""
    return launch_permute_pad_rows(x, x_scale, src_rows, top_k, dst_rows, scatter=True)


def _quantize_scatter(xb, src_rows, dst_rows, top_k, keep):
    """``quantize=True``: BF16 tokens quantized in the scattering kernel (``keep``: the token-order FP8 rows too,
    as the FP8-Flow layer's forward asks; without: its backward's dy)."""
    return launch_quantize_permute_pad_rows(xb, src_rows, top_k, dst_rows, keep)


def _quantize_then_rows(xb, src_rows, dst_rows, top_k, keep):
    """The same in two ops: quantize_1x128 (token-order FP8 rows), then the row kernel on them."""
    x8, s8 = quantize_1x128(xb)
    return permute_pad_rows(x8, s8, src_rows, top_k, dst_rows=dst_rows)


def _inputs(tokens: int, dim: int, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = (torch.randn(tokens, dim, device="cuda") * 64).to(FP8_DTYPE)
    x_scale = torch.exp2(torch.randint(-8, 8, (tokens, dim // BLOCK), device="cuda").float())
    probs = torch.rand(ids.shape, device="cuda")
    return x, x_scale, ids, probs


def bench_case(shape, total_rows: int, skewed: bool, compiled) -> list[dict]:
    top_k, experts, dim = shape.top_k, shape.experts, shape.dim
    tokens = total_rows // top_k
    m_pad = padded_rows_bound(total_rows, experts)
    nb = dim // BLOCK
    set_bytes = tokens * dim + tokens * nb * 4 + total_rows * 12
    sets = [
        _inputs(tokens, dim, routed_expert_ids(total_rows, top_k, experts, skewed, seed=i))
        for i in range(n_rotations(set_bytes))
    ]
    gather_sets = [(x, s, *route_pad(ids, experts)[:2], top_k) for x, s, ids, _ in sets]
    full_args = [(*s, experts) for s in sets]

    got, want = permute_pad(*full_args[0]), unfused_permute_pad(*full_args[0])
    if not torch.equal(got.data.view(torch.uint8), want[0].view(torch.uint8)) or not torch.equal(got.probs, want[2]):
        raise RuntimeError(f"permute_pad and the unfused baseline disagree on {shape.name} T*k={total_rows}")
    ours = bench_us(permute_pad, full_args)
    route_args = [(ids, experts) for _, _, ids, _ in sets]
    route_us = bench_us(route_pad, route_args)
    gather = bench_us(_gather, gather_sets)
    scatter = bench_us(_scatter, gather_sets)
    ref_full = bench_us(compiled["full"], full_args)
    eager = bench_us(unfused_permute_pad, full_args)
    ref_gather = bench_us(lambda x, s, src, dst, k: compiled["gather"](x, s, src, k), gather_sets)

    out_bytes = m_pad * dim + m_pad * nb * 4
    gather_bytes = set_bytes - total_rows * 12 + m_pad * 4 + out_bytes
    full_bytes = set_bytes + out_bytes + m_pad * 8 + total_rows * 4 + experts * 4
    fetched = (total_rows - tokens) * (dim + nb * 4)  # the k-1 extra fetches of each token row
    case = f"{shape.name} T*k={total_rows} D={dim} E={experts} {'skewed' if skewed else 'balanced'}"
    form = "scatter" if scatter_pays(dim, top_k) else "gather"
    full = {"what": f"route_pad + {form} + probs", "route_pad_us": round(route_us, 2)}
    full["device_us"] = device_us(permute_pad, full_args)
    full["route_pad_device_us"] = device_us(route_pad, route_args)
    part = {"what": "gather only", "gbps_rows_fetched": round((gather_bytes + fetched) / gather / 1e3, 1)}
    part["device_us"] = device_us(_gather, gather_sets)
    scattered = {"what": "scatter only (pinned)", "gbps_rows_fetched": None}
    scattered["device_us"] = device_us(_scatter, gather_sets)
    quantized = [
        _quantized_row(case, gather_sets, keep, tokens * dim * 2 + total_rows * 4 + out_bytes) for keep in (False, True)
    ]
    return [
        *quantized,
        row(case, ours, "torch.compile(fullgraph) permute_pad_reference", ref_full, bytes_moved=full_bytes, **full),
        row(case, ours, "unfused eager (argsort, index_select, pad copy)", eager, bytes_moved=full_bytes, **full),
        row(
            case,
            gather,
            "torch.compile(fullgraph) permute_pad_rows_reference",
            ref_gather,
            bytes_moved=gather_bytes,
            **part,
        ),
        row(
            case,
            scatter,
            "torch.compile(fullgraph) permute_pad_rows_reference",
            ref_gather,
            bytes_moved=gather_bytes,
            **scattered,
        ),
    ]


def _quantized_row(case: str, gather_sets, keep: bool, rows_bytes: int) -> dict:
    """``permute_pad_rows(quantize=True)`` (scatter form) against quantize_1x128 + permute_pad_rows, BF16 tokens
    in; checked bit for bit first. Bytes: BF16 x read once, dst_rows (the scatter form's index: ``T*k`` int32;
    session 51, the ``M_pad`` of src_rows before, under 1% of the bytes), the padded FP8 rows and scales written,
    and with ``keep`` the token-order FP8 rows and scales too."""
    tokens, dim = gather_sets[0][0].shape
    bf16_sets = [
        ((x.float() * s.repeat_interleave(BLOCK, 1)).to(torch.bfloat16), src, dst, k, keep)
        for (x, s, src, dst, k) in gather_sets
    ]
    fused, two_ops = _quantize_scatter(*bf16_sets[0])[:2], _quantize_then_rows(*bf16_sets[0])
    if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fused, two_ops, strict=True)):
        raise RuntimeError(f"permute_pad_rows(quantize=True) and quantize_1x128 + permute_pad_rows disagree on {case}")
    extra = {"what": f"quantize + scatter{' + token rows' if keep else ''} (quantize=True)"}
    extra["device_us"] = device_us(_quantize_scatter, bf16_sets)
    extra["baseline_device_us"] = round(device_us(_quantize_then_rows, bf16_sets), 2)
    bytes_moved = rows_bytes + (tokens * dim + tokens * (dim // BLOCK) * 4 if keep else 0)
    return row(
        case,
        bench_us(_quantize_scatter, bf16_sets),
        "quantize_1x128 + permute_pad_rows (two ops)",
        bench_us(_quantize_then_rows, bf16_sets),
        bytes_moved=bytes_moved,
        **extra,
    )


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_permute_pad: no CUDA device; nothing to measure.")
        return
    compiled = {
        "full": torch.compile(permute_pad_reference, fullgraph=True, dynamic=False),
        "gather": torch.compile(permute_pad_rows_reference, fullgraph=True, dynamic=False),
    }
    rows = [
        r
        for shape in (DEEPSEEK_V3, QWEN3_30B_A3B)
        for total_rows in BENCH_DISPATCH_ROWS
        for skewed in (False, True)
        for r in bench_case(shape, total_rows, skewed, compiled)
    ]
    notes = (
        "permute_pad rows time the whole public call: route_pad (three kernels: per-block expert counts, their "
        "scan per expert into bases and totals, the row scatter writing the offsets) + the fused FP8 data+scale "
        "row kernel (scatter or gather, see 'what') + permuted probs; route_pad_us is route_pad alone (host and "
        "device), route_pad_device_us its device time. 'gather only' rows time permute_pad_rows "
        "given src_rows (each padded row reads its token), 'scatter only (pinned)' rows the kernel's scattering "
        "form (each token read once, written to its k rows), which permute_pad runs where scatter_pays (rows >= 4 "
        "KiB). Bytes at the algorithmic minimum (x read once, all M_pad output rows written); gbps_rows_fetched "
        "(gather rows) counts each token row k times. 'quantize + scatter' rows time permute_pad_rows(quantize=True) "
        "on BF16 tokens (checked bit for bit against the two ops first; '+ token rows': also writing the token-order "
        "FP8 copy, as the layer's forward) against quantize_1x128 + permute_pad_rows (the two-step form that picks "
        "gather or scatter by scatter_pays); baseline_device_us is the two ops' device time. " + DEVICE_NOTE
    )
    write_results("permute_pad", rows, notes)


if __name__ == "__main__":
    sys.exit(main())
