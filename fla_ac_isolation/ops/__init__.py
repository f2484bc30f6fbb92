"""Varlen operations behind the mixers, on two backends: ``fla`` (FLA's Triton kernels; CUDA or Triton's interpreter)
and ``reference`` (pure torch); ``backend="auto"`` picks ``fla`` for CUDA tensors. Packed documents: ``cu_seqlens``
(``[N + 1]`` int offsets, ``B == 1``), which both backends hand to FLA's identity-cached helpers. A layer passes
what :meth:`~fla_ac_isolation.LayerLocalSeqlens.local` returned as ``seqlens=`` (its fresh ``cu_seqlens``,
``cu_seqlens_cpu``, ``chunk_indices``, ``chunk_offsets``, ``cp_context`` in one object); FLA's own keywords
(``cu_seqlens=``, ...) are taken too, for code written against FLA's signatures, but not beside ``seqlens``.

``saveable=True`` runs each call as one custom operator (:data:`SAVEABLE_OPS`) that a SAC policy can save
(:func:`fla_ac_isolation.policies.save_fla_ops`) and ``torch.compile`` traces whole; it makes a shared ``cu_seqlens``
safe for these operators only. ``cp_context`` (FLA's ``FLACPContext``) needs the ``fla`` backend and
``saveable=False``; the tensors are then this rank's shard and ``chunk_indices`` the rank-local schedule.

Every op raises ``ValueError`` for an unknown ``backend``, ``seqlens`` beside FLA's offsets keywords,
``backend='fla'`` with CPU tensors outside Triton's interpreter, and the reference's own checks; ``TypeError`` for a
``seqlens`` that is not a :class:`~fla_ac_isolation.LocalSeqlens` or a ``saveable`` that is not a bool. The ops that
take ``chunk_indices`` raise ``ValueError`` unless it is ``[NT, 2]`` rows on the device of ``cu_seqlens``
(``TypeError`` unless an integer tensor); those that take ``cp_context``, ``NotImplementedError`` for it with the
reference backend or ``saveable=True``.
"""

from __future__ import annotations

import math

import torch

from fla_ac_isolation.fla_seam import features
from fla_ac_isolation.fla_seam.kda import MAX_KEY_DIM
from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE, conv_takes_chunk_indices
from fla_ac_isolation.fla_seam.simple_gla import schedule, simple_gla
from fla_ac_isolation.local_seqlens import LocalSeqlens
from fla_ac_isolation.op_inputs import (
    check_conv,
    check_groups,
    check_heads,
    check_kda_gates,
    check_packed,
    discretize_dt,
)
from fla_ac_isolation.op_names import SAVEABLE_OP_NAMES
from fla_ac_isolation.ops import reference, reference_kda
from fla_ac_isolation.ops.backend import (
    BACKENDS,
    Backend,
    check_cp_backend,
    check_fla_device,
    check_saveable,
    resolve_backend,
)
from fla_ac_isolation.ops.saveable import CALLS, OVERLOADS
from fla_ac_isolation.seqlens import devices_match

__all__ = ["BACKENDS", "SAVEABLE_OPS", "Backend", "causal_conv1d", "chunk_gated_delta_rule", "chunk_kda", "ssd"]

SAVEABLE_OPS: dict[str, tuple[torch._ops.OpOverload, torch._ops.OpOverload]] = {
    name: (OVERLOADS["fla"][name], OVERLOADS["reference"][name]) for name in SAVEABLE_OP_NAMES
}
"""The custom operators behind ``saveable=True``: ``(fla, reference)`` forward overloads per operation name.

Outputs: ``gated_delta_rule``: ``fla`` ``o [B, T, HV, V]`` (dtype of q), ``A [B, T, HV, 64]`` (dtype of k),
``g_cumsum [B, T, HV]`` fp32, ``q_rstd``/``k_rstd`` ``[B, T, H]`` fp32 (empty without the L2 norm); ``reference``
``o``. ``causal_conv1d``: ``y [B, T, D]`` (dtype of x). ``ssd``: ``fla`` (simple GLA) ``o [B, T, H, P]`` (dtype of
x), ``g_cumsum [B, T, H]`` fp32; ``reference`` (the scan) ``y [B, T, H, P]`` float32.
"""


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    seqlens: LocalSeqlens | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object | None = None,
    backend: Backend = "auto",
    saveable: bool = False,
) -> torch.Tensor:
    """Depthwise causal conv1d (+ SiLU) restarted at every document.

    ``x [B, T, D]``, ``weight [D, W]``, ``bias [D]`` -> ``[B, T, D]`` (dtype of ``x``); details:
    :func:`fla_ac_isolation.ops.reference.causal_conv1d`. ``fla``: FLA's ``causal_conv1d(..., backend="triton")``.
    With ``cp_context``, ``x`` is this rank's ``[1, T / W, D]`` shard and ``weight``/``bias`` receive this rank's
    part of their gradient (sum it over the CP group). Errors: the module's.
    """
    if seqlens is not None:
        cu_seqlens, cu_seqlens_cpu, chunk_indices, cp_context = _unpack(
            "causal_conv1d", seqlens, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
            cp_context=cp_context)
    _check_chunk_indices(chunk_indices, cu_seqlens)
    check_cp_backend(cp_context, backend, x, saveable)
    check_saveable(saveable)
    if resolve_backend(backend, x) == "reference":
        if not saveable:
            return reference.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                           cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)
        check_conv(x, weight, activation, cu_seqlens)
        return CALLS["reference"]["causal_conv1d"](x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu,
                                                   chunk_indices)
    check_fla_device(x)
    if saveable:
        return CALLS["fla"]["causal_conv1d"](x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    # under CP, FLA takes the rank-local offsets from the context
    offsets = (dict(cp_context=cp_context) if cp_context is not None
               else dict(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu))
    y, _ = features.module("conv").causal_conv1d(
        x=x, weight=weight, bias=bias, activation=activation, backend="triton",
        chunk_indices=chunk_indices if conv_takes_chunk_indices() else None, **offsets,
    )
    return y


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    seqlens: LocalSeqlens | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object | None = None,
    backend: Backend = "auto",
    saveable: bool = False,
) -> torch.Tensor:
    """Gated delta rule, zero state at every document start.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` -> ``[B, T, HV, V]``; details:
    :func:`fla_ac_isolation.ops.reference.chunk_gated_delta_rule`. ``fla``: FLA's ``chunk_gated_delta_rule``
    (``chunk_indices`` reaches it on fla-core 0.6; 0.5.2 builds the schedule from ``cu_seqlens``). ``scale``
    defaults to ``K ** -0.5``. With ``cp_context``, ``T`` is this rank's ``T / W`` tokens. Errors: the module's;
    ``FlaFeatureError`` for ``chunk_indices`` inside a CUDA graph capture on an FLA without ``chunk_indices=``.
    """
    if seqlens is not None:
        cu_seqlens, cu_seqlens_cpu, chunk_indices, cp_context = _unpack(
            "chunk_gated_delta_rule", seqlens, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices, cp_context=cp_context)
    _check_chunk_indices(chunk_indices, cu_seqlens)
    check_cp_backend(cp_context, backend, q, saveable)
    check_saveable(saveable)
    if resolve_backend(backend, q) == "reference":
        if not saveable:
            return reference.chunk_gated_delta_rule(
                q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
            )
        check_packed("q", q, cu_seqlens)
        check_heads(q, k, v)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return CALLS["reference"]["gated_delta_rule"](q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens,
                                                      cu_seqlens_cpu, chunk_indices)
    check_fla_device(q)
    if saveable:
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        return CALLS["fla"]["gated_delta_rule"](q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens,
                                                cu_seqlens_cpu, chunk_indices)[0]
    if cp_context is not None:
        cu_seqlens = cu_seqlens_cpu = None  # FLA reads the rank-local offsets from the context
    schedule_given = {}
    if chunk_indices is not None:
        # (a CPU build of torch raises on asking whether a stream captures: ask only for CUDA tensors)
        if not features.supports("gdn_chunk_indices") and q.is_cuda and torch.cuda.is_current_stream_capturing():
            features.require("gdn_chunk_indices", where="chunk_gated_delta_rule(chunk_indices=) in a CUDA graph")
        if features.supports("gdn_chunk_indices"):
            schedule_given["chunk_indices"] = chunk_indices
        # fla-core 0.5.2 takes no chunk_indices= here: it builds the schedule from this call's cu_seqlens
        # (the layer's fresh copy, so the isolation holds), at the cost of the host sync the schedule spares.
    out, _ = features.gdn_entry_point()(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=CHUNK_SIZE, cp_context=cp_context,
        **schedule_given,
    )
    return out


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
    seqlens: LocalSeqlens | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    backend: Backend = "auto",
    saveable: bool = False,
) -> torch.Tensor:
    """Mamba2 SSD scan, zero state at every document start.

    ``x [B, T, H, P]``, ``dt [B, T, H]`` (raw), ``A [H]``, ``B, C [B, T, G, N]``, ``D [H]`` ->
    ``[B, T, H, P]``; maths: :func:`fla_ac_isolation.ops.reference.ssd`. ``fla``: FLA's ``chunk_simple_gla``'s
    numbers bit for bit (``q = C``, ``k = B``, ``v = dt * x``, ``g = dt * A``, ``scale = 1``, plus ``D * x``),
    without a host sync when both ``chunk_indices [NT, 2]`` and ``chunk_offsets [N + 1]`` are given.

    Raises (besides the module's):
        ValueError: ``seqlens`` under CP; ``H`` not a multiple of the groups of ``B``/``C``; malformed
            ``chunk_offsets`` or one without ``chunk_indices`` (``TypeError``: not an integer tensor).
        FlaFeatureError: ``backend='fla'`` on an FLA without the kernels the SSD needs (fla-core 0.5.2).
    """
    if seqlens is not None:
        cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets = _unpack(
            "ssd", seqlens, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets)
    _check_chunk_indices(chunk_indices, cu_seqlens)
    _check_chunk_offsets(chunk_offsets, chunk_indices, cu_seqlens)
    check_saveable(saveable)
    if resolve_backend(backend, x) == "reference":
        return reference.ssd(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_limit=dt_limit, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                             chunk_offsets=chunk_offsets, scan=CALLS["reference"]["ssd"] if saveable else None)
    check_fla_device(x)
    features.require("ssd_kernels", where="ops.ssd(..., backend='fla', saveable=True)" if saveable
                     else "ops.ssd(..., backend='fla')")
    check_groups(x.shape[2], B, C)
    dt = discretize_dt(dt, dt_bias, dt_limit)
    value = (x * dt.unsqueeze(-1)).to(x.dtype)  # x promoted inside the multiply: no float32 copy of x
    log_decay = dt * A.float()
    if saveable:  # B/C reach the operator grouped
        y, _ = CALLS["fla"]["ssd"](C.to(x.dtype), B.to(x.dtype), value, log_decay, 1.0, cu_seqlens, cu_seqlens_cpu,
                                   chunk_indices, chunk_offsets)
    else:
        repeats = x.shape[2] // B.shape[2]
        query = C.to(x.dtype).repeat_interleave(repeats, dim=2)
        key = B.to(x.dtype).repeat_interleave(repeats, dim=2)
        chunk_indices, chunk_offsets = schedule(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)
        y = simple_gla(query, key, value, log_decay, 1.0, cu_seqlens, chunk_indices, chunk_offsets)
    if D is not None:
        y = (y + D.float()[:, None] * x).to(x.dtype)  # promoted inside the ops: the numbers of y.float() + ...
    return y


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    seqlens: LocalSeqlens | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Kimi Delta Attention (a gated delta rule with a decay per key channel), zero state at every document start.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` (log decay, ``<= 0``, float32 preferred),
    ``beta [B, T, HV]`` -> ``[B, T, HV, V]`` in the dtype of ``q``; maths:
    :func:`fla_ac_isolation.ops.reference_kda.chunk_kda`. ``fla``: FLA 0.6's ``chunk_kda`` with the log decay
    precomputed (``use_gate_in_kernel=False``). No ``chunk_indices``, ``saveable`` or ``cp_context``.

    Raises (besides the module's) ``ValueError``: ``g``/``beta`` not ``[B, T, HV, K]``/``[B, T, HV]``; head counts
    that do not divide; ``B != 1`` with ``cu_seqlens``; ``K`` above FLA's limit
    (:data:`~fla_ac_isolation.fla_seam.kda.MAX_KEY_DIM`) on the ``fla`` backend; ``seqlens`` under CP.
    """
    if seqlens is not None:
        cu_seqlens, cu_seqlens_cpu = _unpack("chunk_kda", seqlens, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    check_packed("q", q, cu_seqlens)
    check_heads(q, k, v)
    check_kda_gates(q, v, g, beta)
    kwargs = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                  cu_seqlens_cpu=cu_seqlens_cpu)
    if resolve_backend(backend, q) == "reference":
        return reference_kda.chunk_kda(q, k, v, g, beta, **kwargs)
    if q.shape[-1] > MAX_KEY_DIM:
        raise ValueError(
            f"FLA's chunk_kda takes key head dims up to {MAX_KEY_DIM}, got K = {q.shape[-1]} "
            "(q [B, T, H, K]); use backend='reference'"
        )
    check_fla_device(q)
    out, _ = features.kda_entry_point()(q=q, k=k, v=v, g=g, beta=beta, chunk_size=CHUNK_SIZE, **kwargs)
    return out


def _unpack(op: str, seqlens: object, **given: object) -> tuple:
    """The fields of ``seqlens`` named by ``given`` (whose values must all be ``None``), in that order.

    Raises:
        TypeError: ``seqlens`` is not a :class:`~fla_ac_isolation.LocalSeqlens` (``.local()``'s result).
        ValueError: a keyword of ``given`` set beside ``seqlens``; ``seqlens`` carries a ``cp_context`` ``op``
            does not take.
    """
    if not isinstance(seqlens, LocalSeqlens):
        hint = " (call .local() on it inside the layer)" if hasattr(seqlens, "local") else ""
        raise TypeError(f"{op}: seqlens must be a fla_ac_isolation.LocalSeqlens, what .local() returns, got "
                        f"{type(seqlens).__name__}{hint}")
    both = [name for name, value in given.items() if value is not None]
    if both:
        raise ValueError(f"{op}: seqlens carries the offsets; got {', '.join(both)} beside it (give one or the other)")
    if seqlens.cp_context is not None and "cp_context" not in given:
        raise ValueError(f"{op} takes no context-parallel offsets: seqlens carries a cp_context (under CP pass the "
                         "whole batch's offsets, .local(whole_batch=True), to a head-parallel call)")
    return tuple(getattr(seqlens, name) for name in given)


def _check_int_tensor(name: str, t: object) -> None:
    """``TypeError`` unless ``t`` is an int32/int64 tensor."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int32/int64 tensor, got {what}")


def _check_beside(name: str, t: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """``ValueError`` naming ``name`` unless ``t`` is on the device of ``cu_seqlens``."""
    if not devices_match(t.device, cu_seqlens.device):
        raise ValueError(f"{name} must be on the device of cu_seqlens ({cu_seqlens.device}), got {t.device}")


def _check_chunk_offsets(chunk_offsets: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                         cu_seqlens: torch.Tensor | None) -> None:
    """Reject a ``chunk_offsets`` FLA's state kernels would misread (not ``[N + 1]`` ints beside ``chunk_indices``)."""
    if chunk_offsets is None:
        return
    if chunk_indices is None:
        raise ValueError("chunk_offsets needs chunk_indices (the state count is its row count); got chunk_indices=None")
    _check_int_tensor("chunk_offsets", chunk_offsets)
    if chunk_offsets.shape != cu_seqlens.shape:
        raise ValueError(
            f"chunk_offsets must be [N + 1] like cu_seqlens {tuple(cu_seqlens.shape)}, got {tuple(chunk_offsets.shape)}"
        )
    _check_beside("chunk_offsets", chunk_offsets, cu_seqlens)


def _check_chunk_indices(chunk_indices: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> None:
    """Reject a ``chunk_indices`` of the wrong form (FLA's kernels index memory with it unchecked); values unchecked."""
    if chunk_indices is None:
        return
    if cu_seqlens is None:
        raise ValueError("chunk_indices describes packed documents and needs cu_seqlens; got cu_seqlens=None")
    _check_int_tensor("chunk_indices", chunk_indices)
    if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(
            f"chunk_indices must be [NT, 2] rows (document, chunk), got shape {tuple(chunk_indices.shape)}"
        )
    _check_beside("chunk_indices", chunk_indices, cu_seqlens)
