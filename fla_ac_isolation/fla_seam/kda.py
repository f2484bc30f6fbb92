"""What the library knows of FLA 0.6's Kimi Delta Attention (``fla/ops/kda/chunk.py``): its key-dim limit and its
index lookup. ``chunk_kda`` takes no ``chunk_indices``: it asks FLA's identity-cached helper itself, so callers pass
:meth:`~fla_ac_isolation.LayerLocalSeqlens.local`'s tensors.
"""

from __future__ import annotations

import torch

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE

__all__ = ["MAX_KEY_DIM", "prepare_kda_chunk_indices"]

MAX_KEY_DIM = 256
"""The largest key head dim ``K`` FLA 0.6's ``chunk_kda`` accepts (it asserts ``K <= 256``)."""


def prepare_kda_chunk_indices(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """FLA's cached ``prepare_chunk_indices`` (``[NT, 2]`` rows on the device of ``cu_seqlens``) called by keyword,
    as ``ChunkKDAFunction.forward`` does: FLA's cache matches keyword sets, so the conv's positional entry is not
    reused."""
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)
