"""Varlen operations behind the mixers, with a choice of backend: one entry point per operation.

Four operations, each computed by two backends from the same arguments: ``fla`` (FLA's Triton kernels,
called here through :mod:`fla_ac_isolation.fla_seam`) | ``reference`` (pure torch,
:mod:`fla_ac_isolation.ops.reference`, :mod:`fla_ac_isolation.ops.reference_kda`):

* :func:`causal_conv1d`: FLA's ``fla.modules.causal_conv1d.causal_conv1d`` | per-document ``F.conv1d``;
* :func:`chunk_gated_delta_rule`: FLA's ``chunk_gated_delta_rule`` | chunked WY form in torch;
* :func:`ssd` (Mamba2): FLA's simple GLA (:mod:`fla_ac_isolation.fla_seam.simple_gla`) | chunked SSD in torch;
* :func:`chunk_kda` (Kimi Delta Attention): FLA's ``chunk_kda`` | token-by-token recurrence in torch. It has
  no ``chunk_indices`` (FLA's ``chunk_kda`` takes none), no ``saveable`` and no ``cp_context``.

``backend`` is ``"auto"`` (``fla`` for CUDA tensors, ``reference`` otherwise), ``"fla"`` or
``"reference"``. Packed documents are described by ``cu_seqlens`` (``[N + 1]`` int offsets, batch size 1)
and optionally ``cu_seqlens_cpu`` (its host copy); both backends hand them to FLA's index helpers, so
pass the per-layer tensors of :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`. All three also take FLA's
``chunk_indices`` (``LocalSeqlens.chunk_indices``), which spares them ``prepare_chunk_indices``; :func:`ssd`
also takes ``chunk_offsets`` (``LocalSeqlens.chunk_offsets``), with which its ``fla`` backend runs FLA's
simple GLA without a host synchronisation. FLA's conv has a fixed chunk size, so the schedule is handed to it
only while that size is :data:`~fla_ac_isolation.fla_seam.layout.CHUNK_SIZE`
(:func:`~fla_ac_isolation.fla_seam.layout.conv_takes_chunk_indices`); a schedule for another chunk size would
be read silently wrong. The ``fla`` backend needs CUDA tensors (or a CPU under ``TRITON_INTERPRET=1`` with the
harness's interpreter backend) and imports FLA only when called.

``saveable=True`` (opt-in) routes a call through torch custom operators instead
(:mod:`fla_ac_isolation.ops.saveable`): the same computation, FLA's own forward and backward functions on the
``fla`` backend, but one operator per call, whose outputs a selective-AC policy can save
(:func:`fla_ac_isolation.policies.save_fla_ops`, operators listed in :data:`SAVEABLE_OPS`) and which
``torch.compile`` traces without a graph break. A saved operator is not rerun in the recompute, so it looks
nothing up in FLA's cache there. Because FLA's index helpers then run *inside* one operator, a ``cu_seqlens``
shared by checkpointed layers becomes safe **for these operators**; it does not make anything else safe
(context-parallel metadata built outside them, other FLA helpers, foreign modules): keep passing
:meth:`~fla_ac_isolation.LayerLocalSeqlens.local`'s tensors.

``SAVEABLE_OPS`` (``dict[str, tuple[OpOverload, OpOverload]]``): the custom operators behind
``saveable=True``, per operation of :data:`~fla_ac_isolation.op_names.SAVEABLE_OP_NAMES`: the ``fla`` and
the ``reference`` backend's forward overloads, whose outputs :func:`fla_ac_isolation.policies.save_fla_ops`
saves. Outputs per call:

* ``gated_delta_rule`` (``fla``): ``o [B, T, HV, V]`` (dtype of q), ``A [B, T, HV, 64]`` (dtype of k),
  ``g_cumsum [B, T, HV]`` fp32, ``q_rstd``/``k_rstd`` ``[B, T, H]`` fp32; (``reference``): ``o``.
* ``causal_conv1d``: ``y [B, T, D]`` (dtype of x).
* ``ssd`` (``fla``, FLA's simple GLA): ``o [B, T, H, P]`` (dtype of x), ``g_cumsum [B, T, H]`` fp32;
  (``reference``, the scan): ``y [B, T, H, P]`` in float32.

Context parallelism: the conv and the gated delta rule take ``cp_context`` (``LocalSeqlens.cp_context``,
FLA's ``FLACPContext``); the tensors are then this rank's shard, FLA takes the rank-local offsets from the
context (``cu_seqlens`` is not passed) and exchanges conv history and recurrent states with the other ranks of
``cp_context.group``; ``chunk_indices`` must then be the rank-local schedule. Only the ``fla`` backend has CP
kernels (:func:`~fla_ac_isolation.ops.backend.check_cp_backend`), and they are not wrapped as custom operators
(``saveable=True`` with ``cp_context`` is refused). FLA's simple GLA (behind :func:`ssd`) has no CP.

The backend choice and its checks live in :mod:`fla_ac_isolation.ops.backend`; the input checks both
backends share in :mod:`fla_ac_isolation.op_inputs`.
"""

from __future__ import annotations

import math

import torch

from fla_ac_isolation.fla_seam import features
from fla_ac_isolation.fla_seam.kda import MAX_KEY_DIM
from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE, conv_takes_chunk_indices
from fla_ac_isolation.fla_seam.simple_gla import schedule, simple_gla
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
"""The custom operators behind ``saveable=True``: ``(fla, reference)`` forward overloads per operation name."""


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object | None = None,
    backend: Backend = "auto",
    saveable: bool = False,
) -> torch.Tensor:
    """Depthwise causal conv1d (+ SiLU) restarted at every document.

    ``x [B, T, D]``, ``weight [D, W]``, ``bias [D]`` -> ``[B, T, D]`` (dtype of ``x``). See
    :func:`fla_ac_isolation.ops.reference.causal_conv1d` for the details. ``fla``: FLA's
    ``causal_conv1d(..., backend="triton")``; ``saveable=True``: one custom operator
    (``fla_ac_isolation::causal_conv1d``, FLA's ``causal_conv1d_fwd``/``_bwd`` | ``causal_conv1d_reference``).
    With ``cp_context`` (FLA's ``FLACPContext``): ``x`` is this rank's ``[1, T / W, D]`` shard, FLA's
    ``causal_conv1d_cp`` fetches the conv history from the previous rank, and ``weight``/``bias`` receive
    this rank's part of their gradient (sum it over the CP group).

    Raises:
        ValueError: unknown ``backend``; malformed ``chunk_indices`` (not ``[NT, 2]`` rows on the device of
            ``cu_seqlens``); ``backend='fla'`` with CPU tensors outside Triton's interpreter; the reference's
            own checks (see :mod:`~fla_ac_isolation.ops.reference`).
        TypeError: ``chunk_indices`` is not an integer tensor; ``saveable`` is not a bool.
        NotImplementedError: ``cp_context`` with the reference backend or ``saveable=True``
            (:func:`~fla_ac_isolation.ops.backend.check_cp_backend`).
    """
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
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object | None = None,
    backend: Backend = "auto",
    saveable: bool = False,
) -> torch.Tensor:
    """Gated delta rule, zero state at every document start.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` -> ``[B, T, HV, V]``. See
    :func:`fla_ac_isolation.ops.reference.chunk_gated_delta_rule`. ``fla``: FLA's ``chunk_gated_delta_rule``
    (``use_qk_l2norm_in_kernel``, native GVA, chunk size 64; ``chunk_indices`` reaches it where it takes one:
    fla-core 0.6, while 0.5.2 builds the schedule from this call's ``cu_seqlens``). ``saveable=True``: one
    custom operator (``fla_ac_isolation::gated_delta_rule`` | ``gated_delta_rule_reference``); ``scale``
    defaults to ``K ** -0.5``. With ``cp_context``: ``T`` is this rank's ``T / W`` tokens and FLA passes the
    recurrent states along the CP ranks.

    Raises:
        ValueError: unknown ``backend``; malformed ``chunk_indices`` (not ``[NT, 2]`` rows on the device of
            ``cu_seqlens``); ``backend='fla'`` with CPU tensors outside Triton's interpreter; the reference's
            own checks (see :mod:`~fla_ac_isolation.ops.reference`).
        TypeError: ``chunk_indices`` is not an integer tensor; ``saveable`` is not a bool.
        NotImplementedError: ``cp_context`` with the reference backend or ``saveable=True``
            (:func:`~fla_ac_isolation.ops.backend.check_cp_backend`).
        FlaFeatureError: ``chunk_indices`` inside a CUDA graph capture on an FLA without ``chunk_indices=``.
    """
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
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    backend: Backend = "auto",
    saveable: bool = False,
) -> torch.Tensor:
    """Mamba2 SSD scan, zero state at every document start.

    ``x [B, T, H, P]``, ``dt [B, T, H]`` (raw), ``A [H]``, ``B, C [B, T, G, N]``, ``D [H]`` ->
    ``[B, T, H, P]``. See :func:`fla_ac_isolation.ops.reference.ssd` for the maths. ``fla``: FLA's simple GLA
    with ``q = C``, ``k = B``, ``v = dt * x``, ``g = dt * A`` and ``scale = 1``, plus ``D * x`` added here (its
    recurrence is the SSD's under that mapping, reset at every document by ``cu_seqlens``); ``dt`` is
    discretised in float32, ``v`` rounded to the dtype of ``x``, ``g`` kept float32, and ``B``/``C`` expanded
    from ``G`` groups to ``H`` heads (inside the operator with ``saveable=True``). The numbers are those of
    FLA's ``chunk_simple_gla(q, k, v, g, scale=1, cu_seqlens=...)``, bit for bit. ``saveable=True``: the scan
    is one custom operator (``fla_ac_isolation::simple_gla`` | ``ssd_scan_reference``). ``chunk_indices
    [NT, 2]`` and ``chunk_offsets [N + 1]``: FLA's chunk schedule and each document's first row in it
    (``LocalSeqlens``); with both, the ``fla`` backend makes no host synchronisation.

    Raises:
        ValueError: unknown ``backend``; ``H`` not a multiple of the groups of ``B``/``C``; malformed
            ``chunk_indices``/``chunk_offsets`` (``chunk_offsets`` without ``chunk_indices``, shapes, device);
            ``backend='fla'`` with CPU tensors outside Triton's interpreter; the reference's own checks.
        TypeError: ``saveable`` is not a bool; ``chunk_indices``/``chunk_offsets`` not integer tensors.
        FlaFeatureError: ``backend='fla'`` on an FLA without the kernels the SSD needs (fla-core 0.5.2).
    """
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
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Kimi Delta Attention (a gated delta rule with a decay per key channel), zero state at every document
    start.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` (log decay, ``<= 0``, float32 preferred),
    ``beta [B, T, HV]`` -> ``[B, T, HV, V]`` in the dtype of ``q``. See
    :func:`fla_ac_isolation.ops.reference_kda.chunk_kda` for the maths; ``fla``: FLA's ``chunk_kda`` (fla-core
    0.6, ``fla/ops/kda/chunk.py``) with the log decay precomputed by the caller (``use_gate_in_kernel=False``),
    native GVA and chunk size 64. Both backends look up FLA's ``prepare_chunk_indices`` (by keyword, as
    ``chunk_kda`` does: :func:`~fla_ac_isolation.fla_seam.kda.prepare_kda_chunk_indices`) and
    ``prepare_chunk_offsets`` for ``cu_seqlens``: pass :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`'s
    tensors.

    Raises:
        ValueError: unknown ``backend``; ``g``/``beta`` not ``[B, T, HV, K]``/``[B, T, HV]``; head counts
            that do not divide; ``B != 1`` with ``cu_seqlens``; ``K`` above FLA's limit
            (:data:`~fla_ac_isolation.fla_seam.kda.MAX_KEY_DIM`) on the ``fla`` backend; ``backend='fla'``
            with CPU tensors outside Triton's interpreter.
    """
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


def _check_int_tensor(name: str, t: object) -> None:
    """``TypeError`` naming ``name`` unless ``t`` is an int32/int64 tensor (a chunk schedule's form)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int32/int64 tensor, got {what}")


def _check_beside(name: str, t: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """``ValueError`` naming ``name`` unless ``t`` is on the device of ``cu_seqlens``."""
    if not devices_match(t.device, cu_seqlens.device):
        raise ValueError(f"{name} must be on the device of cu_seqlens ({cu_seqlens.device}), got {t.device}")


def _check_chunk_offsets(chunk_offsets: torch.Tensor | None, chunk_indices: torch.Tensor | None,
                         cu_seqlens: torch.Tensor | None) -> None:
    """Reject a ``chunk_offsets`` that FLA's state kernels would misread: ``[N + 1]`` integers on the device of
    ``cu_seqlens``, given together with ``chunk_indices`` (the state count is ``len(chunk_indices)``).

    Raises:
        ValueError: ``chunk_offsets`` without ``chunk_indices``, or not ``[N + 1]`` like ``cu_seqlens``, or on
            another device.
        TypeError: not an int32/int64 tensor.
    """
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
    """Reject a ``chunk_indices`` that FLA's kernels would misread (they index memory with it unchecked).

    Checks the form only (``[NT, 2]`` integer rows on the device of ``cu_seqlens``); the values are those
    of :func:`~fla_ac_isolation.seqlens.chunk_indices_for` when it comes from
    :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`.

    Raises:
        ValueError: ``chunk_indices`` given without ``cu_seqlens``, not ``[NT, 2]``, or on another device.
        TypeError: not an int32/int64 tensor.
    """
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
