"""What the library knows of FLA's Kimi Delta Attention (``chunk_kda``, which :func:`fla_ac_isolation.ops.chunk_kda`
calls): its key-dim limit and the index lookups its kernel makes.

FLA's KDA takes no ``chunk_indices``: it asks its identity-cached ``prepare_chunk_indices`` itself, so callers
pass the per-layer tensors of :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`.

* :data:`MAX_KEY_DIM` - the largest key head dim ``chunk_kda`` accepts.
* :func:`prepare_kda_chunk_indices` - FLA's cached ``prepare_chunk_indices`` called exactly as
  ``ChunkKDAFunction.forward`` calls it: by keyword (``cu_seqlens=``, ``chunk_size=``, ``cu_seqlens_cpu=``).
  FLA's cache matches calls by their keyword set, so an entry made by the conv (which passes ``cu_seqlens``
  and ``chunk_size`` positionally) is not reused by KDA; the reference backend
  (:mod:`fla_ac_isolation.ops.reference_kda`) calls this to hit and miss where the kernel does. After it,
  the kernel's forward asks ``prepare_chunk_offsets(cu_seqlens, chunk_size)`` (in
  ``chunk_gated_delta_rule_fwd_h``), which :func:`~fla_ac_isolation.fla_seam.layout.prepare_chunk_offsets`
  calls through.

Read in fla-core 0.6.0: ``fla/ops/kda/chunk.py`` (``chunk_kda``, ``ChunkKDAFunction``) and
``fla/ops/kda/chunk_fwd.py``. FLA is imported inside the function, never at import.
"""

from __future__ import annotations

import torch

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE

__all__ = ["MAX_KEY_DIM", "prepare_kda_chunk_indices"]

MAX_KEY_DIM = 256
"""The largest key head dim ``K`` FLA 0.6's ``chunk_kda`` accepts (it asserts ``K <= 256``)."""


def prepare_kda_chunk_indices(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """FLA's cached ``prepare_chunk_indices`` as ``chunk_kda``'s forward calls it (``[NT, 2]`` rows
    ``(document, chunk)`` on the device of ``cu_seqlens``): same keywords, same chunk size."""
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)
