"""Probe (a design question, not an op's benchmark): can the MoE layer's memory-bound ops hide behind its
compute-bound grouped GEMMs by running on a second stream, with the GEMM's persistent grid left ``k`` SMs short
so that the other kernel has SMs of its own?

Pairs from the DeepSeek-like layer step (T=4096, top-8: M=32768 rows, D=7168, H=2048, E=32 balanced), each an
independent pair in the layer's dataflow:

* FC2 wgrad || W13^T quantization (backward: the FC1 dgrad's weight operand, 128x128 tiles, transpose only);
* FC1 forward GEMM || w2 quantization (forward: FC2's weight operand);
* FC1 dgrad, FC2 dgrad, FC2 wgrad || the scaling-aware transpose of dy's FP8 rows (the FC2 wgrad's operand).

Rows: ``ours_us`` = both kernels' device time per pair when the GEMM runs on ``SMs - k`` programs on the current
stream and the other op on a side stream (for ``k = 0`` the GEMM keeps every SM and the other op fills SMs as
they free up; the transpose, a persistent kernel too, gets ``k`` programs); ``baseline_us`` = the two one after
the other on one stream, each with every SM. ``speedup`` > 1 would mean the overlap pays. Also each kernel alone
(``gemm_us`` at ``SMs - k``, ``other_us`` with every SM). Device time by ``_bench.device_us`` (host excluded).

    python benchmarks/probe_stream_overlap.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import device_us, require_cuda, row, write_results  # noqa: E402

import fp8flow_ao.kernels.grouped_gemm_fp8_blockwise as forward_gemm  # noqa: E402
import fp8flow_ao.kernels.grouped_gemm_fp8_wgrad as wgrad_gemm  # noqa: E402
import fp8flow_ao.kernels.scaling_aware_transpose as transpose_op  # noqa: E402
from fp8flow_ao.kernels._grouped_gemm_common import sm_count  # noqa: E402
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128  # noqa: E402
from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128  # noqa: E402
from fp8flow_ao.shapes import DEEPSEEK_V3  # noqa: E402

SHORT_SMS = (0, 8, 16, 24, 32, 48)
BASELINE = "one after the other, every SM each"


def _operands(m: int) -> dict[str, Callable[[], object]]:
    """The GEMMs and memory-bound ops of the pairs, on DeepSeek-like operands (FP8 rows and their column-wise
    copies from ``quantize_1x128(transpose=True)``, weights from ``quantize_128x128``)."""
    e, d, h = DEEPSEEK_V3.experts, DEEPSEEK_V3.dim, DEEPSEEK_V3.hidden
    dev = torch.device("cuda")
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (m // e)
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16)

    x, x_s, _, _ = quantize_1x128(randn(m, d), transpose=True, group_end_offsets=offs)
    _, _, a_t, a_t_s = quantize_1x128(randn(m, h), transpose=True, group_end_offsets=offs)
    dh, dh_s = quantize_1x128(randn(m, 2 * h))
    dy, dy_s, dy_t, dy_t_s = quantize_1x128(randn(m, d), transpose=True, group_end_offsets=offs)
    w13, w2 = randn(e, 2 * h, d) * 0.02, randn(e, d, h) * 0.02
    w13_d, w13_s, w13t_d, w13t_s = quantize_128x128(w13)
    _, _, w2t_d, w2t_s = quantize_128x128(w2)
    gemm = forward_gemm.grouped_gemm_fp8_blockwise
    return {
        "FC1 forward": lambda: gemm(x, x_s, w13_d, w13_s, offs),
        "FC1 dgrad": lambda: gemm(dh, dh_s, w13t_d, w13t_s, offs),
        "FC2 dgrad": lambda: gemm(dy, dy_s, w2t_d, w2t_s, offs),
        "FC2 wgrad": lambda: wgrad_gemm.grouped_gemm_fp8_wgrad(
            dy_t, dy_t_s, a_t, a_t_s, offs, out_dtype=torch.bfloat16, b_tile_scales=True
        ),
        "W13^T quantization": lambda: quantize_128x128(w13, True, False),
        "w2 quantization": lambda: quantize_128x128(w2, False, True),
        "dy scaling-aware transpose": lambda: transpose_op.scaling_aware_transpose(dy, dy_s, offs),
    }


PAIRS = (
    ("FC2 wgrad", "W13^T quantization"),
    ("FC1 forward", "w2 quantization"),
    ("FC1 dgrad", "dy scaling-aware transpose"),
    ("FC2 dgrad", "dy scaling-aware transpose"),
    ("FC2 wgrad", "dy scaling-aware transpose"),
)


def _in_turn(gemm: Callable[[], object], other: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        gemm()
        other()

    return run


def _together(gemm: Callable[[], object], other: Callable[[], object], side: torch.cuda.Stream) -> Callable[[], None]:
    """The GEMM on the current stream, ``other`` on ``side`` beside it; the current stream then waits for both."""

    def run() -> None:
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        gemm()
        with torch.cuda.stream(side):
            other()
        main_stream.wait_stream(side)

    return run


def main() -> None:
    if not require_cuda("probe_stream_overlap"):
        return
    sms = sm_count(torch.device("cuda"))
    limits = {"gemm": sms, "other": sms}
    # The persistent kernels size their grids by sm_count: the probe sets it per kernel.
    forward_gemm.sm_count = wgrad_gemm.sm_count = lambda device: limits["gemm"]
    transpose_op.sm_count = lambda device: limits["other"]
    ops = _operands(32768)
    side = torch.cuda.Stream()

    rows = []
    for gemm_name, other_name in PAIRS:
        gemm, other = ops[gemm_name], ops[other_name]
        limits.update(gemm=sms, other=sms)
        one_after_other = device_us(_in_turn(gemm, other), [()])
        other_us = device_us(other, [()])
        for k in SHORT_SMS:
            limits.update(gemm=sms - k, other=k or sms)
            case = f"{gemm_name} on {sms - k} SMs beside {other_name}, M=32768"
            rows.append(
                row(
                    case,
                    device_us(_together(gemm, other, side), [()]),
                    BASELINE,
                    one_after_other,
                    gemm_us=round(device_us(gemm, [()]), 2),
                    other_us=round(other_us, 2),
                    sms_to_the_side=k,
                )
            )
            print(rows[-1], flush=True)
    notes = (
        "Device time per pair (host excluded, _bench.device_us). ours_us: the GEMM on SMs - k programs on the "
        "current stream and the other op on a side stream; baseline_us: one after the other on one stream, "
        "every SM each; gemm_us: the GEMM alone on SMs - k programs; other_us: the other op alone."
    )
    write_results("stream_overlap", rows, notes)


if __name__ == "__main__":
    main()
