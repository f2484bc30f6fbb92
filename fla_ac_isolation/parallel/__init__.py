"""Context and pipeline parallelism (CP, PP): packed batches cut for them, isolated per layer under AC.

Public names:

* :class:`CPConfig` - the CP process group, FLA's layout (``contiguous`` | ``zigzag``) and the model's
  conv width; handed to :class:`~fla_ac_isolation.LayerLocalSeqlens` as ``cp=`` with the GLOBAL offsets.
* :func:`shard_packed_batch` / :class:`CPShard`, :func:`cp_token_index`, :func:`unshard`,
  :func:`gather_unshard` - cut a packed batch across CP ranks as FLA expects, and put tensors back.
* :func:`sequence_to_heads`, :func:`heads_to_sequence` - head-parallel CP for mixers without FLA CP kernels
  (Nemotron-H's Mamba2).
* :class:`ParallelMesh` - a run's parallel degrees (dp, ep, cp, pp), validated once: world size, rank
  coordinates and torch's ``DeviceMesh`` come from it.
* :func:`split_packed_microbatches` / :class:`PackedMicrobatches` - a packed batch cut into microbatches of
  whole documents and one token count, each with its own offsets (pipeline parallelism, gradient accumulation).
* :data:`SCHEDULES`, :func:`check_schedule`, :func:`stage_indices`, :func:`build_schedule`,
  :func:`microbatch_seqlens` - torch's pipeline schedules as this package runs them, and the per-microbatch
  ``LayerLocalSeqlens`` a stage builds from its offsets row; :class:`StageRegionTags` - the audit's region tags
  (stage, microbatch, shape-inference pass).

Collectives are torch's (``torch.distributed`` and its functional collectives, with autograd); CP
kernels and metadata are FLA's (through :mod:`fla_ac_isolation.fla_seam.cp`); pipeline stages and schedules are
``torch.distributed.pipelining``'s. See ``docs/context-parallel.md`` and ``docs/pipeline-parallel.md``.
"""

from fla_ac_isolation.parallel.config import LAYOUTS, CPConfig
from fla_ac_isolation.parallel.head_parallel import heads_to_sequence, sequence_to_heads
from fla_ac_isolation.parallel.mesh import ParallelMesh
from fla_ac_isolation.parallel.microbatch import PackedMicrobatches, split_packed_microbatches
from fla_ac_isolation.parallel.pipeline import (
    SCHEDULES,
    PipelineSchedule,
    build_schedule,
    check_schedule,
    microbatch_seqlens,
    stage_indices,
)
from fla_ac_isolation.parallel.sharding import CPShard, cp_token_index, gather_unshard, shard_packed_batch, unshard
from fla_ac_isolation.parallel.stage_tags import StageRegionTags

__all__ = [
    "LAYOUTS",
    "SCHEDULES",
    "CPConfig",
    "CPShard",
    "PackedMicrobatches",
    "ParallelMesh",
    "PipelineSchedule",
    "StageRegionTags",
    "build_schedule",
    "check_schedule",
    "cp_token_index",
    "gather_unshard",
    "heads_to_sequence",
    "microbatch_seqlens",
    "sequence_to_heads",
    "shard_packed_batch",
    "split_packed_microbatches",
    "stage_indices",
    "unshard",
]
