"""Pure-torch Kimi Delta Attention (arXiv:2510.26692): the CPU backend of :func:`fla_ac_isolation.ops.chunk_kda` and
the oracle of FLA's ``chunk_kda``. FLA's ``naive_recurrent_kda``, token by token in float32 (float64 stays float64),
per document and head from ``S [K, V] = 0``::

    S   <- diag(exp(g_t)) S                                  # g_t [K]: log decay per key channel, <= 0
    S   <- S + beta_t k_t (v_t - S^T k_t)^T                  # delta-rule write of strength beta_t
    o_t  = S^T (scale * q_t)

With ``cu_seqlens`` it asks FLA's cached index helpers what ``chunk_kda``'s forward asks, as
:mod:`~fla_ac_isolation.ops.reference` does.
"""

from __future__ import annotations

import torch

from fla_ac_isolation.fla_seam.kda import prepare_kda_chunk_indices
from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE
from fla_ac_isolation.op_inputs import check_heads, check_packed, compute_dtype
from fla_ac_isolation.ops.documents import packed_documents

__all__ = ["chunk_kda", "kda_recurrence"]

_L2_EPS = 1e-6  # FLA's l2norm_fwd default


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def kda_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One document of KDA from a zero state, token by token (FLA's ``naive_recurrent_kda``).

    Args:
        q: ``[B, L, HV, K]`` queries, already scaled (and L2-normalised) and repeated to the value heads.
        k: ``[B, L, HV, K]`` keys, likewise.
        v: ``[B, L, HV, V]`` values.
        g: ``[B, L, HV, K]`` log decay per key channel.
        beta: ``[B, L, HV]`` write strength.

    Returns:
        ``o [B, L, HV, V]`` in the dtype of ``v`` (``L == 0`` gives an empty output).
    """
    batch, length, heads, key_dim = k.shape
    state = v.new_zeros(batch, heads, key_dim, v.shape[-1])                       # S [B, HV, K, V]
    out = []
    for t in range(length):
        state = state * g[:, t].exp().unsqueeze(-1)
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)                 # S^T k_t
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - predicted)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    if not out:
        return v.new_zeros(batch, 0, heads, v.shape[-1])
    return torch.stack(out, dim=1)


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
        ``[B, T, HV, V]`` in the dtype of ``q``.

    Raises:
        ValueError: head counts that do not divide; ``B != 1`` with ``cu_seqlens``.
    """
    check_packed("q", q, cu_seqlens)
    check_heads(q, k, v)
    group = v.shape[2] // q.shape[2]
    dtype = compute_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2_normalize(qf), _l2_normalize(kf)
    qf = (qf * scale).repeat_interleave(group, dim=2)
    kf = kf.repeat_interleave(group, dim=2)
    vf, gf, bf = v.to(dtype), g.to(dtype), beta.to(dtype)

    time = q.shape[1]
    chunk_indices = None if cu_seqlens is None else prepare_kda_chunk_indices(cu_seqlens, cu_seqlens_cpu)
    documents = packed_documents(time, cu_seqlens, cu_seqlens_cpu, CHUNK_SIZE, recurrent=True,
                                 chunk_indices=chunk_indices)
    pieces = [
        kda_recurrence(qf[:, d.start:d.end], kf[:, d.start:d.end], vf[:, d.start:d.end], gf[:, d.start:d.end],
                       bf[:, d.start:d.end])
        for d in documents
    ]
    if not pieces:
        return vf.new_zeros(v.shape).to(q.dtype)
    return torch.cat(pieces, dim=1).to(q.dtype)
