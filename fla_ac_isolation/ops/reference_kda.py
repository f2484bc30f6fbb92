"""Pure-torch Kimi Delta Attention (arXiv:2510.26692): the CPU backend of :func:`fla_ac_isolation.ops.chunk_kda` and
the oracle of FLA's ``chunk_kda``. FLA's own reference, ``naive_recurrent_kda``, run per document (token by token,
in float32), from ``S [K, V] = 0`` per head::

    S   <- diag(exp(g_t)) S                                  # g_t [K]: log decay per key channel, <= 0
    S   <- S + beta_t k_t (v_t - S^T k_t)^T                  # delta-rule write of strength beta_t
    o_t  = S^T (scale * q_t)

With ``cu_seqlens`` it asks FLA's cached index helpers what ``chunk_kda``'s forward asks, as
:mod:`~fla_ac_isolation.ops.reference` does.
"""

from __future__ import annotations

import torch

from fla_ac_isolation.fla_seam.kda import naive_recurrent_kda, prepare_kda_chunk_indices
from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE
from fla_ac_isolation.op_inputs import check_heads, check_packed, l2_normalize
from fla_ac_isolation.ops.documents import packed_documents

__all__ = ["chunk_kda"]


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
    """Kimi Delta Attention over packed documents, each from a zero state.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; ``HV`` a multiple of ``H`` (value head ``j`` reads key head ``j // (HV // H)``).
        g: ``[B, T, HV, K]`` log decay per key channel (``<= 0``), float32 preferred.
        beta: ``[B, T, HV]`` write strength in ``(0, 1)``.
        scale: query scale; ``K ** -0.5`` when ``None``.
        use_qk_l2norm_in_kernel: L2-normalise q and k (in float32) first, as FLA's flag of that name.
        cu_seqlens: optional ``[N + 1]`` offsets (then ``B == 1``).
        cu_seqlens_cpu: optional host copy of ``cu_seqlens`` (handed to FLA's helper, as the kernel does).

    Returns:
        ``[B, T, HV, V]`` in the dtype of ``q``, computed in float32 by FLA's reference (float64 inputs too).

    Raises:
        ValueError: head counts that do not divide; ``B != 1`` with ``cu_seqlens``;
            ``cu_seqlens`` not ending at ``T``.
    """
    check_packed("q", q, cu_seqlens)
    check_heads(q, k, v)
    out_dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
    chunk_indices = None if cu_seqlens is None else prepare_kda_chunk_indices(cu_seqlens, cu_seqlens_cpu)
    documents = packed_documents(q.shape[1], cu_seqlens, cu_seqlens_cpu, CHUNK_SIZE, recurrent=True,
                                 chunk_indices=chunk_indices)
    pieces = [naive_recurrent_kda(q[:, d.start:d.end], k[:, d.start:d.end], v[:, d.start:d.end],
                                  g[:, d.start:d.end], beta[:, d.start:d.end], scale=scale) for d in documents]
    if not pieces:
        return v.new_zeros(v.shape, dtype=out_dtype)
    return torch.cat(pieces, dim=1).to(out_dtype)
