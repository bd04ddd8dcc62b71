"""The whole op ``fp8_grouped_mm`` (quantization included), forward and forward + backward, side by
side with:

* BF16 ``torch._grouped_mm`` (same groups),
* torchao 0.18's blockwise FP8 op on DeepGEMM
  (``torchao.prototype.moe_training.blockwise_fp8.grouped_mm._to_fp8_blockwise_then_scaled_grouped_mm``;
  skipped with a printed reason when ``deep_gemm`` is not importable: without it torchao runs its
  emulated path, which measures nothing useful),
* torchao 0.18's row-wise FP8 op (``...moe_training.fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm``,
  aligned groups only: it cannot pad yet).

Every method gets the same bf16 ``A [M, K]`` and ``W [E, N, K]`` (``B_t = W.transpose(-2, -1)``, as
torchtitan calls it) and the same group END offsets. Modes:

* ``fwd``: ``out = op(A, B_t, offs)``; FLOPs 2 M N K.
* ``fwd+bwd``: forward and ``torch.autograd.grad(out, (A, W), dOut)`` (dA and dW returned, nothing
  accumulated); FLOPs 6 M N K.
* ``fwd+bwd accumulate``: forward and ``out.backward(dOut)`` with ``A.grad`` and ``W.grad`` already
  present (gradient accumulation: our wgrad adds into ``W.grad`` in its epilogue, the others write
  dW and autograd adds it).
* ``fwd+bwd cuda graph`` (``--modes``; not run by default): ``fwd+bwd`` captured once in a CUDA graph per method
  and replayed, as a caller does whose step is host-bound (fine-grained experts): what is left is the device's
  time. Ours and BF16 only (torchao's ops are compared eagerly).

SQNR (dB) of out, dA and dW of every method against fp32 math on the same bf16 operands (one fp32
matmul per group) is in each row, ours and the baseline's. Shapes: the DeepSeek-V3 anchors of
PERF.md (as ``bench_grouped_gemm_fp8_blockwise.py``), fine-grained experts (E = 64-128, 128-256
tokens per expert, D 2048-7168, H 768-2048; K = D, N = 2H is FC1, K = H, N = D is FC2), and one case
whose groups are not multiples of 128 (ours pads on the device; the aligned cases pass
``offs_aligned=True``, the FP8-Flow layout).

    python benchmarks/bench_fp8_grouped_mm.py
    python benchmarks/bench_fp8_grouped_mm.py --cases E=128 E=64 --modes "fwd+bwd" "fwd+bwd cuda graph" --tag _cuda_graph

``--cases`` keeps the cases whose name (``M=... K=... N=... E=... routing``) contains any of the given strings;
``--baselines`` keeps the baselines whose name contains any of the given strings (ours always runs), e.g.
``--baselines DeepGEMM`` where only torchao's DeepGEMM-backed op is wanted (it compiles each new shape, the
slow part of a run); ``--tag`` is appended to the result files' names. A baseline that raises on a case (a
shape its kernels refuse) is left out of that case with the error printed; ours raising stops the run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import (  # noqa: E402
    balanced_counts,
    bench_us,
    host_and_device_us,
    import_deep_gemm,
    require_cuda,
    row,
    skewed_counts,
    write_results,
)
from bench_grouped_gemm_fp8_blockwise import DEFAULT_CASES as ANCHOR_CASES  # noqa: E402

from fp8flow_ao._format import BLOCK  # noqa: E402
from fp8flow_ao.debug import sqnr_db  # noqa: E402
from fp8flow_ao.shapes import DEEPSEEK_V3, QWEN3_30B_A3B  # noqa: E402

# (M, K, N, E, routing): "balanced" / "skewed" groups padded to multiples of 128 rows (the FP8-Flow
# layout), "unaligned": Zipf-like group sizes as the router gives them, not padded. FC1 of a shape is
# K = D, N = 2H; FC2 is K = H, N = D.
_DS, _QW = DEEPSEEK_V3, QWEN3_30B_A3B
CASES = [
    *ANCHOR_CASES,  # the DeepSeek-V3 anchors of PERF.md, as in bench_grouped_gemm_fp8_blockwise.py
    (16384, _QW.dim, 2 * _QW.hidden, _QW.experts, "balanced"),  # fine-grained: 128 tokens/expert, FC1
    (16384, _QW.hidden, _QW.dim, _QW.experts, "balanced"),  # ... FC2
    (16384, _DS.dim, 2 * _DS.hidden, 64, "balanced"),  # DeepSeek-like D and H, 64 experts x 256 tokens, FC1
    (16384, _DS.hidden, _DS.dim, 64, "balanced"),  # ... FC2
    (32768, 4096, 2048, 128, "skewed"),  # 128 experts, 256 tokens/expert on average, some empty
    (16384, _QW.dim, 2 * _QW.hidden, _QW.experts, "unaligned"),  # group sizes as routed: ours pads
]
DEFAULT_MODES = ("fwd", "fwd+bwd", "fwd+bwd accumulate")
GRAPHED_MODE = "fwd+bwd cuda graph"
FLOPS_PER_MODE = {"fwd": 2, "fwd+bwd": 6, "fwd+bwd accumulate": 6, GRAPHED_MODE: 6}  # x M N K
GRAPHED_BASELINE = "bf16 torch._grouped_mm"  # the graphed mode times ours and this one
GRAPHED_NOTE = (
    "forward + autograd.grad captured once in a CUDA graph per method (after two warm-up calls on a side stream) "
    "and replayed, ours and BF16 torch._grouped_mm only: the host enqueues one graph launch, so the time is the "
    "device's."
)


def group_counts(m: int, e: int, routing: str) -> list[int]:
    counts = balanced_counts(m, e) if routing == "balanced" else skewed_counts(m, e, empty=max(1, e // 8))
    if routing == "unaligned":
        return counts
    # Padded to 128 (the aligned layout), shrinking the largest group so M stays as named.
    padded = [-(-c // BLOCK) * BLOCK for c in counts]
    padded[padded.index(max(padded))] -= sum(padded) - m
    return padded


def make_problem(m: int, k: int, n: int, e: int, routing: str) -> dict:
    counts = group_counts(m, e, routing)
    ends = list(itertools.accumulate(counts))
    return {
        "counts": counts,
        "offs": torch.tensor(ends, dtype=torch.int32, device="cuda"),
        "a": torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
        "w": torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5,
        "grad_out": torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
        "aligned": routing != "unaligned",
    }


def methods(p: dict, deep_gemm, baselines: list[str] | None = None) -> dict[str, Callable]:
    """name -> ``f(a, b_t, offs) -> out``: ours first, then the baselines available here whose name contains
    any of ``baselines`` (all where ``None``)."""
    from fp8flow_ao.grouped_mm import fp8_grouped_mm

    aligned = p["aligned"]
    found = {"ours": lambda a, b_t, offs: fp8_grouped_mm(a, b_t, offs, offs_aligned=aligned)}
    found["bf16 torch._grouped_mm"] = lambda a, b_t, offs: torch._grouped_mm(a, b_t, offs=offs)
    try:
        from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import (
            _to_fp8_blockwise_then_scaled_grouped_mm,
        )
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception as exc:  # torchao missing or too old: the bf16 baseline still runs
        print(f"skipping the torchao rows: {type(exc).__name__}: {exc}")
        return chosen(found, baselines)
    if deep_gemm is not None:
        found["torchao blockwise fp8 (DeepGEMM)"] = _to_fp8_blockwise_then_scaled_grouped_mm
    if aligned:  # torchao 0.18's row-wise op cannot pad yet (it asserts): groups must be multiples of 16
        found["torchao rowwise fp8"] = lambda a, b_t, offs: _to_fp8_rowwise_then_scaled_grouped_mm(
            a, b_t, offs, pad_token_groups_for_grouped_mm=False
        )
    else:
        print("skipping torchao rowwise fp8 on unaligned groups: torchao 0.18 cannot pad them for it")
    return chosen(found, baselines)


def chosen(found: dict[str, Callable], baselines: list[str] | None) -> dict[str, Callable]:
    """``found`` less the baselines whose name contains none of ``baselines`` (``None``: all kept); ours stays."""
    return {n: f for n, f in found.items() if n == "ours" or baselines is None or any(b in n for b in baselines)}


def fp32_reference(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, dA, dW in fp32 math on the bf16 operands, one matmul per group (sizes known on the host)."""
    a, w, g = p["a"].float(), p["w"].float(), p["grad_out"].float()
    out, grad_a = torch.zeros(a.shape[0], w.shape[1], device="cuda"), torch.zeros_like(a)
    grad_w = torch.zeros_like(w)
    start = 0
    for e, c in enumerate(p["counts"]):
        rows = slice(start, start + c)
        out[rows] = a[rows] @ w[e].t()
        grad_a[rows] = g[rows] @ w[e]
        grad_w[e] = g[rows].t() @ a[rows]
        start += c
    return out, grad_a, grad_w


def accuracy(fn: Callable, p: dict, ref: tuple) -> dict[str, float]:
    """SQNR of out, dA, dW against the fp32 reference, over the rows inside the groups."""
    a, w = p["a"].detach().requires_grad_(), p["w"].detach().requires_grad_()
    out = fn(a, w.transpose(-2, -1), p["offs"])
    grad_a, grad_w = torch.autograd.grad(out, (a, w), p["grad_out"])
    rows = sum(p["counts"])
    got = (out[:rows], grad_a[:rows], grad_w)
    want = (ref[0][:rows], ref[1][:rows], ref[2])
    return {name: round(sqnr_db(r, x), 2) for name, r, x in zip(("out", "dA", "dW"), want, got, strict=True)}


def accuracies(found: dict[str, Callable], p: dict, ref: tuple) -> dict[str, dict[str, float]]:
    """``accuracy`` of each method; a baseline that raises (a shape its kernels refuse) is left out with the error
    printed, ours raising propagates."""
    sqnr = {}
    for name, fn in found.items():
        try:
            sqnr[name] = accuracy(fn, p, ref)
        except Exception as exc:
            if name == "ours":
                raise
            print(f"skipping {name} on this case: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return sqnr


def captured(step: Callable[[], object]) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (after a warm-up on a side stream): the graph's ``replay``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def timed(fn: Callable, p: dict, mode: str) -> tuple[float, float, float]:
    """Median microseconds of one call in ``mode`` (see the module docstring), then the host's and the
    device's microseconds per call measured apart (``host_and_device_us``)."""
    a, w = p["a"].detach().requires_grad_(), p["w"].detach().requires_grad_()
    offs, grad_out = p["offs"], p["grad_out"]
    if mode == "fwd":

        def step():
            with torch.no_grad():
                fn(a, w.transpose(-2, -1), offs)

    elif mode in ("fwd+bwd", GRAPHED_MODE):

        def step():
            torch.autograd.grad(fn(a, w.transpose(-2, -1), offs), (a, w), grad_out)

        if mode == GRAPHED_MODE:
            step = captured(step)
    else:
        a.grad, w.grad = torch.zeros_like(a), torch.zeros_like(w)

        def step():
            fn(a, w.transpose(-2, -1), offs).backward(grad_out)

    # One input set: A and W together are >= 80 MB at every shape here, past the 50-60 MB L2.
    return (bench_us(step, [()]), *host_and_device_us(step, HOST_DEVICE_ITERS))


HOST_DEVICE_ITERS = 10
NOTES = (
    "Whole op, quantization included, bf16 inputs and weights. ours_us / baseline_us: end to end, the median "
    "of do_bench's single calls timed by CUDA events (its L2 flush runs between calls; a host slower than the "
    "device shows here); ours_host_us, ours_device_us, baseline_host_us, baseline_device_us: measured "
    "apart with the GPU held busy (host above device = host-bound: the op then runs at the host CPU's speed), "
    "device_speedup = baseline_device_us / ours_device_us. tflops = ours, baseline_tflops = the named "
    "baseline on the same FLOPs (fwd 2MNK, fwd+bwd 6MNK). sqnr_* = ours, baseline_sqnr_* = the baseline, "
    "dB vs fp32 math on the same bf16 operands. Aligned cases call ours with offs_aligned=True; 'unaligned' "
    "pads on the device (torchao pads internally in every case). 'fwd+bwd accumulate': .backward() into "
    "existing A.grad / W.grad (our wgrad epilogue adds into W.grad)."
)


def timed_methods(found: dict[str, Callable], p: dict, mode: str) -> dict[str, tuple]:
    """``timed`` of each method; the graphed mode times ours and BF16 only (torchao's ops are compared eagerly)."""
    graphed = mode == GRAPHED_MODE
    return {name: timed(fn, p, mode) for name, fn in found.items() if not graphed or name in ("ours", GRAPHED_BASELINE)}


def case_name(m: int, k: int, n: int, e: int, routing: str) -> str:
    return f"M={m} K={k} N={n} E={e} {routing}"


def run(
    deep_gemm, cases: list[tuple], modes: tuple[str, ...], tag: str, baselines: list[str] | None = None
) -> list[dict]:
    """Every case; the result files are rewritten after each one, so a run stopped by its time limit
    (DeepGEMM compiles each new shape on first use) keeps the cases it finished."""
    rows_out = []
    for i, (m, k, n, e, routing) in enumerate(cases):
        p = make_problem(m, k, n, e, routing)
        case = case_name(m, k, n, e, routing)
        ref = fp32_reference(p)
        found = methods(p, deep_gemm, baselines)
        sqnr = accuracies(found, p, ref)
        found = {name: found[name] for name in sqnr}
        del ref
        for mode in modes:
            times = timed_methods(found, p, mode)
            us = {name: t[0] for name, t in times.items()}
            flops = FLOPS_PER_MODE[mode] * m * n * k
            print(f"{mode} {case}: " + ", ".join(f"{name} {t:.0f} us" for name, t in us.items()), flush=True)
            _, ours_host, ours_device = times["ours"]
            for name in list(times)[1:]:
                rows_out.append(
                    row(
                        f"{mode} {case}",
                        us["ours"],
                        name,
                        us[name],
                        flops=flops,
                        baseline_tflops=round(flops / us[name] / 1e6, 1),
                        ours_host_us=round(ours_host, 1),
                        ours_device_us=round(ours_device, 1),
                        baseline_host_us=round(times[name][1], 1),
                        baseline_device_us=round(times[name][2], 1),
                        device_speedup=round(times[name][2] / ours_device, 3),
                        **{f"sqnr_{t}": v for t, v in sqnr["ours"].items()},
                        **{f"baseline_sqnr_{t}": v for t, v in sqnr[name].items()},
                    )
                )
        del p
        torch.cuda.empty_cache()
        done = "" if i + 1 == len(cases) else f" Partial: {i + 1} of {len(cases)} cases (the run stopped)."
        graphed = f" '{GRAPHED_MODE}': {GRAPHED_NOTE}" if GRAPHED_MODE in modes else ""
        write_results("fp8_grouped_mm" + tag, rows_out, NOTES + graphed + done)
    return rows_out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [case_name(*c) for c in CASES]
    parser.add_argument(
        "--cases", nargs="+", default=None, help=f"keep the cases whose name contains any of these (names: {names})"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=(*DEFAULT_MODES, GRAPHED_MODE), default=list(DEFAULT_MODES), help="modes to time"
    )
    parser.add_argument(
        "--baselines",
        nargs="+",
        default=None,
        help="keep the baselines whose name contains any of these (ours always runs; default: every one found)",
    )
    parser.add_argument("--tag", default="", help="appended to the result files' names (keeps another run's files)")
    args = parser.parse_args(argv)
    args.cases = [c for c in CASES if args.cases is None or any(s in case_name(*c) for s in args.cases)]
    if not args.cases:
        parser.error(f"--cases matched none of {names}")
    return args


def main() -> None:
    args = parse_args()
    if not require_cuda("bench_fp8_grouped_mm"):
        return
    torch.manual_seed(0)
    run(import_deep_gemm(), args.cases, tuple(args.modes), args.tag, args.baselines)


if __name__ == "__main__":
    main()
