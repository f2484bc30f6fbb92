"""torch's checkpoint internals, per torch release: the one place that knows which function a non-reentrant
checkpoint runs through and how to see a reentrant one.

Non-reentrant checkpoints (``use_reentrant=False``) all run through one generator of ``torch.utils.checkpoint``,
called with the checkpointed callable and its ``context_fn``:

* torch 2.11 to 2.13: ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state, context_fn,
  determinism_check, debug, early_stop, *args, **kwargs)``, called by ``checkpoint``;
* torch 2.14 and 2.15: ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, preserve_rng_state,
  context_fn, determinism_check, debug, early_stop, respect_saved_tensors_hooks)``, called by
  ``_checkpoint_impl`` (which ``checkpoint`` and its curried form call). The old name is still there, a
  compatibility shim that no in-tree caller uses: intercepting it alone sees nothing.

Every way users checkpoint reaches that generator: ``checkpoint`` itself (also when imported or bound in a
``functools.partial`` earlier, since ``checkpoint`` looks the generator up when it runs), torch's
``checkpoint_wrapper`` (torchtitan's ``apply_ac``), transformers' ``gradient_checkpointing_enable``,
``checkpoint_sequential``; the composable ``torch.distributed._composable.checkpoint`` imported the generator
into its own module, so it is intercepted there too.

Which generator this torch uses is found by looking (:func:`checkpoint_internals`): the name that
``checkpoint``'s code (or ``_checkpoint_impl``'s) calls, with the parameters listed above. A torch where
neither layout is found raises :class:`UnsupportedTorchCheckpointError` naming ``torch.__version__`` and what was
missing: the audit refuses to start rather than see nothing.

Reentrant checkpoints (``use_reentrant=True``) run ``CheckpointFunction.forward(ctx, run_function,
preserve_rng_state, *args)`` (same on every release above); the audit cannot look into them (the recompute
runs inside autograd's backward of that function, with no ``context_fn``), so :func:`intercept_checkpoints`
wraps that ``forward`` on the class itself, which also sees a ``CheckpointFunction.apply`` called directly,
and reports each run.

Upstream: ``torch/utils/checkpoint.py`` and ``torch/distributed/_composable/checkpoint_activation.py`` of each
release.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CheckpointInternals", "UnsupportedTorchCheckpointError", "checkpoint_internals", "intercept_checkpoints"]

_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"

# The generator layouts this module knows, newest first: (name, parameter names, torch releases seen in).
_LAYOUTS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("_checkpoint_without_reentrant_generator_impl",
     ("fn", "args", "kwargs", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
      "respect_saved_tensors_hooks"), "torch 2.14, 2.15"),
    ("_checkpoint_without_reentrant_generator",
     ("fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop", "args", "kwargs"),
     "torch 2.11, 2.13"),
)
_REENTRANT_FORWARD = ("ctx", "run_function", "preserve_rng_state", "args")


class UnsupportedTorchCheckpointError(RuntimeError):
    """The installed torch's checkpoint internals are not ones this package knows how to audit; the message
    names ``torch.__version__`` and what was not found."""


@dataclass(frozen=True)
class CheckpointInternals:
    """How this torch runs a checkpoint.

    Attributes:
        torch_version: ``torch.__version__``.
        generator: the name, in ``torch.utils.checkpoint``, of the generator every non-reentrant checkpoint runs
            through (``"_checkpoint_without_reentrant_generator_impl"`` on torch 2.14 and 2.15).
        signature: its signature (bound to find ``fn``, ``context_fn`` and ``debug`` of each call).
        caller: the function of ``torch.utils.checkpoint`` whose code calls it (``"_checkpoint_impl"``).
    """

    torch_version: str
    generator: str
    signature: inspect.Signature
    caller: str


def _parameter_names(fn: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _code_names(fn: Any) -> tuple[str, ...]:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return () if code is None else code.co_names


def checkpoint_internals() -> CheckpointInternals:
    """Find the non-reentrant generator and the reentrant ``CheckpointFunction`` of the installed torch.

    Returns:
        The :class:`CheckpointInternals` found.

    Raises:
        UnsupportedTorchCheckpointError: neither known generator is what ``checkpoint`` calls with the known parameters,
            or ``CheckpointFunction.forward`` does not take ``(ctx, run_function, preserve_rng_state, *args)``
            (the message names ``torch.__version__`` and what was looked for).
    """
    import torch.utils.checkpoint as cp

    caller_name = "_checkpoint_impl" if callable(getattr(cp, "_checkpoint_impl", None)) else "checkpoint"
    called = _code_names(getattr(cp, caller_name, None))
    found = None
    for name, params, _ in _LAYOUTS:
        fn = getattr(cp, name, None)
        if fn is not None and name in called and _parameter_names(fn) == params:
            found = (name, inspect.signature(fn))
            break
    if found is None:
        known = "; ".join(f"{name}({', '.join(params)}) ({seen})" for name, params, seen in _LAYOUTS)
        present = [name for name, _, _ in _LAYOUTS if hasattr(cp, name)]
        raise UnsupportedTorchCheckpointError(
            f"ReplayAudit does not know the checkpoint internals of torch {torch.__version__}: "
            f"torch.utils.checkpoint.{caller_name} calls none of the non-reentrant generators it knows with their "
            f"known parameters ({known}); present here: {', '.join(present) or 'neither'}. Auditing would record "
            f"no region, so it refuses; use a torch from 2.11 to 2.15"
        )
    function = getattr(cp, "CheckpointFunction", None)
    forward = getattr(function, "forward", None)
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)
            and _parameter_names(forward) == _REENTRANT_FORWARD):
        raise UnsupportedTorchCheckpointError(
            f"ReplayAudit does not know the checkpoint internals of torch {torch.__version__}: "
            f"torch.utils.checkpoint.CheckpointFunction.forward({', '.join(_REENTRANT_FORWARD)}) was not found, so "
            f"a reentrant checkpoint could not be reported; use a torch from 2.11 to 2.15"
        )
    return CheckpointInternals(torch.__version__, found[0], found[1], caller_name)


def _holders(generator: str) -> list[Any]:
    """The modules holding the generator under its own name: ``torch.utils.checkpoint`` and the composable
    checkpoint's module (imported here, cheaply, so that it is never first imported while patched)."""
    import torch.utils.checkpoint as cp

    out = [cp]
    if torch.distributed.is_available():
        with contextlib.suppress(ImportError):
            composable = importlib.import_module(_COMPOSABLE)
            if getattr(composable, generator, None) is getattr(cp, generator):
                out.append(composable)
    return out


@contextlib.contextmanager
def intercept_checkpoints(
    on_non_reentrant: Callable[[Any, Callable[[], Any], bool], Callable[[], Any]],
    on_reentrant: Callable[[Any], None],
) -> Iterator[CheckpointInternals]:
    """Inside the block, route every checkpoint through the two callbacks.

    Args:
        on_non_reentrant: called as ``on_non_reentrant(fn, context_fn, debug)`` as each non-reentrant checkpoint
            starts (``fn``: the checkpointed callable; ``debug``: torch's debug mode is on for it, by argument or
            ``set_checkpoint_debug_enabled``, in which torch takes no ``context_fn``); returns the ``context_fn``
            the checkpoint runs with.
        on_reentrant: called as ``on_reentrant(run_function)`` as each reentrant checkpoint's forward starts.

    Yields:
        The :class:`CheckpointInternals` intercepted.

    Raises:
        UnsupportedTorchCheckpointError: on entry, from :func:`checkpoint_internals`.
    """
    import torch.utils.checkpoint as cp

    internals = checkpoint_internals()
    original = getattr(cp, internals.generator)
    signature = internals.signature

    def audited_generator(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        global_debug = getattr(cp, "_checkpoint_debug_enabled", None)
        debug = bool(global_debug if global_debug is not None else bound.arguments["debug"])
        bound.arguments["context_fn"] = on_non_reentrant(bound.arguments["fn"], bound.arguments["context_fn"], debug)
        return original(*bound.args, **bound.kwargs)

    function = cp.CheckpointFunction
    original_forward = function.__dict__["forward"]
    forward = function.forward

    def audited_forward(ctx, run_function, preserve_rng_state, *args):
        on_reentrant(run_function)
        return forward(ctx, run_function, preserve_rng_state, *args)

    holders = _holders(internals.generator)
    for holder in holders:
        setattr(holder, internals.generator, audited_generator)
    function.forward = staticmethod(audited_forward)
    try:
        yield internals
    finally:
        function.forward = original_forward
        for holder in holders:
            setattr(holder, internals.generator, original)
