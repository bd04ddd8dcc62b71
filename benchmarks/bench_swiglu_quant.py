"""Benchmark swiglu_quant (forward) and swiglu_quant_backward at the PERF.md shapes.

Cases: M = 32768 and 65536 rows, H = 2048 (DeepSeek-V3-like, E = 32) and H = 768 (Qwen3-like,
E = 128), balanced and skewed (Zipf-like, empty experts) routing padded to 128-row groups.

Bytes at the algorithmic minimum (R = rows before the last group end, about M):
* forward:  read h (R * 2H * 2) + probs (R * 4); write a (M * H) + its scales (M * H/128 * 4).
* backward: read grad_a (R * H * 2) + h (R * 2H * 2) + probs (R * 4); write dh row-wise and
  column-wise (2 * M * 2H) + their scales (2 * M * 2H/128 * 4) + grad_probs (M * 4).

* forward with ``transpose=True`` (``a``'s column-wise copy from the same kernel, the layer's forward when
  FC2's wgrad needs it): the forward's bytes + the copy (M * H + M/128 * H * 4).
* backward with ``transpose=False`` (``backward_rows_only``: no FC1 wgrad to come, frozen W13): the backward's
  bytes less the column-wise copy (M * 2H + M/128 * 2H * 4); baseline: the full backward op.

Baselines (speed-up = baseline time / ours):
* ``torch.compile(fullgraph=True, dynamic=True)`` of the torch reference (one compile for all
  shapes keeps the script under 90 s);
* the unfused eager sequence a user would write: ``F.silu(g) * u * p`` in BF16 then
  ``quantize_1x128``; forward with the transpose: the two ops it replaces in the layer, ``swiglu_quant`` and
  ``scaling_aware_transpose`` of its output, and the plain forward alone (what the copy costs); backward: the BF16 SwiGLU backward math, ``quantize_1x128`` of ``dh`` and
  ``quantize_1x128`` of ``dh.t().contiguous()``.

Ours is timed through the forward's launcher and the public backward op, each with its output allocation
(the forward's Triton kernel; the backward's Hopper TMA kernel on Hopper, the Triton kernel elsewhere; each
row names it); ``device_us`` is
its device time with the host excluded (``_bench.device_us``), next to ``ours_us``. ``--sweep`` times the
Triton launch configurations instead (``ours_us`` and ``device_us`` each), to choose FORWARD_CONFIG /
TRANSPOSE_CONFIG / BACKWARD_CONFIG.

    python benchmarks/bench_swiglu_quant.py [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import (  # noqa: E402
    DEVICE_NOTE,
    balanced_counts,
    bench_us,
    device_us,
    n_rotations,
    row,
    skewed_counts,
    write_results,
)

from fp8flow_ao._format import BLOCK  # noqa: E402
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128  # noqa: E402
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose  # noqa: E402
from fp8flow_ao.kernels.swiglu_quant import (  # noqa: E402
    BACKWARD_CONFIG,
    FORWARD_CONFIG,
    TRANSPOSE_CONFIG,
    LaunchConfig,
    backward_configs,
    backward_takes_sm90_kernel,
    launch_swiglu_quant,
    launch_swiglu_quant_backward,
    swiglu_quant_backward,
    swiglu_quant_backward_reference,
    swiglu_quant_reference,
)
from fp8flow_ao.shapes import DEEPSEEK_V3, QWEN3_30B_A3B  # noqa: E402

ROWS = (32768, 65536)
MODELS = (DEEPSEEK_V3, QWEN3_30B_A3B)
ROUTINGS = {"balanced": balanced_counts, "skewed": skewed_counts}
SWEEP_FORWARD = [LaunchConfig(16, 4), LaunchConfig(32, 4), LaunchConfig(64, 4), LaunchConfig(64, 8)]
SWEEP_TRANSPOSE = [LaunchConfig(128, 8), LaunchConfig(128, 4), LaunchConfig(128, 16)]
SWEEP_BACKWARD = backward_configs()


def group_ends(counts: list[int], rows: int) -> torch.Tensor:
    """Group end offsets with each expert padded to 128 rows, trimmed from the largest groups to fit ``rows``."""
    padded = [-(-c // BLOCK) * BLOCK for c in counts]
    while sum(padded) > rows:
        padded[padded.index(max(padded))] -= BLOCK
    return torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device="cuda")


def make_inputs(rows: int, hidden: int, ends: torch.Tensor) -> list[tuple]:
    """Rotating sets of (grad_a, h, probs, ends) whose total exceeds L2."""
    per_set = rows * hidden * 2 * 3 + rows * 4
    return [
        (
            torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(rows, 2 * hidden, device="cuda", dtype=torch.bfloat16),
            torch.rand(rows, device="cuda"),
            ends,
        )
        for _ in range(n_rotations(per_set))
    ]


def eager_forward(h: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a user writes without the fused op: BF16 SwiGLU, then quantize."""
    g, u = h.chunk(2, dim=1)
    return quantize_1x128(F.silu(g) * u * probs.to(h.dtype)[:, None])


def eager_backward(grad_a: torch.Tensor, h: torch.Tensor, probs: torch.Tensor) -> tuple:
    """BF16 SwiGLU backward, then row-wise quantize and transpose + quantize for the column-wise copy."""
    g, u = h.chunk(2, dim=1)
    p = probs.to(h.dtype)[:, None]
    s = torch.sigmoid(g)
    silu = g * s
    d_gate = grad_a * u * p * s * (1 + g * (1 - s))
    grad_probs = (grad_a * silu * u).float().sum(dim=1)
    dh = torch.cat([d_gate, grad_a * silu * p], dim=1)
    return quantize_1x128(dh), quantize_1x128(dh.t().contiguous()), grad_probs


def forward_then_transpose(h: torch.Tensor, probs: torch.Tensor, ends: torch.Tensor) -> tuple:
    """What the layer ran before the transposing forward: the forward, then the transpose of its output."""
    data, scale, _, _ = launch_swiglu_quant(h, probs, ends)
    return data, scale, *scaling_aware_transpose(data, scale, ends)


def bytes_moved(rows: int, hidden: int, valid_rows: int, backward: bool, transpose: bool) -> int:
    """Each input read once (rows before the last end), each output written once (all rows); ``transpose``: the
    output's column-wise copy too."""
    copies = 2 if transpose else 1
    if not backward:
        return valid_rows * (2 * hidden * 2 + 4) + copies * rows * (hidden + hidden // BLOCK * 4)
    return valid_rows * (3 * hidden * 2 + 4) + copies * rows * (2 * hidden + 2 * hidden // BLOCK * 4) + rows * 4


def run_cases(sweep: bool) -> list[dict]:
    compiled_fwd = torch.compile(swiglu_quant_reference, fullgraph=True, dynamic=True)
    compiled_bwd = torch.compile(swiglu_quant_backward_reference, fullgraph=True, dynamic=True)
    results = []
    for rows, model, (routing, counts_fn) in itertools.product(ROWS, MODELS, ROUTINGS.items()):
        if sweep and routing != "balanced":
            continue
        ends = group_ends(counts_fn(rows, model.experts), rows)
        sets = make_inputs(rows, model.hidden, ends)
        valid = int(ends[-1])
        case = f"M={rows} H={model.hidden} E={model.experts} {routing}"
        extra = {"rows": rows, "hidden": model.hidden, "experts": model.experts, "routing": routing}
        fwd_sets = [(h, p, e) for _, h, p, e in sets]
        fwd_bytes = bytes_moved(rows, model.hidden, valid, backward=False, transpose=False)
        fwd_t_bytes = bytes_moved(rows, model.hidden, valid, backward=False, transpose=True)
        bwd_bytes = bytes_moved(rows, model.hidden, valid, backward=True, transpose=True)
        bwd_rows_bytes = bytes_moved(rows, model.hidden, valid, backward=True, transpose=False)
        backward_op = launch_swiglu_quant_backward if sweep else swiglu_quant_backward
        directions = [
            (
                "forward",
                launch_swiglu_quant,
                fwd_sets,
                fwd_bytes,
                SWEEP_FORWARD,
                [
                    ("torch.compile reference", compiled_fwd, fwd_sets),
                    ("eager BF16 SwiGLU + quantize_1x128", eager_forward, [(h, p) for h, p, _ in fwd_sets]),
                ],
            ),
            (
                "forward_transpose",
                functools.partial(launch_swiglu_quant, transpose=True),
                fwd_sets,
                fwd_t_bytes,
                SWEEP_TRANSPOSE,
                [
                    ("swiglu_quant + scaling_aware_transpose", forward_then_transpose, fwd_sets),
                    ("swiglu_quant alone (no transpose)", launch_swiglu_quant, fwd_sets),
                ],
            ),
            (
                "backward",
                backward_op,
                sets,
                bwd_bytes,
                SWEEP_BACKWARD,
                [
                    ("torch.compile reference", compiled_bwd, sets),
                    ("eager BF16 SwiGLU backward + 2x quantize_1x128", eager_backward, [s[:3] for s in sets]),
                ],
            ),
            (
                "backward_rows_only",
                functools.partial(backward_op, transpose=False),
                sets,
                bwd_rows_bytes,
                SWEEP_BACKWARD,
                [("swiglu_quant_backward with the column-wise copy", swiglu_quant_backward, sets)],
            ),
        ]
        for direction, launch, args, nbytes, configs, baselines in directions:
            common = {"bytes_moved": nbytes, "direction": direction}
            if sweep:
                for cfg in configs:
                    fn = functools.partial(launch, config=cfg)  # positionally it would land in score_before_experts
                    us, dev = bench_us(fn, args), device_us(fn, args)
                    results.append(row(case, us, "none", None, **common, device_us=dev, config=str(cfg)))
                continue
            ours, dev = bench_us(launch, args), device_us(launch, args)
            kernel = _kernel_name(direction, sets[0])
            for name, fn, base_args in baselines:
                results.append(
                    row(case, ours, name, bench_us(fn, base_args), **common, device_us=dev, kernel=kernel, **extra)
                )
        del sets, fwd_sets
        torch.cuda.empty_cache()
    return results


def _kernel_name(direction: str, inputs: tuple) -> str:
    """The kernel the op runs on ``inputs`` (grad_a, h, ...), by the op's own rule."""
    if direction.startswith("backward") and backward_takes_sm90_kernel(inputs[0], inputs[1]):
        return "sm90 TMA ring"
    configs = {"forward": FORWARD_CONFIG, "forward_transpose": TRANSPOSE_CONFIG}
    return f"triton {configs.get(direction, BACKWARD_CONFIG)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time the launch configurations instead of the baselines")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_swiglu_quant: no CUDA device, nothing to measure.")
        return
    rows = run_cases(args.sweep)
    notes = (
        "Ours = the forward's launcher, the public backward op (column 'kernel': the kernel each ran). GB/s at the algorithmic minimum (see the "
        "script's docstring); speed-up = baseline / ours. " + DEVICE_NOTE
    )
    write_results("swiglu_quant_sweep" if args.sweep else "swiglu_quant", rows, notes)


if __name__ == "__main__":
    main()
