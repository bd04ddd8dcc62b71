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
    loads = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return {name for name in loads - local if name in fn.__globals__}


def _allowed(value: object) -> bool:
    # Builtins (tl.load, Gluon's TMA copies) compile like attributes of their modules.
    return (
        isinstance(value, tl.constexpr | types.ModuleType)
        or hasattr(value, "run")
        or value is triton.jit
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
