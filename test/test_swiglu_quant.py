"""swiglu_quant / swiglu_quant_backward: Triton (GPU, or the CPU interpreter) against the torch
reference, numerics against fp64 autograd, group offsets, edge values, op checks, bad input.

Why data is compared at >= 99.9% bit-exact and not 100%: both ops take an ``exp`` (and, on the GPU,
an approximate division) whose last-ulp rounding differs between torch's CPU kernels, numpy (the
interpreter) and the GPU's ``ex2.approx.ftz`` / ``rcp.approx.ftz``. An ulp moves an E4M3 rounding only when
the fp32 value sits on a rounding boundary, so a few elements per million land one E4M3 step away.
Scales are bit-exact (a scale changes only if a block maximum sits within an ulp of 448 * 2**k).
"""

from __future__ import annotations

import pytest
import torch
import triton
from conftest import DEVICE, IS_HOPPER
from fp8_helpers import assert_fp8_close, assert_scales_equal, build_spills, run_build_script, run_compiling

from fp8flow_ao._format import BLOCK, dequantize_rows_reference
from fp8flow_ao.kernels.scaling_aware_transpose import scaling_aware_transpose_reference
from fp8flow_ao.kernels.swiglu_quant import (
    backward_configs,
    launch_swiglu_quant,
    launch_swiglu_quant_backward,
    launch_swiglu_quant_backward_sm90,
    swiglu_backward_reference,
    swiglu_quant,
    swiglu_quant_backward,
    swiglu_quant_backward_reference,
    swiglu_quant_reference,
)

# Gates far into the sigmoid's tails overflow exp to inf on purpose; numpy (the interpreter) warns.
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning",
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:All-NaN slice encountered:RuntimeWarning",
)
MIN_EXACT = 0.999
# Group layouts as (rows M, H, tokens per expert or None): empty experts, a skewed split with rows
# past the last end, one expert holding every row, and no expert holding any. H = 256 makes the
# backward walk two column tiles.
GROUPS = {
    "no_offsets": (384, 256, None),
    "skewed_empty_past_end": (512, 256, [0, 250, 3, 0]),
    "one_expert_all_rows": (256, 128, [256]),
    "all_rows_past_end": (256, 128, [0, 0]),
}
# Where the router prob enters, as (with probs, score_before_experts): none, scaling SwiGLU's output
# (torchtitan's score_before_experts=False) or its inputs (score_before_experts=True, Llama 4).
PROB_MODES = {"no_probs": (False, False), "after": (True, False), "before": (True, True)}
# The backward's kernels: the Triton one (GPU or interpreter) and the Hopper TMA one (the op's on Hopper).
KERNELS = [pytest.param("triton", id="triton"), pytest.param("sm90", id="sm90", marks=pytest.mark.hopper)]


def _ends(counts: list[int] | None) -> torch.Tensor | None:
    """Padded group end offsets: each expert's rows rounded up to a multiple of 128."""
    if counts is None:
        return None
    padded = torch.tensor([-(-c // BLOCK) * BLOCK for c in counts])
    return torch.cumsum(padded, 0).to(device=DEVICE, dtype=torch.int32)


def _inputs(m: int, hidden: int, with_probs: bool = True, spread: float = 2.0):
    """h [M, 2H], grad_a [M, H] (BF16, row magnitudes spread over 10**+-spread) and probs [M]."""
    rows = torch.logspace(-spread, spread, m)[torch.randperm(m)][:, None] if m else torch.ones(0, 1)
    h = (torch.randn(m, 2 * hidden) * rows).to(DEVICE, torch.bfloat16)
    grad_a = (torch.randn(m, hidden) * rows.flip(0)).to(DEVICE, torch.bfloat16)
    probs = torch.rand(m, device=DEVICE) if with_probs else None
    return h, grad_a, probs


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


def _rows_past_end(m: int, ends: torch.Tensor | None) -> slice:
    return slice(m if ends is None else int(ends[-1]), m)


def _assert_forward_matches(h, probs, ends, before: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Both forward kernels: the plain one's ``a`` against the reference (>= 99.9% bit-exact, the exp), and the
    transposing one's ``a`` bit for bit the plain one's, with the scaling-aware transpose of those very rows."""
    data, scale, *no_t = launch_swiglu_quant(h, probs, ends, before)
    assert [tuple(t.shape) for t in no_t] == [(0,), (0,)]
    ref_data, ref_scale, *_ = swiglu_quant_reference(h.cpu(), _cpu(probs), _cpu(ends), before)
    assert_scales_equal(scale, ref_scale, "a_scale")
    assert_fp8_close(data, ref_data, MIN_EXACT, "a_data")
    a_t = scaling_aware_transpose_reference(data.cpu(), scale.cpu(), _cpu(ends))
    expected = (data, scale, *(t.to(DEVICE) for t in a_t))
    _assert_identical(launch_swiglu_quant(h, probs, ends, before, transpose=True), expected)
    return data, scale


def _backward(
    grad_a, h, probs, ends, before: bool = False, kernel: str = "triton", transpose: bool = True, **config
) -> tuple:
    if kernel == "sm90":
        return launch_swiglu_quant_backward_sm90(grad_a, h, probs, ends, before, transpose)
    return launch_swiglu_quant_backward(grad_a, h, probs, ends, before, transpose, **config)


def _assert_backward_matches(grad_a, h, probs, ends, before: bool = False, **kw) -> tuple[torch.Tensor, ...]:
    """``kw``: ``kernel`` (``"triton"``, ``"sm90"``) and the Triton kernel's ``config``."""
    out = _backward(grad_a, h, probs, ends, before, **kw)
    ref = swiglu_quant_backward_reference(grad_a.cpu(), h.cpu(), _cpu(probs), _cpu(ends), before)
    for name, got, want in zip(("dh", "dh_scale", "dh_t", "dh_t_scale"), out[:4], ref[:4], strict=True):
        if name.endswith("scale"):
            assert_scales_equal(got, want, name)
        else:
            assert_fp8_close(got, want, MIN_EXACT, name)
    _assert_grad_probs_close(out[4], ref[4])
    return out


def _assert_grad_probs_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """1e-5 relative, and 1e-5 of the largest finite magnitude absolute (a row's sum can cancel)."""
    finite = want[torch.isfinite(want)]
    atol = 1e-5 * float(finite.abs().max()) if finite.numel() else 0.0
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=atol, equal_nan=True)


def _assert_identical(actual: tuple, expected: tuple) -> None:
    """Every tensor bit for bit (``None`` where ``None``)."""
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            view = torch.int32 if a.dtype == torch.float32 else torch.uint8
            assert a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("mode", list(PROB_MODES))
def test_forward_matches_reference(group, mode):
    m, hidden, counts = GROUPS[group]
    with_probs, before = PROB_MODES[mode]
    h, _, probs = _inputs(m, hidden, with_probs)
    ends = _ends(counts)
    data, scale = _assert_forward_matches(h, probs, ends, before)
    past = _rows_past_end(m, ends)
    assert not bool(data[past].float().any()) and not bool(scale[past].any())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("mode", list(PROB_MODES))
def test_backward_matches_reference(group, mode, kernel):
    m, hidden, counts = GROUPS[group]
    with_probs, before = PROB_MODES[mode]
    h, grad_a, probs = _inputs(m, hidden, with_probs)
    ends = _ends(counts)
    dh, dh_scale, dh_t, dh_t_scale, grad_probs = _assert_backward_matches(grad_a, h, probs, ends, before, kernel=kernel)
    past = _rows_past_end(m, ends)
    assert not bool(dh[past].float().any()) and not bool(dh_scale[past].any())
    assert not bool(dh_t[:, past].float().any())
    assert not bool(dh_t_scale[past.start // BLOCK :].any())
    assert grad_probs.shape == ((m,) if with_probs else (0,))
    if with_probs:
        assert not bool(grad_probs[past].any())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["after", "before"])
def test_backward_without_transpose_writes_the_same_rows(mode, kernel):
    """``transpose=False`` (no FC1 wgrad to come, e.g. frozen W13): the row-wise ``dh`` and ``grad_probs`` bit for
    bit those of the full backward, no column-wise pair (empty tensors from the kernels, ``None`` from the public
    function); the reference agrees."""
    m, hidden, counts = GROUPS["skewed_empty_past_end"]
    h, grad_a, probs = _inputs(m, hidden)
    ends, before = _ends(counts), PROB_MODES[mode][1]
    full = _backward(grad_a, h, probs, ends, before, kernel)
    rows = _backward(grad_a, h, probs, ends, before, kernel, transpose=False)
    _assert_identical((*rows[:2], rows[4]), (*full[:2], full[4]))
    assert [tuple(t.shape) for t in rows[2:4]] == [(0,), (0,)]
    ref = swiglu_quant_backward_reference(grad_a.cpu(), h.cpu(), probs.cpu(), ends.cpu(), before, transpose=False)
    assert [tuple(t.shape) for t in ref[2:4]] == [(0,), (0,)]
    assert_scales_equal(rows[1], ref[1], "dh_scale")
    assert_fp8_close(rows[0], ref[0], MIN_EXACT, "dh")
    public = swiglu_quant_backward(grad_a, h, probs, ends, before, transpose=False)
    assert public[2] is None and public[3] is None
    full_public = swiglu_quant_backward(grad_a, h, probs, ends, before)  # on the CPU: the reference
    _assert_identical((*public[:2], public[4]), (*full_public[:2], full_public[4]))


@pytest.mark.parametrize("config", backward_configs(), ids=str)
def test_every_backward_config_matches_reference(config):
    """Every swept launch configuration: H = 384 is three column tiles, so a program's share of H can
    end in a partial one (col_tiles=2) or exceed H (col_tiles=4), and grad_probs is summed over splits."""
    h, grad_a, probs = _inputs(384, 384)
    _assert_backward_matches(grad_a, h, probs, _ends([130, 0, 100]), config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
def test_realistic_size_on_gpu(before):
    """Thousands of scale blocks per layout at a DeepSeek-like H, skewed groups: the bit-exact
    fraction holds at scale and the kernels' multi-tile loops and grids are exercised."""
    h, grad_a, probs = _inputs(4096, 2048)
    ends = _ends([1000, 0, 2500, 7, 0, 300])
    _assert_forward_matches(h, probs, ends, before)
    out = _assert_backward_matches(grad_a, h, probs, ends, before)
    if IS_HOPPER:  # the TMA kernel: many tiles a program (the ring wraps); the same dh bits as the Triton kernel
        sm90 = _assert_backward_matches(grad_a, h, probs, ends, before, kernel="sm90")
        _assert_identical(sm90[:4], out[:4])
        _assert_grad_probs_close(sm90[4], out[4].cpu())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
def test_rows_past_end_are_not_read(before, kernel):
    """NaN past the last group end must not leak into anything (an end inside a tile, and a tile wholly past it)."""
    h, grad_a, probs = _inputs(384, 128)
    ends = torch.tensor([128], device=DEVICE, dtype=torch.int32)
    h[128:], grad_a[128:], probs[128:] = float("nan"), float("nan"), float("nan")
    data, scale = _assert_forward_matches(h, probs, ends, before)
    dh, dh_scale, dh_t, dh_t_scale, grad_probs = _assert_backward_matches(grad_a, h, probs, ends, before, kernel=kernel)
    inside = _assert_backward_matches(grad_a, h, probs, ends + 57, before, kernel=kernel)
    assert not bool(inside[0][185:].float().any()) and not bool(inside[4][185:].any())
    for t in (data[128:], scale[128:], dh[128:], dh_scale[128:], dh_t[:, 128:], dh_t_scale[1:], grad_probs[128:]):
        assert not bool(t.float().isnan().any()) and not bool(t.float().any())


def test_probs_of_one_equal_no_probs():
    h, grad_a, _ = _inputs(128, 128, with_probs=False)
    ones = torch.ones(128, device=DEVICE)
    _assert_identical(launch_swiglu_quant(h, ones), launch_swiglu_quant(h))
    _assert_identical(launch_swiglu_quant(h, ones, transpose=True), launch_swiglu_quant(h, transpose=True))
    _assert_identical(launch_swiglu_quant_backward(grad_a, h, ones)[:4], launch_swiglu_quant_backward(grad_a, h)[:4])
    # with every prob 1, scaling SwiGLU's inputs and scaling its output are the same function
    _assert_identical(launch_swiglu_quant(h, ones, None, True), launch_swiglu_quant(h))
    before = launch_swiglu_quant_backward(grad_a, h, ones, None, True)
    _assert_identical(before[:4], launch_swiglu_quant_backward(grad_a, h)[:4])


def _dequantize_columns(data_t: torch.Tensor, scale_t: torch.Tensor) -> torch.Tensor:
    """``[2H, M]`` column-wise data with ``[M/128, 2H]`` scales -> fp32 ``[M, 2H]``."""
    return (data_t.float() * scale_t.t().repeat_interleave(BLOCK, dim=1)).t()


def _assert_within_e4m3(deq: torch.Tensor, ref: torch.Tensor, scale_per_elem: torch.Tensor, name: str) -> None:
    """|deq - ref| <= half an E4M3 ulp: 2**-4 relative for normals, 2**-10 * scale on subnormals
    (plus 1e-5 relative for the fp32-vs-fp64 arithmetic)."""
    bound = (2.0**-4 + 1e-5) * ref.abs() + 2.0**-10 * scale_per_elem.double()
    excess = (deq.double() - ref).abs() - bound
    assert bool((excess <= 0).all()), f"{name}: worst excess {float(excess.max()):.3g}"


@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
def test_end_to_end_numerics_vs_fp64_autograd(before):
    m, hidden = 256, 256
    h, grad_a, probs = _inputs(m, hidden, spread=1.0)
    h64 = h.cpu().double().requires_grad_()
    p64 = probs.cpu().double().requires_grad_()
    g64, u64 = h64[:, :hidden], h64[:, hidden:]
    if before:  # torchtitan's score_before_experts: the expert's input (so FC1's output) scaled by p
        a64 = torch.nn.functional.silu(g64 * p64[:, None]) * (u64 * p64[:, None])
    else:
        a64 = torch.nn.functional.silu(g64) * u64 * p64[:, None]
    a64.backward(grad_a.cpu().double())

    data, scale, _, _ = launch_swiglu_quant(h, probs, None, before)
    deq_a = dequantize_rows_reference(data.cpu(), scale.cpu(), BLOCK)
    _assert_within_e4m3(deq_a, a64.detach(), scale.cpu().repeat_interleave(BLOCK, 1), "a")

    dh, dh_scale, dh_t, dh_t_scale, grad_probs = launch_swiglu_quant_backward(grad_a, h, probs, None, before)
    deq_rows = dequantize_rows_reference(dh.cpu(), dh_scale.cpu(), BLOCK)
    _assert_within_e4m3(deq_rows, h64.grad, dh_scale.cpu().repeat_interleave(BLOCK, 1), "dh row-wise")
    deq_cols = _dequantize_columns(dh_t.cpu(), dh_t_scale.cpu())
    _assert_within_e4m3(deq_cols, h64.grad, dh_t_scale.cpu().repeat_interleave(BLOCK, 0), "dh column-wise")
    # the unquantized fp32 dh (FC1's BF16 dgrad takes it): the closed form is SwiGLU's derivative
    d_gate, d_up, _ = swiglu_backward_reference(grad_a.cpu(), h.cpu(), probs.cpu(), None, before)
    dh32 = torch.cat([d_gate, d_up], dim=1).double()
    assert torch.allclose(dh32, h64.grad, rtol=1e-5, atol=1e-6 * float(h64.grad.abs().max()))
    # fp32 sums of H products against fp64: error relative to the sum of magnitudes, not the (cancelling) sum
    ga64, g, u = grad_a.cpu().double(), g64.detach(), u64.detach()
    if before:  # the kernels sum t_gate * g + t_up * u: bound by both products' magnitudes
        p = p64.detach()[:, None]
        s = torch.sigmoid(p * g)
        terms = (ga64 * (u * p) * s * (1 + p * g * (1 - s)) * g).abs() + (ga64 * (p * g * s) * u).abs()
    else:
        terms = (ga64 * torch.nn.functional.silu(g) * u).abs()
    terms = terms.sum(1)
    assert bool(((grad_probs.cpu().double() - p64.grad).abs() <= 1e-5 * terms).all())


@pytest.mark.parametrize("kernel", KERNELS)
def test_zeros(kernel):
    h = torch.zeros(128, 256, device=DEVICE, dtype=torch.bfloat16)
    grad_a = torch.zeros(128, 128, device=DEVICE, dtype=torch.bfloat16)
    data, scale = _assert_forward_matches(h, None, None)
    dh, dh_scale, dh_t, dh_t_scale, _ = _assert_backward_matches(grad_a, h, None, None, kernel=kernel)
    for t in (data, dh, dh_t):
        assert not bool(t.float().any())
    # an all-zero block keeps a tiny finite scale, never 0 (that is reserved for rows past the end)
    for s in (scale, dh_scale, dh_t_scale):
        assert bool((s > 0).all()) and bool((s < 1e-10).all())


@pytest.mark.parametrize("kernel", KERNELS)
def test_large_values(kernel):
    """Gates far into both saturated ends of the sigmoid (exp overflows to inf) and values near bf16's top."""
    h, grad_a, probs = _inputs(128, 128, spread=0.0)
    h[:, :128] *= 100.0  # gates ~ +-100: exp(-g) is 0 or inf in fp32
    h[:64, 128:] = 3e37  # up near the bf16 maximum: a ~ 3e39 overflows fp32 -> inf
    h[64:, 128:] *= 1e4
    grad_a[:32] *= 1e4
    data, scale = _assert_forward_matches(h, probs, None)
    _assert_backward_matches(grad_a, h, probs, None, kernel=kernel)
    assert bool(torch.isfinite(scale[64:]).all())
    assert not bool(torch.isfinite(dequantize_rows_reference(data[:64].cpu(), scale[:64].cpu(), BLOCK)).all())


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_propagates(kernel):
    h, grad_a, probs = _inputs(128, 128)
    h[3, 5] = float("nan")  # gate: a, d_gate and d_up of that element
    h[7, 128 + 9] = float("nan")  # up: a and d_gate of that element
    h[11, :128] = float("nan")  # a whole gate row: every block of row 11 is all NaN
    data, scale = _assert_forward_matches(h, probs, None)
    dh, dh_scale, dh_t, dh_t_scale, grad_probs = _assert_backward_matches(grad_a, h, probs, None, kernel=kernel)
    a = dequantize_rows_reference(data.cpu(), scale.cpu(), BLOCK)
    assert bool(a[3, 5].isnan()) and bool(a[7, 9].isnan()) and bool(a[11].isnan().all())
    assert int(a.isnan().sum()) == 2 + 128
    rowwise = dequantize_rows_reference(dh.cpu(), dh_scale.cpu(), BLOCK)
    for deq in (rowwise, _dequantize_columns(dh_t.cpu(), dh_t_scale.cpu())):
        assert bool(deq[3, 5].isnan()) and bool(deq[3, 128 + 5].isnan()) and bool(deq[7, 9].isnan())
        assert bool(deq[11].isnan().all()) and int(deq.isnan().sum()) == 3 + 256
    assert bool(grad_probs[[3, 7, 11]].isnan().all()) and int(grad_probs.isnan().sum()) == 3


@pytest.mark.parametrize("kernel", KERNELS)
def test_row_stride_is_free(kernel):
    wide = torch.randn(128, 512, device=DEVICE).to(torch.bfloat16)
    h, grad_a = wide[:, :256], wide[:, 256:384]
    _assert_forward_matches(h, None, None)
    _assert_backward_matches(grad_a, h, None, None, kernel=kernel)


def test_sm90_kernel_builds_for_hopper():
    """The Hopper kernel compiled for sm_90a without a GPU (the interpreter cannot run Gluon), as each form's
    launch specializes it: within Hopper's shared memory; no spill with triton 3.6 (the GPU image's). Triton
    3.9 compiles the layer's form (probs after the experts) without spills too, and the forms without probs
    or with the score before the experts to a few at its 168 registers (179-255 local-memory instructions),
    not measured on a GPU."""
    from fp8flow_ao.kernels._sm90_common import SM90_SMEM_BYTES

    most = 0 if triton.__version__.startswith("3.6.") else 300
    forms = [(True, False, True), (False, False, True), (True, True, True), (True, False, False)]
    forms += [(True, False, True, torch.bfloat16, False)]  # without the column-wise copy (frozen W13)
    built = build_spills("swiglu_quant", [f"build_sm90_swiglu_backward_kernel{f}" for f in forms])
    assert all(shared <= SM90_SMEM_BYTES and spills <= most for _, shared, spills in built), built


def test_sm90_kernel_refuses_inputs_other_than_bf16():
    """The Hopper kernel widens its tiles by their bits (bf16 is the high half of an fp32): another input
    dtype stops its build with a message instead of computing from misread bits (compiled in the compiling
    process: the interpreter does not compile)."""
    refused = run_compiling(
        "import json, torch\n"
        "from fp8flow_ao.kernels.swiglu_quant import build_sm90_swiglu_backward_kernel\n"
        "try:\n"
        "    build_sm90_swiglu_backward_kernel(dtype=torch.float16)\n"
        "    print(json.dumps(None))\n"
        "except Exception as e:\n"
        "    print(json.dumps([type(e).__name__, str(e)]))\n"
    )
    assert refused is not None, "the fp16 form built"
    assert refused[0] == "CompileTimeAssertionFailure" and "grad_a and h must be bf16" in refused[1], refused


@pytest.mark.hopper
def test_op_takes_the_sm90_kernel_where_tma_can_load(monkeypatch):
    """On Hopper the op runs the TMA kernel where TMA can load ``grad_a`` and ``h``, the Triton kernel for a row
    stride off a 16-byte boundary; the dh bits agree."""
    import fp8flow_ao.kernels.swiglu_quant as module

    calls = []
    sm90 = module.launch_swiglu_quant_backward_sm90
    monkeypatch.setattr(module, "launch_swiglu_quant_backward_sm90", lambda *a: calls.append(1) or sm90(*a))
    h, grad_a, probs = _inputs(512, 256)
    ends = _ends([300, 0, 129])
    taken = swiglu_quant_backward(grad_a, h, probs, ends)
    assert calls == [1]
    odd = torch.empty(512, 260, device=DEVICE, dtype=torch.bfloat16)[:, :256]  # rows of 520 bytes
    odd.copy_(grad_a)
    triton_out = swiglu_quant_backward(odd, h, probs, ends)
    assert calls == [1]
    _assert_identical(taken[:4], triton_out[:4])
    _assert_grad_probs_close(taken[4], triton_out[4].cpu())


def test_no_rows():
    h = torch.empty(0, 256, device=DEVICE, dtype=torch.bfloat16)
    ends = torch.zeros(2, device=DEVICE, dtype=torch.int32)
    probs = torch.empty(0, device=DEVICE)
    data, scale = swiglu_quant(h, probs, ends)
    assert data.shape == (0, 128) and scale.shape == (0, 1)
    assert [tuple(t.shape) for t in swiglu_quant(h, probs, ends, transpose=True)] == [
        (0, 128),
        (0, 1),
        (128, 0),
        (0, 128),
    ]
    out = swiglu_quant_backward(torch.empty(0, 128, device=DEVICE, dtype=torch.bfloat16), h, probs, ends)
    assert [tuple(t.shape) for t in out] == [(0, 256), (0, 2), (256, 0), (0, 256), (0,)]


# (probs and offsets given, score_before_experts)
EXTRAS = {"with_extras": (True, False), "score_before_experts": (True, True), "without_extras": (False, False)}


@pytest.mark.parametrize("extras", list(EXTRAS))
def test_public_ops_and_compile(extras):
    with_extras, before = EXTRAS[extras]
    h, grad_a, probs = _inputs(256, 128, with_extras)
    ends = _ends([100, 0, 20]) if with_extras else None
    eager = swiglu_quant(h, probs, ends, before)
    _assert_identical(torch.compile(swiglu_quant, fullgraph=True)(h, probs, ends, before), eager)
    eager_t = swiglu_quant(h, probs, ends, before, transpose=True)
    _assert_identical(eager_t[:2], eager)
    _assert_identical(torch.compile(swiglu_quant, fullgraph=True)(h, probs, ends, before, transpose=True), eager_t)
    eager_bwd = swiglu_quant_backward(grad_a, h, probs, ends, before)
    assert (eager_bwd[4] is None) == (not with_extras)
    compiled_bwd = torch.compile(swiglu_quant_backward, fullgraph=True)(grad_a, h, probs, ends, before)
    _assert_identical(compiled_bwd, eager_bwd)
    rows_only = torch.compile(swiglu_quant_backward, fullgraph=True)(grad_a, h, probs, ends, before, transpose=False)
    _assert_identical(rows_only, (*eager_bwd[:2], None, None, eager_bwd[4]))
    # the public ops agree with the references (on a GPU: the Triton kernels)
    ref = swiglu_quant_reference(h.cpu(), _cpu(probs), _cpu(ends), before)
    assert_scales_equal(eager[1], ref[1])
    assert_fp8_close(eager[0], ref[0], MIN_EXACT)
    ref_bwd = swiglu_quant_backward_reference(grad_a.cpu(), h.cpu(), _cpu(probs), _cpu(ends), before)
    assert_fp8_close(eager_bwd[0], ref_bwd[0], MIN_EXACT)


@pytest.mark.parametrize("extras", list(EXTRAS))
def test_opcheck(extras):
    with_extras, before = EXTRAS[extras]
    h, grad_a, probs = _inputs(256, 128, with_extras)
    ends = _ends([130, 0]) if with_extras else None
    for transpose in (False, True):
        torch.library.opcheck(torch.ops.fp8flow.swiglu_quant.default, (h, probs, ends, before, transpose))
    for transpose in (False, True):
        args = (grad_a, h, probs, ends, before, transpose)
        torch.library.opcheck(torch.ops.fp8flow.swiglu_quant_backward.default, args)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


_OK_ENDS = torch.tensor([128], dtype=torch.int32)
BAD_INPUTS = [
    ((_bf16(128, 256).float(), None, None), TypeError, "h must have dtype"),
    ((_bf16(2, 128, 256), None, None), ValueError, "h must have 2 dims"),
    ((_bf16(128, 257), None, None), ValueError, "h width 2H"),
    ((_bf16(128, 384), None, None), ValueError, "h width 2H"),  # H = 192, not a multiple of 128
    ((_bf16(128, 0), None, None), ValueError, "H > 0"),
    ((_bf16(100, 256), None, None), ValueError, "h row count M"),
    ((_bf16(256, 128).t(), None, None), ValueError, "h must be row-major"),
    ((_bf16(128, 256), torch.ones(128, 1), None), ValueError, "probs must have 1 dims"),
    ((_bf16(128, 256), torch.ones(64), None), ValueError, "probs must have shape"),
    ((_bf16(128, 256), torch.ones(128, dtype=torch.bfloat16), None), TypeError, "probs must have dtype"),
    ((_bf16(128, 256), None, _OK_ENDS.long()), TypeError, "group_end_offsets must have dtype"),
    ((_bf16(128, 256), None, _OK_ENDS[:0]), ValueError, "at least one group"),
    (([[1.0]], None, None), TypeError, "h must be a torch.Tensor"),
    ((_bf16(128, 256), None, None, True), ValueError, "score_before_experts=True .* probs must be given"),
    ((_bf16(128, 256), torch.ones(128), None, 1), TypeError, "score_before_experts must be a bool"),
]


@pytest.mark.parametrize(("args", "error", "match"), BAD_INPUTS)
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        swiglu_quant(*args)
    with pytest.raises(error, match=match):
        swiglu_quant_backward(_bf16(128, 128), *args)


def test_bad_transpose_flag():
    with pytest.raises(TypeError, match="transpose must be a bool"):
        swiglu_quant(_bf16(128, 256), None, None, False, 1)
    with pytest.raises(TypeError, match="transpose must be a bool"):
        swiglu_quant_backward(_bf16(128, 128), _bf16(128, 256), transpose=0)


_BUILD_FORWARD = """
from fp8flow_ao.kernels._sm90_common import compile_for_sm90
from fp8flow_ao.kernels import swiglu_quant as mod

def build(item):
    transpose, has_probs, before = item
    pointers = {"h_ptr": "*bf16", "probs_ptr": "*fp32", "offsets_ptr": "*i32", "data_ptr": "*fp8e4nv",
                "scale_inv_ptr": "*fp32", "data_t_ptr": "*fp8e4nv", "scale_inv_t_ptr": "*fp32"}
    config = mod.TRANSPOSE_CONFIG if transpose else mod.FORWARD_CONFIG
    constexprs = dict(HAS_PROBS=has_probs, SCORE_BEFORE_EXPERTS=before, HAS_OFFSETS=True, APPROX=True,
                      BLOCK_M=config.block_m, TRANSPOSE=transpose)
    ints = ("M", "H", "stride_hm", "num_groups")
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    built = compile_for_sm90(mod._swiglu_quant_kernel, signature, constexprs, num_warps=config.num_warps,
                             enable_fp_fusion=False)
    return [list(item), local_memory_instructions(built.asm["cubin"])]

items = [(t, p, b) for t in (False, True) for p, b in ((False, False), (True, False), (True, True))]
print(json.dumps(parallel_map(build, items)))
"""


def test_forward_kernels_build_for_sm90():
    """The interpreter runs the forward kernels without compiling them: build both (plain, and with ``a``'s
    transpose) for sm_90a in each probs form, as their launches specialize them; no spills."""
    built = run_build_script(_BUILD_FORWARD)
    assert len(built) == 6 and all(spills == 0 for _, spills in built), built


@pytest.mark.parametrize(
    ("grad_a", "match"),
    [
        (_bf16(128, 256), "grad_a must have shape"),
        (_bf16(128, 128).float(), "grad_a must have dtype"),
        (_bf16(128, 128).t(), "grad_a must be row-major"),
    ],
)
def test_bad_grad_a(grad_a, match):
    with pytest.raises((TypeError, ValueError), match=match):
        swiglu_quant_backward(grad_a, _bf16(128, 256))
