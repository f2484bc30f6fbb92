"""The forward pre-hook :func:`~fla_ac_isolation.isolate_seqlens` puts on a foreign mixer (:class:`OffsetsHook`).

Offsets are 1-D integer tensors (``[N + 1]`` ``cu_seqlens``) or NamedTuples holding them (torchtitan's
``VarlenMetadata``); "offsets-like" keywords are those named ``cu_*`` that hold such a value.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from fla_ac_isolation.local_seqlens import LocalSeqlens, fresh_copy
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["HOOK_ATTRIBUTE", "CallCounter", "HostOffsets", "OffsetsHook", "is_isolated", "is_offsets",
           "offsets_like_keywords", "refresh"]

HOOK_ATTRIBUTE = "_fla_ac_isolation_hook"
"""Where a hooked module keeps the ``RemovableHandle`` of its hook (in its ``__dict__``)."""

_CACHE_LIMIT = 8  # offsets objects whose host offsets and schedule are kept (one per live batch)


def is_isolated(module: nn.Module) -> bool:
    """``module`` carries a hook of :func:`~fla_ac_isolation.isolate_seqlens` (not removed)."""
    return HOOK_ATTRIBUTE in vars(module)


def is_offsets(value: Any) -> bool:
    """``value`` is a 1-D integer tensor (not bool): the shape of packed offsets."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point() \
        and not value.is_complex() and value.dtype != torch.bool


def _holds_offsets(value: Any) -> bool:
    if is_offsets(value):
        return True
    fields = getattr(value, "_fields", None) if isinstance(value, tuple) else None
    return bool(fields) and any(is_offsets(getattr(value, f)) for f in fields if f.startswith("cu_"))


def offsets_like_keywords(kwargs: dict) -> list[str]:
    """Sorted names of ``kwargs`` that start with ``cu_`` and hold offsets (or a NamedTuple of ``cu_*`` offsets)."""
    return sorted(k for k, v in kwargs.items() if k.startswith("cu_") and _holds_offsets(v))


def _fresh_offsets(t: torch.Tensor) -> torch.Tensor:
    """``fresh_copy(t)``, keeping ``torch.compile``'s dynamic-shape marking (OLMo-core marks ``cu_doc_lens``)."""
    fresh = fresh_copy(t)
    dynamic = getattr(t, "_dynamo_dynamic_indices", None)
    if dynamic:
        fresh._dynamo_dynamic_indices = set(dynamic)
    return fresh


def refresh(value: Any, name: str, where: str, memo: dict[int, torch.Tensor]) -> Any:
    """A fresh object for an offsets tensor, or a NamedTuple whose offsets tensors are fresh; ``None`` passes.

    ``memo`` keeps aliasing inside one call: an object passed twice gets one copy.

    Raises:
        TypeError: ``value`` is neither (e.g. a float tensor named by ``arg_names``).
    """
    if value is None:
        return None
    if is_offsets(value):
        if id(value) not in memo:
            memo[id(value)] = _fresh_offsets(value)
        return memo[id(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields") and hasattr(value, "_replace"):
        changes = {
            field: refresh(getattr(value, field), name, where, memo)
            for field in value._fields
            if is_offsets(getattr(value, field))
        }
        if changes:
            return value._replace(**changes)
    kind = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
        else type(value).__name__
    raise TypeError(
        f"isolate_seqlens: argument {name!r} of {where} is a {kind}; the arguments to isolate must be 1-D "
        "integer offsets tensors (cu_seqlens) or NamedTuples holding them"
    )


class HostOffsets:
    """Per handle: a validated :class:`LayerLocalSeqlens` per model-level offsets object (weakly keyed by
    identity, so a recompute finds what its forward built)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, LayerLocalSeqlens]] = {}

    @torch.compiler.disable
    def local(self, offsets: torch.Tensor, name: str, where: str) -> LocalSeqlens:
        """Fresh offsets, host offsets and chunk schedule for ``offsets`` (``name`` of ``where``, for errors).

        Raises:
            TypeError, ValueError: ``offsets`` fail :class:`LayerLocalSeqlens`'s checks.
        """
        entry = self._by_id.get(id(offsets))
        if entry is None or entry[0]() is not offsets:
            # invisible to SAC and the audit: the recompute finds the entry and runs none of these ops
            with _disable_current_modes(), torch.no_grad():
                try:
                    seqlens = LayerLocalSeqlens(offsets)
                except (TypeError, ValueError) as err:
                    raise type(err)(f"isolate_seqlens: {name} passed to {where} is not valid offsets: {err}") from err
            live = {k: v for k, v in self._by_id.items() if v[0]() is not None}
            self._by_id = dict(list(live.items())[-(_CACHE_LIMIT - 1):])
            entry = (weakref.ref(offsets), seqlens)
            self._by_id[id(offsets)] = entry
        return entry[1].local()


class CallCounter:
    """Calls whose offsets the hooks of one :class:`~fla_ac_isolation.isolate.IsolationHandle` rewrote."""

    def __init__(self) -> None:
        self.rewritten = 0


class OffsetsHook:
    """The forward pre-hook of one mixer: fresh offsets in, FLA's extra keywords added where accepted.

    Args:
        where: the mixer's path (for messages).
        module: the mixer (its ``forward`` signature places positional offsets arguments).
        names: the ``forward`` arguments carrying offsets (keyword or positional).
        fla_keywords: FLA keywords (``cu_seqlens_cpu``, ``chunk_indices``) to add next to ``names[0]``.
        host: the handle's :class:`HostOffsets`.
        counter: the handle's :class:`CallCounter`.
        registry_names: the registry's offsets names for the mixer's class, if known (for error messages).
    """

    def __init__(self, where: str, module: nn.Module, names: tuple[str, ...], fla_keywords: tuple[str, ...],
                 host: HostOffsets, counter: CallCounter, registry_names: tuple[str, ...] = ()) -> None:
        self.where = where
        self.cls = type(module).__name__
        self.names = names
        self.fla_keywords = fla_keywords
        self.host = host
        self.counter = counter
        self.registry_names = registry_names
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):  # a forward without a signature: keywords only
            params = []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.positions = {n: positional.index(n) for n in names if n in positional}  # args exclude self

    def _present(self, args: tuple, kwargs: dict) -> list[str]:
        return [n for n in self.names if kwargs.get(n) is not None
                or (n in self.positions and self.positions[n] < len(args) and args[self.positions[n]] is not None)]

    def _refuse(self, arrived: list[str]) -> None:
        head = (f"isolate_seqlens: {self.where} ({self.cls}) is hooked to refresh {list(self.names)}, but this call "
                f"passed none of them and passed the offsets-like keyword(s) {arrived}: ")
        if self.registry_names and tuple(self.registry_names) == tuple(self.names):
            # a known class hooked with its own names: the call's keyword is one FLA never reads for it
            raise ValueError(
                head + f"{self.cls} hands FLA its offsets only from {list(self.names)}, so FLA would never see "
                f"these and would run the packed documents as one sequence (they mix); fix the call: pass the "
                f"offsets as {self.names[0]}=..."
            )
        if self.registry_names:
            hint = (f"call isolate_seqlens(model) without arg_names: the registry knows {self.cls} and refreshes "
                    f"{list(self.registry_names)}")
        else:
            hint = (f"if {self.cls}.forward hands {arrived} to FLA, hook it with arg_names={arrived}; if it is a "
                    f"misspelling of {list(self.names)}, fix the call")
        raise ValueError(head + f"the shared offsets would reach FLA unchanged (the fault stays); {hint}")

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self._present(args, kwargs):
            arrived = offsets_like_keywords(kwargs)
            if arrived:
                self._refuse(arrived)
            return args, kwargs  # an unpacked call: nothing to refresh
        memo: dict[int, torch.Tensor] = {}
        first = self.names[0]
        if self.fla_keywords and is_offsets(kwargs.get(first)):
            local = self.host.local(kwargs[first], first, self.where)
            memo[id(kwargs[first])] = local.cu_seqlens
            extras = {"cu_seqlens_cpu": local.cu_seqlens_cpu, "chunk_indices": local.chunk_indices}
            for key in self.fla_keywords:
                if kwargs.get(key) is None and extras[key] is not None:
                    kwargs[key] = extras[key]
        for name in self.names:
            if name in kwargs:
                kwargs[name] = refresh(kwargs[name], name, self.where, memo)
            elif name in self.positions and self.positions[name] < len(args):
                i = self.positions[name]
                args = (*args[:i], refresh(args[i], name, self.where, memo), *args[i + 1:])
        self.counter.rewritten += 1
        return args, kwargs
