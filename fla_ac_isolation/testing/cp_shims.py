"""Test-only shims that let FLA 0.6's context-parallel (CP) kernels run on a CPU under Triton's interpreter and gloo.

Test support only: library code never imports this module. Use together with
:func:`~fla_ac_isolation.testing.triton_interpret.interpreter_shims` (first autotune config, loop-variable
``.to()``), or enter :func:`cpu_cp_harness`, which does both (the regression's ``rank_setup`` on CPU)::

    # TRITON_INTERPRET=1 set before FLA is imported, gloo process group initialised
    with cpu_cp_harness():
        seqlens = LayerLocalSeqlens(cu_seqlens, cp=CPConfig(group=group, layout="zigzag", conv_kernel_size=4))
        ...

Three shims, each undone on exit (measured with fla-core 0.6.0, Triton 3.9, torch 2.13):

1. ``device_check``: FLA's ``_check_cp_device`` (``fla/ops/cp/context.py``) accepts only CUDA (Ampere+) or NPU
   devices. It is imported *by name* into ``fla.ops.cp.chunk_delta_h``, ``chunk_merge``, ``chunk_fwd`` and
   ``chunk_bwd`` (and ``fla.ops.common.intracard_cp``), so each module's binding is replaced with a no-op.
2. ``all_gather``: FLA's ``fla.ops.cp.comm.all_gather_into_tensor`` allocates its output as ``[world, *shape]``
   and gloo refuses that ("ProcessGroupGloo::allgather: invalid tensor size ..."). The replacement gathers into
   the concatenated ``[world * shape[0], *shape[1:]]`` buffer (same memory) and returns its ``[world, *shape]``
   view, so callers see what FLA's function returns. Rebound in ``fla.ops.cp.comm``, ``fla.ops.cp``,
   ``fla.ops.cp.chunk_delta_h`` and ``fla.modules.causal_conv1d.cp`` (the modules that hold the name).
3. ``comparison_dtype``: Triton's interpreter (3.9) labels the result of ``create_icmp*``/``create_fcmp*`` with
   the *operand* dtype instead of ``int1``; FLA's conv ``compute_dh0_kernel`` (run on non-first CP ranks) then
   fails with "mask has unsupported dtype". The replacement relabels comparison results as ``tl.int1``.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator

__all__ = ["cpu_cp_harness", "fla_cp_cpu_shims"]

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
    "fla.modules.causal_conv1d.cp",
)


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
                raise RuntimeError(f"FLA changed: {name} has no {attr}; revisit the CP test shims")
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
def fla_cp_cpu_shims(
    *, device_check: bool = True, all_gather: bool = True, comparison_dtype: bool = True
) -> Iterator[None]:
    """Apply the three CP-on-CPU shims inside the block (each can be switched off to show why it exists).

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set, or FLA/Triton no longer has what a shim replaces.
    """
    from fla_ac_isolation.testing.triton_interpret import require_interpreter

    require_interpreter()
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
def cpu_cp_harness() -> Iterator[None]:
    """What a CPU rank of a CP test or regression enters: the interpreter shims and the three CP shims.

    Also silences the ``FutureWarning`` torch 2.13 emits for every FLA CP all-gather
    (``dist.all_gather_into_tensor`` is deprecated there) and numpy's ``RuntimeWarning`` s from the
    interpreter (``overflow encountered in exp2``, ``invalid value encountered in multiply``: FLA's kernels
    compute ``exp`` in masked-out lanes and discard them with ``tl.where``, silently on a GPU). Used as the
    regression's ``rank_setup``
    (``"fla_ac_isolation.testing.cp_shims:cpu_cp_harness"``) with ``TRITON_INTERPRET=1`` in the rank's
    environment.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is not set (it must be, before FLA's kernels are imported).
    """
    import warnings

    from fla_ac_isolation.testing.triton_interpret import interpreter_shims

    with warnings.catch_warnings(), interpreter_shims(), fla_cp_cpu_shims():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        yield
