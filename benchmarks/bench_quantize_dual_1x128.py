"""quantize_dual_1x128 (row-wise + column-wise FP8 from one read) against torch.compile(fullgraph=True)
of ``quantize_dual_1x128_reference``.

Cases (PERF.md): M = 16384 and 32768 routed rows x N = D = 7168 and N = 2H = 4096, bf16, without
offsets; and with skewed (Zipf, empty experts) group end offsets of E = 32 experts in a buffer
padded to the static bound M + 128 E, whose rows past the last group are not read; and M unpadded rows
of skewed, unaligned groups over E = 128 gathered (``src_rows``) into their padded layout (the
``dOut`` of ``fp8_grouped_mm`` on such groups). Bytes at the algorithmic minimum: read the rows before
the last group end (2 B/elem) + write row_data and col_data (1 B/elem each over the whole buffer) +
write both scale tensors (4 B per block) (+ read src_rows, 4 B per padded row).

``--sweep`` times every launch configuration (``quantize_dual_1x128_configs()``) through the
launcher instead of the baseline, each checked bit for bit against the compiled reference, to choose
DEFAULT_CONFIG (results in ``quantize_dual_1x128_sweep``). Otherwise ``device_us`` (ours) is the
call's device time with the host excluded (``_bench.device_us``), next to ``ours_us``.

    python benchmarks/bench_quantize_dual_1x128.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import (  # noqa: E402
    DEVICE_NOTE,
    bench_us,
    bits_equal,
    n_rotations,
    row,
    skewed_counts,
    unaligned_offsets,
    versus_baseline,
    write_results,
)

from fp8flow_ao._format import BLOCK  # noqa: E402
from fp8flow_ao.kernels._sm90_common import sm90_takes_plain_form  # noqa: E402
from fp8flow_ao.kernels.pad_group_offsets import pad_group_offsets  # noqa: E402
from fp8flow_ao.kernels.quantize_dual_1x128 import (  # noqa: E402
    DEFAULT_CONFIG,
    launch_quantize_dual_1x128,
    quantize_dual_1x128,
    quantize_dual_1x128_configs,
    quantize_dual_1x128_reference,
)
from fp8flow_ao.shapes import BENCH_ROUTED_ROWS, DEEPSEEK_V3  # noqa: E402

BASELINE = "torch.compile(fullgraph=True) reference"
D, TWO_H, E = DEEPSEEK_V3.dim, 2 * DEEPSEEK_V3.hidden, DEEPSEEK_V3.experts
GATHER_EXPERTS = 128
CASES = [(m, n, None) for m in BENCH_ROUTED_ROWS for n in (D, TWO_H)] + [(m, D, E) for m in BENCH_ROUTED_ROWS]


def skewed_offsets(m: int, experts: int) -> torch.Tensor:
    """int32 padded group end offsets of ``m`` rows routed Zipf-like over ``experts`` (some empty)."""
    padded = [-(-c // BLOCK) * BLOCK for c in skewed_counts(m, experts)]
    return torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device="cuda")


def sweep_rows(case: str, compiled, sets: list[tuple], bytes_moved: int) -> list[dict]:
    """One row per launch configuration: its time through the launcher and whether its bits match."""
    expected = compiled(*sets[0])
    rows = []
    for cfg in quantize_dual_1x128_configs():
        exact = bits_equal(launch_quantize_dual_1x128(*sets[0], config=cfg), expected)
        us = bench_us(lambda g, o, c=cfg: launch_quantize_dual_1x128(g, o, config=c), sets)
        default = cfg == DEFAULT_CONFIG
        rows.append(
            row(case, us, "none", None, bytes_moved=bytes_moved, config=str(cfg), default=default, bit_exact=exact)
        )
    return rows


def gathered_rows(compiled) -> list[dict]:
    """The unpadded gradient of unaligned groups quantized into their padded layout (``src_rows``)."""
    rows = []
    for m in BENCH_ROUTED_ROWS:
        src_rows, _, offsets = pad_group_offsets(unaligned_offsets(m, GATHER_EXPERTS), m)
        padded = src_rows.shape[0]
        bytes_moved = 2 * m * D + 2 * padded * D + 2 * 4 * padded * D // BLOCK + 4 * padded
        sets = [
            (torch.randn(m, D, device="cuda", dtype=torch.bfloat16), offsets, src_rows)
            for _ in range(n_rotations(bytes_moved))
        ]
        case = f"M={m} N={D} gathered into {padded} padded rows (E={GATHER_EXPERTS} unaligned)"
        kernel = f"triton {DEFAULT_CONFIG}"  # gathering: TMA cannot gather rows
        rows.append(versus_baseline(case, quantize_dual_1x128, compiled, BASELINE, sets, bytes_moved, kernel=kernel))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time the launch configurations instead of the baseline")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_quantize_dual_1x128: no CUDA device, nothing to measure")
        return
    compiled = torch.compile(quantize_dual_1x128_reference, fullgraph=True)
    rows = []
    for m, n, experts in CASES:
        offsets = skewed_offsets(m, experts) if experts else None
        buffer_rows = m + BLOCK * experts if experts else m
        read_rows = int(offsets[-1]) if experts else m  # host read here, in the benchmark only
        bytes_moved = 2 * read_rows * n + 2 * buffer_rows * n + 2 * 4 * buffer_rows * n // BLOCK
        sets = [
            (torch.randn(buffer_rows, n, device="cuda", dtype=torch.bfloat16), offsets)
            for _ in range(n_rotations(bytes_moved))
        ]
        case = f"M={m} N={n}" + (f" skewed E={experts} buffer={buffer_rows} end={read_rows}" if experts else "")
        if args.sweep:
            rows += sweep_rows(case, compiled, sets, bytes_moved)
        else:
            kernel = "sm90 TMA ring" if sm90_takes_plain_form(sets[0][0], None) else f"triton {DEFAULT_CONFIG}"
            rows.append(
                versus_baseline(case, quantize_dual_1x128, compiled, BASELINE, sets, bytes_moved, kernel=kernel)
            )
        del sets
        torch.cuda.empty_cache()
    if not args.sweep:
        rows += gathered_rows(compiled)
    notes = "bytes = read g bf16 (rows before the last group end) + write fp8 row/col data + fp32 scales. "
    notes += "" if args.sweep else DEVICE_NOTE
    write_results("quantize_dual_1x128_sweep" if args.sweep else "quantize_dual_1x128", rows, notes)


if __name__ == "__main__":
    main()
