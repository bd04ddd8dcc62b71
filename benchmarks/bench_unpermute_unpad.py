"""Benchmark unpermute_unpad: padded expert-major BF16 rows -> tokens, fused with the prob-weighted top-k sum.

Cases: DeepSeek-V3-like (D = 7168, E = 32) and Qwen3-30B-A3B-like (D = 2048, E = 128) experts, top-8,
T*k = 32768 and 65536 routed rows, balanced and skewed (Zipf, some experts empty) routing; probs fp32.

Timed (inputs rotated past L2; routing metadata from route_pad, computed outside the timing):
* forward ``unpermute_unpad(y, dst_rows, k, probs)`` against ``torch.compile(fullgraph=True)`` of
  ``unpermute_unpad_reference`` and against the unfused eager sequence a user would write (unpad:
  gather the real rows; index scatter back to (token, slot) order; weighted sum over k);
* backward ``unpermute_unpad_backward`` (grad_y in padded order + grad_probs) against ``torch.compile``
  of ``unpermute_unpad_backward_reference`` and against eager autograd through the unfused sequence.

Bytes at the algorithmic minimum (each input read once, each output written once):
* forward: read the ``T*k`` real rows of y ``T*k*D*2`` + dst_rows + probs ``T*k*(4+4)``; write ``T*D*2``;
* backward: read grad_out ``T*D*2`` + real rows of y ``T*k*D*2`` + probs, dst_rows ``T*k*8`` + src_rows
  ``M_pad*4``; write grad_y ``M_pad*D*2`` (pad rows zeroed) + grad_probs ``T*k*4``.

``device_us`` (ours, forward and backward) is the call's device time with the host excluded
(``_bench.device_us``), next to ``ours_us``, which follows the host CPU wherever the host is the slower.
"""

from __future__ import annotations

import sys

import torch
from _bench import DEVICE_NOTE, bench_us, device_us, n_rotations, routed_expert_ids, row, write_results

from fp8flow_ao.kernels.permute_pad import route_pad
from fp8flow_ao.kernels.unpermute_unpad import (
    unpermute_unpad,
    unpermute_unpad_backward,
    unpermute_unpad_backward_reference,
    unpermute_unpad_reference,
)
from fp8flow_ao.shapes import BENCH_DISPATCH_ROWS, DEEPSEEK_V3, QWEN3_30B_A3B


def unfused_unpermute_unpad(y, real_rows, order, probs):
    """The eager sequence without the fused kernel: unpad (gather the real rows, expert-major), scatter
    them back to (token, slot) order, then the prob-weighted sum over the k slots in fp32."""
    rows = y.index_select(0, real_rows)
    by_slot = torch.empty_like(rows)
    by_slot[order] = rows
    return (by_slot.view(*probs.shape, -1).float() * probs[..., None]).sum(1).to(y.dtype)


def _case_sets(shape, total_rows: int, skewed: bool) -> list[dict]:
    top_k, dim = shape.top_k, shape.dim
    ids = routed_expert_ids(total_rows, top_k, shape.experts, skewed)
    src_rows, dst_rows, _ = route_pad(ids, shape.experts)
    order = torch.argsort(ids.reshape(-1), stable=True)
    meta = {"src_rows": src_rows, "dst_rows": dst_rows, "order": order, "real_rows": dst_rows[order].long()}
    y_bytes = src_rows.numel() * dim * 2
    return [
        {
            **meta,
            "y": torch.randn(src_rows.numel(), dim, device="cuda", dtype=torch.bfloat16),
            "probs": torch.rand(ids.shape, device="cuda"),
            "grad_out": torch.randn(total_rows // top_k, dim, device="cuda", dtype=torch.bfloat16),
        }
        for _ in range(n_rotations(y_bytes))
    ]


def _eager_backward_sets(sets: list[dict]) -> list[tuple]:
    """One autograd graph of the unfused sequence per input set, replayed with retain_graph."""
    out = []
    for s in sets:
        y, probs = s["y"].detach().requires_grad_(), s["probs"].detach().requires_grad_()
        out.append((unfused_unpermute_unpad(y, s["real_rows"], s["order"], probs), (y, probs), s["grad_out"]))
    return out


def _eager_backward(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)


def bench_case(shape, total_rows: int, skewed: bool, compiled) -> list[dict]:
    top_k, dim = shape.top_k, shape.dim
    tokens = total_rows // top_k
    sets = _case_sets(shape, total_rows, skewed)
    m_pad = sets[0]["src_rows"].numel()
    fwd_args = [(s["y"], s["dst_rows"], top_k, s["probs"]) for s in sets]
    eager_args = [(s["y"], s["real_rows"], s["order"], s["probs"]) for s in sets]
    bwd_args = [(s["grad_out"], s["y"], s["src_rows"], s["dst_rows"], s["probs"], top_k) for s in sets]
    # same math, another fp32 summation order in the baseline's sum over k: equal up to bf16 rounding
    torch.testing.assert_close(
        unpermute_unpad(*fwd_args[0]), unfused_unpermute_unpad(*eager_args[0]), rtol=2**-7, atol=1e-3
    )

    fwd, fwd_dev = bench_us(unpermute_unpad, fwd_args), device_us(unpermute_unpad, fwd_args)
    fwd_ref = bench_us(compiled["fwd"], fwd_args)
    fwd_eager = bench_us(unfused_unpermute_unpad, eager_args)
    bwd, bwd_dev = bench_us(unpermute_unpad_backward, bwd_args), device_us(unpermute_unpad_backward, bwd_args)
    bwd_ref = bench_us(compiled["bwd"], bwd_args)
    bwd_eager = bench_us(_eager_backward, _eager_backward_sets(sets))

    fwd_bytes = total_rows * (dim * 2 + 8) + tokens * dim * 2
    bwd_bytes = tokens * dim * 2 + total_rows * (dim * 2 + 8) + m_pad * 4 + m_pad * dim * 2 + total_rows * 4
    case = f"{shape.name} T*k={total_rows} D={dim} E={shape.experts} {'skewed' if skewed else 'balanced'}"
    return [
        row(
            case,
            fwd,
            "torch.compile(fullgraph) unpermute_unpad_reference",
            fwd_ref,
            bytes_moved=fwd_bytes,
            device_us=fwd_dev,
            what="forward",
        ),
        row(
            case,
            fwd,
            "unfused eager (unpad gather, index scatter, weighted sum)",
            fwd_eager,
            bytes_moved=fwd_bytes,
            device_us=fwd_dev,
            what="forward",
        ),
        row(
            case,
            bwd,
            "torch.compile(fullgraph) unpermute_unpad_backward_reference",
            bwd_ref,
            bytes_moved=bwd_bytes,
            device_us=bwd_dev,
            what="backward",
        ),
        row(
            case,
            bwd,
            "eager autograd of the unfused sequence",
            bwd_eager,
            bytes_moved=bwd_bytes,
            device_us=bwd_dev,
            what="backward",
        ),
    ]


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_unpermute_unpad: no CUDA device; nothing to measure.")
        return
    compiled = {
        "fwd": torch.compile(unpermute_unpad_reference, fullgraph=True, dynamic=False),
        "bwd": torch.compile(unpermute_unpad_backward_reference, fullgraph=True, dynamic=False),
    }
    rows = [
        r
        for shape in (DEEPSEEK_V3, QWEN3_30B_A3B)
        for total_rows in BENCH_DISPATCH_ROWS
        for skewed in (False, True)
        for r in bench_case(shape, total_rows, skewed, compiled)
    ]
    notes = (
        "Forward with fp32 router probs (the weighted combine); backward = grad_y in padded order (pad rows "
        "zeroed) + grad_probs, one fused kernel. Routing metadata (route_pad) is computed outside the timing "
        "for all contenders. Bytes at the algorithmic minimum (real rows of y read once). " + DEVICE_NOTE
    )
    write_results("unpermute_unpad", rows, notes)


if __name__ == "__main__":
    sys.exit(main())
