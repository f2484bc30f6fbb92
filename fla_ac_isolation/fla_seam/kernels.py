"""The ``fla`` backend of :mod:`fla_ac_isolation.ops`: its three varlen operations on FLA's Triton kernels.

Each function has the signature and semantics of its twin in :mod:`~fla_ac_isolation.ops.reference`
(the parity oracle); read that module for the maths. This one only maps our arguments onto FLA 0.6:

* :func:`causal_conv1d` -> ``fla.modules.causal_conv1d.causal_conv1d`` (Triton backend, the functional
  form behind ``fla.modules.ShortConvolution``); weight ``[D, W]``.
* :func:`chunk_gated_delta_rule` -> ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with
  ``use_qk_l2norm_in_kernel`` and native GVA (``HV > H``).
* :func:`ssd` -> FLA's simple GLA (``fla.ops.simple_gla.chunk_simple_gla``'s kernels, through
  :mod:`~fla_ac_isolation.fla_seam.simple_gla`, which sizes its state tensors on the host) with ``q = C``,
  ``k = B``, ``v = dt * x``, ``g = dt * A`` and ``scale = 1``, plus ``D * x`` added here. Simple GLA's recurrence
  ``S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale * S_t^T q_t`` *is* the SSD recurrence under that
  mapping, and it is reset at every document by ``cu_seqlens``. We use it rather than mamba_ssm's
  ``mamba_chunk_scan_combined(seq_idx=...)`` because it ships with fla-core (pure Triton, nothing to
  compile, available on the device image), takes ``cu_seqlens``/``cu_seqlens_cpu`` like the other two
  operations, and goes through the same ``tensor_cache``'d index helpers, so one isolation mechanism
  covers every mixer. Cost: ``B``/``C`` are expanded from ``G`` groups to ``H`` heads before the call.

``cu_seqlens`` and ``cu_seqlens_cpu`` are passed to FLA wherever its API takes them; pass the tensors
returned by :meth:`~fla_ac_isolation.LayerLocalSeqlens.local` so each layer gets its own objects.
``chunk_indices`` (the conv, the gated delta rule and the SSD; the SSD also takes ``chunk_offsets``, and
then makes no host synchronisation) is passed with ``chunk_size=CHUNK_SIZE`` where FLA takes a chunk
size; FLA's conv has a fixed chunk size, so the schedule is only handed to it while that size is
:data:`~fla_ac_isolation.fla_seam.layout.CHUNK_SIZE`
(:func:`~fla_ac_isolation.fla_seam.layout.conv_takes_chunk_indices`), and otherwise left for FLA to compute.
A schedule for another chunk size would be read silently wrong by the kernel.

Context parallelism: the conv and the gated delta rule take FLA's ``cp_context`` (an ``FLACPContext``,
``LocalSeqlens.cp_context``); the tensors are then this rank's shard and FLA takes the rank-local offsets
from the context (``cu_seqlens`` is not passed), exchanging conv history and recurrent states with the
other ranks of ``cp_context.group``. ``chunk_indices`` must then be the RANK-LOCAL schedule. FLA's simple
GLA (behind :func:`ssd`) has no CP in FLA 0.6.

FLA is imported inside each function, never at import. The kernels need CUDA tensors (or a CPU under
``TRITON_INTERPRET=1`` with the harness's interpreter backend, ``harness/fla_seam/interpreter.py``).
"""

from __future__ import annotations

import math
import os

import torch

from fla_ac_isolation.fla_seam import features
from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE, conv_takes_chunk_indices
from fla_ac_isolation.fla_seam.simple_gla import schedule, simple_gla
from fla_ac_isolation.op_inputs import discretize_dt

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "ssd"]


def _check_device(t: torch.Tensor) -> None:
    """FLA's Triton kernels need a GPU; on CPU they only run under Triton's interpreter."""
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            "backend='fla' needs CUDA tensors (FLA's Triton kernels have no CPU backend); got CPU tensors. "
            "Use backend='reference' (or 'auto') on CPU, or TRITON_INTERPRET=1 for kernel tests."
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
) -> torch.Tensor:
    """Depthwise causal conv1d reset at every document; see :func:`reference.causal_conv1d`.

    ``x [B, T, D]``, ``weight [D, W]``, ``bias [D]`` or ``None`` -> ``[B, T, D]`` (dtype of ``x``). With
    ``cp_context``: ``x [1, T / W, D]`` is this rank's shard and the result too (FLA's
    ``causal_conv1d_cp``; the gradients of ``weight``/``bias`` are this rank's part, summed by the caller).
    """
    fla_causal_conv1d = features.module("conv").causal_conv1d

    _check_device(x)
    if cp_context is not None:
        y, _ = fla_causal_conv1d(
            x=x, weight=weight, bias=bias, activation=activation, backend="triton", cp_context=cp_context,
            chunk_indices=chunk_indices if conv_takes_chunk_indices() else None,
        )
        return y
    y, _ = fla_causal_conv1d(
        x=x,
        weight=weight,
        bias=bias,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices if conv_takes_chunk_indices() else None,
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
) -> torch.Tensor:
    """The gated delta rule on FLA's chunk kernel; see :func:`reference.chunk_gated_delta_rule`.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` -> ``[B, T, HV, V]``. With
    ``cp_context``: ``T`` is this rank's ``T / W`` tokens; FLA passes the states along the ranks.
    ``chunk_indices`` reaches FLA where it takes it (fla-core 0.6; 0.5.2 builds the schedule itself).

    Raises:
        FlaFeatureError: ``chunk_indices`` inside a CUDA graph capture on an FLA without ``chunk_indices=``.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    _check_device(q)
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
    out, _ = fla_chunk_gated_delta_rule(
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
        cp_context=cp_context,
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
) -> torch.Tensor:
    """The Mamba2 SSD scan on FLA's simple GLA chunk kernels; see :func:`reference.ssd`.

    ``x [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``, ``B, C [B, T, G, N]``, ``D [H]`` -> ``[B, T, H, P]``.
    ``dt`` is discretised in float32 here (bias, softplus, clamp); ``v = dt * x`` is rounded to the dtype
    of ``x`` for the kernel, ``g = dt * A`` stays float32. ``chunk_indices [NT, 2]`` and ``chunk_offsets
    [N + 1]`` (``LocalSeqlens``): FLA's schedule, given; without them FLA's cached helpers compute it
    (:func:`~fla_ac_isolation.fla_seam.simple_gla.schedule`). The numbers are those of FLA's
    ``chunk_simple_gla(q, k, v, g, scale=1, cu_seqlens=...)``, bit for bit.
    """
    _check_device(x)
    features.require("ssd_kernels", where="ops.ssd(..., backend='fla')")
    heads, groups = x.shape[2], B.shape[2]
    if heads % groups or C.shape[2] != groups:
        raise ValueError(f"heads ({heads}) must be a multiple of the B/C groups ({groups}, {C.shape[2]})")
    dt = discretize_dt(dt, dt_bias, dt_limit)
    value = (x * dt.unsqueeze(-1)).to(x.dtype)  # x promoted inside the multiply: no float32 copy of x
    log_decay = dt * A.float()
    query = C.to(x.dtype).repeat_interleave(heads // groups, dim=2)
    key = B.to(x.dtype).repeat_interleave(heads // groups, dim=2)
    chunk_indices, chunk_offsets = schedule(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)
    y = simple_gla(query, key, value, log_decay, 1.0, cu_seqlens, chunk_indices, chunk_offsets)
    if D is not None:
        y = (y + D.float()[:, None] * x).to(x.dtype)  # promoted inside the ops: the numbers of y.float() + ...
    return y
