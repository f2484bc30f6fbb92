"""Run FLA's real Triton kernels on a CPU, under Triton's interpreter (``TRITON_INTERPRET=1``).

Test support only: library code never imports this module. Two shims make FLA 0.6's kernels run in the
interpreter (measured with Triton 3.9):

1. **First autotune config only.** Autotuning benchmarks every config through the active GPU driver,
   and there is none ("0 active drivers"). We trim each ``triton.runtime.autotuner.Autotuner`` (FLA's
   ``CachedAutotuner`` subclasses it) to its first config when it runs, so no benchmark is needed.
2. **Loop variables with a no-op ``.to()``.** Compiled Triton gives ``for i_t in range(NT)`` a tensor
   loop variable, and FLA kernels call ``i_t.to(tl.int64)`` on it. The interpreter runs the kernel as
   Python, where ``i_t`` is a plain ``int``. When the interpreter builds a kernel function, we give it a
   ``range`` (and ``tl.range``/``tl.static_range``) whose items are ints with a ``.to()`` that returns
   the int unchanged. The kernel's module globals are copied for this, not modified.

``TRITON_INTERPRET=1`` must be set before ``triton.jit`` decorates FLA's kernels, i.e. before FLA's
ops are imported; tests therefore run interpreter cases in a subprocess (``tests/interpret_cases.py``).

Usage::

    # TRITON_INTERPRET=1 in the environment of this process
    from fla_ac_isolation.testing.triton_interpret import interpreter_shims
    with interpreter_shims():
        o, _ = fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Iterator

from fla_ac_isolation.testing.autotune import first_autotune_config

__all__ = ["interpreter_enabled", "interpreter_shims", "require_interpreter"]


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_interpreter() -> None:
    """Raise unless ``TRITON_INTERPRET=1`` is set.

    Raises:
        RuntimeError: explaining that the variable must be set before FLA/Triton kernels are imported.
    """
    if not interpreter_enabled():
        raise RuntimeError(
            "TRITON_INTERPRET=1 must be set in the environment before FLA's kernels are imported; "
            "run interpreter cases in a fresh process"
        )


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
    """Apply both shims inside the block and undo them on exit.

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
