"""What the library knows of FLA's Kimi Delta Attention (``fla/ops/kda/``): 0.6's key-dim limit, its index lookup
and FLA's reference recurrence. ``chunk_kda`` takes no ``chunk_indices``: it asks FLA's identity-cached helper
itself, so callers pass :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`'s tensors.
"""

from __future__ import annotations

import torch

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE

__all__ = ["MAX_KEY_DIM", "naive_recurrent_kda", "prepare_kda_chunk_indices"]

MAX_KEY_DIM = 256
"""The largest key head dim ``K`` FLA 0.6's ``chunk_kda`` accepts (it asserts ``K <= 256``)."""


def prepare_kda_chunk_indices(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """FLA's cached ``prepare_chunk_indices`` (``[NT, 2]`` rows on the device of ``cu_seqlens``) called by keyword,
    as ``ChunkKDAFunction.forward`` does: FLA's cache matches keyword sets, so the conv's positional entry is not
    reused."""
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)


def naive_recurrent_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """FLA's reference recurrence ``fla.ops.kda.naive.naive_recurrent_kda`` (fla-core 0.5.2 and 0.6) from a zero
    state: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]`` ->
    ``o [B, T, HV, V]`` in the dtype of ``v``, computed token by token in float32 (float64 inputs too)."""
    from fla.ops.kda.naive import naive_recurrent_kda as naive

    return naive(q, k, v, g, beta, scale=scale)[0]
