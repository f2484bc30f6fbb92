"""What one :class:`~fla_ac_isolation.ReplayAudit` hands its pass recorders: an explicit session object.

The audit owns the session; each :class:`~fla_ac_isolation.audit.recorder.PassRecorder` receives it and
reads nothing else of the audit. The session holds the divergence mode, the ops SAC ignores, the region
namer, the FLA cache probe of the active ``with`` block (``None`` outside one), the regions recorded so far and
the checkpointed regions it could not look into.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from fla_ac_isolation.audit.labels import RegionNamer
    from fla_ac_isolation.audit.records import CacheEvent, Region, UnauditedRegion

__all__ = ["AuditSession", "OnDivergence"]

OnDivergence = Literal["raise", "warn", "record"]


@dataclass
class AuditSession:
    """The state one audit shares with the recorders of its checkpointed regions.

    Attributes:
        on_divergence: ``"raise"``, ``"warn"`` or ``"record"`` (see :class:`~fla_ac_isolation.ReplayAudit`).
        namer: names regions and the module running at a divergent op.
        ignored: ops neither SAC nor the audit counts (:func:`~fla_ac_isolation.audit.records.ignored_ops`).
        probe: FLA's cache probe while the audit's ``with`` block is active (its ``events`` list), else ``None``.
        regions: every region whose forward was recorded, in forward order (index = position).
        unaudited: every checkpointed region that ran but could not be looked into (reentrant, debug mode).
    """

    on_divergence: OnDivergence
    namer: RegionNamer
    ignored: frozenset
    probe: Any = None
    regions: list[Region] = field(default_factory=list)
    unaudited: list[UnauditedRegion] = field(default_factory=list)

    def probe_events(self) -> list[CacheEvent] | None:
        """The live event list of the active FLA cache probe, or ``None`` (no shared probe: no FLA telemetry)."""
        return None if self.probe is None else self.probe.events

    def add_region(self, region: Region, label_from: Any) -> None:
        """Number ``region`` (its forward just started), name it if unnamed, put the region tag in front of its
        label (:meth:`RegionNamer.tagged <fla_ac_isolation.audit.labels.RegionNamer.tagged>`), and keep it."""
        index = len(self.regions)
        label = region.label if region.label is not None else self.namer.label_for(label_from, index)
        region.label = self.namer.tagged(label)
        region.index = index
        self.regions.append(region)
