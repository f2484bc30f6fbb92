"""torch's checkpoint internals (``torch/utils/checkpoint.py``), per release: the one place that knows which
generator every non-reentrant checkpoint runs through (``_LAYOUTS``: torch 2.11 to 2.15; on 2.14+ the old name
is an unused shim) and how to see a reentrant one (``CheckpointFunction.forward``, wrapped to report each run).
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
    """The installed torch's checkpoint internals are unknown to the audit (the message names the version)."""


@dataclass(frozen=True)
class CheckpointInternals:
    """How this torch runs a checkpoint: ``generator`` (its name in ``torch.utils.checkpoint``), its ``signature``,
    and ``caller``, the function that calls it (``"_checkpoint_impl"`` on torch 2.14+)."""

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

    Raises:
        UnsupportedTorchCheckpointError: no known generator is what ``checkpoint`` calls with the known
            parameters, or ``CheckpointFunction.forward`` has another signature (naming ``torch.__version__``).
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
    """``torch.utils.checkpoint`` and the composable checkpoint's module (imported now, never first while patched)."""
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
    """Inside the block, route every checkpoint through the two callbacks; yields the internals intercepted.

    Args:
        on_non_reentrant: ``on_non_reentrant(fn, context_fn, debug)`` as each non-reentrant checkpoint starts
            (``debug``: torch's debug mode, which takes no ``context_fn``, is on); returns the ``context_fn`` to use.
        on_reentrant: ``on_reentrant(run_function)`` as each reentrant checkpoint's forward starts.

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
