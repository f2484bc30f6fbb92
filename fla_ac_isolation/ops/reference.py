"""Pure-torch varlen operations: the CPU backend of :mod:`fla_ac_isolation.ops` and the parity oracle of its FLA path.
With ``cu_seqlens`` they ask FLA's identity-cached helpers for the schedule as FLA's kernels do (a shared ``cu_seqlens``
misbehaves here as on a GPU). Float32 compute (float64 stays), deterministic, outputs in the input dtype.

Every op takes ``cu_seqlens`` (optional ``[N + 1]`` int offsets, then ``B == 1``), ``cu_seqlens_cpu`` (its host
copy, handed to FLA's helpers) and ``chunk_indices`` (the ``[NT, 2]`` chunk schedule, used instead of FLA's helper),
and raises ``ValueError`` for ``B != 1`` with ``cu_seqlens`` or ``cu_seqlens`` not ending at ``T``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE
from fla_ac_isolation.op_inputs import (
    check_conv,
    check_groups,
    check_heads,
    check_packed,
    compute_dtype,
    discretize_dt,
    l2_normalize,
)
from fla_ac_isolation.ops.documents import PackedDocument, packed_documents

__all__ = ["CHUNK_SIZE", "PackedDocument", "causal_conv1d", "chunk_gated_delta_rule", "packed_documents", "ssd",
           "ssd_scan"]


def _concat_time(pieces: list[torch.Tensor], like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Concatenate per-chunk outputs along time; an input with no tokens gives an empty output."""
    if not pieces:
        return like.new_zeros(shape)
    return torch.cat(pieces, dim=1)


# ------------------------------------------------------------------------------------ causal conv1d
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution along time (``F.conv1d`` per document), restarted at every document.

    Args:
        x: ``[B, T, D]`` input (``B == 1`` when ``cu_seqlens`` is given).
        weight: ``[D, W]`` filter; ``weight[:, -1]`` multiplies the current token (the layout of
            ``nn.Conv1d(D, D, W, groups=D).weight.squeeze(1)``).
        bias: optional ``[D]``.
        activation: ``"silu"``/``"swish"`` or ``None``.

    Returns ``[B, T, D]`` in the dtype of ``x``. Raises ``ValueError``: bad ``activation``; ``weight`` not ``[D, W]``.
    """
    check_conv(x, weight, activation, cu_seqlens)
    width = weight.shape[1]
    documents = packed_documents(
        x.shape[1], cu_seqlens, cu_seqlens_cpu, CHUNK_SIZE, recurrent=False, chunk_indices=chunk_indices
    )
    pieces = []
    for doc in documents:
        segment = x[:, doc.start:doc.end].transpose(1, 2).to(weight.dtype)  # [B, D, L]
        y = F.conv1d(segment, weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
        y = y[..., : doc.end - doc.start]
        if activation is not None:
            y = F.silu(y)
        pieces.append(y.transpose(1, 2).to(x.dtype))
    return _concat_time(pieces, x, tuple(x.shape))


# ------------------------------------------------------------------------------ gated delta rule
def _pairwise_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp(sum_{j < r <= i} a_r)`` for ``j <= i``, 0 above; ``[..., C] -> [..., C, C]``. Summed directly, not as
    a difference of cumsums, which loses digits when a chunk's decay is large."""
    size = log_decay.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=log_decay.device).tril()
    lower_strict = lower.tril(-1)
    terms = log_decay.unsqueeze(-1).expand(*log_decay.shape, size).masked_fill(~lower_strict, 0.0)
    sums = terms.cumsum(-2)                                         # [..., i, j] = sum_{j < r <= i} a_r
    return sums.masked_fill(~lower, float("-inf")).exp()


def _gdn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk (``[B, H, C, *]``, ``q`` scaled) of ``S_t = exp(g_t) S_{t-1} + k_t (x) d_t``,
    ``d_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)``, ``o_t = S_t^T q_t``, solved at once (WY form): with ``G``
    the in-chunk cumsum of ``g``, ``d = (I + A)^{-1} beta (v - exp(G) k S_0)``,
    ``A[i, j] = beta_i exp(G_i - G_j) k_i . k_j`` for ``j < i``."""
    cum = g.cumsum(-1)                                              # G_i, [B, H, C]
    decay = _pairwise_decay(g)                                      # exp(G_i - G_j), 0 for j > i
    eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)

    kk = k @ k.transpose(-1, -2)
    system = eye + (beta.unsqueeze(-1) * kk * decay).tril(-1)      # I + A
    rhs = beta.unsqueeze(-1) * (v - (cum.exp().unsqueeze(-1) * k) @ state)
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)

    out = (cum.exp().unsqueeze(-1) * q) @ state + ((q @ k.transpose(-1, -2)) * decay) @ delta
    tail = decay[..., -1, :].unsqueeze(-1)                          # exp(G_C - G_j)
    state = cum[..., -1:].exp().unsqueeze(-1) * state + (tail * k).transpose(-1, -2) @ delta
    return out, state


def chunk_gated_delta_rule(
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
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule (Gated Delta Networks, arXiv:2412.06464) over packed documents, each from a zero state.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, HV, V]`` values; ``HV`` a multiple of ``H`` (GVA: value head ``j`` reads key head
            ``j // (HV // H)``).
        g: ``[B, T, HV]`` log decay (``<= 0``), float32 preferred.
        beta: ``[B, T, HV]`` write strength in ``(0, 1)``.
        scale: query scale; ``K ** -0.5`` when ``None``.
        use_qk_l2norm_in_kernel: L2-normalise q and k (in float32) first, as FLA's flag of that name.

    Returns ``[B, T, HV, V]`` in the dtype of ``q``. Raises ``ValueError``: head counts that do not divide.
    """
    check_packed("q", q, cu_seqlens)
    check_heads(q, k, v)
    heads, value_heads = q.shape[2], v.shape[2]
    out_dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q)
    qf, kf = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    if value_heads != heads:
        qf = qf.repeat_interleave(value_heads // heads, dim=2)
        kf = kf.repeat_interleave(value_heads // heads, dim=2)
    # [B, T, H, *] -> [B, H, T, *]
    qf, kf, vf = (t.transpose(1, 2) for t in (qf * scale, kf, v.to(dtype)))
    gf, bf = g.to(dtype).transpose(1, 2), beta.to(dtype).transpose(1, 2)

    batch, _, time, key_dim = kf.shape
    pieces = []
    documents = packed_documents(time, cu_seqlens, cu_seqlens_cpu, CHUNK_SIZE, recurrent=True,
                                 chunk_indices=chunk_indices)
    for doc in documents:
        state = vf.new_zeros(batch, value_heads, key_dim, vf.shape[-1])
        for lo, hi in doc.chunks:
            out, state = _gdn_chunk(qf[:, :, lo:hi], kf[:, :, lo:hi], vf[:, :, lo:hi],
                                    gf[:, :, lo:hi], bf[:, :, lo:hi], state)
            pieces.append(out.transpose(1, 2))
    result = _concat_time(pieces, vf, (batch, time, value_heads, vf.shape[-1]))
    return result.to(out_dtype)


# ------------------------------------------------------------------------------------ Mamba2 SSD
def _ssd_chunk(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk (``[B, H, C, *]``; ``x = dt * x``, ``a = dt * A``) of the SSD scan: state in, (output, state) out."""
    cum = a.cumsum(-1)
    decay = _pairwise_decay(a)
    out = (cum.exp().unsqueeze(-1) * c) @ state + ((c @ b.transpose(-1, -2)) * decay) @ x
    tail = decay[..., -1, :].unsqueeze(-1)
    state = cum[..., -1:].exp().unsqueeze(-1) * state + (tail * b).transpose(-1, -2) @ x
    return out, state


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    scan: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The Mamba2 SSD scan (arXiv:2405.21060) over packed documents, each starting from a zero state.

    Per head ``h`` and token ``t`` (``dt`` discretised by :func:`~fla_ac_isolation.op_inputs.discretize_dt`)::

        S_t = exp(dt_t * A_h) * S_{t-1} + B_t (x) (dt_t * x_t)      # [N, P]
        y_t = C_t . S_t + D_h * x_t

    Args:
        x: ``[B, T, H, P]`` inputs.
        dt: ``[B, T, H]`` raw time steps (before bias and softplus).
        A: ``[H]`` negative decay rates (``-exp(A_log)``).
        B: ``[B, T, G, N]`` input projections; head ``h`` uses group ``h // (H // G)``.
        C: ``[B, T, G, N]`` output projections.
        D: optional ``[H]`` skip weights.
        dt_bias: optional ``[H]``.
        dt_limit: ``(min, max)`` clamp of the discretised ``dt``.
        chunk_offsets: the ``[N + 1]`` first schedule row per document, used with ``chunk_indices``.
        scan: called as :func:`ssd_scan` (the default); ``ops.ssd(..., saveable=True)`` passes its operator.

    Returns ``[B, T, H, P]`` in the dtype of ``x``. Raises ``ValueError``: ``H`` not a multiple of ``G``.
    """
    check_packed("x", x, cu_seqlens)
    check_groups(x.shape[2], B, C)
    dtype = compute_dtype(x)
    dt = discretize_dt(dt, dt_bias, dt_limit).to(dtype)
    y = (scan or ssd_scan)(x.to(dtype) * dt.unsqueeze(-1), dt * A.to(dtype), B.to(dtype), C.to(dtype),
                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                           chunk_offsets=chunk_offsets)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x.to(dtype)
    return y.to(x.dtype)


def ssd_scan(
    x: torch.Tensor,
    log_decay: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scan of :func:`ssd`, the part FLA's simple GLA computes: no discretisation, no ``D`` skip.

    ``x [B, T, H, P]`` (``dt * x``), ``log_decay [B, T, H]`` (``dt * A``, ``<= 0``), ``B, C [B, T, G, N]``, all in
    the compute dtype (float32 or float64) -> ``y [B, T, H, P]``, ``y_t = C_t . S_t``,
    ``S_t = exp(a_t) S_{t-1} + B_t (x) x_t``; the offsets as in :func:`ssd`.
    """
    heads, groups = x.shape[2], B.shape[2]
    xf = x.transpose(1, 2)                                                     # [B, H, T, P]
    af = log_decay.transpose(1, 2)                                             # [B, H, T]
    bf = B.repeat_interleave(heads // groups, dim=2).transpose(1, 2)           # [B, H, T, N]
    cf = C.repeat_interleave(heads // groups, dim=2).transpose(1, 2)

    batch, _, time, head_dim = xf.shape
    pieces = []
    for doc in packed_documents(time, cu_seqlens, cu_seqlens_cpu, CHUNK_SIZE, recurrent=True,
                                chunk_indices=chunk_indices, chunk_offsets=chunk_offsets):
        state = xf.new_zeros(batch, heads, bf.shape[-1], head_dim)
        for lo, hi in doc.chunks:
            out, state = _ssd_chunk(xf[:, :, lo:hi], af[:, :, lo:hi], bf[:, :, lo:hi], cf[:, :, lo:hi], state)
            pieces.append(out.transpose(1, 2))
    return _concat_time(pieces, xf, (batch, time, heads, head_dim))
