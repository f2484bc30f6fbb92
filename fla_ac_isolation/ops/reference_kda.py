"""Pure-torch Kimi Delta Attention (KDA): the CPU backend of :func:`fla_ac_isolation.ops.chunk_kda` and the
parity oracle of its ``fla`` backend (FLA's ``chunk_kda``).

Kimi Delta Attention (Kimi Team, 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture",
arXiv:2510.26692) is the gated delta rule with a decay per key channel instead of per head. Per document,
head ``h`` and token ``t``, with state ``S [K, V]`` starting at zero::

    S   <- diag(exp(g_t)) S                                  # g_t [K]: log decay per key channel, <= 0
    S   <- S + beta_t k_t (v_t - S^T k_t)^T                  # delta-rule write of strength beta_t
    o_t  = S^T (scale * q_t)

This module follows FLA's ``naive_recurrent_kda`` (``fla/ops/kda/naive.py``, fla-core 0.6.0) token by
token, in float32 (float64 inputs stay float64), with grouped value attention (value head ``j`` reads key
head ``j // (HV // H)``) and, with ``use_qk_l2norm_in_kernel``, q and k L2-normalised first as FLA's
``l2norm_fwd`` does (``x / sqrt(sum(x**2) + 1e-6)``). It is written for clarity and as an oracle, not
speed: one loop step per token.

Documents and FLA's cache. With ``cu_seqlens`` the input is packed (``B == 1``) and this backend asks
FLA's identity-cached index helpers what ``chunk_kda``'s forward asks, with the same arguments:
``prepare_chunk_indices`` by keyword (:func:`~fla_ac_isolation.fla_seam.kda.prepare_kda_chunk_indices`),
then ``prepare_chunk_offsets(cu_seqlens, 64)``. A ``cu_seqlens`` object shared by checkpointed layers
therefore misses and hits FLA's cache here as on a GPU, and the per-layer tensors of
:meth:`~fla_ac_isolation.LayerLocalSeqlens.local` are safe here for the same reason. The schedule is then
used (:func:`~fla_ac_isolation.ops.documents.packed_documents`): each document's tokens are those its
chunks cover, so a misreplayed schedule raises instead of mixing documents.
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
        q: ``[B, L, HV, K]`` queries, already scaled (and L2-normalised if wanted) and repeated to the
            value heads.
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
    """Kimi Delta Attention over packed documents, each from a zero state (module docstring).

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; ``HV`` a multiple of ``H``.
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
