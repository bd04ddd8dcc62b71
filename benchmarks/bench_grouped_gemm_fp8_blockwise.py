"""Blockwise FP8 grouped GEMMs -- forward, dgrad (``grouped_gemm_fp8_blockwise``) and wgrad
(``grouped_gemm_fp8_wgrad``) -- side by side with:

* BF16 ``torch._grouped_mm`` (same groups),
* FP8 row-wise ``torch._scaled_grouped_mm`` (same FP8 data, one scale per row/column),
* cuBLAS dense blockwise FP8 ``F.scaled_mm`` (1x128 x 128x128; 1x128 x 1x128 for wgrad) over all
  M rows with one expert's weight: the same FLOPs as one dense GEMM, the bar a grouped kernel aims at,
* torchao's Triton dense blockwise GEMMs (``triton_fp8_gemm_1x128_128x128``; ``..._128x1`` for wgrad),
  same dense problem,
* DeepGEMM (when ``deep_gemm`` is importable; skipped with a printed reason otherwise): its
  M-grouped contiguous kernel (``m_grouped_fp8_gemm_nt_contiguous``) for forward and dgrad on our FP8
  data and weight scales, the activation scales in the M-major layout it reads; its K-grouped
  contiguous kernel (``k_grouped_fp8_gemm_nt_contiguous``) for wgrad on our column-wise FP8 data laid
  out its way (each expert's ``[N, tokens]`` chunk flattened in turn). Layout changes are made once,
  outside the timing. Its sm90 wgrad writes fp32 ``D = C + A B`` (zero ``C`` here); ours writes bf16.

Wgrad operands as the MoE layer and ``fp8_grouped_mm`` make them: dY^T quantized column-wise (one scale per
128 tokens x 1 column), X^T re-encoded from the row-wise X by ``scaling_aware_transpose`` (one scale per
128 x 128 tile), which ours reads one per tile (``b_tile_scales=True``); the baseline row "fp8flow op,
per-column B scales" runs our kernel on the same data reading every column's scale (the form before).

FLOPs = 2 * rows * N * K with rows = the padded rows of all groups (what every grouped method
computes); TFLOP/s = FLOPs / time. Shapes from PERF.md: M = 16384 / 32768 routed rows, (K, N) =
(7168, 4096), (2048, 7168), (7168, 2048), E = 8 / 32, balanced or skewed (Zipf, empty experts).
Forward: out[M, N] = X[M, K] W_e^T; dgrad: dX[M, K] = dY[M, N] W_e; wgrad: dW_e[N, K] = dY_e^T X_e.
"ours" is the op's CUDA kernel (on Hopper the warp-specialized Gluon sm90 kernel); our Triton tl.dot
kernel runs beside it as a baseline row.

    python benchmarks/bench_grouped_gemm_fp8_blockwise.py            # default subset (~2-3 min on H100)
    python benchmarks/bench_grouped_gemm_fp8_blockwise.py --full     # the whole matrix
    python benchmarks/bench_grouped_gemm_fp8_blockwise.py --sweep    # time every launch config, no autotune
    python benchmarks/bench_grouped_gemm_fp8_blockwise.py --weights  # bf16 weights quantized in the GEMM or before it

``--weights`` (results ``grouped_gemm_weights``): forward and dgrad with the bf16 weight as the op's
``b``, quantized tile by tile inside the kernel (ours), against ``quantize_128x128`` of the weight (the
orientation the pass needs) followed by the FP8 call -- what the MoE layer and ``fp8_grouped_mm`` did
before -- and against the FP8 call alone on weights quantized beforehand (a cached FP8 weight), over
rows per expert from 128 to 2048 at DeepSeek-V3 and Qwen3-30B-A3B expert dims: where the in-GEMM path
stops paying is the layer's rule (``quantize_weights_in_gemm``).
"""

from __future__ import annotations

import argparse
import functools
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
    bits_equal,
    import_deep_gemm,
    require_cuda,
    row,
    skewed_counts,
    write_results,
)

from fp8flow_ao._format import BLOCK, quantize_rows_reference  # noqa: E402
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128_reference  # noqa: E402
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose  # noqa: E402

DEFAULT_CASES = [  # (M, K, N, E, routing)
    (16384, 7168, 4096, 8, "balanced"),
    (16384, 2048, 7168, 8, "balanced"),
    (32768, 7168, 2048, 32, "balanced"),
    (16384, 7168, 4096, 8, "skewed"),
]
FULL_CASES = [
    (m, k, n, e, routing)
    for m, (k, n), e, routing in itertools.product(
        (16384, 32768), ((7168, 4096), (2048, 7168), (7168, 2048)), (8, 32), ("balanced", "skewed")
    )
]
SWEEP_CASES = DEFAULT_CASES[:3]


def padded_counts(m: int, e: int, routing: str) -> list[int]:
    counts = balanced_counts(m, e) if routing == "balanced" else skewed_counts(m, e, empty=max(1, e // 8))
    return [-(-c // BLOCK) * BLOCK for c in counts]


def column_wise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, C] -> column-wise FP8 data [C, M] (tokens contiguous) + scales [M/128, C]."""
    data, scale = quantize_rows_reference(x.T.contiguous(), BLOCK)
    return data, scale.T.contiguous()


def make_problem(m: int, k: int, n: int, e: int, routing: str) -> dict:
    """Every operand of the three passes, FP8 in the FP8-Flow layouts plus the BF16 originals."""
    counts = padded_counts(m, e, routing)
    rows = sum(counts)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    p = {"rows": rows, "counts": counts, "offs": offs, "x": x, "dy": dy, "w": w, "e": e}
    p["x8"], p["xs"] = quantize_rows_reference(x, BLOCK)
    p["dy8"], p["dys"] = quantize_rows_reference(dy, BLOCK)
    p["w8"], p["ws"], p["wt8"], p["wts"] = quantize_128x128_reference(w)  # dgrad takes the exact transpose
    p["dyt8"], p["dyts"] = column_wise(dy)
    # X^T as the layer re-encodes it: one scale per 128x128 tile (the wgrad's b_tile_scales)
    p["xt8"], p["xts"] = scaling_aware_transpose(p["x8"], p["xs"], offs)
    return p


def ours(p: dict, which: str, config=None, kernel: str = "op", b_tile_scales: bool = True) -> tuple[Callable, tuple]:
    """The op's CUDA kernel (sm90 Gluon on Hopper); ``kernel="triton"`` our tl.dot kernel, autotuned;
    with ``config``, the kernel that config is for, pinned. Wgrad reads X^T's scales one per tile
    (``b_tile_scales``, as the layer does) unless told otherwise."""
    import triton

    from fp8flow_ao.kernels import grouped_gemm_fp8_blockwise as fwd
    from fp8flow_ao.kernels import grouped_gemm_fp8_wgrad as wgrad

    if which == "wgrad":
        op, sm90, tl_dot = (
            wgrad.launch_grouped_gemm_fp8_wgrad,
            wgrad.launch_grouped_gemm_fp8_wgrad_sm90,
            wgrad.launch_grouped_gemm_fp8_wgrad_triton,
        )
        args = (p["dyt8"], p["dyts"], p["xt8"], p["xts"], p["offs"], torch.bfloat16)
        op, sm90, tl_dot = (functools.partial(f, b_tile_scales=b_tile_scales) for f in (op, sm90, tl_dot))
    else:
        op, sm90, tl_dot = (
            fwd.launch_grouped_gemm_fp8_blockwise,
            fwd.launch_grouped_gemm_fp8_blockwise_sm90,
            fwd.launch_grouped_gemm_fp8_blockwise_triton,
        )
        a, sa, b, sb = (
            (p["x8"], p["xs"], p["w8"], p["ws"]) if which == "forward" else (p["dy8"], p["dys"], p["wt8"], p["wts"])
        )
        args = (a, sa, b, sb, p["offs"], torch.bfloat16)
    if config is None:
        return (tl_dot if kernel == "triton" else op), args
    launcher = tl_dot if isinstance(config, triton.Config) else sm90
    return lambda *a: launcher(*a, config=config), args


def ours_triton(p: dict, which: str) -> tuple[Callable, tuple]:
    """Our Triton (tl.dot) kernel, autotuned: the previous version, for the speed-up of the sm90 kernel."""
    return ours(p, which, kernel="triton")


def ours_per_column_scales(p: dict, which: str) -> tuple[Callable, tuple]:
    """Wgrad only: our kernel on the same operands, reading X^T's scales column by column (the form before
    ``b_tile_scales``): what one scale per tile saves."""
    return ours(p, which, b_tile_scales=False)


def bf16_grouped(p: dict, which: str) -> tuple[Callable, tuple]:
    if which == "forward":
        return torch._grouped_mm, (p["x"], p["w"].transpose(-2, -1), p["offs"])
    if which == "dgrad":
        return torch._grouped_mm, (p["dy"], p["w"], p["offs"])
    return torch._grouped_mm, (p["dy"].t(), p["x"], p["offs"])


def fp8_rowwise_grouped(p: dict, which: str) -> tuple[Callable, tuple]:
    """Same FP8 data with unit row-wise scales (the scale values do not change the work)."""
    rows, e = p["rows"], p["e"]

    def call(a, b, sa, sb, offs):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=torch.bfloat16, use_fast_accum=True)

    ones = lambda *s: torch.ones(*s, device="cuda")  # noqa: E731
    if which == "forward":
        return call, (p["x8"], p["w8"].transpose(-2, -1), ones(rows), ones(e, p["w8"].shape[1]), p["offs"])
    if which == "dgrad":
        return call, (p["dy8"], p["wt8"].transpose(-2, -1), ones(rows), ones(e, p["wt8"].shape[1]), p["offs"])
    n, k = p["dyt8"].shape[0], p["xt8"].shape[0]
    return call, (p["dyt8"], p["xt8"].t(), ones(e * n), ones(e * k), p["offs"])


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """[rows, blocks] scales with rows contiguous: the layout cuBLAS and torchao want for 1x128 LHS scales."""
    return scale.t().contiguous().t()


def cublas_dense_blockwise(p: dict, which: str) -> tuple[Callable, tuple]:
    import torch.nn.functional as F

    st = F.ScalingType
    if which == "wgrad":  # dY^T [N, M] x X [M, K], 1x128 blocks along M on both sides

        def call(a, b, sa, sb):
            return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise1x128, output_dtype=torch.bfloat16)

        return call, (p["dyt8"], p["xt8"].t(), p["dyts"].t(), p["xts"].t())

    def call(a, b, sa, sb):
        return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)

    a, sa, b, sb = (
        (p["x8"], p["xs"], p["w8"], p["ws"]) if which == "forward" else (p["dy8"], p["dys"], p["wt8"], p["wts"])
    )
    return call, (a, b[0].t(), _outer_major(sa), sb[0].t())


def torchao_dense_blockwise(p: dict, which: str) -> tuple[Callable, tuple]:
    from torchao.prototype.blockwise_fp8_training.kernels import (
        triton_fp8_gemm_1x128_128x1,
        triton_fp8_gemm_1x128_128x128,
    )

    if which == "wgrad":
        fn = lambda *a: triton_fp8_gemm_1x128_128x1(*a, out_dtype=torch.bfloat16)  # noqa: E731
        return fn, (p["dyt8"], p["xt8"].t(), p["dyts"].t(), p["xts"])
    a, sa, b, sb = (
        (p["x8"], p["xs"], p["w8"], p["ws"]) if which == "forward" else (p["dy8"], p["dys"], p["wt8"], p["wts"])
    )
    fn = lambda *a: triton_fp8_gemm_1x128_128x128(*a, out_dtype=torch.bfloat16)  # noqa: E731
    return fn, (a, b[0].t(), _outer_major(sa), sb[0].t())


def deepgemm_grouped(deep_gemm, p: dict, which: str) -> tuple[Callable, tuple]:
    """DeepGEMM's grouped kernels on our FP8 data (see the module docstring), called as torchao 0.18
    calls them (``torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels``)."""
    counts = p["counts"]
    if which == "wgrad":
        starts = [0, *itertools.accumulate(counts)]

        def flat(t: torch.Tensor) -> torch.Tensor:  # [C, M] -> each expert's [C, tokens] chunk, flattened
            return torch.cat([t[:, s : s + c].contiguous().view(-1) for s, c in zip(starts, counts, strict=False)])

        e, n, k = p["w"].shape
        out = torch.empty(e, n, k, device="cuda")
        acc = torch.zeros_like(out)
        ks = torch.tensor(counts, dtype=torch.int32, device="cuda")
        lhs = (flat(p["dyt8"]), p["dyts"].t().contiguous())  # data, scales [N, M/128]
        rhs = (flat(p["xt8"]), p["xts"].t().contiguous())  # data, scales [K, M/128]

        def wgrad():
            deep_gemm.k_grouped_fp8_gemm_nt_contiguous(lhs, rhs, out, counts, ks, acc, recipe=(1, 1, BLOCK))

        return wgrad, ()
    gemm = (
        getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None) or deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous
    )
    a, sa, b, sb = (
        (p["x8"], p["xs"], p["w8"], p["ws"]) if which == "forward" else (p["dy8"], p["dys"], p["wt8"], p["wts"])
    )
    expert_of_row = torch.repeat_interleave(
        torch.arange(len(counts), dtype=torch.int32, device="cuda"), torch.tensor(counts, device="cuda")
    )
    out = torch.empty(a.shape[0], b.shape[1], device="cuda", dtype=torch.bfloat16)
    lhs, rhs = (a, _outer_major(sa)), (b, sb)

    def grouped():
        gemm(lhs, rhs, out, expert_of_row, recipe_a=(1, BLOCK), recipe_b=(BLOCK, BLOCK), disable_ue8m0_cast=True)

    return grouped, ()


BASELINES = {
    "fp8flow Triton tl.dot kernel": ours_triton,
    "fp8flow op, per-column B scales (b_tile_scales=False)": ours_per_column_scales,
    "bf16 torch._grouped_mm": bf16_grouped,
    "fp8 row-wise torch._scaled_grouped_mm": fp8_rowwise_grouped,
    "cuBLAS dense blockwise F.scaled_mm": cublas_dense_blockwise,
    "torchao Triton dense blockwise": torchao_dense_blockwise,
}
PASSES = ("forward", "dgrad", "wgrad")
WGRAD_ONLY = ("fp8flow op, per-column B scales (b_tile_scales=False)",)


def pass_dims(p: dict, which: str) -> tuple[int, int]:
    """(N, K) of the pass's GEMM (output columns, reduction) for the FLOP count."""
    e, n, k = p["w"].shape
    return {"forward": (n, k), "dgrad": (k, n), "wgrad": (n, k)}[which]


def time_it(make: Callable, p: dict, which: str) -> tuple[float | None, str]:
    """Median time in us (or None and the error). One input set: every pass reads >= 150 MB, past L2."""
    try:
        fn, args = make(p, which)
        return bench_us(fn, [args]), ""
    except Exception as exc:  # a baseline missing from this torch/torchao build: record why
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def run_cases(cases, passes, baselines: dict[str, Callable]) -> list[dict]:
    rows_out = []
    for m, k, n, e, routing in cases:
        p = make_problem(m, k, n, e, routing)
        for which in passes:
            nn, kk = pass_dims(p, which)
            flops = 2 * p["rows"] * nn * kk
            case = f"{which} M={m} K={k} N={n} E={e} {routing}"
            ours_us, err = time_it(ours, p, which)
            if ours_us is None:
                raise RuntimeError(f"{case}: {err}")
            print(f"{case}: ours {ours_us:.1f} us, {flops / ours_us / 1e6:.0f} TFLOP/s", flush=True)
            for name, make in baselines.items():
                if name in WGRAD_ONLY and which != "wgrad":
                    continue
                base_us, err = time_it(make, p, which)
                extra = {"baseline_tflops": None if base_us is None else round(flops / base_us / 1e6, 1)}
                rows_out.append(
                    row(case, ours_us, name, base_us, flops=flops, **extra, **({"error": err} if err else {}))
                )
        del p
        torch.cuda.empty_cache()
    return rows_out


def run_sweep(passes: list[str]) -> list[dict]:
    """Every candidate config of both kernels, pinned (no autotune), on the PERF.md anchor shapes."""
    from fp8flow_ao.kernels.grouped_gemm_fp8_blockwise import FORWARD_CONFIGS, SM90_CONFIGS
    from fp8flow_ao.kernels.grouped_gemm_fp8_wgrad import SM90_WGRAD_CONFIGS, WGRAD_CONFIGS

    forward = SM90_CONFIGS + FORWARD_CONFIGS
    per_pass = {"forward": forward, "dgrad": forward, "wgrad": SM90_WGRAD_CONFIGS + WGRAD_CONFIGS}
    rows_out = []
    for m, k, n, e, routing in SWEEP_CASES:
        p = make_problem(m, k, n, e, routing)
        for which, configs in ((w, per_pass[w]) for w in passes):
            nn, kk = pass_dims(p, which)
            flops = 2 * p["rows"] * nn * kk
            # wgrad: each config with X^T's scales read one per tile (the op's form) and column by column
            forms = (True, False) if which == "wgrad" else (True,)
            for cfg, tile_scales in itertools.product(configs, forms):
                fn, args = ours(p, which, config=cfg, b_tile_scales=tile_scales)
                us = bench_us(fn, [args])
                name = (
                    str(cfg)
                    if not hasattr(cfg, "kwargs")
                    else f"triton {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"
                )
                if which == "wgrad":
                    name += " b_tile_scales" if tile_scales else " per-column B scales"
                print(f"{which} M={m} K={k} N={n} E={e}: {name}: {flops / us / 1e6:.0f} TFLOP/s", flush=True)
                rows_out.append(
                    row(f"{which} M={m} K={k} N={n} E={e} {routing}", us, "-", None, flops=flops, config=name)
                )
        del p
        torch.cuda.empty_cache()
    return rows_out


# (M, K, N, E): forward out[M, N] = X W_e^T with W [E, N, K]; dgrad runs on the same W.
WEIGHT_CASES = [
    *((16384, 7168, 4096, e) for e in (8, 32, 64)),  # DeepSeek-V3 FC1: 2048 / 512 / 256 rows per expert
    (32768, 7168, 4096, 32),  # 1024 rows per expert (the DeepSeek-like layer at T=4096, top-8)
    (16384, 2048, 7168, 64),  # DeepSeek-V3 FC2, 256 rows per expert
    *((m, 2048, 1536, 128) for m in (16384, 65536)),  # Qwen3-30B-A3B FC1: 128 / 512 rows per expert
    *((m, 768, 2048, 128) for m in (16384, 65536)),  # Qwen3-30B-A3B FC2
]


def run_weights(passes: list[str]) -> list[dict]:
    """bf16 weights quantized in the GEMM (ours) vs quantize_128x128 + the FP8 call vs the FP8 call alone."""
    from fp8flow_ao.kernels import grouped_gemm_fp8_blockwise as fwd
    from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128

    rows_out = []
    for m, k, n, e in WEIGHT_CASES:
        p = make_problem(m, k, n, e, "balanced")
        for which in (w for w in passes if w != "wgrad"):
            nn, kk = pass_dims(p, which)
            flops = 2 * p["rows"] * nn * kk
            t = which == "dgrad"
            a, sa = (p["dy8"], p["dys"]) if t else (p["x8"], p["xs"])
            b8, sb8 = (p["wt8"], p["wts"]) if t else (p["w8"], p["ws"])
            w, offs, op = p["w"], p["offs"], fwd.launch_grouped_gemm_fp8_blockwise

            def separate(a=a, sa=sa, w=w, offs=offs, t=t, op=op):
                data, scale, data_t, scale_t = quantize_128x128(w, with_transpose=t, with_data=not t)
                return op(a, sa, data_t if t else data, scale_t if t else scale, offs)

            bf16_fn, bf16_args = bf16_grouped(p, which)
            ours_us = bench_us(
                lambda a=a, sa=sa, w=w, offs=offs, t=t, op=op: op(a, sa, w, None, offs, transpose_b=t), [()]
            )
            case = f"{which} M={m} K={k} N={n} E={e} rows/expert={p['rows'] // e}"
            print(f"{case}: in-GEMM {ours_us:.1f} us", flush=True)
            baselines = [
                ("quantize_128x128 + FP8 GEMM", separate),
                (
                    "FP8 GEMM alone (weights quantized beforehand)",
                    lambda a=a, sa=sa, b8=b8, sb8=sb8, offs=offs, op=op: op(a, sa, b8, sb8, offs),
                ),
                ("bf16 torch._grouped_mm", functools.partial(bf16_fn, *bf16_args)),
            ]
            if t:  # the dgrad on the forward's FP8 tiles, transposed in the kernel (no transposed copy)
                w8, ws8 = p["w8"], p["ws"]
                baselines.append(
                    (
                        "FP8 GEMM transposing the forward's tiles (quantized beforehand)",
                        lambda a=a, sa=sa, w8=w8, ws8=ws8, offs=offs, op=op: op(a, sa, w8, ws8, offs, transpose_b=True),
                    )
                )
            ours_out = op(a, sa, w, None, offs, transpose_b=t)
            for name, fn in baselines:
                base_us = bench_us(fn, [()])
                print(f"    {name}: {base_us:.1f} us", flush=True)
                # the FP8 paths must give the in-GEMM path's bits (the same tiles); BF16 is another computation
                exact = None if name.startswith("bf16") else bits_equal(ours_out, fn())
                rows_out.append(
                    row(case, ours_us, name, base_us, flops=flops, rows_per_expert=p["rows"] // e, bit_exact=exact)
                )
        del p
        torch.cuda.empty_cache()
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the whole shape matrix")
    parser.add_argument("--sweep", action="store_true", help="time every launch config (no autotune)")
    parser.add_argument("--weights", action="store_true", help="bf16 weights quantized in the GEMM vs before it")
    parser.add_argument("--passes", default=",".join(PASSES), help="comma-separated subset of forward,dgrad,wgrad")
    parser.add_argument("--tag", default="", help="appended to the result files' names (keeps another run's files)")
    args = parser.parse_args()
    suffix = f"_{args.tag}" if args.tag else ""
    if not require_cuda("bench_grouped_gemm_fp8_blockwise"):
        return
    if args.weights:
        write_results(
            "grouped_gemm_weights" + suffix,
            run_weights(args.passes.split(",")),
            "ours = bf16 weights as the op's b, quantized tile by tile in the kernel; bit_exact: its output equals "
            "the FP8 baseline's bit for bit (checked on each row; None for BF16); baselines: quantize_128x128 of the weight (the pass's orientation) + the FP8 call, "
            "the FP8 call alone on pre-quantized weights, BF16 torch._grouped_mm. Balanced groups.",
        )
        return
    if args.sweep:
        write_results(
            "grouped_gemm_fp8_blockwise_sweep" + suffix,
            run_sweep(args.passes.split(",")),
            "Each launch config pinned (no autotune).",
        )
        return
    baselines = dict(BASELINES)
    deep_gemm = import_deep_gemm()
    if deep_gemm is not None:
        baselines["DeepGEMM grouped (M-grouped fwd/dgrad, K-grouped wgrad)"] = functools.partial(
            deepgemm_grouped, deep_gemm
        )
    rows_out = run_cases(FULL_CASES if args.full else DEFAULT_CASES, args.passes.split(","), baselines)
    write_results(
        "grouped_gemm_fp8_blockwise" + suffix,
        rows_out,
        "tflops = ours; baseline_tflops = the named baseline on the same FLOPs (dense baselines: all rows x "
        "one expert's weight). Row-wise baseline: same FP8 data, unit scales. Every output bf16 (wgrad too: "
        "the weights' dtype, what the MoE layer asks for) except DeepGEMM's wgrad (fp32 D = C + AB, its sm90 "
        "kernel's only form). DeepGEMM: our FP8 data, layouts changed outside the timing (module docstring).",
    )


if __name__ == "__main__":
    main()
