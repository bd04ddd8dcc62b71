"""Expert parallelism with FP8 dispatch: 2 ranks against the single-process FP8-Flow layer.

Two processes (gloo on the CPU, where the torch references stand in for the kernels; NCCL with the
Triton kernels where 2 GPUs exist) each take half of the tokens and half of the experts; the
single-process path runs all tokens on all experts. Outputs and every gradient agree bit for bit:
every row meets the same operands in the same order (each expert's rows arrive in global token
order, rank 0's tokens first), the BF16 rows return unchanged and the top-k sum runs on the token's
rank in the same fp32 order. Also: still exactly 2 explicit activation casts per layer and step;
empty experts, a rank that receives no rows, recompute; torchtitan's MoE layer with its experts
parallelized by torchtitan's own ``ExpertParallel`` style (a BF16 layer beside it keeps torchtitan's);
FSDP2 with the expert weights all-gathered in FP8 (bit-identical to the BF16 all-gather); a DCP
checkpoint under EP that resumes bit for bit and loads into an unconverted BF16 layer (same keys);
clear errors for bad degrees and unsupported parallelisms.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import assert_accumulated, assert_sizes_compile_nothing_new, int_drawer, make_routing
from test_moe import PARAMS, ROUTINGS, _inputs, make_moe, run_step

from fp8flow_ao.debug import FP8FlowOpCounter
from fp8flow_ao.moe import _routed_experts, convert_moe_layer, fp8flow_routed_experts
from fp8flow_ao.parallel import shard_experts
from fp8flow_ao.parallel.expert_parallel import plan_dispatch

WORLD = 2
DIM, HIDDEN, TOKENS_PER_RANK = 256, 128, 48


def _routed_case(seed: int, experts: int, top_k: int, route: str, recompute: bool, backward: str = "fp8") -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = WORLD * TOKENS_PER_RANK
    scores = torch.rand(tokens, experts, generator=g)
    if route == "skewed":  # expert 0 wins most rows, the last quarter of the experts never win
        scores = scores * torch.linspace(3.0, 0.1, experts)
        scores[:, experts - experts // 4 :] = -1.0
    elif route == "one_rank":  # every row goes to rank 0's experts: rank 1 receives nothing
        scores[:, experts // WORLD :] = -1.0
    probs, indices = scores.topk(top_k, dim=1)
    probs = probs.abs() / probs.abs().sum(1, keepdim=True)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    return {
        "x": torch.randn(tokens, DIM, generator=g).to(torch.bfloat16),
        "probs": probs.float(),
        "indices": indices,
        "grad": torch.randn(tokens, DIM, generator=g).to(torch.bfloat16),
        "w1": weight(experts, HIDDEN, DIM),
        "w2": weight(experts, DIM, HIDDEN),
        "w3": weight(experts, HIDDEN, DIM),
        "token_splits": [TOKENS_PER_RANK] * WORLD,
        "options": {"recompute_experts": recompute, "backward": backward},
    }


def _draw_layer_dims(draw: Callable[[int], int], gpu_sized: bool) -> tuple[int, int, int]:
    """``(D, H, E)`` of a random case: widths any multiple of 128 (up to 1536 GPU-sized), E a multiple of WORLD."""
    dim, hidden = (128 * draw(12), 128 * draw(12)) if gpu_sized else (128 * draw(3), 128 * draw(2))
    return dim, hidden, WORLD * draw(16 if gpu_sized else 4)


def _random_ep_case(seed: int, gpu_sized: bool) -> dict:
    """A routed case no other test names, drawn from ``seed``: widths, expert count, top-k, and a different token
    count on each rank (every fourth seed none on one rank); a skewed router that leaves some experts without
    rows; bf16 or fp32 tokens and weights; the routed options (recompute, score placement, weight cache, FC1's
    dgrad in BF16) drawn too. GPU-sized: up to 1536 wide, 32 experts, ~1500 tokens a rank."""
    g = torch.Generator().manual_seed(seed)
    draw = int_drawer(g)
    dim, hidden, experts = _draw_layer_dims(draw, gpu_sized)
    top_k = draw(min(experts, 8))
    token_splits = [draw(1500 if gpu_sized else 40) - 1 for _ in range(WORLD)]
    if seed % 4 == 0:
        token_splits[seed // 4 % WORLD] = 0
    tokens = sum(token_splits)
    popularity = torch.rand(experts, generator=g) ** 4 * (torch.rand(experts, generator=g) > 0.25) + 1e-6
    indices = torch.multinomial(popularity.expand(tokens, -1), top_k, generator=g) if tokens else torch.zeros(0, top_k)
    x_dtype, w_dtype = (torch.float32 if draw(4) == 1 else torch.bfloat16 for _ in range(2))

    def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return {
        "x": randn(tokens, dim, dtype=x_dtype) * torch.logspace(-1, 1, tokens)[:, None].to(x_dtype),
        "probs": torch.rand(tokens, top_k, generator=g),
        "indices": indices.long(),
        "grad": randn(tokens, dim, dtype=x_dtype),
        "w1": randn(experts, hidden, dim, scale=dim**-0.5, dtype=w_dtype),
        "w2": randn(experts, dim, hidden, scale=hidden**-0.5, dtype=w_dtype),
        "w3": randn(experts, hidden, dim, scale=dim**-0.5, dtype=w_dtype),
        "token_splits": token_splits,
        "options": {
            "recompute_experts": draw(2) == 1,
            "score_before_experts": draw(3) == 1,
            "weight_cache": ("off", "forward")[draw(2) - 1],
            "backward": ("fp8", "bf16_fc1_dgrad")[int(draw(4) == 1)],
        },
    }


CASES = {
    "balanced": _routed_case(1, experts=4, top_k=2, route="balanced", recompute=False),
    # FC1's dgrad in BF16 too: its rows travel back like FP8-Flow's
    "skewed_recompute": _routed_case(2, experts=8, top_k=3, route="skewed", recompute=True, backward="bf16_fc1_dgrad"),
    "one_rank": _routed_case(3, experts=4, top_k=2, route="one_rank", recompute=False),
}
_g = torch.Generator().manual_seed(5)
# whole torchtitan layers: DeepSeek-V3 style (score after the experts) and Llama 4 style (top-1, score before)
for _name, _routing in (("layer", "skewed"), ("layer_llama4", "llama4_skewed")):
    CASES[_name] = {
        "make": ROUTINGS[_routing],
        "x": torch.randn(WORLD * TOKENS_PER_RANK, DIM, generator=_g).to(torch.bfloat16),
        "grad": torch.randn(WORLD * TOKENS_PER_RANK, DIM, generator=_g).to(torch.bfloat16),
    }


# FSDP2 (data parallel, experts sharded on dim 0): the same FSDP_STEPS steps (fused AdamW, clipped) with
# the expert weights all-gathered in BF16 and as FP8 tiles; the layer under test is the skewed one.
for _fp8_gather in (False, True):
    CASES[f"fsdp_fp8_gather={_fp8_gather}"] = CASES["layer"] | {"fsdp_fp8_all_gather": _fp8_gather}


def _dcp_case(checkpoint_dir) -> dict:
    """Two steps of the skewed layer under EP: a DCP checkpoint after the first (see ep_worker.run_dcp_case)."""
    g = torch.Generator().manual_seed(11)
    tensors = {
        f"{name}{i}": torch.randn(WORLD * TOKENS_PER_RANK, DIM, generator=g).to(torch.bfloat16)
        for i in (0, 1)
        for name in ("x", "grad")
    }
    return {"make": CASES["layer"]["make"], "checkpoint_dir": str(checkpoint_dir)} | tensors


def _check_dcp(ranks: list[dict]) -> None:
    for rank, results in enumerate(ranks):
        dcp = results["dcp"]
        assert torch.equal(dcp["resumed"], dcp["uninterrupted"]), f"rank {rank}: resumed step differs"
        assert dcp["same_keys"] and dcp["bf16_has_step1_weights"], f"rank {rank}: BF16 layer did not load it"


def _single_process_routed(case: dict, device: str) -> dict:
    # copy=True: never set requires_grad on the shared CASES tensors (the NCCL test saves them for its ranks)
    x, probs = case["x"].to(device, copy=True).requires_grad_(), case["probs"].to(device, copy=True).requires_grad_()
    weights = [case[n].to(device, copy=True).requires_grad_() for n in ("w1", "w2", "w3")]
    out = fp8flow_routed_experts(x, probs, case["indices"].to(device), *weights, **case["options"])
    out.backward(case["grad"].to(device))
    grads = {n: w.grad.cpu() for n, w in zip(("w1", "w2", "w3"), weights, strict=True)}
    return {"out": out.detach().cpu(), "x": x.grad.cpu(), "probs": probs.grad.cpu()} | grads


def _single_process_layer(case: dict, device: str) -> dict:
    moe = convert_moe_layer(make_moe(**case["make"], device=device))
    shape = (WORLD, TOKENS_PER_RANK, DIM)  # batch rows = ranks: the same tokens in the same order
    result = run_step(moe, case["x"].to(device).view(shape), case["grad"].to(device).view(shape))
    grads = {n: p.grad.cpu() for n, p in moe.named_parameters()}
    return {k: result[k].cpu().view(-1, DIM) for k in ("out", "x")} | grads


def _run_ranks(tmp_path, device: str, cases: dict) -> list[dict]:
    """Run ``cases`` on WORLD spawned ranks (ep_worker.py); each rank's results."""
    import ep_worker

    torch.save(cases, tmp_path / "cases.pt")
    torch.multiprocessing.spawn(ep_worker.worker, args=(WORLD, device, str(tmp_path)), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def _split(t: torch.Tensor, rank: int, sizes: list[int] | None = None) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` along dim 0: ``sizes`` rows each, else equal parts."""
    return t.split(sizes or t.shape[0] // WORLD)[rank]


# Split over ranks along dim 0: token-major results (by the case's token_splits where it has them) and the
# experts' weights and their gradients (equal parts).
_BY_TOKEN = ("out", "x", "probs")
_BY_RANK = (*_BY_TOKEN, "w1", "w2", "w3", "experts.w1", "experts.w2", "experts.w3")


def _check_fsdp(ranks: list[dict], prefix: str = "") -> None:
    """FP8 all-gather of the expert weights changes no bit and quantizes only the shards, never the full weight:
    outputs, gradients and updated weights over several steps of fused AdamW with gradient clipping (the cases
    ``<prefix>fsdp_fp8_gather=False`` and ``=True``)."""
    import ep_worker

    bf16, fp8 = (f"{prefix}fsdp_fp8_gather={flag}" for flag in (False, True))
    for results in ranks:
        for key, value in results[bf16].items():
            if key.startswith(("quantize_128x128", "weight_quantizations")):
                continue
            assert torch.equal(results[fp8][key], value), f"FSDP2 FP8 vs BF16 all-gather: {key} differs"
        # BF16 gather: the layer quantizes the whole W13 and w2 in forward, their transposes in backward
        # (4 quantize_128x128 passes, or 4 GEMMs that quantize as they load: few rows per expert here);
        # FP8 gather: each rank quantizes only its shards of w1, w2, w3, at the forward's all-gather and at
        # backward's re-gather (6 calls on half the bytes), the layer none, its GEMMs none either.
        steps = range(ep_worker.FSDP_STEPS)
        assert [results[bf16][f"weight_quantizations@{s}"] for s in steps] == [4] * len(steps)
        assert [results[fp8][f"quantize_128x128@{s}"] for s in steps] == [6] * len(steps)
        assert [results[fp8][f"weight_quantizations@{s}"] for s in steps] == [6] * len(steps)
        assert any(key.startswith("weight:experts.") for key in results[fp8]), "the updated weights are compared"
    assert not torch.equal(ranks[0][fp8]["out@0"], ranks[0][fp8]["out@1"]), "the optimizer step must change the weights"


def _check_case(name: str, case: dict, ranks: list[dict], device: str) -> dict:
    """Each rank's results of a routed or layer case against the one-process run (returned)."""
    ref = (_single_process_layer if "make" in case else _single_process_routed)(case, device)
    for key, expected in ref.items():
        if key in _BY_RANK:
            sizes = case.get("token_splits") if key in _BY_TOKEN else None
            for rank, results in enumerate(ranks):
                got = results[name][key]
                assert torch.equal(got, _split(expected, rank, sizes)), f"{name}: {key} differs on rank {rank}"
        else:  # replicated BF16 parameters (router, shared expert): each rank holds its tokens' share,
            # so the sum of two rounded partials meets one rounded total within a few BF16 ulps.
            total = sum(results[name][key].float() for results in ranks)
            atol = 2**-6 * expected.float().abs().max().item()
            torch.testing.assert_close(total, expected.float(), rtol=0, atol=atol, msg=f"{name}: {key}")
    if "make" not in case:
        assert [results[name]["casts"] for results in ranks] == [2] * WORLD, f"{name}: explicit casts per rank"
    else:  # torchtitan's ExpertParallel: FP8 dispatch (no hooks) on the converted layer only
        assert all(results[name]["fp8flow_hooks"] == 0 for results in ranks)
        assert all(results[name]["bf16_hooks"] == 2 for results in ranks)
    return ref


def _check_against_single_process(ranks: list[dict], device: str) -> None:
    _check_fsdp(ranks)
    _check_dcp(ranks)
    for name, case in CASES.items():
        if "fsdp_fp8_all_gather" in case:
            continue
        ref = _check_case(name, case, ranks, device)
        if name == "layer":  # FSDP2's first step sees the same weights: the one-process layer's tokens
            for rank, results in enumerate(ranks):
                for key in ("out", "x"):
                    got = results["fsdp_fp8_gather=True"][f"{key}@0"]
                    assert torch.equal(got, _split(ref[key], rank)), f"FSDP2: {key} differs on rank {rank}"
    skewed_l2 = CASES["skewed_recompute"]["indices"].unique().numel()
    assert skewed_l2 < 8, "the skewed case must leave experts empty"


def _all_cases(tmp_path) -> dict:
    return CASES | {"dcp": _dcp_case(tmp_path / "dcp")}


def test_two_ranks_gloo_match_single_process(tmp_path):
    _check_against_single_process(_run_ranks(tmp_path, "cpu", _all_cases(tmp_path)), "cpu")


_TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")]


def _random_fsdp_cases(seed: int, gpu_sized: bool) -> dict:
    """The FSDP2 pair (BF16 and FP8 all-gather of the expert weights) on a torchtitan layer whose widths, expert
    count (a multiple of the ranks), top-k, routing bias (some experts never chosen) and token count are drawn."""
    g = torch.Generator().manual_seed(seed)
    draw = int_drawer(g)
    dim, hidden, experts = _draw_layer_dims(draw, gpu_sized)
    bias = torch.where(torch.rand(experts, generator=g) < 0.25, -5.0, torch.rand(experts, generator=g))
    make = {"dim": dim, "hidden": hidden, "experts": experts, "top_k": draw(min(experts, 6))}
    tokens = WORLD * draw(600 if gpu_sized else 40)
    layer = {
        "make": make | {"expert_bias": bias.tolist()},
        "x": torch.randn(tokens, dim, generator=g).to(torch.bfloat16),
        "grad": torch.randn(tokens, dim, generator=g).to(torch.bfloat16),
    }
    return {f"seed{seed}:fsdp_fp8_gather={flag}": layer | {"fsdp_fp8_all_gather": flag} for flag in (False, True)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_TWO_GPUS)])
def test_two_ranks_match_single_process_at_random_shapes(tmp_path, device):
    """Bit for bit, at shapes, routings, per-rank token counts and options no other case names
    (:func:`_random_ep_case`): 3 seeds on gloo (the references: a rank without tokens, fp32 tokens at top-6 over
    uneven ranks, FC1's dgrad in BF16), 10 GPU-sized ones on NCCL (the kernels). Beside them FSDP2 at random
    shapes (:func:`_random_fsdp_cases`): the FP8 all-gather equals the BF16 one over steps with updates."""
    seeds = (0, 5, 6) if device == "cpu" else range(300, 310)
    cases = {f"seed{s}": _random_ep_case(s, gpu_sized=device == "cuda") for s in seeds}
    fsdp_seeds = (5,) if device == "cpu" else (400, 401, 402)
    for s in fsdp_seeds:
        cases |= _random_fsdp_cases(s, gpu_sized=device == "cuda")
    ranks = _run_ranks(tmp_path, device, cases)
    for name, case in cases.items():
        if "fsdp_fp8_all_gather" not in case:
            _check_case(name, case, ranks, device)
    for s in fsdp_seeds:
        _check_fsdp(ranks, prefix=f"seed{s}:")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_two_ranks_nccl_match_single_gpu(tmp_path):
    _check_against_single_process(_run_ranks(tmp_path, "cuda", _all_cases(tmp_path)), "cuda")


def test_shard_experts_errors():
    moe = make_moe(experts=4)
    with pytest.raises(TypeError, match="convert the MoE layer first"):
        shard_experts(moe.experts, _FakeMesh(2))
    convert_moe_layer(moe)
    with pytest.raises(ValueError, match="expert parallel degree 3 must divide the number of experts 4"):
        shard_experts(moe.experts, _FakeMesh(3))
    with pytest.raises(TypeError, match="1-D DeviceMesh"):
        shard_experts(moe.experts, _FakeMesh(2, ndim=2))


class _FakeMesh:
    """Enough of a DeviceMesh for the checks that run before any collective."""

    def __init__(self, size: int, ndim: int = 1):
        self._size, self.ndim = size, ndim

    def size(self) -> int:
        return self._size


def _parallel_dims(**degrees: int):
    from torchtitan.distributed import ParallelDims

    sizes = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1} | degrees
    return ParallelDims(**sizes, world_size=WORLD)


def _job_config(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.custom_config_module", "fp8flow_ao.torchtitan.job_config", *args])


@pytest.mark.parametrize(
    ("degrees", "args", "match"),
    [
        ({"tp": 2, "dp_shard": 1}, (), "tensor_parallel_degree > 1 is not supported"),
        (
            {"ep": 2},
            ("--parallelism.expert_parallel_comm_backend", "deepep"),
            "expert_parallel_comm_backend = 'deepep'",
        ),
    ],
)
def test_converter_refuses_unsupported_parallelism_before_building(degrees, args, match):
    from fp8flow_ao.torchtitan.converter import FP8FlowConverter

    with pytest.raises(ValueError, match=match):
        FP8FlowConverter(_job_config(*args), _parallel_dims(**degrees))


def test_converter_refuses_ep_degree_that_does_not_divide_experts():
    from fp8flow_ao.torchtitan.converter import FP8FlowConverter

    moe = make_moe(experts=3, top_k=1, expert_bias=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="expert_parallel_degree = 2 must divide the number of experts"):
        FP8FlowConverter(_job_config(), _parallel_dims(ep=2)).convert(torch.nn.ModuleDict({"moe": moe}))
    # The rowwise baseline keeps torchtitan's own expert path, which torchtitan checks itself.
    FP8FlowConverter(_job_config("--fp8flow.recipe", "rowwise"), _parallel_dims(ep=2))


def test_torchtitan_styles_other_than_ep_refuse_converted_experts():
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertTensorParallel, TensorParallel

    moe = convert_moe_layer(make_moe())
    for style, setting in ((TensorParallel(), "tensor_parallel_degree"), (ExpertTensorParallel(), "expert_tensor")):
        with pytest.raises(ValueError, match=setting):
            parallelize_module(moe.experts, _FakeMesh(2), style)


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-rank default process group in this process (gloo on the CPU, NCCL on a GPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("recompute", "backward"), [(False, "fp8"), (True, "fp8"), (True, "bf16_fc1_dgrad")], ids=str)
def test_one_rank_group_is_the_single_process_path(one_rank_group, recompute, backward):
    """EP degree 1 runs the whole dispatch machinery (on the GPU: its kernels) and changes no bit."""
    case = _routed_case(7, experts=4, top_k=2, route="skewed", recompute=recompute, backward=backward)
    ref = _single_process_routed(case, DEVICE)
    x, probs = case["x"].to(DEVICE).requires_grad_(), case["probs"].to(DEVICE).requires_grad_()
    weights = [case[n].to(DEVICE).requires_grad_() for n in ("w1", "w2", "w3")]
    out = fp8flow_routed_experts(
        x,
        probs,
        case["indices"].to(DEVICE),
        *weights,
        recompute_experts=recompute,
        ep_group=one_rank_group,
        backward=backward,
    )
    out.backward(case["grad"].to(DEVICE))
    got = {"out": out, "x": x.grad, "probs": probs.grad} | dict(
        zip(("w1", "w2", "w3"), (w.grad for w in weights), strict=True)
    )
    for key, expected in ref.items():
        assert torch.equal(got[key].detach().cpu(), expected), key


@pytest.mark.gpu
def test_gpu_received_row_counts_compile_no_kernel(one_rank_group):
    """Under EP the rows a rank receives change every step: forward + backward at a new count compiles no
    kernel (on one rank the count follows the tokens; the dispatch path is the same)."""

    def run(tokens: int) -> None:
        x = torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(tokens, 2, device="cuda", requires_grad=True)
        shapes = ((4, HIDDEN, DIM), (4, DIM, HIDDEN), (4, HIDDEN, DIM))
        weights = [(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_() for s in shapes]
        ids = make_routing("skewed", tokens, 2, 4, "cuda")
        out = fp8flow_routed_experts(x, probs, ids, *weights, ep_group=one_rank_group)
        out.float().square().sum().backward()

    assert_sizes_compile_nothing_new(run, (2048, 2047, 2041, 2032, 1999, 1027))


def test_sharded_experts_accumulate_into_their_dtensor_gradients(one_rank_group):
    """shard_experts' DTensor parameters (the layer runs on their local shards): a second micro-batch without
    zero_grad adds each weight gradient into the parameter's DTensor gradient's local shard in the wgrad
    epilogue (no fresh wgrad, no add), giving the first gradient plus the second's."""
    from torch.distributed.device_mesh import init_device_mesh

    moe = convert_moe_layer(make_moe(**ROUTINGS["skewed"]))
    shard_experts(moe.experts, init_device_mesh(DEVICE, (1,), mesh_dim_names=("ep",)))
    x, grad = _inputs(256, 128)
    first = run_step(moe, x, grad)
    fresh = {name: first[name].to_local().clone() for name in PARAMS[:3]}
    storages = {name: first[name].to_local().data_ptr() for name in PARAMS[:3]}
    with FP8FlowOpCounter() as counter:
        second = run_step(moe, x, grad)
    assert counter.counts["grouped_gemm_fp8_wgrad_accumulate"] == 3 and counter.counts["grouped_gemm_fp8_wgrad"] == 0
    for name in PARAMS[:3]:
        assert second[name].to_local().data_ptr() == storages[name], name
        assert_accumulated(second[name].to_local(), fresh[name], fresh[name])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def test_step_cache_sees_in_place_writes_to_dtensor_weights(one_rank_group):
    """An in-place write to a DTensor expert weight outside any optimizer (shard_experts' parameters) bumps the
    DTensor's version counter, not its local shard's: weight_cache="step" once kept serving the old tiles."""
    from torch.distributed.device_mesh import init_device_mesh

    from fp8flow_ao.weight_cache import EXPERT_WEIGHT_CACHE

    mesh = init_device_mesh(DEVICE, (1,), mesh_dim_names=("ep",))
    cached, fresh = (convert_moe_layer(make_moe(**ROUTINGS["skewed"]), weight_cache=m) for m in ("step", "off"))
    for moe in (cached, fresh):
        shard_experts(moe.experts, mesh)
    x, grad = _inputs(256, 128)
    try:
        for step in range(3):
            got, want = run_step(cached, x, grad), run_step(fresh, x, grad)
            for key in ("out", "x", *PARAMS[:3]):
                assert torch.equal(_local(got[key]), _local(want[key])), (step, key)
            with torch.no_grad():
                for moe in (cached, fresh):
                    moe.experts.w2.mul_(1.5)  # no optimizer: only the version counters say it changed
    finally:
        EXPERT_WEIGHT_CACHE.invalidate()


def test_fsdp_fp8_all_gather_on_a_one_rank_mesh(one_rank_group, tmp_path):
    """A one-rank shard mesh (torchtitan's expert mesh when expert_parallel_degree equals data_parallel_shard_degree):
    FSDP2 gathers nothing and hands over only its first all-gather input, which once lost the scales
    ("not enough values to unpack"). Bit-identical to the BF16 gather over steps with updates (the refills
    quantize into the held tiles), and its DCP checkpoint holds plain tensors that load into a BF16 layer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE, (1,))
    layers = {}
    for fp8_gather in (True, False):
        moe = convert_moe_layer(make_moe(**ROUTINGS["skewed"]), fsdp_fp8_all_gather=fp8_gather)
        fully_shard(moe.experts, mesh=mesh)
        fully_shard(moe, mesh=mesh)
        layers[fp8_gather] = (moe, torch.optim.SGD(moe.parameters(), lr=1.0))
    x, grad = _inputs(256, 128)
    for step in range(3):
        results = {}
        for fp8_gather, (moe, optimizer) in layers.items():
            results[fp8_gather] = run_step(moe, x, grad)
            optimizer.step()
            optimizer.zero_grad()
        for key in ("out", "x", *PARAMS[:3]):
            assert torch.equal(_local(results[True][key]), _local(results[False][key])), (step, key)
    moe = layers[True][0]
    state = moe.state_dict()
    assert all(type(getattr(v, "_local_tensor", v)) is torch.Tensor for v in state.values()), "plain local shards"
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    bf16 = make_moe(**ROUTINGS["skewed"], seed=5)
    fully_shard(bf16, mesh=mesh)
    loaded = bf16.state_dict()
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt")
    for name, value in state.items():
        assert torch.equal(_local(loaded[name]), _local(value)), name


def test_fp8_all_gather_refuses_experts_that_do_not_divide_over_the_ranks():
    """FSDP2 pads an uneven dim-0 shard and requires every all-gather input at the padded shard's shape, which the
    scales cannot have: every rank raises the same clear error (the ranks once failed in different ways)."""
    from fp8flow_ao.parallel.fsdp import pre_all_gather

    for shard in (torch.randn(2, 128, 256), torch.randn(1, 128, 256), torch.randn(0, 128, 256)):
        with pytest.raises(ValueError, match="E=3 over 2 ranks"):
            pre_all_gather(shard, (3, 128, 256), torch.bfloat16, ranks=2)
    data, scale = pre_all_gather(torch.randn(2, 128, 256), (4, 128, 256), torch.bfloat16, ranks=2)
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (2, 1, 2)
    (whole,) = pre_all_gather(torch.randn(3, 128, 256), (3, 128, 256), torch.bfloat16, ranks=1)
    assert whole.dtype == torch.bfloat16 and whole.shape == (3, 128, 256)


def test_compiled_experts_given_an_ep_group_later_run_it_eagerly(one_rank_group, monkeypatch):
    """A layer whose routed path is compiled (``fp8flow.compile_experts``) and gets its EP group after a
    compiled step (torchtitan applies EP after the converter ran) runs the EP path, eagerly: the group is
    read on every call, never frozen into the graph traced before. EP degree 1 changes no bit."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import fp8flow_ao.moe as moe_py

    torch._dynamo.reset()
    ref = make_moe(**ROUTINGS["skewed"])
    x, grad = _inputs(256, 128)
    expected = run_step(convert_moe_layer(copy.deepcopy(ref)), x, grad)
    moe = convert_moe_layer(copy.deepcopy(ref))
    moe.experts.fp8flow_compile_backend = "aot_eager"
    steps = [run_step(moe, x, grad)]
    assert len(_debug_get_cache_entry_list(_routed_experts.__code__)) == 1
    plans = []
    monkeypatch.setattr(moe_py, "plan_dispatch", lambda *a: plans.append(a) or plan_dispatch(*a))
    moe.experts.fp8flow_ep_group = one_rank_group  # what shard_experts sets
    moe.zero_grad()
    steps.append(run_step(moe, x, grad))
    assert len(plans) == 1, "the EP dispatch ran"
    assert len(_debug_get_cache_entry_list(_routed_experts.__code__)) == 1, "nothing traced under EP"
    for got in steps:
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


def test_fp8_all_gathered_weight_is_exact_and_refuses_other_ops():
    from fp8flow_ao.kernels.quantize_128x128 import quantize_128x128
    from fp8flow_ao.parallel.fsdp import check_shard_tiles
    from fp8flow_ao.tensor import Float8BlockwiseWeight

    w = torch.randn(3, 256, 384).to(torch.bfloat16)
    data, scale, data_t, scale_t = quantize_128x128(w)
    gathered = Float8BlockwiseWeight(data, scale, torch.bfloat16)
    got_t, got_scale_t = gathered.transposed()
    assert torch.equal(got_t.view(torch.uint8), data_t.view(torch.uint8)) and torch.equal(got_scale_t, scale_t)
    assert gathered.shape == w.shape and gathered.dtype == torch.bfloat16
    assert isinstance(gathered.detach(), Float8BlockwiseWeight)
    with pytest.raises(NotImplementedError, match="fsdp_fp8_all_gather"):
        gathered + 1
    with pytest.raises(ValueError, match="whole 128x128 tiles"):
        check_shard_tiles((3, 192, 384), (3, 384, 384))  # Shard(1) of N=384 over 2 ranks: 192 rows
    check_shard_tiles((2, 256, 384), (3, 256, 384))  # Shard(0): whole experts


def test_fsdp_fp8_all_gather_option_checks():
    from fp8flow_ao.config import FP8FlowConfig

    with pytest.raises(ValueError, match="needs recipe='blockwise'"):
        FP8FlowConfig(recipe="rowwise", fsdp_fp8_all_gather=True)
    with pytest.raises(TypeError, match="must be a bool"):
        FP8FlowConfig(fsdp_fp8_all_gather=1)
    moe = convert_moe_layer(make_moe(), fsdp_fp8_all_gather=True)
    assert all(type(v) is torch.Tensor for v in moe.state_dict().values()), "checkpoints hold plain tensors"


def test_one_rank_group_with_no_tokens(one_rank_group):
    """T = 0 (a rank whose batch routed nothing): empty payloads through the whole dispatch path."""
    case = _routed_case(8, experts=4, top_k=2, route="balanced", recompute=False)
    x = case["x"][:0].to(DEVICE).requires_grad_()
    probs = case["probs"][:0].to(DEVICE).requires_grad_()
    weights = [case[n].to(DEVICE).requires_grad_() for n in ("w1", "w2", "w3")]
    out = fp8flow_routed_experts(x, probs, case["indices"][:0].to(DEVICE), *weights, ep_group=one_rank_group)
    out.backward(torch.ones_like(out))
    assert out.shape == (0, DIM) and x.grad.shape == (0, DIM) and probs.grad.shape == (0, 2)
    assert all(w.grad is not None and not w.grad.any() for w in weights)


def test_single_process_reference_leaves_the_shared_cases_untouched():
    """A CPU reference run must not make CASES require grad: the NCCL test that follows in the same
    process saves them for its ranks, where a tensor that requires grad gives non-leaf inputs and no .grad."""
    _single_process_routed(CASES["balanced"], "cpu")
    assert not any(t.requires_grad for t in CASES["balanced"].values() if torch.is_tensor(t))
