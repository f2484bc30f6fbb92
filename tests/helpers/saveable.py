"""The saveable ops (FLA's calls as custom operators) under SAC: which operators ran in each pass with the cache
events inside them (:class:`OpRecorder`), a recorded step, and what a policy saved (SAC's own storage)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fla_ac_isolation.harness.environment import sac_replay_semantics
from fla_ac_isolation.policies import sac_context_fn


def saveable_op_names() -> dict[Any, str]:
    """``{forward overload: operation name}`` for both backends (``ops.SAVEABLE_OPS`` inverted)."""
    from fla_ac_isolation.ops import SAVEABLE_OPS

    return {overload: name for name, overloads in SAVEABLE_OPS.items() for overload in overloads}


class OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the calls of the saveable custom operators and the FLA cache events made inside each.

    Enter it around a forward or a backward (inside ``probe_tensor_cache()`` as ``probe``). Under SAC the
    checkpoint's own dispatch mode sits above this one, so an op whose output SAC saved never reaches it in
    the recompute. ``forward_calls[name]``/``forward_events[name]``: calls of operation ``name``'s forward
    operator (in a backward pass: its recompute) and the cache events made inside them;
    ``backward_calls[name]``: calls of its backward operator; ``outside``: cache events made outside any of
    these operators; ``in_backward_op``: true while a backward operator runs (to attribute other events).
    """

    def __init__(self, probe: Any) -> None:
        super().__init__()
        self.probe = probe
        self.names = saveable_op_names()
        self.forward_calls: dict[str, int] = {}
        self.forward_events: dict[str, list] = {}
        self.backward_calls: dict[str, int] = {}
        self.in_backward_op = False
        self._inside: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema.name
        if not schema.startswith("fla_ac_isolation::"):
            return func(*args, **kwargs)
        start = self.probe.mark()
        self.in_backward_op = func not in self.names
        try:
            out = func(*args, **kwargs)
        finally:
            self.in_backward_op = False
        self._inside.append((start, self.probe.mark()))
        if func in self.names:
            name = self.names[func]
            self.forward_calls[name] = self.forward_calls.get(name, 0) + 1
            self.forward_events.setdefault(name, []).extend(self.probe.events[start:])
        else:
            name = next(n for f, n in self.names.items() if schema == f._schema.name + "_backward")
            self.backward_calls[name] = self.backward_calls.get(name, 0) + 1
        return out

    @property
    def outside(self) -> list:
        inside = {i for start, end in self._inside for i in range(start, end)}
        return [e for i, e in enumerate(self.probe.events) if i not in inside]


@dataclass
class RecordedStep:
    """One forward + backward of a stack: the numbers, and what the saveable ops did in each pass."""

    loss: torch.Tensor
    dx: torch.Tensor
    grads: dict[str, torch.Tensor]
    forward: OpRecorder
    backward: OpRecorder


def recorded_step(layers: nn.ModuleList, x: torch.Tensor, seqlens: Any) -> RecordedStep:
    """``loss_and_grads`` (:mod:`helpers.mixers`) with an :class:`OpRecorder` (and a cache probe) around the forward and the backward."""
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache, probe_tensor_cache

    clear_tensor_cache()
    h = x.clone().requires_grad_()
    with probe_tensor_cache() as probe, OpRecorder(probe) as forward:
        out = h
        for layer in layers:
            out = layer(out, seqlens)
        loss = out.float().pow(2).mean()
    with probe_tensor_cache() as probe, OpRecorder(probe) as backward:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in layers.named_parameters()}
    return RecordedStep(loss.detach(), h.grad, grads, forward, backward)


def assert_bit_equal(got: Any, want: Any) -> None:
    """Loss, input gradient and every parameter gradient of two steps are equal bit for bit."""
    assert torch.equal(got.loss, want.loss), (got.loss, want.loss)
    assert torch.equal(got.dx, want.dx)
    assert got.grads.keys() == want.grads.keys()
    for name, grad in want.grads.items():
        assert torch.equal(got.grads[name], grad), name


# ============================================================ SAC storage (what a policy saved)
def sac_forward_storages(policy: Any, run: Callable[[Callable], Any]) -> list[dict]:
    """SAC's storage (``{op: {invocation index: saved outputs or a recompute marker}}``) of every
    checkpointed region that ``run(context_fn)`` runs forward with ``context_fn = sac_context_fn(policy)``,
    in region order; read it before any backward consumes it."""
    storages = []

    def context_fn():
        forward_ctx, recompute_ctx = sac_context_fn(policy)()
        storages.append(forward_ctx.storage)
        return forward_ctx, recompute_ctx

    run(context_fn)
    return storages


def saved_indices(storage: dict, op: Any) -> list[int]:
    """Invocation indices of ``op`` whose outputs SAC saved in one region's ``storage``."""
    return sorted(i for i, entry in storage.get(op, {}).items() if _saved(entry))


def _saved(entry: Any) -> bool:
    first = entry[0] if isinstance(entry, (tuple, list)) else entry
    return hasattr(first, "val")


def sac_storage_bytes(policy: Any, run: Callable[[Callable], Any]) -> dict[str, int]:
    """Bytes SAC holds after a checkpointed forward, per op name: what ``policy`` saved, read from SAC's storage.

    See :func:`sac_forward_storages` for ``run``. Each tensor storage is counted once, whole (a saved view
    keeps its base alive).
    """
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for storage in sac_forward_storages(policy, run):
        for func, entries in storage.items():
            # (op, index) replay (torch >= 2.13): {invocation index: entry}; per-op FIFO (2.11): a list queue
            by_op = entries.values() if sac_replay_semantics() == "(op, index)" else entries
            for entry in by_op:
                for wrapped in (entry if isinstance(entry, (tuple, list)) else [entry]):
                    value = getattr(wrapped, "val", None)
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                        seen.add(value.untyped_storage().data_ptr())
                        name = func._schema.name.split("::")[-1]
                        sizes[name] = sizes.get(name, 0) + value.untyped_storage().nbytes()
    return sizes
