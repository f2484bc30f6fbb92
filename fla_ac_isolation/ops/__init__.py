"""Varlen operations behind the mixers, with a choice of backend.

Three operations, each offered by two backends with identical signatures: ``fla``
(:mod:`fla_ac_isolation.fla_seam.kernels`, FLA's Triton kernels) | ``reference``
(:mod:`fla_ac_isolation.ops.reference`, pure torch):

* :func:`causal_conv1d`: FLA's ``fla.modules.causal_conv1d.causal_conv1d`` | per-document ``F.conv1d``;
* :func:`chunk_gated_delta_rule`: FLA's ``chunk_gated_delta_rule`` | chunked WY form in torch;
* :func:`ssd` (Mamba2): FLA's ``chunk_simple_gla`` | chunked SSD in torch.

``backend`` is ``"auto"`` (``fla`` for CUDA tensors, ``reference`` otherwise), ``"fla"`` or
``"reference"``. Packed documents are described by ``cu_seqlens`` (``[N + 1]`` int offsets, batch size 1)
and optionally ``cu_seqlens_cpu`` (its host copy); both backends hand them to FLA's index helpers, so
pass the per-layer tensors of :meth:`~fla_ac_isolation.LayerLocalSeqlens.local`. The conv and the gated
delta rule also take FLA's ``chunk_indices`` (``LocalSeqlens.chunk_indices``), which spares them
``prepare_chunk_indices``; FLA's simple GLA (behind :func:`ssd`) has no such argument.

Context parallelism: the conv and the gated delta rule take ``cp_context`` (``LocalSeqlens.cp_context``),
FLA's CP metadata; only the ``fla`` backend has CP kernels (:func:`check_cp_backend`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from fla_ac_isolation.fla_seam import kernels as fla_backend
from fla_ac_isolation.ops import reference as reference_backend
from fla_ac_isolation.seqlens import devices_match

__all__ = [
    "BACKENDS",
    "Backend",
    "causal_conv1d",
    "check_backend",
    "check_chunk_indices",
    "check_cp_backend",
    "chunk_gated_delta_rule",
    "resolve_backend",
    "ssd",
]

Backend = Literal["auto", "fla", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "fla", "reference")


def check_backend(backend: str) -> str:
    """Return ``backend`` if it is one of :data:`BACKENDS`.

    Raises:
        ValueError: naming ``backend`` and the accepted values.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(backend: str, tensor: torch.Tensor) -> Literal["fla", "reference"]:
    """The concrete backend for ``tensor``: ``auto`` picks ``fla`` on CUDA, ``reference`` elsewhere.

    Raises:
        ValueError: unknown ``backend``.
    """
    check_backend(backend)
    if backend == "auto":
        return "fla" if tensor.device.type == "cuda" else "reference"
    return backend  # type: ignore[return-value]


def _module(backend: str, tensor: torch.Tensor):
    return fla_backend if resolve_backend(backend, tensor) == "fla" else reference_backend


def check_chunk_indices(chunk_indices: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> None:
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


def check_cp_backend(cp_context: object | None, backend: str, tensor: torch.Tensor) -> None:
    """Refuse context parallelism on a backend without CP kernels.

    Raises:
        NotImplementedError: ``cp_context`` is given and ``backend`` resolves to ``reference`` for ``tensor``
            (the pure-torch backend computes whole sequences only; FLA's CP kernels are the ``fla`` backend:
            CUDA, or a CPU under ``TRITON_INTERPRET=1`` with the test shims of
            :mod:`fla_ac_isolation.testing.cp_shims`).
    """
    if cp_context is None or resolve_backend(backend, tensor) != "reference":
        return
    chosen = f"backend={backend!r}" + (f" (which picks 'reference' for {tensor.device.type} tensors)"
                                       if backend == "auto" else "")
    raise NotImplementedError(
        f"context parallelism needs FLA's CP kernels, but {chosen} has none: the reference backend computes "
        "whole sequences only; use backend='fla' (CUDA, or a CPU under TRITON_INTERPRET=1 with "
        "fla_ac_isolation.testing.cp_shims)"
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
) -> torch.Tensor:
    """Depthwise causal conv1d (+ SiLU) restarted at every document.

    ``x [B, T, D]``, ``weight [D, W]``, ``bias [D]`` -> ``[B, T, D]``. See
    :func:`fla_ac_isolation.ops.reference.causal_conv1d` for the details. With ``cp_context`` (FLA's
    ``FLACPContext``): ``x`` is this rank's ``[1, T / W, D]`` shard, FLA's ``causal_conv1d_cp`` fetches the
    conv history from the previous rank, and ``weight``/``bias`` receive this rank's part of their
    gradient (sum it over the CP group).

    Raises:
        ValueError: unknown ``backend``; malformed ``chunk_indices`` (:func:`check_chunk_indices`); the
            backend's own checks (see :mod:`~fla_ac_isolation.ops.reference`).
        TypeError: ``chunk_indices`` is not an integer tensor.
        NotImplementedError: ``cp_context`` with the reference backend (:func:`check_cp_backend`).
    """
    check_chunk_indices(chunk_indices, cu_seqlens)
    check_cp_backend(cp_context, backend, x)
    if cp_context is not None:
        return fla_backend.causal_conv1d(x, weight, bias, activation=activation, chunk_indices=chunk_indices,
                                         cp_context=cp_context)
    return _module(backend, x).causal_conv1d(
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
) -> torch.Tensor:
    """Gated delta rule, zero state at every document start.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` -> ``[B, T, HV, V]``. See
    :func:`fla_ac_isolation.ops.reference.chunk_gated_delta_rule`. With ``cp_context``: ``T`` is this
    rank's ``T / W`` tokens and FLA passes the recurrent states along the CP ranks
    (``fla.ops.gated_delta_rule.chunk_gated_delta_rule(..., cp_context=)``).

    Raises:
        ValueError: unknown ``backend``; malformed ``chunk_indices`` (:func:`check_chunk_indices`); the
            backend's own checks (see :mod:`~fla_ac_isolation.ops.reference`).
        TypeError: ``chunk_indices`` is not an integer tensor.
        NotImplementedError: ``cp_context`` with the reference backend (:func:`check_cp_backend`).
    """
    check_chunk_indices(chunk_indices, cu_seqlens)
    check_cp_backend(cp_context, backend, q)
    if cp_context is not None:
        return fla_backend.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                  chunk_indices=chunk_indices, cp_context=cp_context)
    return _module(backend, q).chunk_gated_delta_rule(
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
    backend: Backend = "auto",
) -> torch.Tensor:
    """Mamba2 SSD scan, zero state at every document start.

    ``x [B, T, H, P]``, ``dt [B, T, H]`` (raw), ``A [H]``, ``B, C [B, T, G, N]``, ``D [H]`` ->
    ``[B, T, H, P]``. See :func:`fla_ac_isolation.ops.reference.ssd`.
    """
    return _module(backend, x).ssd(
        x, dt, A, B, C,
        D=D,
        dt_bias=dt_bias,
        dt_limit=dt_limit,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
