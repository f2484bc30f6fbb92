"""The ``reference`` backend as torch custom operators: the CPU twin of :mod:`fla_ac_isolation.fla_seam.custom_ops`.

Each operation of :mod:`~fla_ac_isolation.ops.reference` that stands in for an FLA call becomes one
operator of the ``fla_ac_isolation`` namespace, with a fake (meta) kernel and a backward operator, so that
the CPU tests cover what the ``fla`` custom ops offer on a GPU: a SAC policy can save their outputs
(:func:`fla_ac_isolation.policies.save_fla_ops`), and ``torch.compile`` traces a mixer without a graph
break at the call (the reference's ``.tolist()`` calls run inside the op's kernel, never traced).

* ``causal_conv1d_reference(x, weight, bias?, activation?, cu_seqlens?, cu_seqlens_cpu?, chunk_indices?)
  -> y``: :func:`reference.causal_conv1d`;
* ``gated_delta_rule_reference(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens?,
  cu_seqlens_cpu?, chunk_indices?) -> o``: :func:`reference.chunk_gated_delta_rule`;
* ``ssd_scan_reference(x, log_decay, B, C, cu_seqlens?, cu_seqlens_cpu?, chunk_indices?, chunk_offsets?) -> y``:
  :func:`reference.ssd_scan`, the part FLA's simple GLA computes (discretisation and the ``D`` skip stay
  outside, in float32).

Registered with :func:`~fla_ac_isolation.saveable_op.register_saveable_op` without a backward function:
forward op the reference function (run below autograd, so nothing is recorded), backward op
(``<name>_backward``) the same function rerun on detached copies of the saved inputs under autograd, then
``torch.autograd.grad``. Gradients are returned contiguous (the fake kernels promise it), so
in float32 they can differ from the plain reference's in the last bit (another summation order downstream);
the promise is "AC equals no AC bit for bit" within this backend, which the tests check. The reference reads
FLA's cached index helpers inside the ops, forward and backward, so a saved op looks nothing up in the
recompute, exactly as the ``fla`` ops.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fla_ac_isolation.op_inputs import (
    check_activation,
    check_groups,
    check_heads,
    check_packed,
    compute_dtype,
    discretize_dt,
)
from fla_ac_isolation.op_names import by_operation
from fla_ac_isolation.ops import reference
from fla_ac_isolation.saveable_op import register_saveable_op

__all__ = ["OPS", "causal_conv1d", "chunk_gated_delta_rule", "ssd"]


def _conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> Tensor:
    return reference.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                   cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices).contiguous()


def _gdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> Tensor:
    return reference.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
    ).contiguous()


def _scan(
    x: Tensor, log_decay: Tensor, B: Tensor, C: Tensor, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> Tensor:
    return reference.ssd_scan(x, log_decay, B, C, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                              chunk_indices=chunk_indices, chunk_offsets=chunk_offsets).contiguous()


def _contiguous_like(first: Tensor, *_args) -> Tensor:
    return torch.empty_like(first, memory_format=torch.contiguous_format)


_conv_forward = register_saveable_op("causal_conv1d_reference", _conv, fake=_contiguous_like,
                                     grads_of=("x", "weight", "bias"))
_gdn_forward = register_saveable_op("gated_delta_rule_reference", _gdn, fake=lambda q, k, v, *_: q.new_empty(v.shape),
                                    grads_of=("q", "k", "v", "g", "beta"))  # o [B, T, HV, V] in the dtype of q
_scan_forward = register_saveable_op("ssd_scan_reference", _scan, fake=_contiguous_like,
                                     grads_of=("x", "log_decay", "B", "C"))

OPS: dict[str, torch._ops.OpOverload] = by_operation(
    gated_delta_rule=torch.ops.fla_ac_isolation.gated_delta_rule_reference.default,
    causal_conv1d=torch.ops.fla_ac_isolation.causal_conv1d_reference.default,
    ssd=torch.ops.fla_ac_isolation.ssd_scan_reference.default,
)
"""The forward operator behind each saveable operation (what a SAC policy saves), by operation name
(:data:`~fla_ac_isolation.op_names.SAVEABLE_OP_NAMES`)."""


# ------------------------------------------------------------------- the backend functions (ops facade)
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
) -> Tensor:
    """:func:`reference.causal_conv1d` as the ``causal_conv1d_reference`` op; same arguments and result.

    Raises:
        ValueError: as :func:`reference.causal_conv1d` (checked here, before the op runs).
    """
    check_activation(activation)
    check_packed("x", x, cu_seqlens)
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [D, W] with D = {x.shape[-1]}, got shape {tuple(weight.shape)}")
    return _conv_forward(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
) -> Tensor:
    """:func:`reference.chunk_gated_delta_rule` as the ``gated_delta_rule_reference`` op; same arguments and result.

    Raises:
        ValueError: as :func:`reference.chunk_gated_delta_rule` (checked here, before the op runs).
    """
    check_packed("q", q, cu_seqlens)
    check_heads(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _gdn_forward(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices)


def ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
) -> Tensor:
    """:func:`reference.ssd` with its scan as the ``ssd_scan_reference`` op; same arguments and result.

    The torch ops around the scan (discretisation, ``dt * x``, ``dt * A``, the ``D`` skip) are those of
    :func:`reference.ssd`.

    Raises:
        ValueError: as :func:`reference.ssd` (checked here, before the op runs).
    """
    check_packed("x", x, cu_seqlens)
    check_groups(x.shape[2], B, C)
    dtype = compute_dtype(x)
    dt = discretize_dt(dt, dt_bias, dt_limit).to(dtype)
    y = _scan_forward(x.to(dtype) * dt.unsqueeze(-1), dt * A.to(dtype), B.to(dtype), C.to(dtype), cu_seqlens,
                      cu_seqlens_cpu, chunk_indices, chunk_offsets)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x.to(dtype)
    return y.to(x.dtype)
