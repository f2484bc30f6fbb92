"""ReplayAudit: name the first op where a checkpointed region's recompute diverges from its forward. It records
each op's overload and output shape/dtype/device (never a tensor) and FLA's cache events per region and pass,
compares them op by op, and never changes results. Guide: ``docs/audit.md``.
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
