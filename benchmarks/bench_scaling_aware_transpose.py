"""Benchmark scaling_aware_transpose against torch.compile(fullgraph=True) of its torch reference and
of the naive dequantize -> transpose -> requantize path (BF16 in between), at the PERF.md shapes.

Bytes at the algorithmic minimum: read the data and scales of the rows before the last group end
(``rows * K`` + ``rows * K / 128 * 4``), write every output once (``M * K`` + ``M / 128 * K * 4``,
``M`` = the padded buffer's rows). ``--sweep`` times every launch configuration of
``transpose_configs()`` instead of the baselines (balanced cases and the skewed M=16384 ones), to
choose ``default_transpose_config``. ``device_us`` (ours, not in ``--sweep``) is the call's device time
with the host excluded (``_bench.device_us``); at K = 2048 (~15 us of device work) ``ours_us`` follows
the host CPU wherever the host is the slower.

    python benchmarks/bench_scaling_aware_transpose.py [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import (  # noqa: E402
    DEVICE_NOTE,
    balanced_counts,
    bench_us,
    n_rotations,
    row,
    skewed_counts,
    versus_baseline,
    write_results,
)

from fp8flow_ao._format import BLOCK, quantize_rows_reference  # noqa: E402
from fp8flow_ao.kernels._sm90_common import sm90_takes_plain_form  # noqa: E402
from fp8flow_ao.kernels.scaling_aware_transpose import (  # noqa: E402
    default_transpose_config,
    dequantize_transpose_requantize_reference,
    launch_scaling_aware_transpose,
    scaling_aware_transpose,
    scaling_aware_transpose_reference,
    transpose_configs,
)
from fp8flow_ao.shapes import BENCH_ROUTED_ROWS, DEEPSEEK_V3, DEEPSEEK_V3_E8  # noqa: E402

# K = the hidden size D (7168: FC1 wgrad operand x) and the expert ffn size H (2048: FC2 wgrad
# operand a); routing: balanced over 8 experts, Zipf-skewed over 32 with empty experts.
HIDDEN_SIZES = (DEEPSEEK_V3.dim, DEEPSEEK_V3.hidden)
ROUTINGS = (("balanced", DEEPSEEK_V3_E8.experts), ("skewed", DEEPSEEK_V3.experts))


def grouped_inputs(counts: list[int], k: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise FP8 activations of expert groups padded to 128 rows, in a buffer of the static upper
    bound ``sum(counts)`` rounded up to 128 ``+ 128 * E`` rows; rows of very different scales; pad rows data 0, scale 0."""
    m = BLOCK * (-(-sum(counts) // BLOCK) + len(counts))
    padded = torch.tensor([-(-c // BLOCK) * BLOCK for c in counts])
    ends = torch.cumsum(padded, 0)
    is_pad = torch.arange(m) < ends[-1]
    for start, count in zip((ends - padded).tolist(), counts, strict=True):
        is_pad[start : start + count] = False
    is_pad = is_pad.to(device)
    x = torch.randn(m, k, device=device) * 2.0 ** torch.randint(-8, 9, (m, 1), device=device)
    x[is_pad] = 0
    data, scale_inv = quantize_rows_reference(x.bfloat16(), BLOCK)
    scale_inv[is_pad] = 0
    return data, scale_inv, ends.to(device=device, dtype=torch.int32)


def bytes_moved(m: int, k: int, rows_read: int) -> int:
    return rows_read * k + rows_read * (k // BLOCK) * 4 + m * k + (m // BLOCK) * k * 4


def sweep_rows(case: str, sets: list[tuple], nbytes: int, extra: dict) -> list[dict]:
    """One row per launch configuration (no baseline), each checked bit for bit against the torch reference's
    output (the oracle; not the default configuration's, which a wrong default would share)."""
    expected = scaling_aware_transpose_reference(*sets[0])
    rows = []
    for config in transpose_configs():
        got = launch_scaling_aware_transpose(*sets[0], config=config)
        exact = all(torch.equal(g.view(torch.uint8), e.view(torch.uint8)) for g, e in zip(got, expected, strict=True))
        us = bench_us(lambda d, s, o, c=config: launch_scaling_aware_transpose(d, s, o, config=c), sets)
        rows.append(row(case, us, "none", None, bytes_moved=nbytes, bit_exact=exact, **extra, config=str(config)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time the launch configurations instead of the baselines")
    sweep = parser.parse_args().sweep
    if not torch.cuda.is_available():
        print("bench_scaling_aware_transpose: no CUDA device, nothing to measure")
        return
    compiled_ref = torch.compile(scaling_aware_transpose_reference, fullgraph=True)
    compiled_naive = torch.compile(dequantize_transpose_requantize_reference, fullgraph=True)
    rows = []
    for k in HIDDEN_SIZES:
        for m_routed in BENCH_ROUTED_ROWS:
            for routing, experts in ROUTINGS:
                if sweep and routing == "skewed" and m_routed != BENCH_ROUTED_ROWS[0]:
                    continue
                counts = (balanced_counts if routing == "balanced" else skewed_counts)(m_routed, experts)
                first = grouped_inputs(counts, k)
                m = first[0].shape[0]
                sets = [first] + [grouped_inputs(counts, k) for _ in range(n_rotations(2 * m * k) - 1)]
                for t in (t for tensors in sets for t in tensors):  # tokens and experts vary: one graph for all
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                case = f"M={m_routed} K={k} E={experts} {routing}"
                rows_read = int(first[2][-1])
                nbytes = bytes_moved(m, k, rows_read)
                extra = {"rows_buffer": m, "rows_read": rows_read}
                if sweep:
                    rows += sweep_rows(case, sets, nbytes, extra)
                    del sets, first
                    torch.cuda.empty_cache()
                    continue
                # The op's kernel here: the Hopper TMA kernel (plain form), else the Triton kernel's config.
                hopper = sm90_takes_plain_form(first[0], None)
                extra["kernel"] = "sm90 TMA ring" if hopper else f"triton {default_transpose_config(k)}"
                vs_ref = versus_baseline(
                    case, scaling_aware_transpose, compiled_ref, "torch.compile reference", sets, nbytes
                )
                vs_ref.update(extra)
                naive_us = bench_us(compiled_naive, sets)
                naive_name = "torch.compile dequantize->transpose->requantize"
                ours_us, ours_device_us = vs_ref["ours_us"], vs_ref["device_us"]
                naive = row(case, ours_us, naive_name, naive_us, bytes_moved=nbytes, device_us=ours_device_us, **extra)
                rows += [vs_ref, naive]
                del sets, first
                torch.cuda.empty_cache()
    write_results(
        "scaling_aware_transpose_sweep" if sweep else "scaling_aware_transpose",
        rows,
        notes="Bytes: read data + scales of the rows before the last group end, write data_t + scale_inv_t once. "
        + ("" if sweep else DEVICE_NOTE),
    )


if __name__ == "__main__":
    main()
