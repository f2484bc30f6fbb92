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

Forward op: the reference function (run below autograd, so nothing is recorded). Backward op
(``<name>_backward``): the same reference function rerun on detached copies of the saved inputs under
autograd, then ``torch.autograd.grad``. Gradients are returned contiguous (the fake kernels promise it), so
in float32 they can differ from the plain reference's in the last bit (another summation order downstream);
the promise is "AC equals no AC bit for bit" within this backend, which the tests check. The reference reads
FLA's cached index helpers inside the ops, forward and backward, so a saved op looks nothing up in the
recompute, exactly as the ``fla`` ops.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

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

__all__ = ["OPS", "causal_conv1d", "chunk_gated_delta_rule", "ssd"]

_NS = "fla_ac_isolation"
_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")


@contextlib.contextmanager
def _autograd_inside_kernel() -> Iterator[None]:
    """Let autograd record inside a custom op's kernel (torch runs kernels with the autograd keys excluded).

    The backward ops differentiate the reference forward inside their kernel, so they lift the exclusion of
    the autograd dispatch keys for the block and restore each key's prior state on exit. This is torch's
    private dispatch TLS API (``torch._C._dispatch_tls_*``); nothing else in the package touches it.
    """
    keys = [getattr(torch._C.DispatchKey, name) for name in _AUTOGRAD_KEYS]
    prior = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in keys]
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for key, was in zip(keys, prior):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def _grads(fn: Callable[..., Tensor], inputs: tuple[Tensor | None, ...], grad_out: Tensor) -> list[Tensor | None]:
    """Gradients of ``fn(*inputs)`` for each input tensor (``None`` for ``None`` inputs), contiguous and
    owning their memory (a custom op's output may not alias its inputs, e.g. ``grad_out``)."""
    with _autograd_inside_kernel():
        leaves = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
        out = fn(*leaves)
        wanted = [t for t in leaves if t is not None]
        found = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
    grads: list[Tensor | None] = []
    for t in leaves:
        if t is None:
            grads.append(None)
            continue
        g = next(found)
        g = t.new_zeros(t.shape) if g is None else g.contiguous()
        if g.untyped_storage().data_ptr() == grad_out.untyped_storage().data_ptr():
            g = g.clone()
        grads.append(g)
    return grads


def _dense(t: Tensor) -> Tensor:
    return t.new_empty(t.shape)  # contiguous, whatever the strides of t


# ------------------------------------------------------------------------------------------ causal conv
def _conv(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices) -> Tensor:
    return reference.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                   cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)


@torch.library.custom_op(f"{_NS}::causal_conv1d_reference", mutates_args=())
def _conv_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> Tensor:
    return _conv(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices).contiguous()


@_conv_forward.register_fake
def _(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_NS}::causal_conv1d_reference_backward", mutates_args=())
def _conv_backward_op(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _grads(
        lambda x, w, b: _conv(x, w, b, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices), (x, weight, bias), dy,
    )
    return dx, dw, (db if db is not None else weight.new_empty(0))


@_conv_backward_op.register_fake
def _(dy, x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices):
    return _dense(x), _dense(weight), (_dense(bias) if bias is not None else weight.new_empty(0))


def _conv_setup(ctx, inputs, output) -> None:
    x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    ctx.activation = activation


def _conv_backward(ctx, dy):
    x, weight, bias, cu_seqlens, cu_seqlens_cpu, chunk_indices = ctx.saved_tensors
    dx, dw, db = _conv_backward_op(dy, x, weight, bias, ctx.activation, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    return dx, dw, (db if bias is not None else None), None, None, None, None


_conv_forward.register_autograd(_conv_backward, setup_context=_conv_setup)


# ------------------------------------------------------------------------------------- gated delta rule
def _gdn(q, k, v, g, beta, scale, l2, cu_seqlens, cu_seqlens_cpu, chunk_indices) -> Tensor:
    return reference.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
    )


@torch.library.custom_op(f"{_NS}::gated_delta_rule_reference", mutates_args=())
def _gdn_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> Tensor:
    out = _gdn(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    return out.contiguous()


@_gdn_forward.register_fake
def _(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices):
    return q.new_empty(v.shape)  # [B, T, HV, V] in the dtype of q


@torch.library.custom_op(f"{_NS}::gated_delta_rule_reference_backward", mutates_args=())
def _gdn_backward_op(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
    use_qk_l2norm_in_kernel: bool, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _grads(
        lambda q, k, v, g, beta: _gdn(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu,
                                      chunk_indices),
        (q, k, v, g, beta), do,
    )
    return tuple(grads)


@_gdn_backward_op.register_fake
def _(do, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices):
    return tuple(_dense(t) for t in (q, k, v, g, beta))


def _gdn_setup(ctx, inputs, output) -> None:
    q, k, v, g, beta, scale, l2, cu_seqlens, cu_seqlens_cpu, chunk_indices = inputs
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    ctx.meta = (scale, l2)


def _gdn_backward(ctx, do):
    q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, chunk_indices = ctx.saved_tensors
    grads = _gdn_backward_op(do, q, k, v, g, beta, *ctx.meta, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    return (*grads, None, None, None, None, None)


_gdn_forward.register_autograd(_gdn_backward, setup_context=_gdn_setup)


# --------------------------------------------------------------------------------------------- SSD scan
def _scan(x, log_decay, B, C, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets) -> Tensor:
    return reference.ssd_scan(x, log_decay, B, C, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                              chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)


@torch.library.custom_op(f"{_NS}::ssd_scan_reference", mutates_args=())
def _scan_forward(
    x: Tensor, log_decay: Tensor, B: Tensor, C: Tensor, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> Tensor:
    return _scan(x, log_decay, B, C, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets).contiguous()


@_scan_forward.register_fake
def _(x, log_decay, B, C, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_NS}::ssd_scan_reference_backward", mutates_args=())
def _scan_backward_op(
    dy: Tensor, x: Tensor, log_decay: Tensor, B: Tensor, C: Tensor, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = _grads(lambda x, a, b, c: _scan(x, a, b, c, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets),
                   (x, log_decay, B, C), dy)
    return tuple(grads)


@_scan_backward_op.register_fake
def _(dy, x, log_decay, B, C, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets):
    return tuple(_dense(t) for t in (x, log_decay, B, C))


def _scan_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _scan_backward(ctx, dy):
    x, log_decay, B, C, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets = ctx.saved_tensors
    grads = _scan_backward_op(dy, x, log_decay, B, C, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)
    return (*grads, None, None, None, None)


_scan_forward.register_autograd(_scan_backward, setup_context=_scan_setup)

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
