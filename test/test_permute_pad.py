"""permute_pad: routing metadata and the fused gather, bit-exact against a naive loop and the reference."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import assert_fp8_equal, assert_scales_equal, edge_case_rows, make_routing, run_compiling

import fp8flow_ao.kernels.permute_pad as permute_pad_module
from fp8flow_ao._format import BLOCK, FP8_DTYPE, dequantize_rows_reference, quantize_rows_reference
from fp8flow_ao.kernels.permute_pad import (
    SCATTER_MIN_ROW_BYTES,
    PermutePadResult,
    launch_permute_pad_rows,
    launch_quantize_permute_pad_rows,
    launch_route_pad,
    padded_rows_bound,
    permute_pad,
    permute_pad_reference,
    permute_pad_rows,
    permute_pad_rows_reference,
    quantize_permute_pad_rows_reference,
    route_pad,
    route_pad_reference,
    scatter_pays,
)
from fp8flow_ao.kernels.quantize_1x128 import quantize_1x128, quantize_1x128_reference
from fp8flow_ao.kernels.unpermute_unpad import unpermute_unpad


def naive_route(ids: torch.Tensor, experts: int) -> tuple[list[int], list[int], list[int]]:
    """The row maps by the definition, one row at a time: groups in expert order, rows in (t, j) order."""
    flat = ids.reshape(-1).tolist()
    src = [-1] * padded_rows_bound(len(flat), experts)
    dst = [0] * len(flat)
    ends, start = [], 0
    for e in range(experts):
        rows = [f for f, v in enumerate(flat) if v == e]
        for i, f in enumerate(rows):
            src[start + i], dst[f] = f, start + i
        start += -(-len(rows) // BLOCK) * BLOCK
        ends.append(start)
    return src, dst, ends


# (kind, T, k, E): top-k 1 and 8, T = 0, groups of several 128-row blocks, skewed and empty experts
ROUTINGS = [
    ("distinct", 37, 8, 12),
    ("distinct", 50, 1, 4),
    ("skewed", 300, 2, 9),
    ("one_expert", 200, 2, 4),
    ("twice", 23, 3, 5),
    ("distinct", 0, 2, 4),
    ("distinct", 5, 1, 1),
]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: f"{r[0]}-T{r[1]}-k{r[2]}-E{r[3]}")
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_route_pad_matches_naive(routing, id_dtype):
    kind, tokens, top_k, experts = routing
    ids = make_routing(kind, tokens, top_k, experts, DEVICE).to(id_dtype)
    src_rows, dst_rows, ends = route_pad(ids, experts)
    src, dst, naive_ends = naive_route(ids.cpu(), experts)
    assert src_rows.dtype == dst_rows.dtype == ends.dtype == torch.int32
    assert src_rows.device == ids.device
    assert src_rows.cpu().tolist() == src
    assert dst_rows.cpu().tolist() == dst
    assert ends.cpu().tolist() == naive_ends


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: f"{r[0]}-T{r[1]}-k{r[2]}-E{r[3]}")
@pytest.mark.parametrize("probs_dtype", [None, torch.bfloat16])
def test_route_kernel_matches_reference(routing, probs_dtype):
    kind, tokens, top_k, experts = routing
    ids = make_routing(kind, tokens, top_k, experts, DEVICE).to(torch.int32)
    probs = None if probs_dtype is None else torch.rand(tokens, top_k, device=DEVICE).to(probs_dtype)
    got = launch_route_pad(ids, experts, probs)
    want = route_pad_reference(ids.cpu(), experts, None if probs is None else probs.cpu())
    for name, a, b in zip(("probs", "src_rows", "dst_rows", "group_end_offsets"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), name


# Many routed-row blocks per kernel program grid (up to 128 rows a block, fewer at more experts; E = 256:
# 64 rows a block, 64 scan programs of 4 experts each).
MULTI_BLOCK_ROUTINGS = [("skewed", 1500, 2, 9), ("distinct", 500, 8, 256), ("one_expert", 700, 3, 2)]


@pytest.mark.parametrize("scan_rows", [1024, 4], ids=["one-scan-step", "scan-steps-of-4-blocks"])
@pytest.mark.parametrize("routing", MULTI_BLOCK_ROUTINGS, ids=lambda r: f"{r[0]}-T{r[1]}-k{r[2]}-E{r[3]}")
def test_route_kernels_match_reference_across_blocks(routing, scan_rows, monkeypatch):
    """Rows of one expert spread over many blocks keep (token, slot) order: each block's base is the group
    start plus the expert's rows in the blocks before it, carried across the scan's steps."""
    monkeypatch.setattr(permute_pad_module, "_ROUTE_SCAN_ROWS", scan_rows)
    kind, tokens, top_k, experts = routing
    ids = make_routing(kind, tokens, top_k, experts, DEVICE)
    probs = torch.rand(tokens, top_k, device=DEVICE)
    got = launch_route_pad(ids, experts, probs)
    want = route_pad_reference(ids.cpu(), experts, probs.cpu())
    for name, a, b in zip(("probs", "src_rows", "dst_rows", "group_end_offsets"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), name
    src, dst, naive_ends = naive_route(ids.cpu(), experts)
    assert got[1].cpu().tolist() == src and got[2].cpu().tolist() == dst and got[3].cpu().tolist() == naive_ends


def test_out_of_range_ids_are_clamped_without_validation():
    """Without FP8FLOW_VALIDATE an id < 0 joins expert 0 and an id >= E the last expert: wrong routing,
    but the maps stay a permutation, so no later kernel reads out of bounds."""
    ids = make_routing("distinct", 40, 2, 5, DEVICE)
    ids[3, 0], ids[7, 1], ids[9, 0] = -4, 5, 99
    got, want = launch_route_pad(ids, 5), route_pad_reference(ids.cpu(), 5)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))
    src_rows, dst_rows, ends = (t.long() for t in want[1:])
    assert torch.equal(src_rows[dst_rows], torch.arange(80))
    expert_of_row = torch.searchsorted(ends, dst_rows, right=True)
    assert torch.equal(expert_of_row, ids.reshape(-1).cpu().clamp(0, 4))


@pytest.mark.parametrize("routing", ROUTINGS[:5], ids=lambda r: r[0])
def test_group_offsets_are_128_aligned(routing):
    kind, tokens, top_k, experts = routing
    ids = make_routing(kind, tokens, top_k, experts, DEVICE)
    src_rows, dst_rows, ends = (t.cpu().long() for t in route_pad(ids, experts))
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1]])
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=experts)
    assert bool((ends % BLOCK == 0).all()) and bool((starts % BLOCK == 0).all())
    assert torch.equal(ends - starts, (counts + BLOCK - 1) // BLOCK * BLOCK)  # each group rounded up, empty -> 0
    assert int(ends[-1]) <= src_rows.numel() == padded_rows_bound(tokens * top_k, experts)
    assert torch.equal(src_rows[dst_rows], torch.arange(tokens * top_k))  # maps are inverse
    assert int((src_rows >= 0).sum()) == tokens * top_k
    expert_of_row = torch.searchsorted(ends, dst_rows, right=True)
    assert torch.equal(expert_of_row, ids.reshape(-1).cpu())  # every row lands inside its expert's group


def _random_rows(dtype: torch.dtype, tokens: int, cols: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token rows in ``dtype`` with edge values (NaN, inf, zeros, subnormals); FP8 rows come with scales."""
    x = torch.randn(tokens, cols) * torch.logspace(-3, 3, max(tokens, 1))[:tokens, None]
    if tokens >= 8:
        x[:8] = edge_case_rows(cols, "cpu", torch.float32)
    if dtype == FP8_DTYPE:
        data, scale = quantize_rows_reference(x, BLOCK)
        return data.to(DEVICE), scale.to(DEVICE)
    return x.to(DEVICE, dtype), None


def _assert_rows_equal(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    if actual.dtype == FP8_DTYPE:
        assert_fp8_equal(actual, expected, name)
    else:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        assert torch.equal(
            actual.cpu().view(torch.int16 if actual.element_size() == 2 else torch.int32),
            expected.cpu().view(torch.int16 if expected.element_size() == 2 else torch.int32),
        ), name


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: f"{r[0]}-T{r[1]}-k{r[2]}")
@pytest.mark.parametrize(
    ("dtype", "cols"), [(FP8_DTYPE, 384), (FP8_DTYPE, 200), (torch.bfloat16, 200), (torch.float32, 64)]
)
@pytest.mark.parametrize("scatter", [False, True], ids=["gather", "scatter"])
def test_row_kernel_matches_reference(routing, dtype, cols, scatter):
    """Both forms of the kernel: gathering by src_rows, and (given dst_rows, top_k > 1) scattering each token
    to its rows with the pad rows zeroed by their own programs."""
    kind, tokens, top_k, experts = routing
    x, x_scale = _random_rows(dtype, tokens, cols)
    src_rows, dst_rows, _ = route_pad(make_routing(kind, tokens, top_k, experts, DEVICE), experts)
    data, scale = launch_permute_pad_rows(x, x_scale, src_rows, top_k, dst_rows, scatter=scatter)
    ref_data, ref_scale = permute_pad_rows_reference(
        x.cpu(), None if x_scale is None else x_scale.cpu(), src_rows.cpu(), top_k
    )
    _assert_rows_equal(data, ref_data, "data")
    assert_scales_equal(scale, ref_scale)
    # and the reference is the definition: row r holds token src // k, pad rows hold +0 bits
    src = src_rows.cpu().long()
    real = src >= 0
    assert not bool(ref_data[~real].view(torch.uint8).any())
    _assert_rows_equal(ref_data[real], x.cpu()[src[real] // top_k], "reference rows")


def test_the_launcher_scatters_where_it_pays():
    """Given dst_rows the op scatters wide rows of several experts per token and gathers otherwise (same
    rows either way); the pinned form needs dst_rows."""
    assert scatter_pays(7168, 8) and scatter_pays(SCATTER_MIN_ROW_BYTES, 2)
    assert not scatter_pays(2048, 8) and not scatter_pays(7168, 1)
    x, x_scale = _random_rows(FP8_DTYPE, 30, SCATTER_MIN_ROW_BYTES)
    src_rows, dst_rows, _ = route_pad(make_routing("skewed", 30, 3, 4, DEVICE), 4)
    ref = permute_pad_rows_reference(x.cpu(), x_scale.cpu(), src_rows.cpu(), 3)
    for form in (None, True, False):
        data, scale = launch_permute_pad_rows(x, x_scale, src_rows, 3, dst_rows, scatter=form)
        assert_fp8_equal(data, ref[0])
        assert_scales_equal(scale, ref[1])
    with pytest.raises(ValueError, match="scatter=True needs dst_rows"):
        launch_permute_pad_rows(x, x_scale, src_rows, 3, scatter=True)


def test_gather_row_stride_is_free():
    x, x_scale = _random_rows(FP8_DTYPE, 40, 512)
    src_rows, _, _ = route_pad(make_routing("distinct", 40, 2, 3, DEVICE), 3)
    view, scale_view = x[:, :256], x_scale[:, :2]  # row strides 512 and 4
    data, scale = launch_permute_pad_rows(view, scale_view, src_rows, 2)
    ref_data, ref_scale = permute_pad_rows_reference(
        view.contiguous().cpu(), scale_view.contiguous().cpu(), src_rows.cpu(), 2
    )
    assert_fp8_equal(data, ref_data)
    assert_scales_equal(scale, ref_scale)


def _assert_quantized_rows_equal(actual, expected) -> None:
    names = ("data", "scale_inv", "token_data", "token_scale_inv")[: len(expected)]
    for got, ref, name in zip(actual, expected, names, strict=True):
        if ref.dtype == FP8_DTYPE:
            assert_fp8_equal(got, ref, name)
        else:
            assert got.shape == ref.shape, name
            assert_scales_equal(got, ref)


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: f"{r[0]}-T{r[1]}-k{r[2]}")
@pytest.mark.parametrize(
    ("dtype", "cols", "keep"),
    [
        (torch.bfloat16, 384, True),
        (torch.bfloat16, 200, False),
        (torch.float16, 256, False),
        (torch.float32, 128, True),
    ],
    ids=["bf16-384-rows+tokens", "bf16-200-rows", "fp16-256-rows", "fp32-128-rows+tokens"],
)
def test_quantizing_row_kernel_matches_reference(routing, dtype, cols, keep):
    """quantize=True: each token read once, quantized 1x128 (edge values, a ragged last block), scattered to
    its rows with the pad rows zeroed; with keep_token_rows also the token-order FP8 rows. Bit for bit the
    reference, which is quantize_1x128 then the gather."""
    kind, tokens, top_k, experts = routing
    x, _ = _random_rows(dtype, tokens, cols)
    src_rows, dst_rows, _ = route_pad(make_routing(kind, tokens, top_k, experts, DEVICE), experts)
    out = launch_quantize_permute_pad_rows(x, src_rows, top_k, dst_rows, keep)
    ref = quantize_permute_pad_rows_reference(x.cpu(), src_rows.cpu(), top_k, dst_rows.cpu(), keep)
    _assert_quantized_rows_equal(out, ref)
    # and the reference is the definition: the gather of quantize_1x128(x)'s rows
    x8, s8 = quantize_1x128_reference(x.cpu())
    data, scale = permute_pad_rows_reference(x8, s8, src_rows.cpu(), top_k)
    expected_tokens = (x8, s8) if keep else (x8[:0], s8[:0])
    _assert_quantized_rows_equal(ref, (data, scale, *expected_tokens))


def test_quantizing_row_stride_is_free():
    """quantize=True reads x through its row stride (a column slice of a wider tensor), as quantize_1x128 does."""
    wide, _ = _random_rows(torch.bfloat16, 40, 512)
    view = wide[:, 128:384]
    src_rows, dst_rows, _ = route_pad(make_routing("skewed", 40, 3, 4, DEVICE), 4)
    out = launch_quantize_permute_pad_rows(view, src_rows, 3, dst_rows, True)
    ref = quantize_permute_pad_rows_reference(view.contiguous().cpu(), src_rows.cpu(), 3, dst_rows.cpu(), True)
    _assert_quantized_rows_equal(out, ref)


def test_permute_pad_quantizes_as_quantize_1x128():
    """permute_pad(quantize=True) == quantize_1x128 then permute_pad, token rows included; the probs keep
    their gradient; the public gather's quantize flag gives the same rows."""
    tokens, top_k, experts, cols = 45, 3, 5, 256
    x, _ = _random_rows(torch.bfloat16, tokens, cols)
    ids = make_routing("skewed", tokens, top_k, experts, DEVICE)
    probs = torch.rand(tokens, top_k, device=DEVICE, requires_grad=True)
    out = permute_pad(x, None, ids, probs, experts, quantize=True)
    x8, s8 = quantize_1x128(x)
    two_steps = permute_pad(x8, s8, ids, probs, experts)
    ref = permute_pad_reference(x.cpu(), None, ids.cpu(), probs.detach().cpu(), experts, quantize=True)
    fields = ("data", "scale_inv", "token_data", "token_scale_inv")
    _assert_quantized_rows_equal([getattr(out, f) for f in fields], [getattr(ref, f) for f in fields])
    _assert_quantized_rows_equal([getattr(out, f) for f in fields], (two_steps.data, two_steps.scale_inv, x8, s8))
    for expected in (two_steps, ref):
        for name in ("probs", "src_rows", "dst_rows", "group_end_offsets"):
            assert torch.equal(getattr(out, name).detach().cpu(), getattr(expected, name).detach().cpu()), name
    assert two_steps.token_data is None and two_steps.token_scale_inv is None
    (grad,) = torch.autograd.grad(out.probs.sum(), probs)
    assert torch.equal(grad, torch.ones_like(probs))
    data, scale = permute_pad_rows(x, None, out.src_rows, top_k, dst_rows=out.dst_rows, quantize=True)
    _assert_quantized_rows_equal((data, scale), (out.data, out.scale_inv))


def test_quantizing_permute_compiles_fullgraph():
    tokens, top_k, experts = 40, 4, 6
    x, _ = _random_rows(torch.bfloat16, tokens, 256)
    ids = make_routing("skewed", tokens, top_k, experts, DEVICE)
    eager = permute_pad(x, None, ids, None, experts, quantize=True)
    compiled = torch.compile(permute_pad, fullgraph=True)(x, None, ids, None, experts, quantize=True)
    fields = ("data", "scale_inv", "token_data", "token_scale_inv")
    _assert_quantized_rows_equal([getattr(compiled, f) for f in fields], [getattr(eager, f) for f in fields])


def test_quantizing_opcheck():
    tokens, top_k, experts = 24, 2, 3
    src_rows, dst_rows, _ = route_pad(make_routing("distinct", tokens, top_k, experts, DEVICE), experts)
    x = torch.randn(tokens, 256, device=DEVICE, dtype=torch.bfloat16)
    # test_schema and the fake-tensor check compare outputs with torch.allclose, which float8 lacks
    checks = ("test_autograd_registration", "test_aot_dispatch_dynamic")
    for keep in (False, True):
        torch.library.opcheck(
            torch.ops.fp8flow.quantize_permute_pad_rows.default, (x, src_rows, top_k, dst_rows, keep), test_utils=checks
        )


_BUILD_KERNELS = """
import json
from fp8flow_ao.kernels._sm90_common import compile_for_sm90
from fp8flow_ao.kernels import permute_pad as pp
built = []
def build(name, kernel, pointers, ints, constexprs):
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    built.append([name, len(compile_for_sm90(kernel, signature, constexprs).asm["cubin"])])
ints = ("num_rows", "num_tokens", "cols", "num_scale_cols", "top_k", "stride_xm", "stride_sm")
scales = ("x_scale_ptr", "src_rows_ptr", "dst_rows_ptr", "scale_ptr", "tok_scale_ptr")
for scatter in (False, True):
    for bits, has_scale in (("*u8", True), ("*i16", False), ("*i32", False)):
        pointers = {**dict.fromkeys(("x_ptr", "data_ptr", "tok_data_ptr"), bits), **dict.fromkeys(scales, "*i32")}
        constexprs = dict(BLOCK_M=8, BLOCK_D=1024, SCALE_COLS=8, HAS_SCALE=has_scale, SCATTER=scatter,
                          PAD_ROWS=pp._PAD_ROWS, QUANTIZE=False, KEEP_TOKENS=False)
        build(f"rows scatter={scatter} {bits}", pp._permute_pad_rows_kernel, pointers, ints, constexprs)
for keep in (False, True):
    pointers = {"x_ptr": "*bf16", **dict.fromkeys(("data_ptr", "tok_data_ptr"), "*u8"), **dict.fromkeys(scales, "*i32")}
    constexprs = dict(BLOCK_M=8, BLOCK_D=1024, SCALE_COLS=8, HAS_SCALE=True, SCATTER=True, PAD_ROWS=pp._PAD_ROWS,
                      QUANTIZE=True, KEEP_TOKENS=keep)
    build(f"rows quantize keep={keep}", pp._permute_pad_rows_kernel, pointers, ints, constexprs)
for has_probs in (False, True):
    flags = dict(BLOCK_E=128, HAS_PROBS=has_probs)
    pointers = {"ids_ptr": "*i64", "counts_ptr": "*i32", "src_rows_ptr": "*i32", "probs_out_ptr": "*fp32"}
    ints = ("num_routed", "num_rows", "num_experts", "fill_per_program")
    build(f"route count probs={has_probs}", pp._route_count_kernel, pointers, ints,
          dict(BLOCK_R=pp._ROUTE_MAX_ROWS, FILL_BLOCK=pp._ROUTE_FILL_BLOCK, **flags))
    pointers = {"ids_ptr": "*i64", "probs_ptr": "*bf16",
                **dict.fromkeys(("bases_ptr", "totals_ptr", "offsets_ptr", "src_rows_ptr", "dst_rows_ptr"), "*i32"),
                "probs_out_ptr": "*fp32"}
    build(f"route scatter probs={has_probs}", pp._route_scatter_kernel, pointers, ("num_routed", "num_experts"),
          dict(BLOCK_R=pp._ROUTE_MAX_ROWS, **flags))
build("route scan", pp._route_scan_kernel, {"counts_ptr": "*i32", "totals_ptr": "*i32"}, ("num_blocks",),
      dict(SCAN_R=pp._ROUTE_SCAN_ROWS, SCAN_E=pp._ROUTE_SCAN_LANES, BLOCK_E=128))
print(json.dumps(built))
"""


def test_kernels_build_for_sm90():
    """The CPU interpreter runs kernels without compiling them; compiled, a runtime branch must leave no
    value whose type differs between its sides (the first scatter kernel did): build the row kernel's
    forms (FP8 rows with scales, 2- and 4-byte rows without, BF16 rows quantized with and without the
    token-order copy) and the route kernels for sm_90a with Triton's own ptxas."""
    built = run_compiling(_BUILD_KERNELS)
    rows = [f"rows scatter={s} {b}" for s in (False, True) for b in ("*u8", "*i16", "*i32")]
    rows += [f"rows quantize keep={k}" for k in (False, True)]
    routes = [f"route {k} probs={p}" for p in (False, True) for k in ("count", "scatter")]
    assert [name for name, _ in built] == [*rows, *routes, "route scan"]
    assert all(size > 0 for _, size in built)


@pytest.mark.parametrize("routing", [ROUTINGS[0], ROUTINGS[2], ROUTINGS[5]], ids=lambda r: r[0])
@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.bfloat16])
def test_permute_pad_matches_reference(routing, dtype):
    kind, tokens, top_k, experts = routing
    x, x_scale = _random_rows(dtype, tokens, 256)
    ids = make_routing(kind, tokens, top_k, experts, DEVICE)
    probs = torch.rand(tokens, top_k, device=DEVICE, dtype=torch.bfloat16)
    out = permute_pad(x, x_scale, ids, probs, experts)
    ref = permute_pad_reference(x.cpu(), None if x_scale is None else x_scale.cpu(), ids.cpu(), probs.cpu(), experts)
    assert isinstance(out, PermutePadResult)
    _assert_rows_equal(out.data, ref.data, "data")
    if dtype == FP8_DTYPE:
        assert_scales_equal(out.scale_inv, ref.scale_inv)
    else:
        assert out.scale_inv is None
    for name in ("probs", "src_rows", "dst_rows", "group_end_offsets"):
        assert torch.equal(getattr(out, name).cpu(), getattr(ref, name)), name
    # permuted probs by the definition: fp32, probs[t, j] on real rows, 0 on pad rows
    src = out.src_rows.cpu().long()
    real = src >= 0
    assert out.probs.dtype == torch.float32
    assert torch.equal(out.probs.cpu()[real], probs.cpu().reshape(-1).float()[src[real]])
    assert not bool(out.probs.cpu()[~real].any())
    assert out.data.shape[0] == padded_rows_bound(tokens * top_k, experts)


def test_fp8_combine_backward_is_the_gather():
    """The unweighted combine's gradient to y is a plain gather of grad_out; for an FP8 gradient with its
    scales that is permute_pad_rows with the same src_rows (data and scales move unchanged)."""
    tokens, top_k, experts, cols = 30, 4, 5, 256
    ids = make_routing("distinct", tokens, top_k, experts, DEVICE)
    src_rows, dst_rows, _ = route_pad(ids, experts)
    grad = torch.randn(tokens, cols, dtype=torch.bfloat16, device=DEVICE)
    y = torch.randn(src_rows.shape[0], cols, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    (grad_y,) = torch.autograd.grad(unpermute_unpad(y, dst_rows, top_k), y, grad)
    gathered, _ = permute_pad_rows(grad, None, src_rows, top_k)
    assert torch.equal(grad_y, gathered)
    g8, s8 = quantize_rows_reference(grad.float().cpu(), BLOCK)
    data, scale = permute_pad_rows(g8.to(DEVICE), s8.to(DEVICE), src_rows, top_k)
    deq = dequantize_rows_reference(data.cpu(), scale.cpu(), BLOCK)
    assert torch.equal(deq, permute_pad_rows(dequantize_rows_reference(g8, s8, BLOCK), None, src_rows.cpu(), top_k)[0])


@pytest.mark.parametrize("top_k", [1, 3])
def test_backward_matches_fp64_autograd(top_k):
    tokens, experts, cols = 33, 4, 128
    ids = make_routing("twice" if top_k > 1 else "distinct", tokens, top_k, experts, DEVICE)
    x = torch.randn(tokens, cols, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, top_k, device=DEVICE, requires_grad=True)
    out = permute_pad(x, None, ids, probs, experts)
    w = torch.randn(out.data.shape, device=DEVICE, dtype=torch.bfloat16)
    wp = torch.randn(out.probs.shape, device=DEVICE)
    gx, gp = torch.autograd.grad((out.data.float() * w).sum() + (out.probs * wp).sum(), (x, probs))
    # fp64 reference autograd through plain indexing
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    src = out.src_rows.long()
    real = src >= 0
    rows = torch.where(real[:, None], x64[torch.where(real, src // top_k, 0)], 0.0)
    prow = torch.where(real, p64.reshape(-1)[torch.where(real, src, 0)], 0.0)
    rx, rp = torch.autograd.grad((rows * w.double()).sum() + (prow * wp.double()).sum(), (x64, p64))
    assert gx.dtype == torch.bfloat16 and gp.dtype == torch.float32
    torch.testing.assert_close(gx.double(), rx, rtol=2**-7, atol=1e-6)  # one bf16 rounding of a k-term fp32 sum
    torch.testing.assert_close(gp.double(), rp, rtol=0, atol=0)


def test_double_backward():
    """The gradient of the gather (unpermute_unpad of the output's gradient) is itself differentiable: a backward
    with create_graph gives the second-order terms (here d(grad x)/d(w) = the gather of the upstream weights)."""
    tokens, top_k, experts = 20, 2, 3
    ids = make_routing("twice", tokens, top_k, experts, DEVICE)
    x = torch.randn(tokens, 128, device=DEVICE, requires_grad=True)
    src_rows, dst_rows, _ = route_pad(ids, experts)
    data, _ = permute_pad_rows(x, None, src_rows, top_k, dst_rows=dst_rows)
    w = torch.randn(data.shape, device=DEVICE, requires_grad=True)
    (gx,) = torch.autograd.grad((data * w).sum(), x, create_graph=True)
    assert gx.grad_fn is not None
    v = torch.randn_like(gx)
    (gw,) = torch.autograd.grad((gx * v).sum(), w)
    torch.testing.assert_close(gw, permute_pad_rows_reference(v, None, src_rows, top_k)[0], rtol=0, atol=0)


def test_compile_fullgraph():
    tokens, top_k, experts = 40, 4, 6
    x, x_scale = _random_rows(FP8_DTYPE, tokens, 256)
    ids = make_routing("skewed", tokens, top_k, experts, DEVICE)
    probs = torch.rand(tokens, top_k, device=DEVICE)
    eager = permute_pad(x, x_scale, ids, probs, experts)
    compiled = torch.compile(permute_pad, fullgraph=True)(x, x_scale, ids, probs, experts)
    assert_fp8_equal(compiled.data, eager.data)
    assert_scales_equal(compiled.scale_inv, eager.scale_inv)
    for name in ("probs", "src_rows", "dst_rows", "group_end_offsets"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    routed = torch.compile(route_pad, fullgraph=True)(ids, experts)
    assert all(torch.equal(a, b) for a, b in zip(routed, route_pad(ids, experts), strict=True))
    # the BF16 gather and its backward (unpermute_unpad without probs) under compile
    xb = torch.randn(tokens, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(eager.data.shape, device=DEVICE, dtype=torch.bfloat16)
    grads = []
    for fn in (permute_pad_rows, torch.compile(permute_pad_rows, fullgraph=True)):
        data, scale = fn(xb, None, eager.src_rows, top_k)
        assert scale is None
        grads.append(torch.autograd.grad(data, xb, w)[0])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("gather", ["permute_pad_rows", "permute_pad_rows_recompute"])
def test_opcheck(gather):
    """Both names of the gather (backward's is a distinct op for torch.compile) pass the op checks."""
    op = getattr(torch.ops.fp8flow, gather).default
    tokens, top_k, experts = 24, 2, 3
    ids = make_routing("distinct", tokens, top_k, experts, DEVICE)
    src_rows, dst_rows, _ = route_pad(ids, experts)
    # The ops carry no gradient (their public functions do: test_backward_matches_fp64_autograd); inputs without requires_grad.
    probs = torch.rand(tokens, top_k, device=DEVICE)
    torch.library.opcheck(torch.ops.fp8flow.route_pad.default, (ids, experts, probs))
    torch.library.opcheck(torch.ops.fp8flow.route_pad.default, (ids, experts, None))
    x8, s8 = (
        t.to(DEVICE) for t in quantize_rows_reference(torch.randn(tokens, 256), BLOCK)
    )  # finite: opcheck compares without equal_nan
    x8_before = x8.clone()
    # test_schema compares inputs with torch.allclose, which torch does not implement for float8:
    # run the other checks, and check the no-mutation part of the schema here.
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, (x8, s8, src_rows, top_k), test_utils=checks)
    torch.library.opcheck(op, (x8, s8, src_rows, top_k, dst_rows), test_utils=checks)
    assert_fp8_equal(x8, x8_before, "x8 after the op")
    x = torch.randn(tokens, 128, device=DEVICE, dtype=torch.bfloat16)
    torch.library.opcheck(op, (x, None, src_rows, top_k))
    torch.library.opcheck(op, (x, None, src_rows, top_k, dst_rows))
    # the public function's recompute flag picks the second name and gives the same rows
    assert_fp8_equal(
        permute_pad_rows(x8, s8, src_rows, top_k, recompute=True)[0],
        permute_pad_rows(x8, s8, src_rows, top_k)[0],
        "rows",
    )


def _bad_cases():
    x8 = torch.zeros(4, 256, dtype=FP8_DTYPE)
    s8 = torch.ones(4, 2)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    xb = torch.zeros(4, 256, dtype=torch.bfloat16)
    return [
        ((torch.zeros(4, 256, dtype=torch.int8), None, ids, None, 3), TypeError, "x must have dtype"),
        ((x8, None, ids, None, 3), ValueError, "x_scale is required"),
        ((xb, s8, ids, None, 3), ValueError, "x_scale must be None"),
        ((x8, torch.ones(4, 3), ids, None, 3), ValueError, "x_scale must have shape"),
        ((x8, s8.double(), ids, None, 3), TypeError, "x_scale must have dtype"),
        ((torch.zeros(256, 4, dtype=FP8_DTYPE).t(), s8, ids, None, 3), ValueError, "x must be row-major"),
        ((x8, s8, ids.float(), None, 3), TypeError, "expert_indices must have dtype"),
        ((x8, s8, ids[:3], None, 3), ValueError, "expert_indices must have x's 4 rows"),
        ((x8, s8, ids[:, :0], None, 3), ValueError, "top_k"),
        ((x8, s8, ids.view(-1), None, 3), ValueError, "expert_indices must have 2 dims"),
        ((x8, s8, ids, torch.ones(4, 3), 3), ValueError, "probs must have shape"),
        ((x8, s8, ids, torch.ones(4, 2, dtype=torch.float16), 3), TypeError, "probs must have dtype"),
        ((x8, s8, ids, None, 0), ValueError, "num_experts must be a positive int"),
        ((x8, s8, ids, None, 3, True), ValueError, "quantize=True takes bf16/fp16/fp32 x without x_scale"),
        ((xb, None, ids, None, 3, 1), TypeError, "quantize must be a bool"),
        ((xb.requires_grad_(), None, ids, None, 3, True), RuntimeError, "has no gradient formula"),
    ]


@pytest.mark.parametrize(("args", "error", "match"), _bad_cases())
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        permute_pad(*args)


def test_bad_gather_input():
    x, src = torch.zeros(4, 128, dtype=torch.bfloat16), torch.full((128,), -1, dtype=torch.int32)
    with pytest.raises(TypeError, match="src_rows must have dtype"):
        permute_pad_rows(x, None, src.long(), 2)
    with pytest.raises(ValueError, match="src_rows must be contiguous"):
        permute_pad_rows(x, None, torch.full((256,), -1, dtype=torch.int32)[::2], 2)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        permute_pad_rows(x, None, src, 0)
    with pytest.raises(ValueError, match="num_experts"):
        route_pad(torch.zeros(4, 2, dtype=torch.int32), -1)
    with pytest.raises(ValueError, match=r"dst_rows must have shape \(8,\)"):
        permute_pad_rows(x, None, src, 2, dst_rows=torch.zeros(7, dtype=torch.int32))
    with pytest.raises(TypeError, match="dst_rows must have dtype"):
        permute_pad_rows(x, None, src, 2, dst_rows=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="quantize=True needs dst_rows"):
        permute_pad_rows(x, None, src, 2, quantize=True)
    with pytest.raises(ValueError, match="does not combine with quantize=True"):
        permute_pad_rows(x, None, src, 2, recompute=True, dst_rows=torch.zeros(8, dtype=torch.int32), quantize=True)


def test_dst_rows_that_are_not_the_inverse_raise_in_validation_mode(monkeypatch):
    """The scatter writes only the rows dst_rows names: a map that is not src_rows' inverse would leave
    rows unwritten, so validation mode refuses it (a swapped pair, and a map naming one row twice)."""
    x = torch.randn(6, 128, device=DEVICE).to(torch.bfloat16)
    src_rows, dst_rows, _ = route_pad(make_routing("distinct", 6, 2, 3, DEVICE), 3)
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    permute_pad_rows(x, None, src_rows, 2, dst_rows=dst_rows)  # the inverse passes
    for bad in (dst_rows[[1, 0, *range(2, 12)]], dst_rows[[0, 0, *range(2, 12)]]):
        with pytest.raises(ValueError, match="dst_rows must be the inverse of src_rows"):
            permute_pad_rows(x, None, src_rows, 2, dst_rows=bad.contiguous())


@pytest.mark.parametrize("bad", [-1, 3])
def test_out_of_range_ids_raise_in_validation_mode(monkeypatch, bad):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    ids[2, 1] = bad
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setenv("FP8FLOW_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"expert_indices values must lie in \[0, 3\)"):
        route_pad(ids, 3)
    with pytest.raises(ValueError, match="expert_indices values must lie in"):
        permute_pad(x, None, ids, None, 3)
    src = torch.full((128,), -1, dtype=torch.int32, device=DEVICE)
    src[5] = 8  # T * k = 8 rows exist: 8 is one past the end
    with pytest.raises(ValueError, match=r"src_rows values must lie in \[-1, 8\)"):
        permute_pad_rows(x, None, src, 2)


def test_cpu_row_maps_are_checked_without_opting_in():
    """On CPU tensors a row map's values are checked for free: ``src_rows`` of ``route_pad(ids, E)`` with
    ``k = 2`` given with ``top_k = 1`` names rows past the tokens, a ValueError, not an IndexError."""
    ids = torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1]], dtype=torch.int32)
    src_rows, _, _ = route_pad(ids, 2)
    with pytest.raises(ValueError, match=r"src_rows values must lie in \[-1, 4\)"):
        permute_pad_rows(torch.zeros(4, 128, dtype=torch.bfloat16), None, src_rows, 1)
