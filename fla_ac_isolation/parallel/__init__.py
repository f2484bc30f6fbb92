"""Context parallelism (CP): FLA's CP layouts for packed batches, isolated per layer under AC.

Public names:

* :class:`CPConfig` - the CP process group, FLA's layout (``contiguous`` | ``zigzag``) and the model's
  conv width; handed to :class:`~fla_ac_isolation.LayerLocalSeqlens` as ``cp=`` with the GLOBAL offsets.
* :func:`shard_packed_batch` / :class:`CPShard`, :func:`cp_token_index`, :func:`unshard`,
  :func:`gather_unshard` - cut a packed batch across CP ranks as FLA expects, and put tensors back.
* :func:`sequence_to_heads`, :func:`heads_to_sequence` - head-parallel CP for mixers without FLA CP kernels
  (Nemotron-H's Mamba2).
* :class:`ParallelMesh` - a run's parallel degrees (dp, ep, cp, pp), validated once: world size, rank
  coordinates and torch's ``DeviceMesh`` come from it.

Collectives are torch's (``torch.distributed`` and its functional collectives, with autograd); CP
kernels and metadata are FLA's (through :mod:`fla_ac_isolation.fla_seam.cp`). See ``docs/context-parallel.md``.
"""

from fla_ac_isolation.parallel.config import LAYOUTS, CPConfig
from fla_ac_isolation.parallel.head_parallel import heads_to_sequence, sequence_to_heads
from fla_ac_isolation.parallel.mesh import ParallelMesh
from fla_ac_isolation.parallel.sharding import CPShard, cp_token_index, gather_unshard, shard_packed_batch, unshard

__all__ = [
    "LAYOUTS",
    "CPConfig",
    "CPShard",
    "ParallelMesh",
    "cp_token_index",
    "gather_unshard",
    "heads_to_sequence",
    "sequence_to_heads",
    "shard_packed_batch",
    "unshard",
]
