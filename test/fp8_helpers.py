"""Helpers shared by the tests: bit-exact fp8 comparison and inputs that probe the edges."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from conftest import INTERPRETING

from fp8flow_ao._format import BLOCK, FP8_DTYPE
from fp8flow_ao.debug import sqnr_db  # noqa: F401  (the tests import it from here)


def param_id(value: object) -> str:
    """A parametrized test's id for ``value``: a function's name, else ``str``. A function's ``str`` holds its
    address, which differs between processes: pytest-xdist's workers must collect the same ids."""
    return getattr(value, "__name__", None) or str(value)


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    """The E4M3 bit patterns of ``t`` with every NaN folded to 0x7F (the GPU and CPU may differ in a NaN's sign)."""
    bits = t.contiguous().view(torch.uint8)
    return torch.where((bits & 0x7F) == 0x7F, torch.full_like(bits, 0x7F), bits)


def assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "data") -> None:
    """Bit-exact comparison of two E4M3 tensors (shape, dtype and every bit but a NaN's sign)."""
    assert actual.dtype == FP8_DTYPE == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    a, e = fp8_bits(actual.cpu()), fp8_bits(expected.cpu())
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{name}: {bad.shape[0]} of {a.numel()} bytes differ, first at {bad[0].tolist()}: "
        f"{a[tuple(bad[0])].item():#04x} vs {e[tuple(bad[0])].item():#04x}"
    )


def assert_scales_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "scale_inv") -> None:
    """Bit-exact comparison of fp32 scale tensors (NaN == NaN)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual.shape, expected.shape)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True, msg=name)


def assert_accumulated(grad: torch.Tensor, existing: torch.Tensor, fresh: torch.Tensor) -> None:
    """``grad == existing + fresh``, a gradient added into an existing one by the wgrad epilogue: bit for bit in
    fp32 (the same fp32 add as autograd's); in bf16 within the fused sum's one rounding (2^-8 of it) plus that
    of the plain path's bf16 ``fresh`` (2^-8 of it: near cancellation the bound is on ``|fresh|``)."""
    if grad.dtype == torch.float32:
        assert torch.equal(grad, existing + fresh)
    else:
        ref = existing.float() + fresh.float()
        assert ((grad.float() - ref).abs() <= 2**-8 * (ref.abs() + fresh.float().abs()) + 1e-30).all()


@contextlib.contextmanager
def kernels_compiled() -> Iterator[list[str]]:
    """Collect, while the block runs, every Triton or Gluon kernel specialization compiled in this process (one
    that Triton had not met before: its name and its arguments' specializations), through Triton's
    ``jit_cache_hook``, which Triton calls before each compile."""
    from triton import knobs

    compiled: list[str] = []
    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> bool | None:
        compiled.append(kwargs["repr"])
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield compiled
    finally:
        knobs.runtime.jit_cache_hook = previous


def assert_sizes_compile_nothing_new(run: Callable[[int], None], sizes: Sequence[int]) -> None:
    """``run(sizes[0])`` compiles what it needs; ``run`` at each other size must then compile no kernel (a
    count that changes between steps must not recompile anything mid-training)."""
    run(sizes[0])
    with kernels_compiled() as compiled:
        for size in sizes[1:]:
            run(size)
    assert not compiled, "compiled again for a new size:\n" + "\n".join(compiled)


def capture_cuda_graph(step: Callable[[], Any], warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``step()`` run ``warmups`` times on a side stream (compiles, allocations and autograd's device thread happen
    outside the capture), then captured in a CUDA graph: (the graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def edge_case_rows(k: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows that probe the format's edges, each ``k`` wide.

    Values near 448 and above it, ties between E4M3 neighbours, tiny values that land on E4M3
    subnormals, a whole-zero row, +-0, a row with one NaN and a row with one inf.
    """
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(8, k, generator=g)
    rows = [
        base[0] * 448 / base[0].abs().max(),  # amax exactly 448
        base[1] * 449 / base[1].abs().max(),  # just over 448: scale 2
        torch.full((k,), 125.5) * torch.sign(base[2]),  # tie halfway between 124 and 128 at scale 1... after scaling
        base[3] * 1e-6,  # tiny: subnormals after scaling
        torch.zeros(k),  # whole-zero row
        torch.where(base[5] > 0, 0.0, -0.0) + torch.arange(k) * 0.0,  # signed zeros
        base[6],
        base[7] * 3e4,
    ]
    x = torch.stack(rows)
    x[6, 3] = float("nan")
    x[7, min(5, k - 1)] = float("inf")
    return x.to(device=device, dtype=dtype)


def opcheck_fp8_inputs(op: torch._ops.OpOverload, args: tuple) -> None:
    """``torch.library.opcheck`` for an op that takes E4M3 tensors.

    opcheck's ``test_schema`` compares inputs before and after the call with ``torch.allclose``, which
    torch does not implement for float8 ("mul_cpu_reduced_float" ...). So run every other opcheck
    test, and do what ``test_schema`` checks here: inputs unchanged bit for bit, outputs alias no input.
    """
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    out = op(*args)
    outs = out if isinstance(out, tuple | list) else (out,)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)) if t.dtype == FP8_DTYPE else torch.equal(t, b)
        assert not any(torch._C._overlaps(o, t) for o in outs if isinstance(o, torch.Tensor) and o.numel())


def make_routing(kind: str, tokens: int, top_k: int, experts: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Router top-k expert ids ``[tokens, top_k]`` (int64) of a named pattern.

    ``distinct``: k different experts per token (a real router); ``skewed``: Zipf-like with a third of
    the experts empty; ``one_expert``: every row on the last expert; ``twice``: each token names its
    first expert again in its last slot (two rows of one expert).
    """
    if kind == "distinct":
        ids = torch.rand(tokens, experts).argsort(dim=1)[:, :top_k]
    elif kind == "skewed":
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.5
        w[torch.randperm(experts)[: max(1, experts // 3)]] = 0
        ids = torch.multinomial(w, tokens * top_k, replacement=True).view(tokens, top_k)
    elif kind == "one_expert":
        ids = torch.full((tokens, top_k), experts - 1)
    elif kind == "twice":
        ids = torch.randint(0, experts, (tokens, top_k))
        ids[:, -1] = ids[:, 0]
    else:
        raise ValueError(f"unknown routing kind {kind!r}")
    return ids.to(device)


def fp8_ordinal(t: torch.Tensor) -> torch.Tensor:
    """Signed position of each E4M3 value on the E4M3 number line (int32): neighbours differ by 1,
    +0 and -0 are both 0. NaN maps to 127 (outside the finite range +-126)."""
    bits = t.contiguous().view(torch.uint8).to(torch.int32)
    magnitude = bits & 0x7F
    return torch.where(((bits & 0x80) != 0) & (magnitude != 0x7F), -magnitude, magnitude)


def assert_fp8_close(actual: torch.Tensor, expected: torch.Tensor, min_exact: float, name: str = "data") -> None:
    """E4M3 tensors equal except at most a ``1 - min_exact`` fraction of elements, each of those one
    E4M3 step from the expected value; NaN in exactly the same places.

    For ops whose fp32 math includes a transcendental (exp) that the GPU, the CPU interpreter and
    torch's CPU reference round differently by an ulp: such an ulp moves an E4M3 rounding only when
    the value sits on a rounding boundary, i.e. rarely and by exactly one step.
    """
    assert actual.dtype == FP8_DTYPE == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    a, e = fp8_ordinal(actual.cpu()), fp8_ordinal(expected.cpu())
    nan_a, nan_e = fp8_bits(actual.cpu()) == 0x7F, fp8_bits(expected.cpu()) == 0x7F
    assert torch.equal(nan_a, nan_e), f"{name}: NaN at different places ({int((nan_a != nan_e).sum())} elements)"
    differ = a != e
    n_differ = int(differ.sum())
    assert n_differ <= (1 - min_exact) * a.numel(), f"{name}: {n_differ} of {a.numel()} elements differ"
    far = differ & ((a - e).abs() > 1)
    assert not bool(far.any()), f"{name}: {int(far.sum())} elements more than one E4M3 step apart"


# Relative error (Frobenius norm) of the grouped GEMMs against fp32 math on the dequantized operands.
# bf16 output: its rounding. fp32 output: 1e-5 where the dot is exact fp32 (the CPU interpreter). On
# Hopper the FP8 tensor cores add the products of each 128-wide block with ~14-bit alignment (why the
# partials are promoted every 128; DeepSeek-V3 report, 3.3.2): measured 1.2e-4..2e-4 on an H200.
GEMM_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5 if INTERPRETING else 5e-4}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The worst relative error (Frobenius norm) of any row (last dim) of ``actual`` against ``expected``.

    Row by row, not over the whole tensor: the GEMM tests spread their rows' and experts' magnitudes over six
    decades, and a whole-tensor norm would hide a wrong row or expert among the small ones. A row that is exactly
    zero in ``expected`` (a pad row, an empty expert) must be exactly zero in ``actual`` (else the error is inf).
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    a, e = (t.detach().cpu().double().reshape(-1, t.shape[-1]) for t in (actual, expected))
    diff, norm = (a - e).norm(dim=1), e.norm(dim=1)
    zero_ok = torch.where(diff == 0, 0.0, float("inf"))
    return float(torch.where(norm > 0, diff / norm.clamp_min(1e-300), zero_ok).max())


# Seeds of random_grouping: the first two small enough for the CPU interpreter, the rest GPU-sized.
RANDOM_GROUPING_SEEDS = [0, 1, *(pytest.param(seed, marks=pytest.mark.gpu) for seed in range(100, 112))]


def int_drawer(g: torch.Generator) -> Callable[[int], int]:
    """``draw(high)``: an int in ``[1, high]`` from ``g`` (the random cases' one way of drawing sizes)."""

    def draw(high: int) -> int:
        return int(torch.randint(1, high + 1, (1,), generator=g))

    return draw


def random_grouping(seed: int) -> tuple[list[int], int, int, int]:
    """A grouping no test names, drawn from ``seed``: (rows per group, K, N, rows past the last end).

    Group sizes mix empty groups, single rows, 127/128/129 (a tile's edges) and random sizes; K and N are any
    multiples of 128 (odd ones too: no 256-wide tile). Seeds under 100 are small (the CPU interpreter)."""
    draw = int_drawer(torch.Generator().manual_seed(seed))
    small = seed < 100
    edges = [0, 0, 1, 127, 128, 129]
    counts = []
    for _ in range(draw(5 if small else 40)):
        pick = draw(len(edges) + 4) - 1
        counts.append(edges[pick] if pick < len(edges) else draw(300 if small else 900))
    k, n = (BLOCK * draw(3 if small else 16) for _ in range(2))
    extra = draw(200) if draw(2) == 2 else 0
    return counts, k, n, extra


def padded_ends(counts: list[int]) -> list[int]:
    """Group end offsets with each group padded up to a multiple of 128 rows."""
    ends, end = [], 0
    for c in counts:
        end += -(-c // BLOCK) * BLOCK
        ends.append(end)
    return ends


# The prelude of the build scripts: the spill count of a cubin, and a map over the builds on every core (a
# build is one process's CPU for seconds and the suite runs on one core: CI's second core idles otherwise).
_BUILD_PRELUDE = """
import json, multiprocessing, os, subprocess, tempfile, torch, triton

def parallel_map(fn, items):
    # fork: the children inherit the imported kernels (fn is defined in the compiling process's __main__)
    with multiprocessing.get_context("fork").Pool(max(1, min(len(items), os.cpu_count() or 1))) as pool:
        return pool.map(fn, items)

def local_memory_instructions(cubin):
    # ptxas's spills: loads and stores of thread-local memory in the SASS (Triton's own cuobjdump)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return sum(word.split(".")[0] in ("LDL", "STL") for word in sass.split())
"""

_BUILD_EVERY_SM90_CONFIG = (
    _BUILD_PRELUDE.replace("{", "{{").replace("}", "}}")
    + """
from fp8flow_ao.kernels import _sm90_common as common, {module} as mod

def build(item):
    config, out_dtype = item
    kernel = mod.{builder}(config, out_dtype{extra})
    cubin = kernel.asm["cubin"]
    return [str(config), str(out_dtype), kernel.metadata.shared, len(cubin), local_memory_instructions(cubin)]

items = [(c, d) for c in mod.{configs} for d in (torch.bfloat16, torch.float32)
         if mod.sm90_smem_bytes(c, d{smem_extra}) <= common.SM90_SMEM_BYTES]
print(json.dumps(parallel_map(build, items)))
"""
)


def build_every_sm90_config(
    module: str, configs: str, builder: str, extra: str = "", smem_extra: str = ""
) -> list[list]:
    """Compile ``fp8flow_ao.kernels.<module>.<builder>(config, out_dtype, <extra>)`` for sm_90a for every
    config in ``<configs>`` and both output dtypes that fit (``<module>.sm90_smem_bytes(config, out_dtype,
    <smem_extra>)``); ``[config, dtype, shared bytes, cubin bytes, local-memory instructions (spills) in its
    SASS]`` per build. In the compiling process (:func:`run_compiling`): under TRITON_INTERPRET=1 (the suite
    without a GPU) Triton's own reduction helpers are interpreter functions, which the Gluon compiler refuses."""
    code = _BUILD_EVERY_SM90_CONFIG.format(
        module=module,
        configs=configs,
        builder=builder,
        extra=f", {extra}" if extra else "",
        smem_extra=f", {smem_extra}" if smem_extra else "",
    )
    return run_compiling(code)


def build_spills(module: str, builds: list[str]) -> list[list]:
    """Compile each ``fp8flow_ao.kernels.<module>.<build>`` expression (a builder returning a compiled
    kernel, e.g. ``build_sm90_transpose_kernel(True)``) for sm_90a in the compiling process; ``[build, shared
    bytes, local-memory instructions (spills) in its SASS]`` per build."""
    code = (
        _BUILD_PRELUDE
        + f"from fp8flow_ao.kernels import {module} as mod\n"
        + "def build(b):\n"
        + "    kernel = eval('mod.' + b)\n"
        + "    return [b, kernel.metadata.shared, local_memory_instructions(kernel.asm['cubin'])]\n"
        + f"print(json.dumps(parallel_map(build, {builds!r})))\n"
    )
    return run_compiling(code)


def run_build_script(code: str) -> Any:
    """:func:`run_compiling` of ``code`` after the build prelude (``parallel_map``, ``local_memory_instructions``)."""
    return run_compiling(_BUILD_PRELUDE + code)


# The compiling process: it imports torch, Triton and the kernels once (~5 s a process on the CPU machine, 15-20
# build scripts a suite) and then runs each script sent to it, one JSON line in, one out, as its __main__ (the
# build scripts' pools fork it and find their functions there). Its own names stay local to _serve.
_COMPILING_PROCESS = r"""
import contextlib, io, json, sys, traceback

def _serve(stdin=sys.stdin, stdout=sys.stdout, json=json, io=io, contextlib=contextlib, traceback=traceback):
    namespace = sys.modules["__main__"].__dict__
    for line in stdin:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(json.loads(line), "<build script>", "exec"), namespace)
            reply = {"stdout": printed.getvalue()}
        except BaseException:
            reply = {"stdout": printed.getvalue(), "error": traceback.format_exc()}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()

_serve()
"""
_compiling: subprocess.Popen | None = None


def _compiling_process() -> subprocess.Popen:
    """The compiling process, started on first use (again if it died), without ``TRITON_INTERPRET``."""
    global _compiling
    if _compiling is None or _compiling.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        _compiling = subprocess.Popen(
            [sys.executable, "-c", _COMPILING_PROCESS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # never read: a full pipe would block it
            text=True,
            env=env,
        )
        atexit.register(_compiling.kill)
    return _compiling


def run_compiling(code: str, timeout: float = 600.0) -> Any:
    """Run ``code`` without ``TRITON_INTERPRET`` (kernels then compile: the interpreter runs them without compiling,
    so it misses what only the compiler refuses), in the compiling process (a process of its own, shared by the
    session's build scripts), and return the JSON value its last printed line holds. An exception in ``code``
    fails the calling test with its traceback; so does a script still running after ``timeout`` seconds (the
    process is then killed, and the next call starts another)."""
    process = _compiling_process()
    process.stdin.write(json.dumps(code) + "\n")
    process.stdin.flush()
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        process.kill()
        raise AssertionError(f"the build script ran past {timeout} s")
    line = process.stdout.readline()
    assert line, f"the compiling process ended (exit code {process.wait()})"
    reply = json.loads(line)
    assert "error" not in reply, reply["error"][-3000:]
    return json.loads(reply["stdout"].strip().splitlines()[-1])
