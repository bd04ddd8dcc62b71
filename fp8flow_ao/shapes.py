"""The shapes every test and benchmark reports on (one registry; see PERF.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """Routed-expert dimensions of one MoE layer.

    ``dim`` is the model's hidden size D, ``hidden`` the expert ffn size H, ``experts`` the local
    expert count E, ``top_k`` the experts per token.
    """

    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int


DEEPSEEK_V3 = MoEShape("deepseek-v3-like", dim=7168, hidden=2048, experts=32, top_k=8)
DEEPSEEK_V3_E8 = MoEShape("deepseek-v3-like-e8", dim=7168, hidden=2048, experts=8, top_k=8)
QWEN3_30B_A3B = MoEShape("qwen3-30b-a3b-like", dim=2048, hidden=768, experts=128, top_k=8)
BENCH_SHAPES = (DEEPSEEK_V3, DEEPSEEK_V3_E8, QWEN3_30B_A3B)
# Routed rows (tokens x top-k) at which the memory-bound kernels are reported.
BENCH_ROUTED_ROWS = (16384, 32768)
# A tiny shape with every dim a multiple of 128, for CPU tests of whole layers.
TINY = MoEShape("tiny", dim=256, hidden=128, experts=4, top_k=2)
# Routed rows (tokens x top-k) at which the dispatch-side data movement (permute_pad,
# unpermute_unpad) is reported: 4096 and 8192 tokens at top-8.
BENCH_DISPATCH_ROWS = (32768, 65536)
