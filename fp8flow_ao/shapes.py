"""The shapes every test and benchmark reports on (one registry; see PERF.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """Routed-expert dimensions of one MoE layer.

    ``dim`` is the model's hidden size D, ``hidden`` the expert ffn size H, ``experts`` the local
    expert count E, ``top_k`` the experts per token; ``score_before_experts`` is torchtitan's
    ``MoEArgs`` field of that name (the router score multiplies the expert's input, as in Llama 4).
    """

    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int
    score_before_experts: bool = False


DEEPSEEK_V3 = MoEShape("deepseek-v3-like", dim=7168, hidden=2048, experts=32, top_k=8)
DEEPSEEK_V3_E8 = MoEShape("deepseek-v3-like-e8", dim=7168, hidden=2048, experts=8, top_k=8)
QWEN3_30B_A3B = MoEShape("qwen3-30b-a3b-like", dim=2048, hidden=768, experts=128, top_k=8)
# torchtitan's llama4 "17bx16e" flavor: D=5120, expert ffn 8192 (4 * 5120 * 2/3 * 1.2 / (top-1 + 1
# shared), rounded up to a multiple of 2048), 16 experts, top-1, score before the experts.
LLAMA4_SCOUT = MoEShape("llama4-scout-like", dim=5120, hidden=8192, experts=16, top_k=1, score_before_experts=True)
BENCH_SHAPES = (DEEPSEEK_V3, DEEPSEEK_V3_E8, QWEN3_30B_A3B)
# Routed rows (tokens x top-k) at which the memory-bound kernels are reported.
BENCH_ROUTED_ROWS = (16384, 32768)
# A tiny shape with every dim a multiple of 128, for CPU tests of whole layers.
TINY = MoEShape("tiny", dim=256, hidden=128, experts=4, top_k=2)
# Routed rows (tokens x top-k) at which the dispatch-side data movement (permute_pad,
# unpermute_unpad) is reported: 4096 and 8192 tokens at top-8.
BENCH_DISPATCH_ROWS = (32768, 65536)
