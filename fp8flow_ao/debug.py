"""Debug helpers: count the fp8flow ops a step runs, the explicit BF16->FP8 casts among them; SQNR.

FP8-Flow's promise is two explicit activation casts per MoE layer per step (the layer input in
forward, the output gradient in backward); every other FP8 tensor comes out of a fused kernel
(permute, SwiGLU+quant, the scaling-aware transpose) and weights are quantized once per step.
:class:`FP8FlowOpCounter` checks that from the outside: it sees every ``fp8flow::*`` op call that
goes through the dispatcher (forward and backward, eager mode), not what happens inside one.

    with FP8FlowOpCounter() as counter:
        model(x).sum().backward()
    assert counter.activation_casts == 2 * num_moe_layers
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that take a BF16/FP32 activation or gradient to FP8 on their own: the casts FP8-Flow counts.
# (swiglu_quant* quantize inside a fused op; quantize_128x128 quantizes weights.)
ACTIVATION_CAST_OPS = (
    "quantize_1x128",
    "quantize_1x128_transpose",
    "quantize_dual_1x128",
    "quantize_permute_pad_rows",
)
# The count key of grouped GEMM calls that quantize a high-precision weight themselves (tile by tile as they
# load it, instead of reading quantize_128x128's tiles), whether or not they keep the tiles (keep_b).
QUANTIZING_GEMMS = "grouped_gemm_fp8_blockwise(high-precision b)"


class FP8FlowOpCounter(TorchDispatchMode):
    """Dispatch mode that counts ``fp8flow::<op>`` calls by op name in :attr:`counts`; grouped GEMM calls
    that quantize their weight themselves are also counted under :data:`QUANTIZING_GEMMS`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fp8flow":
            self.counts[func._opname] += 1
            if func._opname == "grouped_gemm_fp8_blockwise_keep_b" or (
                func._opname == "grouped_gemm_fp8_blockwise" and args[2].dtype != torch.float8_e4m3fn
            ):
                self.counts[QUANTIZING_GEMMS] += 1
        return func(*args, **(kwargs or {}))

    @property
    def weight_quantizations(self) -> int:
        """Weights made FP8 (in one or both orientations): one per ``quantize_128x128`` call, two per
        ``quantize_128x128_pair`` call, one per GEMM that quantizes its weight."""
        return (
            self.counts["quantize_128x128"] + 2 * self.counts["quantize_128x128_pair"] + self.counts[QUANTIZING_GEMMS]
        )

    @property
    def activation_casts(self) -> int:
        """Explicit BF16/FP32 -> FP8 activation/gradient casts seen (see ``ACTIVATION_CAST_OPS``)."""
        return sum(self.counts[name] for name in ACTIVATION_CAST_OPS)


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(||ref||^2 / ||ref - out||^2)`` in dB (fp64).

    ``inf`` when ``out`` equals ``ref``; the tests, benchmarks and the training probe
    (:mod:`fp8flow_ao.torchtitan.probe`) all measure FP8 error with it.
    """
    ref, out = ref.detach().double(), out.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
