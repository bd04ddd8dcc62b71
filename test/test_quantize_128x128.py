"""quantize_128x128: bit-exact against the reference (Triton on GPU, or the CPU interpreter), the exact
transpose, op checks, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from fp8_helpers import assert_fp8_equal, assert_scales_equal, edge_case_rows, run_build_script

from fp8flow_ao._format import FP8_MAX
from fp8flow_ao.kernels.quantize_128x128 import (
    launch_quantize_128x128,
    launch_quantize_128x128_pair,
    quantize_128x128,
    quantize_128x128_configs,
    quantize_128x128_pair,
    quantize_128x128_reference,
)

SHAPES = [(128, 128), (256, 384), (3, 128, 256), (0, 128, 128)]


def _weights(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random weights whose tiles span six decades, so every tile gets its own scale."""
    rows = shape[-2] * (shape[0] if len(shape) == 3 else 1)
    mag = torch.logspace(-3, 3, max(rows, 1))[:rows].reshape(*shape[:-1], 1)
    return (torch.randn(shape) * mag).to(DEVICE, dtype)


def _assert_outputs_equal(actual: tuple, expected: tuple) -> None:
    for name, a, e in zip(("data", "scale_inv", "data_t", "scale_inv_t"), actual, expected, strict=True):
        check = assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal
        check(a, e, name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_transpose", [True, False])
def test_triton_matches_reference(shape, dtype, with_transpose):
    w = _weights(shape, dtype)
    out = launch_quantize_128x128(w, with_transpose)
    _assert_outputs_equal(out, quantize_128x128_reference(w.cpu(), with_transpose))


@pytest.mark.parametrize("config", quantize_128x128_configs(), ids=lambda c: f"warps{c.num_warps}-maxnreg{c.maxnreg}")
def test_every_launch_config_matches_reference(config):
    w = _weights((2, 256, 384), torch.bfloat16)
    _assert_outputs_equal(launch_quantize_128x128(w, True, config=config), quantize_128x128_reference(w.cpu()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_edge_tiles_bit_exact(dtype):
    # One expert per edge case: amax 448, just over 448, ties, tiny (subnormal) values, a zero tile,
    # signed zeros, a NaN and an inf, each filling a whole 128 x 128 tile.
    w = edge_case_rows(128 * 128, DEVICE, dtype).reshape(8, 128, 128)
    _assert_outputs_equal(launch_quantize_128x128(w), quantize_128x128_reference(w.cpu()))


def test_transpose_is_exact_and_tiles_have_one_scale():
    w = _weights((2, 256, 384), torch.bfloat16)
    data, scale_inv, data_t, scale_inv_t = launch_quantize_128x128(w)
    assert_fp8_equal(data_t, data.transpose(-1, -2), "data_t")
    assert_scales_equal(scale_inv_t, scale_inv.transpose(-1, -2), "scale_inv_t")
    assert data.is_contiguous() and data_t.is_contiguous() and scale_inv_t.is_contiguous()
    # one power-of-two scale per tile: the smallest that keeps the tile's amax within 448
    amax = w.float().abs().reshape(2, 2, 128, 3, 128).amax(dim=(2, 4)).cpu()
    scale_inv = scale_inv.cpu()
    assert torch.equal(torch.frexp(scale_inv)[0], torch.full_like(scale_inv, 0.5))
    assert bool((amax <= FP8_MAX * scale_inv).all()) and bool((amax > FP8_MAX * scale_inv / 2).all())


def test_reference_special_tiles():
    w = torch.zeros(256, 256)
    w[128:, :128] = float("inf")
    w[128:, 128:] = torch.randn(128, 128)
    w[130, 140] = float("nan")
    data, scale_inv, _, _ = quantize_128x128_reference(w)
    assert bool((scale_inv[0] > 0).all()) and bool((data[:128].float() == 0).all())  # zero tiles: tiny scale
    assert torch.isinf(scale_inv[1, 0]) and bool(torch.isnan(data[128:, :128].float()).all())
    assert torch.isfinite(scale_inv[1, 1]) and torch.isnan(data[130, 140].float())  # NaN never sets the scale


@pytest.mark.gpu
def test_deepseek_weight_shape_on_gpu():
    w = _weights((2, 4096, 7168), torch.bfloat16)
    _assert_outputs_equal(launch_quantize_128x128(w), quantize_128x128_reference(w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", quantize_128x128_configs(), ids=lambda c: f"warps{c.num_warps}-maxnreg{c.maxnreg}")
def test_both_orientations_of_weights_like_a_models_on_gpu(dtype, config):
    """Both orientations at once from weights like a model's (``randn * 0.02``: one scale for all
    tiles), fp32 as torchtitan keeps them on one GPU, at the fp8flow_gpu flavor's W13 shape. Triton 3.6
    wrote a wrong transpose here for fp32 in every config (recompute's NaN gradients, H200)."""
    w1, w3 = (torch.randn(4, 768, 2048, device=DEVICE, dtype=dtype) * 0.02 for _ in range(2))
    expected = quantize_128x128_reference(torch.cat([w1, w3], dim=1))
    _assert_outputs_equal(launch_quantize_128x128(w1, w_tail=w3, config=config), expected)
    _assert_outputs_equal(
        launch_quantize_128x128(w1.transpose(-1, -2).contiguous(), config=config),
        quantize_128x128_reference(w1.transpose(-1, -2).contiguous()),
    )


@pytest.mark.gpu
def test_deepseek_w13_in_one_pass_on_gpu():
    """W13 = [w1; w3] at the DeepSeek-like shape (H=2048, D=7168): one pass equals the concatenation's."""
    w1, w3 = _weights((2, 2048, 7168), torch.bfloat16), _weights((2, 2048, 7168), torch.bfloat16).flip(-2)
    expected = quantize_128x128_reference(torch.cat([w1, w3], dim=1))
    _assert_outputs_equal(launch_quantize_128x128(w1, w_tail=w3), expected)


@pytest.mark.parametrize("with_transpose", [True, False])
@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256)])
def test_op_dispatch_and_compile(with_transpose, shape):
    w = _weights(shape, torch.bfloat16)
    eager = quantize_128x128(w, with_transpose)
    compiled = torch.compile(quantize_128x128, fullgraph=True)(w, with_transpose)
    assert (eager[2] is None) == (not with_transpose) == (compiled[2] is None) == (compiled[3] is None)
    for a, e in zip(compiled, eager, strict=True):
        if e is not None:
            (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e)


@pytest.mark.parametrize("with_transpose", [True, False])
def test_opcheck(with_transpose):
    w = _weights((2, 128, 256), torch.bfloat16)
    torch.library.opcheck(torch.ops.fp8flow.quantize_128x128.default, (w, with_transpose, True))


@pytest.mark.parametrize(
    ("w", "with_transpose", "error", "match"),
    [
        (torch.zeros(128, 128, dtype=torch.int32), True, TypeError, "w must have dtype"),
        (torch.zeros(128 * 128), True, ValueError, "w must have 2 or 3 dims"),
        (torch.zeros(1, 1, 128, 128), True, ValueError, "w must have 2 or 3 dims"),
        (torch.zeros(100, 128), True, ValueError, r"w dim N \(-2\) must be a multiple of 128"),
        (torch.zeros(2, 128, 200), True, ValueError, r"w dim K \(-1\) must be a multiple of 128"),
        (torch.zeros(256, 128).t(), True, ValueError, "w must be contiguous"),
        (torch.zeros(128, 512)[:, :256], True, ValueError, "w must be contiguous"),
        (torch.zeros(128, 128), 1, TypeError, "with_transpose must be a bool"),
        ([[1.0]], True, TypeError, "w must be a torch.Tensor"),
    ],
)
def test_bad_input(w, with_transpose, error, match):
    with pytest.raises(error, match=match):
        quantize_128x128(w, with_transpose)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transpose_only_is_the_transposed_half(dtype):
    """with_data=False (the MoE backward's re-quantization) writes only data_t, bit for bit the same."""
    w = _weights((2, 256, 384), dtype)
    full = launch_quantize_128x128(w)
    only_t = launch_quantize_128x128(w, with_data=False)
    assert only_t[0].numel() == 0 and only_t[1].numel() == 0
    assert_fp8_equal(only_t[2], full[2], "data_t")
    assert_scales_equal(only_t[3], full[3], "scale_inv_t")
    public = quantize_128x128(w, with_data=False)
    assert public[0] is None and public[1] is None
    assert_fp8_equal(public[2], full[2], "data_t")
    ref = quantize_128x128_reference(w.cpu(), with_data=False)
    assert ref[0].numel() == 0 and torch.equal(ref[2].view(torch.uint8), full[2].cpu().view(torch.uint8))


# (w shape, w_tail shape): the MoE layer's W13 = [w1; w3] (equal halves), uneven halves, 2-D weights
TAIL_SHAPES = [((2, 128, 256), (2, 128, 256)), ((3, 256, 128), (3, 128, 128)), ((128, 384), (256, 384))]


@pytest.mark.parametrize(("shape", "tail_shape"), TAIL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("with_data", "with_transpose"), [(True, True), (True, False), (False, True)])
def test_tail_equals_quantizing_the_concatenation(shape, tail_shape, dtype, with_data, with_transpose):
    """One pass over [w; w_tail] gives, bit for bit, the quantization of the high-precision concatenation."""
    w, tail = _weights(shape, dtype), _weights(tail_shape, dtype).flip(-2)  # tail tiles get other scales
    expected = quantize_128x128_reference(torch.cat([w, tail], dim=-2).cpu(), with_transpose, with_data)
    _assert_outputs_equal(launch_quantize_128x128(w, with_transpose, with_data, w_tail=tail), expected)
    public = quantize_128x128(w, with_transpose, with_data, w_tail=tail)
    for a, e in zip(public, expected, strict=True):
        if e.numel():
            (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e)
        else:
            assert a is None


@pytest.mark.parametrize(("with_data", "with_transpose"), [(True, True), (True, False), (False, True)])
def test_out_rewrites_the_same_tensors_with_a_fresh_quantization(with_data, with_transpose):
    """``out``: the bits of a fresh call, written into the given tensors (addresses kept, versions moved),
    which are returned; the launcher takes the same buffers."""
    w, tail = _weights((2, 128, 256), torch.bfloat16), _weights((2, 256, 256), torch.bfloat16).flip(-2)
    out = quantize_128x128(w, with_transpose, with_data, w_tail=tail)
    addresses = [None if t is None else t.data_ptr() for t in out]
    versions = [None if t is None else t._version for t in out]
    w, tail = w * 1000, tail.flip(-1)  # other tiles, other scales
    assert quantize_128x128(w, with_transpose, with_data, w_tail=tail, out=out) is out
    assert [None if t is None else t.data_ptr() for t in out] == addresses
    assert all(t is None or t._version > v for t, v in zip(out, versions, strict=True))
    expected = quantize_128x128_reference(torch.cat([w, tail], dim=-2).cpu(), with_transpose, with_data)
    for a, e in zip(out, expected, strict=True):
        if e.numel():
            (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e)
        else:
            assert a is None
    buffers = tuple(torch.empty_like(e, device=DEVICE) for e in quantize_128x128_reference(w.cpu() / 3))
    _assert_outputs_equal(launch_quantize_128x128(w / 3, out=buffers), quantize_128x128_reference(w.cpu() / 3))


def test_out_refuses_what_a_call_would_not_return(monkeypatch):
    w = _weights((2, 128, 256), torch.bfloat16)
    out = quantize_128x128(w)
    with pytest.raises(TypeError, match=r"out must be a tuple \(data, scale_inv, data_t, scale_inv_t\)"):
        quantize_128x128(w, out=list(out))
    with pytest.raises(ValueError, match=r"out data must have shape \(2, 128, 256\)"):
        quantize_128x128(w, out=(out[0][:, :, :128], *out[1:]))
    with pytest.raises(TypeError, match="out scale_inv must have dtype"):
        quantize_128x128(w, out=(out[0], out[1].bfloat16(), *out[2:]))
    with pytest.raises(ValueError, match="out data_t must be contiguous"):
        quantize_128x128(w, out=(*out[:2], out[2].transpose(1, 2).contiguous().transpose(1, 2), out[3]))
    with pytest.raises(ValueError, match="out data_t must be None"):
        quantize_128x128(w, with_transpose=False, out=out)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="call it eagerly"):
        quantize_128x128(w, out=out)


def test_tail_compiles_and_passes_opcheck():
    w, tail = _weights((2, 128, 256), torch.bfloat16), _weights((2, 256, 256), torch.bfloat16)
    torch.library.opcheck(torch.ops.fp8flow.quantize_128x128.default, (w, True, True, tail))
    eager = quantize_128x128(w, w_tail=tail)
    compiled = torch.compile(quantize_128x128, fullgraph=True)(w, w_tail=tail)
    assert compiled[0].shape == (2, 384, 256) and compiled[2].shape == (2, 256, 384)
    for a, e in zip(compiled, eager, strict=True):
        (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e)


@pytest.mark.parametrize(
    ("tail", "error", "match"),
    [
        (torch.zeros(2, 128, 256, dtype=torch.float32), TypeError, "w_tail must have dtype"),
        (torch.zeros(128, 256, dtype=torch.bfloat16), ValueError, "w_tail must have 3 dims"),
        (torch.zeros(3, 128, 256, dtype=torch.bfloat16), ValueError, "w_tail must match w"),
        (torch.zeros(2, 128, 384, dtype=torch.bfloat16), ValueError, "w_tail must match w"),
        (torch.zeros(2, 64, 256, dtype=torch.bfloat16), ValueError, r"w_tail dim N \(-2\) must be a multiple"),
        (torch.zeros(2, 256, 128, dtype=torch.bfloat16).transpose(1, 2), ValueError, "w_tail must be contiguous"),
    ],
)
def test_tail_bad_input(tail, error, match):
    with pytest.raises(error, match=match):
        quantize_128x128(torch.zeros(2, 128, 256, dtype=torch.bfloat16), w_tail=tail)


def test_nothing_requested_is_an_error():
    with pytest.raises(ValueError, match="nothing to compute"):
        quantize_128x128(torch.zeros(128, 128), with_transpose=False, with_data=False)


# (w shape, w_tail shape or None, second shape): the MoE forward's W13 = [w1; w3] and w2, 2-D weights,
# an empty first or second weight (no tiles on that side of the launch), fewer tiles second than first
PAIR_SHAPES = [
    ((2, 128, 256), (2, 128, 256), (2, 256, 128)),
    ((256, 384), None, (128, 128)),
    ((0, 128, 256), (0, 128, 256), (3, 256, 128)),
    ((3, 256, 128), None, (0, 128, 128)),
]


@pytest.mark.parametrize(("shape", "tail_shape", "second_shape"), PAIR_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("with_data", "with_transpose"), [(True, True), (True, False), (False, True)])
def test_pair_equals_two_calls(shape, tail_shape, second_shape, dtype, with_data, with_transpose):
    """Two weights in one launch: each weight's outputs are, bit for bit, those of its own call."""
    w, second = _weights(shape, dtype), _weights(second_shape, dtype).flip(-1)
    tail = None if tail_shape is None else _weights(tail_shape, dtype).flip(-2)
    expected = (
        quantize_128x128_reference(w.cpu(), with_transpose, with_data, None if tail is None else tail.cpu()),
        quantize_128x128_reference(second.cpu(), with_transpose, with_data),
    )
    launched = launch_quantize_128x128_pair(w, second, with_transpose, with_data, w_tail=tail)
    _assert_outputs_equal(launched[:4], expected[0])
    _assert_outputs_equal(launched[4:], expected[1])
    asked = (with_data, with_data, with_transpose, with_transpose)
    public = quantize_128x128_pair(w, second, with_transpose, with_data, w_tail=tail)
    for outs, ref in zip(public, expected, strict=True):
        assert [a is not None for a in outs] == list(asked)
        for a, e, want in zip(outs, ref, asked, strict=True):
            if want:
                (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e)


@pytest.mark.parametrize("config", quantize_128x128_configs(), ids=lambda c: f"warps{c.num_warps}-maxnreg{c.maxnreg}")
def test_pair_every_launch_config(config):
    w, tail, second = (_weights(s, torch.bfloat16) for s in ((2, 128, 256), (2, 256, 256), (2, 256, 128)))
    launched = launch_quantize_128x128_pair(w, second, w_tail=tail, config=config)
    _assert_outputs_equal(launched[:4], quantize_128x128_reference(w.cpu(), w_tail=tail.cpu()))
    _assert_outputs_equal(launched[4:], quantize_128x128_reference(second.cpu()))


@pytest.mark.gpu
def test_deepseek_w13_and_w2_in_one_launch_on_gpu():
    """The DeepSeek-like layer's forward weights (H=2048, D=7168; two experts): W13 and w2 in one launch."""
    w1, w3 = _weights((2, 2048, 7168), torch.bfloat16), _weights((2, 2048, 7168), torch.bfloat16).flip(-2)
    w2 = _weights((2, 7168, 2048), torch.bfloat16).flip(-1)
    launched = launch_quantize_128x128_pair(w1, w2, with_transpose=False, w_tail=w3)
    _assert_outputs_equal(launched[:4], quantize_128x128_reference(torch.cat([w1, w3], dim=1).cpu(), False))
    _assert_outputs_equal(launched[4:], quantize_128x128_reference(w2.cpu(), False))


def test_pair_compiles_and_passes_opcheck():
    w, tail, second = (_weights(s, torch.bfloat16) for s in ((2, 128, 256), (2, 256, 256), (256, 128)))
    op = torch.ops.fp8flow.quantize_128x128_pair.default
    for with_transpose in (True, False):
        torch.library.opcheck(op, (w, tail, second, with_transpose, True))
    torch.library.opcheck(op, (w, None, second, True, False))
    eager = quantize_128x128_pair(w, second, w_tail=tail)
    compiled = torch.compile(quantize_128x128_pair, fullgraph=True)(w, second, w_tail=tail)
    assert compiled[0][0].shape == (2, 384, 256) and compiled[1][2].shape == (128, 256)
    for a, e in zip((*compiled[0], *compiled[1]), (*eager[0], *eager[1]), strict=True):
        (assert_fp8_equal if e.dtype != torch.float32 else assert_scales_equal)(a, e)


@pytest.mark.parametrize(
    ("second", "error", "match"),
    [
        (torch.zeros(128, 128, dtype=torch.int32), TypeError, "second must have dtype"),
        (torch.zeros(128, 128, dtype=torch.bfloat16), TypeError, "second must have dtype"),  # w's is fp32
        (torch.zeros(2, 100, 128), ValueError, r"second dim N \(-2\) must be a multiple of 128"),
        (torch.zeros(256, 128).t(), ValueError, "second must be contiguous"),
        (torch.zeros(1, 1, 128, 128), ValueError, "second must have 2 or 3 dims"),
        (torch.zeros(128, 128, device="meta"), ValueError, "share one device"),
        (torch.zeros(128, 128, requires_grad=True), RuntimeError, "quantize_128x128_pair"),
    ],
)
def test_pair_bad_input(second, error, match):
    with pytest.raises(error, match=match):
        quantize_128x128_pair(torch.zeros(2, 128, 256), second)
    with pytest.raises(ValueError, match="nothing to compute"):
        quantize_128x128_pair(torch.zeros(128, 128), torch.zeros(128, 128), with_transpose=False, with_data=False)


_BUILD = """
from fp8flow_ao.kernels._sm90_common import compile_for_sm90
from fp8flow_ao.kernels import quantize_128x128 as mod

def build(item):
    dtype, pair, with_data, with_transpose = item
    part = {"w_ptr": dtype, "tail_ptr": dtype, "data_ptr": "*fp8e4nv", "scale_inv_ptr": "*fp32",
            "data_t_ptr": "*fp8e4nv", "scale_inv_t_ptr": "*fp32", "N": "i32", "N_HEAD": "i32", "K": "i32"}
    second = dict(zip(("second_ptr", "second_tail_ptr", "data2_ptr", "scale_inv2_ptr", "data_t2_ptr",
                       "scale_inv_t2_ptr", "N2", "N2_HEAD", "K2"), part.values()))
    constexprs = dict(WITH_DATA=with_data, WITH_TRANSPOSE=with_transpose, TILE=128)
    runtime = {**part, **second, "TILES_FIRST": "i32"} if pair else part
    signature = {**runtime, **dict.fromkeys(constexprs, "constexpr")}
    kernel = mod._quantize_128x128_pair_kernel if pair else mod._quantize_128x128_kernel
    config = mod.default_config(with_transpose)
    built = compile_for_sm90(kernel, signature, constexprs, num_warps=config.num_warps,
                             aligned=(*(k for k in signature if k.endswith("_ptr")),), maxnreg=config.maxnreg)
    return [list(item), local_memory_instructions(built.asm["cubin"])]

# the launches' forms: bf16 one pass (either orientation set), fp32 one orientation a pass (_passes)
items = [("*bf16", p, True, t) for p in (False, True) for t in (False, True)]
items += [("*fp32", True, d, not d) for d in (True, False)] + [("*bf16", False, False, True)]
print(json.dumps(parallel_map(build, items)))
"""


def test_kernel_builds_for_sm90():
    """The interpreter runs the kernel without compiling it: build the forms launches take for sm_90a (one
    weight or a pair; bf16 writing the forward tiles, both orientations, or the transposes only; fp32 one
    orientation a pass) with their launch configs."""
    built = run_build_script(_BUILD)
    assert len(built) == 7, built
