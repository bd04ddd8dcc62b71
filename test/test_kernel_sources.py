"""Static checks on every Triton and Gluon kernel of the package, so the CPU suite catches what only the GPU
compiler would reject: the interpreter lets a @triton.jit function read any module global, the GPU
compiler only tl.constexpr globals, JIT functions and modules."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton
import triton.language as tl
from fp8_helpers import run_build_script

import fp8flow_ao.kernels


def _kernel_modules() -> list[types.ModuleType]:
    return [
        importlib.import_module(f"fp8flow_ao.kernels.{m.name}")
        for m in pkgutil.iter_modules(fp8flow_ao.kernels.__path__)
    ]


def _jit_functions() -> list[tuple[str, object]]:
    found = {}
    for mod in _kernel_modules():
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            while fn is not None and not inspect.isfunction(fn):  # autotune/heuristics wrappers
                fn = getattr(fn, "fn", None)
            if fn is not None and fn.__module__ == mod.__name__ and hasattr(obj, "run"):
                found[f"{mod.__name__}.{name}"] = fn
    return sorted(found.items())


def _read_globals(fn: types.FunctionType) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    local = {a.arg for a in func.args.args + func.args.kwonlyargs}
    local |= {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    # the body's reads (not the decorators': triton.jit, jit_any_count run on the host)
    loads = {
        n.id for stmt in func.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return {name for name in loads - local if name in fn.__globals__}


def _allowed(value: object) -> bool:
    # Builtins (tl.load, Gluon's TMA copies) compile like attributes of their modules.
    return (
        isinstance(value, tl.constexpr | types.ModuleType)
        or hasattr(value, "run")
        or getattr(value, "__triton_builtin__", False)
    )


def test_there_are_kernels_to_check():
    assert len(_jit_functions()) >= 1


@pytest.mark.parametrize(("name", "fn"), _jit_functions(), ids=lambda v: v if isinstance(v, str) else "")
def test_jit_functions_read_only_constexpr_globals(name, fn):
    bad = {g: type(fn.__globals__[g]).__name__ for g in _read_globals(fn) if not _allowed(fn.__globals__[g])}
    assert not bad, f"{name} reads non-constexpr globals {bad}; wrap them in tl.constexpr(...)"


def _autotuners() -> list[tuple[str, object]]:
    return sorted(
        (f"{mod.__name__}.{name}", obj)
        for mod in _kernel_modules()
        for name, obj in vars(mod).items()
        if isinstance(obj, triton.runtime.Autotuner)
    )


@pytest.mark.parametrize(("name", "tuner"), _autotuners(), ids=lambda v: v if isinstance(v, str) else "")
def test_autotune_keys_are_kernel_arguments_and_exclude_token_count(name, tuner):
    # An autotune key that names no argument is silently ignored; one on M (tokens) re-tunes every step.
    assert set(tuner.keys) <= set(tuner.arg_names), (name, tuner.keys, tuner.arg_names)
    assert "M" not in tuner.keys, f"{name}: the token count changes every step and must not be an autotune key"


# Every kernel with counts it does not specialize on (jit_any_count): its runtime signature and constexprs at a
# typical launch of the layer (DeepSeek-like widths, top-8, 32 experts).
_I32 = "i32"
_ANY_COUNT_LAUNCHES = {
    "permute_pad._permute_pad_rows_kernel": [
        (
            {"x_ptr": "*bf16", "x_scale_ptr": "*i32", "src_rows_ptr": "*i32", "dst_rows_ptr": "*i32"}
            | {"data_ptr": "*u8", "scale_ptr": "*fp32", "tok_data_ptr": "*u8", "tok_scale_ptr": "*fp32"}
            | dict.fromkeys(
                ("num_rows", "num_tokens", "cols", "num_scale_cols", "top_k", "stride_xm", "stride_sm"), _I32
            ),
            {"BLOCK_M": 4, "BLOCK_D": 1024, "SCALE_COLS": 8, "HAS_SCALE": True, "PAD_ROWS": 64}
            | {"SCATTER": scatter, "QUANTIZE": scatter, "KEEP_TOKENS": scatter},
        )
        for scatter in (True, False)  # the forward's quantizing scatter; backward's gather of FP8 rows
    ],
    "permute_pad._route_count_kernel": [
        (
            {"ids_ptr": "*i64", "counts_ptr": "*i32", "src_rows_ptr": "*i32", "probs_out_ptr": "*fp32"}
            | dict.fromkeys(("num_routed", "num_rows", "num_experts", "fill_per_program"), _I32),
            {"BLOCK_R": 128, "BLOCK_E": 32, "FILL_BLOCK": 1024, "HAS_PROBS": True},
        )
    ],
    "permute_pad._route_scan_kernel": [
        ({"counts_ptr": "*i32", "totals_ptr": "*i32", "num_blocks": _I32}, {"SCAN_R": 256, "SCAN_E": 4, "BLOCK_E": 32})
    ],
    "permute_pad._route_scatter_kernel": [
        (
            {"ids_ptr": "*i64", "bases_ptr": "*i32", "totals_ptr": "*i32", "offsets_ptr": "*i32", "probs_ptr": "*fp32"}
            | {"src_rows_ptr": "*i32", "dst_rows_ptr": "*i32", "probs_out_ptr": "*fp32"}
            | dict.fromkeys(("num_routed", "num_experts"), _I32),
            {"BLOCK_R": 128, "BLOCK_E": 32, "HAS_PROBS": True},
        )
    ],
    "unpermute_unpad._unpermute_unpad_kernel": [
        (
            {"y_ptr": "*bf16", "dst_rows_ptr": "*i32", "probs_ptr": "*fp32", "out_ptr": "*bf16"}
            | dict.fromkeys(("num_tokens", "cols", "stride_ym"), _I32),
            {"TOP_K": 8, "BLOCK_T": 1, "BLOCK_D": 1024, "HAS_PROBS": True},
        )
    ],
    "unpermute_unpad._unpermute_unpad_backward_kernel": [
        (
            {"grad_out_ptr": "*bf16", "y_ptr": "*bf16", "probs_ptr": "*fp32", "src_rows_ptr": "*i32"}
            | {"dst_rows_ptr": "*i32", "grad_y_ptr": "*bf16", "grad_probs_ptr": "*fp32"}
            | dict.fromkeys(("num_tokens", "num_rows", "cols", "stride_gm", "stride_ym", "token_programs"), _I32),
            {"TOP_K": 8, "BLOCK_T": 1, "BLOCK_K": 8, "BLOCK_R": 16, "BLOCK_D": 1024, "HAS_PROBS": True, "HAS_Y": True},
        )
    ],
    "quantize_1x128._quantize_1x128_kernel": [
        (
            {"x_ptr": "*bf16", "src_rows_ptr": "*i32", "data_ptr": "*fp8e4nv", "scale_inv_ptr": "*fp32"}
            | dict.fromkeys(("M", "K", "block", "stride_xm", "num_scale_cols"), _I32),
            {"GATHER": gather, "BLOCK_M": 8, "BLOCK_K": 128},
        )
        for gather in (False, True)
    ],
    "pad_group_offsets._pad_group_offsets_kernel": [
        (
            {"offs_ptr": "*i32", "src_rows_ptr": "*i32", "dst_rows_ptr": "*i32", "padded_offs_ptr": "*i32"}
            | dict.fromkeys(("M", "E"), _I32),
            {"BLOCK_G": 64},
        )
    ],
    "dequantize._dequantize_kernel": [
        (
            {"data_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16"}
            | dict.fromkeys(("R", "C", "stride_sb", "stride_sr", "stride_sc"), _I32),
            {"ROW_BLOCK": 1, "BLOCK_R": 16, "BLOCK_C": 128},
        )
    ],
    "scaling_aware_transpose._scaling_aware_transpose_kernel": [
        (
            {
                "data_ptr": "*fp8e4nv",
                "scale_inv_ptr": "*fp32",
                "group_end_offsets_ptr": "*i32",
                "data_t_ptr": "*fp8e4nv",
            }
            | {"scale_inv_t_ptr": "*fp32", "src_rows_ptr": "*i32"}
            | dict.fromkeys(("M", "K", "num_groups", "group_m", "top_k"), _I32),
            {"HAS_OFFSETS": True, "GATHER": True, "K_BLOCKS_PER_PROGRAM": 4},
        )
    ],
}

# Build each launch twice for sm_90a, every pointer 16-byte aligned and every int a multiple of 16 (the Triton
# specialization of a padded count or a stride), once more with the kernel's do_not_specialize counts left
# unspecialized; count its global memory instructions by width in the SASS.
_MEMORY_OPS_SCRIPT = """
import collections, importlib, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def memory_ops(item):
    name, unspecialized, signature, constexprs = item
    module, kernel_name = name.rsplit(".", 1)
    kernel = getattr(importlib.import_module("fp8flow_ao.kernels." + module), kernel_name)
    names = [p.name for p in kernel.params]
    skip = set(kernel.do_not_specialize) if unspecialized else set()
    attrs = {{(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in signature and n not in skip}}
    full = {{n: signature.get(n, "constexpr") for n in names}}
    compiled = triton.compile(ASTSource(kernel, full, constexprs, attrs), target=GPUTarget("cuda", 90, 32))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(0) for m in re.finditer(r"\\b(?:LDG|STG|RED|ATOMG)(?:\\.[A-Z0-9]+)*", sass))
    return [name, unspecialized, sorted(ops.items())]

def kernels_with_unspecialized_counts():
    # compiled (not interpreted) kernels keep their do_not_specialize
    kernels = []
    for info in pkgutil.iter_modules(fp8flow_ao.kernels.__path__):
        module = importlib.import_module("fp8flow_ao.kernels." + info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and obj.__module__ == module.__name__ and obj.do_not_specialize:
                kernels.append(info.name + "." + name)
    return sorted(kernels)

import pkgutil, fp8flow_ao.kernels
print(json.dumps([kernels_with_unspecialized_counts(), parallel_map(memory_ops, {items!r})]))
"""


def test_counts_left_unspecialized_cost_no_vector_access():
    """A count left unspecialized (jit_any_count: no recompile when it changes) by any kernel must not cost a vectorized load or
    store: built for sm_90a with the counts unspecialized, each kernel has the same global memory instructions,
    width for width, as with them specialized as multiples of 16. (A padded row count did cost the unpermute
    backward's pad-row loads their 128-bit vectors, and the route's per-program fill share its stores.)"""
    items = [
        (name, unspecialized, signature, constexprs)
        for name, launches in _ANY_COUNT_LAUNCHES.items()
        for signature, constexprs in launches
        for unspecialized in (False, True)
    ]
    kernels, built = run_build_script(_MEMORY_OPS_SCRIPT.format(items=items))
    assert kernels == sorted(_ANY_COUNT_LAUNCHES)  # every such kernel is checked
    for (name, _, _, constexprs), specialized, unspecialized in zip(items[::2], built[::2], built[1::2], strict=True):
        assert specialized[2], (name, "no global memory access found in the SASS")
        assert unspecialized[2] == specialized[2], (name, constexprs)
