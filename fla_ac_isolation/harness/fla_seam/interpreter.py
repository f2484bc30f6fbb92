"""The interpreter backend: FLA's real Triton kernels, context parallelism included, on a CPU under Triton's
interpreter. ``TRITON_INTERPRET=1`` must be set before FLA's ops are imported. Every patch is undone on exit; a shim
whose target FLA or Triton no longer has raises ``RuntimeError`` rather than running unpatched."""

from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator

from fla_ac_isolation.fla_seam import features

__all__ = [
    "cp_cpu_shims",
    "cpu_cp_kernels",
    "first_autotune_config",
    "interpreter_enabled",
    "interpreter_shims",
    "require_interpreter",
]

_DEVICE_CHECK_MODULES = (
    "fla.ops.cp.context",
    "fla.ops.cp.chunk_delta_h",
    "fla.ops.cp.chunk_merge",
    "fla.ops.cp.chunk_fwd",
    "fla.ops.cp.chunk_bwd",
)
_OPTIONAL_DEVICE_CHECK_MODULES = ("fla.ops.common.intracard_cp",)
_ALL_GATHER_MODULES = (
    "fla.ops.cp.comm",
    "fla.ops.cp",
    "fla.ops.cp.chunk_delta_h",
    "fla.modules.causal_conv1d.cp",  # features.module_path("conv_cp") of fla-core 0.6, the release CP needs
)


# ------------------------------------------------------------------------------------------ interpreter
def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_interpreter() -> None:
    """Raise unless ``TRITON_INTERPRET=1`` is set.

    Raises:
        RuntimeError: explaining that the variable must be set before FLA's kernels are imported.
    """
    if not interpreter_enabled():
        raise RuntimeError(
            "TRITON_INTERPRET=1 must be set in the environment before FLA's kernels are imported; "
            "run interpreter cases in a fresh process"
        )


@contextlib.contextmanager
def first_autotune_config() -> Iterator[None]:
    """Make every Triton autotuner use only its first config inside the block (no GPU to time them; same values)."""
    import triton.runtime.autotuner as autotuner

    original_run = autotuner.Autotuner.run

    def run_first_config(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return original_run(self, *args, **kwargs)

    autotuner.Autotuner.run = run_first_config
    try:
        yield
    finally:
        autotuner.Autotuner.run = original_run


class _LoopIndex(int):
    """An ``int`` that tolerates ``.to(dtype)``, as a compiled Triton loop variable does."""

    def to(self, *args, **kwargs) -> _LoopIndex:
        return self


def _loop_range(arg1, arg2=None, step=None, **kwargs):
    """``range`` yielding :class:`_LoopIndex`; also stands in for ``tl.range`` (``num_stages=``, ...)."""
    start, end = (0, arg1) if arg2 is None else (arg1, arg2)
    return map(_LoopIndex, builtins.range(start, end, 1 if step is None else step))


@contextlib.contextmanager
def interpreter_shims() -> Iterator[None]:
    """First autotune config and loop variables with ``.to()`` (kernel globals copied, not modified) in the block.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set.
    """
    require_interpreter()
    import triton.runtime.interpreter as interpreter

    original_compile = interpreter.FunctionRewriter._compile_and_exec
    original_patch_core = interpreter._patch_lang_core

    def compile_with_loop_range(self, transformed_ast):
        # Mirrors FunctionRewriter._compile_and_exec, but executes in a copy of the kernel's globals in
        # which `range` yields _LoopIndex items.
        code = compile(transformed_ast, filename=self.filename, mode="exec")
        namespace = dict(self.kwargs)
        shimmed = {**vars(interpreter), **self.fn.__globals__, "range": _loop_range}
        exec(code, shimmed, namespace)
        return namespace[self.fn.__name__]

    def patch_core_with_loop_range(lang, scope):
        original_patch_core(lang, scope)
        scope.set_attr(lang, "range", _loop_range)
        scope.set_attr(lang, "static_range", _loop_range)

    # Kernels rewritten before the shims were applied would keep the builtin `range`.
    saved_rewritten = dict(interpreter.InterpretedFunction.rewritten_fn)
    interpreter.InterpretedFunction.rewritten_fn.clear()
    interpreter.FunctionRewriter._compile_and_exec = compile_with_loop_range
    interpreter._patch_lang_core = patch_core_with_loop_range
    try:
        with first_autotune_config():
            yield
    finally:
        interpreter.FunctionRewriter._compile_and_exec = original_compile
        interpreter._patch_lang_core = original_patch_core
        interpreter.InterpretedFunction.rewritten_fn.clear()
        interpreter.InterpretedFunction.rewritten_fn.update(saved_rewritten)


# ------------------------------------------------------------------------------------ context parallel
def _no_device_check(device) -> None:
    """Stand-in for FLA's ``_check_cp_device``: every device passes."""


def _gather_concatenated(inp, out=None, group=None, async_op=False):
    """FLA's ``all_gather_into_tensor`` contract (``[world, *inp.shape]`` result), gathered in gloo's layout."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group=group)
    if inp.dim() == 0:
        inp = inp.reshape(1)
    flat = torch.empty(world * inp.shape[0], *inp.shape[1:], device=inp.device, dtype=inp.dtype)
    handle = dist.all_gather_into_tensor(flat, inp.contiguous(), group=group, async_op=async_op)
    view = flat.view(world, *inp.shape)
    if out is not None:
        if handle is not None:
            handle.wait()
            handle = None
        out.copy_(view)
        view = out
    return view, handle


@contextlib.contextmanager
def _rebind(module_names, attr, value, *, optional=()) -> Iterator[None]:
    saved = []
    try:
        for name in (*module_names, *optional):
            if name in optional and name not in sys.modules:
                try:
                    importlib.import_module(name)
                except ImportError:
                    continue
            module = importlib.import_module(name)
            if not hasattr(module, attr):
                raise RuntimeError(f"FLA changed: {name} has no {attr}; revisit fla_seam.interpreter's CP shims")
            saved.append((module, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, original in reversed(saved):
            setattr(module, attr, original)


@contextlib.contextmanager
def _comparisons_as_int1() -> Iterator[None]:
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    names = [n for n in vars(builder) if n.startswith(("create_icmp", "create_fcmp"))]
    if not names:
        raise RuntimeError("Triton changed: InterpreterBuilder has no create_icmp*/create_fcmp*; revisit the shim")
    saved = {n: vars(builder)[n] for n in names}

    def relabel(original):
        def compare(self, lhs, rhs):
            result = original(self, lhs, rhs)
            return interpreter.TensorHandle(result.data.astype(bool), tl.int1)

        return compare

    for n in names:
        setattr(builder, n, relabel(saved[n]))
    try:
        yield
    finally:
        for n, original in saved.items():
            setattr(builder, n, original)


@contextlib.contextmanager
def cp_cpu_shims(
    *, device_check: bool = True, all_gather: bool = True, comparison_dtype: bool = True
) -> Iterator[None]:
    """FLA's CP code on a CPU over gloo, inside the block: no CP device check, a gloo-shaped all-gather, and
    comparison results labelled ``tl.int1`` (each can be switched off).

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set, or FLA/Triton no longer has what a shim replaces.
        FlaFeatureError: the installed FLA predates the CP API (fla-core < 0.6).
    """
    require_interpreter()
    features.require("cp", where="FLA's CP kernels on a CPU (fla_seam.interpreter.cp_cpu_shims)")
    with contextlib.ExitStack() as stack:
        if device_check:
            stack.enter_context(
                _rebind(_DEVICE_CHECK_MODULES, "_check_cp_device", _no_device_check,
                        optional=_OPTIONAL_DEVICE_CHECK_MODULES)
            )
        if all_gather:
            stack.enter_context(_rebind(_ALL_GATHER_MODULES, "all_gather_into_tensor", _gather_concatenated))
        if comparison_dtype:
            stack.enter_context(_comparisons_as_int1())
        yield


@contextlib.contextmanager
def cpu_cp_kernels() -> Iterator[None]:
    """What a CPU rank enters to run FLA's kernels, CP ones included: :func:`interpreter_shims` and
    :func:`cp_cpu_shims`, with the interpreter's known warnings silenced.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set.
    """
    with warnings.catch_warnings(), interpreter_shims(), cp_cpu_shims():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        yield
