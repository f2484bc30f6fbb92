"""ReplayAudit: name the first op where a checkpointed region's recompute diverges from its forward.

SAC hands the recompute the outputs saved in forward by op and invocation index (torch >= 2.13) or from one
FIFO queue per op (torch 2.11); both assume the recompute runs the forward's aten ops in order. State that
changes in between (FLA's identity-keyed ``tensor_cache``, a memoised mask) breaks that, and SAC replays
saved tensors into the wrong ops. :class:`ReplayAudit` records, per region and pass, each op's overload and
its outputs' shape, dtype and device (never a tensor; ops SAC ignores are ignored), compares them op by op,
and slices FLA's cache-probe events per region so a divergence names the index helper whose cache state
differed. Recording never changes results. ``docs/audit.md`` is the guide.

Seen: every aten op of eager regions, early-stopped recomputes (compared as prefixes), later recomputes
(``retain_graph=True``); in compiled code inside a region, the ops SAC sees (``ignore_compile_internals``:
dispatcher ops, not fused ones). Not seen: checkpoint calls traced into a compiled graph; reentrant and
debug-mode checkpoints, which are reported (:class:`UnauditedCheckpointWarning`,
:attr:`ReplayAudit.unaudited`, verdict ``"blind"``), never counted clean. On a torch whose checkpoint
internals :mod:`~fla_ac_isolation.audit.torch_checkpoint` does not know, entering raises
:class:`UnsupportedTorchCheckpointError`.

Modes (``on_divergence``): ``"raise"`` raises :class:`ReplayDivergenceError` from ``backward()`` at the first
divergent op, before it runs (so before SAC replays a wrong tensor); ``"warn"`` emits a
:class:`ReplayDivergenceWarning` once per divergent recompute; ``"record"`` stays silent (read
:attr:`ReplayAudit.regions`, :meth:`ReplayAudit.summary`).
"""

from fla_ac_isolation.audit.recorder import ReplayDivergenceError, ReplayDivergenceWarning
from fla_ac_isolation.audit.records import CacheDifference, UnauditedRegion
from fla_ac_isolation.audit.replay_audit import ReplayAudit, UnauditedCheckpointWarning
from fla_ac_isolation.audit.report import RegionReport
from fla_ac_isolation.audit.session import OnDivergence
from fla_ac_isolation.audit.torch_checkpoint import UnsupportedTorchCheckpointError

__all__ = [
    "CacheDifference",
    "OnDivergence",
    "RegionReport",
    "ReplayAudit",
    "ReplayDivergenceError",
    "ReplayDivergenceWarning",
    "UnauditedCheckpointWarning",
    "UnauditedRegion",
    "UnsupportedTorchCheckpointError",
]
