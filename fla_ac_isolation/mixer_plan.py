"""What each FLA-backed module of a model is (:func:`classify`): the plan
:func:`~fla_ac_isolation.isolate_seqlens` hooks and warns from, and ``fla-ac-isolation check`` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fla_ac_isolation.foreign_classes import LeakingMixer, UpstreamMixer, drop_in_name, foreign_mixer, is_drop_in
from fla_ac_isolation.offsets_hook import is_isolated

__all__ = ["DROP_IN", "EXPOSED", "HOOKED", "LEAKING", "STATUSES", "PlannedMixer", "classify"]

EXPOSED, HOOKED, DROP_IN, LEAKING = "exposed", "hooked", "drop-in", "leaking"
STATUSES: tuple[str, ...] = (EXPOSED, HOOKED, DROP_IN, LEAKING)
"""Every status a :class:`PlannedMixer` can have: ``"exposed"`` (hands FLA the shared offsets: to hook),
``"hooked"`` (carries ``isolate_seqlens``'s hook), ``"drop-in"`` (one of our mixers), ``"leaking"`` (drops the
offsets, which no isolation fixes)."""


@dataclass(frozen=True)
class PlannedMixer:
    """One FLA-backed module of a model, as :func:`classify` found it.

    Attributes:
        path: its path in the model (``"model.layers.0.linear_attn"``; ``""``: the model itself).
        cls: its class, ``"module.Class"`` (for a foreign class, the registry's class it matched).
        status: one of :data:`STATUSES`.
        entry: the registry's entry for the class; ``None`` for a drop-in.
        matched: the class of the module's hierarchy the entry matched (the drop-in's class for a drop-in).
        module: the module itself (not compared).
    """

    path: str
    cls: str
    status: str
    entry: UpstreamMixer | LeakingMixer | None
    matched: type
    module: nn.Module = field(compare=False, repr=False)

    @property
    def covered(self) -> bool:
        """Its offsets are fresh per call already: hooked, or a drop-in."""
        return self.status in (HOOKED, DROP_IN)

    @property
    def swappable(self) -> bool:
        """:func:`~fla_ac_isolation.swap_mixers` has a drop-in for its class."""
        return self.entry is not None and drop_in_name(self.entry) is not None


def classify(model: nn.Module) -> tuple[PlannedMixer, ...]:
    """The plan of ``model``: every module of a known FLA-backed class or of our drop-ins, in ``named_modules()``
    order (modules of no known class are left out).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sources: dict = {}
    plan = []
    for path, module in model.named_modules():
        cls = type(module)
        if is_drop_in(cls):
            plan.append(PlannedMixer(path, f"{cls.__module__}.{cls.__qualname__}", DROP_IN, None, cls, module))
            continue
        found = foreign_mixer(module, sources)
        if found is None:
            continue
        entry, matched = found
        if isinstance(entry, LeakingMixer):
            status = LEAKING
        elif entry.offsets:
            status = HOOKED if is_isolated(module) else EXPOSED
        else:  # hands FLA no offsets: nothing to isolate, nothing known to leak
            continue
        plan.append(PlannedMixer(path, entry.qualified, status, entry, matched, module))
    return tuple(plan)
