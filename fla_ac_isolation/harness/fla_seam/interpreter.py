"""The interpreter backend of the seam: FLA's real Triton kernels, context parallelism included, on a CPU.

FLA's kernels need a GPU driver. Triton's interpreter (``TRITON_INTERPRET=1``, read when ``triton.jit``
decorates FLA's kernels, i.e. before FLA's ops are imported) runs them on a CPU as Python, slowly; this
module adds what FLA 0.6 needs to run there (measured with fla-core 0.6.0, Triton 3.9, torch 2.13). The
CPU context-parallel regression (``RegressionSpec(cp=2)`` on a CPU, ``kernels="interpreter"``) enters
:func:`cpu_cp_kernels` in every rank; the tests and ``examples/context_parallel.py`` use it too. On a GPU
none of it is needed.

* :func:`first_autotune_config` - every Triton autotuner (FLA's ``CachedAutotuner`` subclasses
  ``triton.runtime.autotuner.Autotuner``) keeps only its first config. Autotuning times every config
  through a GPU driver (there is none under the interpreter), and takes minutes on a fresh GPU machine;
  any config computes the same values, so results stay exact (a benchmark that uses it says so).
* :func:`interpreter_shims` - :func:`first_autotune_config`, and loop variables with a no-op ``.to()``:
  compiled Triton gives ``for i_t in range(NT)`` a tensor loop variable and FLA's kernels call
  ``i_t.to(tl.int64)``; in the interpreter ``i_t`` is a plain ``int``. Kernel functions are built with a
  ``range`` (and ``tl.range`` / ``tl.static_range``) yielding ints that accept ``.to()``; the kernels'
  module globals are copied for this, not modified.
* :func:`cp_cpu_shims` - FLA's CP code on a CPU over gloo, three rebindings:

  1. ``device_check``: FLA's ``_check_cp_device`` (``fla/ops/cp/context.py``) accepts only CUDA (Ampere+)
     or NPU devices; it is imported by name into ``fla.ops.cp.chunk_delta_h``, ``chunk_merge``,
     ``chunk_fwd`` and ``chunk_bwd`` (and ``fla.ops.common.intracard_cp``); each binding becomes a no-op.
  2. ``all_gather``: FLA's ``fla.ops.cp.comm.all_gather_into_tensor`` allocates its output as
     ``[world, *shape]``, which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"); the
     replacement gathers into the concatenated ``[world * shape[0], *shape[1:]]`` buffer (same memory) and
     returns its ``[world, *shape]`` view, as FLA's function does. Rebound in ``fla.ops.cp.comm``,
     ``fla.ops.cp``, ``fla.ops.cp.chunk_delta_h`` and ``fla.modules.causal_conv1d.cp``.
  3. ``comparison_dtype``: Triton's interpreter labels the result of ``create_icmp*`` / ``create_fcmp*``
     with the operand dtype instead of ``int1``; FLA's conv ``compute_dh0_kernel`` (non-first CP ranks)
     then fails with "mask has unsupported dtype". Comparison results are relabelled ``tl.int1``.

* :func:`cpu_cp_kernels` - what a CPU rank enters to run FLA's CP kernels: both of the above.

Every patch is undone on exit. A shim whose target FLA or Triton no longer has raises ``RuntimeError``
naming it, rather than running unpatched.

Usage::

    # TRITON_INTERPRET=1 in this process's environment before FLA is imported; a gloo group initialised
    with cpu_cp_kernels():
        seqlens = LayerLocalSeqlens(cu_seqlens, cp=CPConfig(group=group, layout="zigzag", conv_kernel_size=4))
        ...
"""

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
    """Make every Triton autotuner use only its first config inside the block (restored on exit)."""
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
    """First autotune config and loop variables with ``.to()`` inside the block; undone on exit.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set (see :func:`require_interpreter`).
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
    """Stand-in for FLA's ``_check_cp_device``: every device passes (CPU under the interpreter)."""


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
    """Apply the three CP-on-CPU shims of the module docstring inside the block (each can be switched off, to
    show why it exists).

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set, or FLA/Triton no longer has what a shim replaces.
        FlaFeatureError: the installed FLA predates the CP API the shims replace parts of (fla-core < 0.6).
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
    :func:`cp_cpu_shims`.

    Also silences the ``FutureWarning`` torch 2.13 emits for every FLA CP all-gather
    (``dist.all_gather_into_tensor`` is deprecated there) and numpy's ``RuntimeWarning`` s from the
    interpreter (``overflow encountered in exp2``, ``invalid value encountered in multiply``: FLA's kernels
    compute ``exp`` in masked-out lanes and discard them with ``tl.where``, silently on a GPU). The
    regression enters it in every rank of a spec with ``kernels="interpreter"``, whose ranks start with
    ``TRITON_INTERPRET=1`` in their environment.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set (it must be, before FLA's kernels are imported).
    """
    with warnings.catch_warnings(), interpreter_shims(), cp_cpu_shims():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        yield
