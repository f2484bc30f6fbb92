"""Context and pipeline parallelism (CP, PP): packed batches cut for them, isolated per layer under AC
(:class:`CPSeqlens`), and the mixers' CP paths (``gdn_cp``, ``mamba2_cp``, imported when a ``CPSeqlens`` arrives).

Collectives are ``torch.distributed``'s, CP kernels FLA's, pipelining ``torch.distributed.pipelining``'s
(``docs/context-parallel.md``, ``docs/pipeline-parallel.md``).
"""

from fla_ac_isolation.parallel.config import LAYOUTS, CPConfig
from fla_ac_isolation.parallel.head_parallel import heads_to_sequence, sequence_to_heads
from fla_ac_isolation.parallel.microbatch import PackedMicrobatches, split_packed_microbatches
from fla_ac_isolation.parallel.pipeline import microbatch_seqlens
from fla_ac_isolation.parallel.seqlens_cp import CPSeqlens
from fla_ac_isolation.parallel.sharding import CPShard, cp_token_index, gather_unshard, shard_packed_batch, unshard
from fla_ac_isolation.parallel.stage_tags import StageRegionTags

__all__ = [
    "LAYOUTS",
    "CPConfig",
    "CPSeqlens",
    "CPShard",
    "PackedMicrobatches",
    "StageRegionTags",
    "cp_token_index",
    "gather_unshard",
    "heads_to_sequence",
    "microbatch_seqlens",
    "sequence_to_heads",
    "shard_packed_batch",
    "split_packed_microbatches",
    "unshard",
]
