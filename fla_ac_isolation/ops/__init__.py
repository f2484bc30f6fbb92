"""Varlen operations behind the mixers, with a choice of backend.

Four operations, each offered by two backends with identical signatures: ``fla``
(:mod:`fla_ac_isolation.fla_seam.kernels`, :mod:`fla_ac_isolation.fla_seam.kda`: FLA's Triton kernels) |
``reference`` (:mod:`fla_ac_isolation.ops.reference`, :mod:`fla_ac_isolation.ops.reference_kda`: pure torch):

* :func:`causal_conv1d`: FLA's ``fla.modules.causal_conv1d.causal_conv1d`` | per-document ``F.conv1d``;
* :func:`chunk_gated_delta_rule`: FLA's ``chunk_gated_delta_rule`` | chunked WY form in torch;
* :func:`ssd` (Mamba2): FLA's ``chunk_simple_gla`` | chunked SSD in torch;
* :func:`chunk_kda` (Kimi Delta Attention): FLA's ``chunk_kda`` | token-by-token recurrence in torch. It has
  no ``chunk_indices`` (FLA's ``chunk_kda`` takes none), no ``saveable`` and no ``cp_context``.

``backend`` is ``"auto"`` (``fla`` for CUDA tensors, ``reference`` otherwise), ``"fla"`` or
``"reference"``. Packed documents are described by ``cu_seqlens`` (``[N + 1]`` int offsets, batch size 1)
and optionally ``cu_seqlens_cpu`` (its host copy); both backends hand them to FLA's index helpers, so
pass the per-layer tensors of :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`. All three also take FLA's
``chunk_indices`` (``LocalSeqlens.chunk_indices``), which spares them ``prepare_chunk_indices``; :func:`ssd`
also takes ``chunk_offsets`` (``LocalSeqlens.chunk_offsets``), with which its ``fla`` backend runs FLA's
simple GLA without a host synchronisation (:mod:`fla_ac_isolation.fla_seam.simple_gla`).

``saveable=True`` (opt-in) routes a call through torch custom operators instead
(:mod:`fla_ac_isolation.fla_seam.custom_ops` | :mod:`fla_ac_isolation.ops.reference_ops`): the same
computation, FLA's own forward and backward functions on the ``fla`` backend, but one operator per call,
whose outputs a selective-AC policy can save (:func:`fla_ac_isolation.policies.save_fla_ops`, operators
listed in :data:`SAVEABLE_OPS`) and which ``torch.compile`` traces without a graph break. A saved operator
is not rerun in the recompute, so it looks nothing up in FLA's cache there. Because FLA's index helpers
then run *inside* one operator, a ``cu_seqlens`` shared by checkpointed layers becomes safe **for these
operators**; it does not make anything else safe (context-parallel metadata built outside them, other FLA
helpers, foreign modules): keep passing :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`'s tensors.

``SAVEABLE_OPS`` (``dict[str, tuple[OpOverload, OpOverload]]``): the custom operators behind
``saveable=True``, per operation of :data:`~fla_ac_isolation.op_names.SAVEABLE_OP_NAMES`: the ``fla`` and
the ``reference`` backend's forward overloads, whose outputs :func:`fla_ac_isolation.policies.save_fla_ops`
saves. Outputs per call:

* ``gated_delta_rule`` (``fla``): ``o [B, T, HV, V]`` (dtype of q), ``A [B, T, HV, 64]`` (dtype of k),
  ``g_cumsum [B, T, HV]`` fp32, ``q_rstd``/``k_rstd`` ``[B, T, H]`` fp32; (``reference``): ``o``.
* ``causal_conv1d``: ``y [B, T, D]`` (dtype of x).
* ``ssd`` (``fla``, FLA's simple GLA): ``o [B, T, H, P]`` (dtype of x), ``g_cumsum [B, T, H]`` fp32;
  (``reference``, the scan): ``y [B, T, H, P]`` in float32.

Context parallelism: the conv and the gated delta rule take ``cp_context`` (``LocalSeqlens.cp_context``),
FLA's CP metadata; only the ``fla`` backend has CP kernels
(:func:`~fla_ac_isolation.ops.backend.check_cp_backend`), and they are not wrapped as custom operators
(``saveable=True`` with ``cp_context`` is refused).

The backend choice and its checks live in :mod:`fla_ac_isolation.ops.backend`; the input checks both
backends share in :mod:`fla_ac_isolation.op_inputs`.
"""

from __future__ import annotations

import math

import torch

from fla_ac_isolation.fla_seam import custom_ops as fla_saveable_backend
from fla_ac_isolation.fla_seam import kda as fla_kda_backend
from fla_ac_isolation.fla_seam import kernels as fla_backend
from fla_ac_isolation.op_inputs import check_heads, check_kda_gates, check_packed
from fla_ac_isolation.op_names import SAVEABLE_OP_NAMES
from fla_ac_isolation.ops import reference as reference_backend
from fla_ac_isolation.ops import reference_kda as reference_kda_backend
from fla_ac_isolation.ops import reference_ops as reference_saveable_backend
from fla_ac_isolation.ops.backend import BACKENDS, Backend, check_cp_backend, check_saveable, resolve_backend
from fla_ac_isolation.seqlens import devices_match

__all__ = ["BACKENDS", "SAVEABLE_OPS", "Backend", "causal_conv1d", "chunk_gated_delta_rule", "chunk_kda", "ssd"]

SAVEABLE_OPS: dict[str, tuple[torch._ops.OpOverload, torch._ops.OpOverload]] = {
    name: (fla_saveable_backend.OPS[name], reference_saveable_backend.OPS[name]) for name in SAVEABLE_OP_NAMES
}
"""The custom operators behind ``saveable=True``: ``(fla, reference)`` forward overloads per operation name."""


def _module(backend: str, tensor: torch.Tensor, saveable: bool):
    """The module implementing the three operations for ``backend`` on ``tensor``, plain or as custom ops.

    Raises:
        ValueError: unknown ``backend``.
        TypeError: ``saveable`` is not a bool.
    """
    check_saveable(saveable)
    if resolve_backend(backend, tensor) == "fla":
        return fla_saveable_backend if saveable else fla_backend
    return reference_saveable_backend if saveable else reference_backend


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
    if not isinstance(chunk_offsets, torch.Tensor) or chunk_offsets.dtype not in (torch.int32, torch.int64):
        what = chunk_offsets.dtype if isinstance(chunk_offsets, torch.Tensor) else type(chunk_offsets).__name__
        raise TypeError(f"chunk_offsets must be an int32/int64 tensor, got {what}")
    if chunk_offsets.shape != cu_seqlens.shape:
        raise ValueError(
            f"chunk_offsets must be [N + 1] like cu_seqlens {tuple(cu_seqlens.shape)}, got {tuple(chunk_offsets.shape)}"
        )
    if not devices_match(chunk_offsets.device, cu_seqlens.device):
        raise ValueError(
            f"chunk_offsets must be on the device of cu_seqlens ({cu_seqlens.device}), got {chunk_offsets.device}"
        )


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
    if not isinstance(chunk_indices, torch.Tensor) or chunk_indices.dtype not in (torch.int32, torch.int64):
        what = chunk_indices.dtype if isinstance(chunk_indices, torch.Tensor) else type(chunk_indices).__name__
        raise TypeError(f"chunk_indices must be an int32/int64 tensor, got {what}")
    if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(
            f"chunk_indices must be [NT, 2] rows (document, chunk), got shape {tuple(chunk_indices.shape)}"
        )
    if not devices_match(chunk_indices.device, cu_seqlens.device):
        raise ValueError(
            f"chunk_indices must be on the device of cu_seqlens ({cu_seqlens.device}), got {chunk_indices.device}"
        )


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

    ``x [B, T, D]``, ``weight [D, W]``, ``bias [D]`` -> ``[B, T, D]``. See
    :func:`fla_ac_isolation.ops.reference.causal_conv1d` for the details. ``saveable=True``: one custom
    operator (``fla_ac_isolation::causal_conv1d`` | ``causal_conv1d_reference``), see the module docstring.
    With ``cp_context`` (FLA's ``FLACPContext``): ``x`` is this rank's ``[1, T / W, D]`` shard, FLA's
    ``causal_conv1d_cp`` fetches the conv history from the previous rank, and ``weight``/``bias`` receive
    this rank's part of their gradient (sum it over the CP group).

    Raises:
        ValueError: unknown ``backend``; malformed ``chunk_indices`` (not ``[NT, 2]`` rows on the device of
            ``cu_seqlens``); the backend's own checks (see :mod:`~fla_ac_isolation.ops.reference`).
        TypeError: ``chunk_indices`` is not an integer tensor; ``saveable`` is not a bool.
        NotImplementedError: ``cp_context`` with the reference backend or ``saveable=True``
            (:func:`~fla_ac_isolation.ops.backend.check_cp_backend`).
    """
    _check_chunk_indices(chunk_indices, cu_seqlens)
    check_cp_backend(cp_context, backend, x, saveable)
    if cp_context is not None:
        return fla_backend.causal_conv1d(x, weight, bias, activation=activation, chunk_indices=chunk_indices,
                                         cp_context=cp_context)
    return _module(backend, x, saveable).causal_conv1d(
        x, weight, bias, activation=activation, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )


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
    :func:`fla_ac_isolation.ops.reference.chunk_gated_delta_rule`. ``saveable=True``: one custom operator
    (``fla_ac_isolation::gated_delta_rule`` | ``gated_delta_rule_reference``), see the module docstring.
    With ``cp_context``: ``T`` is this rank's ``T / W`` tokens and FLA passes the recurrent states along the
    CP ranks (``fla.ops.gated_delta_rule.chunk_gated_delta_rule(..., cp_context=)``).

    Raises:
        ValueError: unknown ``backend``; malformed ``chunk_indices`` (not ``[NT, 2]`` rows on the device of
            ``cu_seqlens``); the backend's own checks (see :mod:`~fla_ac_isolation.ops.reference`).
        TypeError: ``chunk_indices`` is not an integer tensor; ``saveable`` is not a bool.
        NotImplementedError: ``cp_context`` with the reference backend or ``saveable=True``
            (:func:`~fla_ac_isolation.ops.backend.check_cp_backend`).
    """
    _check_chunk_indices(chunk_indices, cu_seqlens)
    check_cp_backend(cp_context, backend, q, saveable)
    if cp_context is not None:
        return fla_backend.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                  chunk_indices=chunk_indices, cp_context=cp_context)
    return _module(backend, q, saveable).chunk_gated_delta_rule(
        q, k, v, g, beta,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )


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
    ``[B, T, H, P]``. See :func:`fla_ac_isolation.ops.reference.ssd`. ``saveable=True``: the scan is one
    custom operator (``fla_ac_isolation::simple_gla`` | ``ssd_scan_reference``), see the module docstring.
    ``chunk_indices [NT, 2]`` and ``chunk_offsets [N + 1]``: FLA's chunk schedule and each document's first
    row in it (``LocalSeqlens``); with both, the ``fla`` backend makes no host synchronisation.

    Raises:
        ValueError: unknown ``backend``; ``H`` not a multiple of the groups of ``B``/``C``; malformed
            ``chunk_indices``/``chunk_offsets`` (``chunk_offsets`` without ``chunk_indices``, shapes, device);
            the backend's own checks (see :mod:`~fla_ac_isolation.ops.reference`).
        TypeError: ``saveable`` is not a bool; ``chunk_indices``/``chunk_offsets`` not integer tensors.
    """
    _check_chunk_indices(chunk_indices, cu_seqlens)
    _check_chunk_offsets(chunk_offsets, chunk_indices, cu_seqlens)
    return _module(backend, x, saveable).ssd(
        x, dt, A, B, C,
        D=D,
        dt_bias=dt_bias,
        dt_limit=dt_limit,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
    )


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

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]`` (log decay, ``<= 0``), ``beta [B, T, HV]``
    -> ``[B, T, HV, V]`` in the dtype of ``q``. See :func:`fla_ac_isolation.ops.reference_kda.chunk_kda` for
    the maths; the ``fla`` backend is FLA's ``chunk_kda`` (:func:`fla_ac_isolation.fla_seam.kda.chunk_kda`).
    Both backends look up FLA's ``prepare_chunk_indices`` (by keyword, as ``chunk_kda`` does) and
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
        return reference_kda_backend.chunk_kda(q, k, v, g, beta, **kwargs)
    if q.shape[-1] > fla_kda_backend.MAX_KEY_DIM:
        raise ValueError(
            f"FLA's chunk_kda takes key head dims up to {fla_kda_backend.MAX_KEY_DIM}, got K = {q.shape[-1]} "
            "(q [B, T, H, K]); use backend='reference'"
        )
    return fla_kda_backend.chunk_kda(q, k, v, g, beta, **kwargs)
