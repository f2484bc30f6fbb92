"""FLA's Kimi Delta Attention (KDA): the ``fla`` backend of :func:`fla_ac_isolation.ops.chunk_kda`, and the index
lookups its kernel makes.

* :func:`chunk_kda` -> ``fla.ops.kda.chunk_kda`` (fla-core 0.6) with the log decay precomputed by the caller
  (``use_gate_in_kernel=False``), ``use_qk_l2norm_in_kernel``, native GVA (``HV > H``) and
  ``chunk_size=``:data:`~fla_ac_isolation.fla_seam.layout.CHUNK_SIZE`. ``cu_seqlens`` and
  ``cu_seqlens_cpu`` are handed on; FLA's KDA takes no ``chunk_indices`` (it asks its identity-cached
  ``prepare_chunk_indices`` itself), so pass the per-layer tensors of
  :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`.
* :func:`prepare_kda_chunk_indices` - FLA's cached ``prepare_chunk_indices`` called exactly as
  ``ChunkKDAFunction.forward`` calls it: by keyword (``cu_seqlens=``, ``chunk_size=``, ``cu_seqlens_cpu=``).
  FLA's cache matches calls by their keyword set, so an entry made by the conv (which passes ``cu_seqlens``
  and ``chunk_size`` positionally) is not reused by KDA; the reference backend
  (:mod:`fla_ac_isolation.ops.reference_kda`) calls this to hit and miss where the kernel does. After it,
  the kernel's forward asks ``prepare_chunk_offsets(cu_seqlens, chunk_size)`` (in
  ``chunk_gated_delta_rule_fwd_h``), which :func:`~fla_ac_isolation.fla_seam.layout.prepare_chunk_offsets`
  calls through.

Read in fla-core 0.6.0: ``fla/ops/kda/chunk.py`` (``chunk_kda``, ``ChunkKDAFunction``) and
``fla/ops/kda/chunk_fwd.py``. FLA is imported inside each function, never at import. The kernels need CUDA
tensors (or a CPU under ``TRITON_INTERPRET=1`` with the harness's interpreter backend,
``harness/fla_seam/interpreter.py``).
"""

from __future__ import annotations

import os

import torch

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE

__all__ = ["MAX_KEY_DIM", "chunk_kda", "prepare_kda_chunk_indices"]

MAX_KEY_DIM = 256
"""The largest key head dim ``K`` FLA 0.6's ``chunk_kda`` accepts (it asserts ``K <= 256``)."""


def prepare_kda_chunk_indices(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """FLA's cached ``prepare_chunk_indices`` as ``chunk_kda``'s forward calls it (``[NT, 2]`` rows
    ``(document, chunk)`` on the device of ``cu_seqlens``): same keywords, same chunk size."""
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kimi Delta Attention on FLA's chunk kernel; see :func:`fla_ac_isolation.ops.reference_kda.chunk_kda`
    for the maths.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` (log decay, float32 preferred),
    ``beta [B, T, HV]`` -> ``o [B, T, HV, V]`` in the dtype of ``q``. Zero initial state per document, no
    final state.

    Raises:
        ValueError: CPU tensors outside Triton's interpreter (FLA's kernels have no CPU backend).
    """
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            "backend='fla' needs CUDA tensors (FLA's Triton kernels have no CPU backend); got CPU tensors. "
            "Use backend='reference' (or 'auto') on CPU, or TRITON_INTERPRET=1 for kernel tests."
        )
    out, _ = fla_chunk_kda(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_size=CHUNK_SIZE,
    )
    return out
