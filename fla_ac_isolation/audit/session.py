"""The state one :class:`~fla_ac_isolation.ReplayAudit` shares with its pass recorders (which read nothing else)."""

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
        on_divergence: ``"raise"``, ``"warn"`` or ``"record"``.
        namer: names regions and the module running at a divergent op.
        ignored: ops neither SAC nor the audit counts.
        probe: FLA's cache probe while the ``with`` block is active, else ``None``.
        regions: every region whose forward was recorded, in forward order (index = position).
        unaudited: checkpointed regions that could not be looked into.
        running: the regions whose forward or recompute is running now, outermost first (a checkpoint inside
            a checkpoint runs its forward inside the outer one's forward, and again inside its recompute).
    """

    on_divergence: OnDivergence
    namer: RegionNamer
    ignored: frozenset
    probe: Any = None
    regions: list[Region] = field(default_factory=list)
    unaudited: list[UnauditedRegion] = field(default_factory=list)
    running: list[Region] = field(default_factory=list)

    def probe_events(self) -> list[CacheEvent] | None:
        """The live event list of the active FLA cache probe, or ``None`` (no shared probe: no FLA telemetry)."""
        return None if self.probe is None else self.probe.events

    def add_region(self, region: Region, label_from: Any) -> None:
        """Number, name (if unnamed), tag and keep ``region``, whose forward just started inside the forward or
        recompute of the innermost region running (:attr:`Region.outer`), if any."""
        index = len(self.regions)
        label = region.label if region.label is not None else self.namer.label_for(label_from, index)
        region.label = self.namer.tagged(label)
        region.index = index
        region.outer = self.running[-1].index if self.running else None
        self.regions.append(region)

    def pass_ended(self, region: Region) -> None:
        """A pass of ``region`` ended (it ran, or raised): it no longer holds the regions that start."""
        self.running = [r for r in self.running if r is not region]
