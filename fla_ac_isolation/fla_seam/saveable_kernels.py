"""FLA 0.6's own forward and backward functions (and fakes) as the kernels of the ``fla`` backend's saveable custom
operators (outputs: :data:`fla_ac_isolation.ops.SAVEABLE_OPS`). Same numbers as FLA's ``Function`` s, but the L2-normed
q/k are recomputed in backward, not outputs; grouped ``B``/``C`` are expanded inside; no backend dispatch, no
``cp_context`` or states; inputs keep their dtypes (no autocast); outputs are contiguous and alias nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from fla_ac_isolation.fla_seam import features, simple_gla
from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE, conv_takes_chunk_indices
from fla_ac_isolation.op_names import by_operation

__all__ = ["KERNELS"]

# --------------------------------------------------------------------------------------------- helpers
def _contiguous(t: Tensor | None) -> Tensor | None:
    """What FLA's ``input_guard`` does to every tensor argument (the same object when already contiguous)."""
    return t.contiguous() if t is not None else None


def _device(t: Tensor):
    """FLA's ``input_guard`` device context: kernels launch on the device of the inputs."""
    from fla.utils import custom_device_ctx

    return custom_device_ctx(t.device.index) if t.device.type != "cpu" else contextlib.nullcontext()


def _schedule(cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None):
    """FLA's chunk schedule: the given one, else ``prepare_chunk_indices`` (as FLA's ``Function`` s do)."""
    if chunk_indices is None and cu_seqlens is not None:
        from fla.ops.utils.index import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)
    return chunk_indices


def _conv_schedule(chunk_indices: Tensor | None) -> Tensor | None:
    """The schedule for FLA's conv only while its chunk size is ours (read inside the kernel, never traced)."""
    return chunk_indices if conv_takes_chunk_indices() else None


def _expand(t: Tensor, heads: int) -> Tensor:
    """``[B, T, G, K]`` -> ``[B, T, heads, K]``, group ``i`` serving heads ``i * heads/G ...``."""
    return t if t.shape[2] == heads else t.repeat_interleave(heads // t.shape[2], dim=2)


# ------------------------------------------------------------------------------------------ causal conv
def _conv_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> Tensor:
    ops = features.module("conv_ops")
    _has_non_standard_layout, causal_conv1d_fwd = ops._has_non_standard_layout, ops.causal_conv1d_fwd

    with _device(x):
        y, _ = causal_conv1d_fwd(
            x=x, weight=weight, bias=bias, residual=None, initial_state=None, output_final_state=False,
            activation=activation, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=_conv_schedule(chunk_indices), layout_fallback=_has_non_standard_layout(x=x),
        )
    return y.contiguous()


def _conv_forward_fake(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _conv_backward_op(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    ops = features.module("conv_ops")
    _has_non_standard_layout, causal_conv1d_bwd = ops._has_non_standard_layout, ops.causal_conv1d_bwd

    with _device(x):
        dx, dw, db, _, _ = causal_conv1d_bwd(
            x=x, dy=dy, dht=None, weight=weight, bias=bias, residual=None, initial_state=None,
            activation=activation, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=_conv_schedule(chunk_indices), layout_fallback=_has_non_standard_layout(x=x),
        )
    db = db.contiguous() if db is not None else weight.new_empty(0)
    return dx.contiguous(), dw.contiguous(), db


def _conv_backward_op_fake(dy, x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


# ------------------------------------------------------------------------------------- gated delta rule
def _gdn_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    l2norm_fwd = features.module("l2norm").l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    q, k, v, g, beta = (_contiguous(t) for t in (q, k, v, g, beta))
    q_rstd, k_rstd = g.new_empty(0), g.new_empty(0)  # distinct objects: outputs may not alias each other
    with _device(q):
        if use_qk_l2norm_in_kernel:
            q, q_rstd = l2norm_fwd(q)
            k, k_rstd = l2norm_fwd(k)
        chunk_indices = _schedule(cu_seqlens, cu_seqlens_cpu, chunk_indices)
        g_cumsum, o, A, _, _, _ = chunk_gated_delta_rule_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=None, output_final_state=False,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=CHUNK_SIZE,
        )
    return o.to(q.dtype), A, g_cumsum, q_rstd, k_rstd


def _gdn_forward_fake(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices):
    batch, tokens, heads, _ = q.shape
    value_heads = v.shape[2]
    if use_qk_l2norm_in_kernel:
        q_rstd = q.new_empty(batch, tokens, heads, dtype=torch.float32)
        k_rstd = q.new_empty(batch, tokens, heads, dtype=torch.float32)
    else:
        q_rstd, k_rstd = g.new_empty(0), g.new_empty(0)
    return (q.new_empty(v.shape), k.new_empty(batch, tokens, value_heads, CHUNK_SIZE),
            g.new_empty(g.shape, dtype=torch.float32), q_rstd, k_rstd)


def _gdn_backward_op(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, A: Tensor, g_cumsum: Tensor, q_rstd: Tensor,
    k_rstd: Tensor, g_dtype: torch.dtype, scale: float, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    l2norm = features.module("l2norm")
    l2norm_bwd, l2norm_fwd = l2norm.l2norm_bwd, l2norm.l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    dtypes = (q.dtype, k.dtype, v.dtype, beta.dtype)
    q, k, v, beta, do = (_contiguous(t) for t in (q, k, v, beta, do))
    with _device(q):
        if use_qk_l2norm_in_kernel:  # the forward's normalised q/k: same kernel, same input, same bits
            q, _ = l2norm_fwd(q)
            k, _ = l2norm_fwd(k)
        chunk_indices = _schedule(cu_seqlens, cu_seqlens_cpu, chunk_indices)
        dq, dk, dv, dbeta, dg, _, _, _ = chunk_gated_delta_rule_bwd(
            q=q, k=k, v=v, g=g_cumsum, beta=beta, A=A, scale=scale, initial_state=None, do=do, dht=None,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=CHUNK_SIZE,
        )
        if use_qk_l2norm_in_kernel:
            dq = l2norm_bwd(q, q_rstd, dq)
            dk = l2norm_bwd(k, k_rstd, dk)
    grads = (dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2]), dg.to(g_dtype), dbeta.to(dtypes[3]))
    return tuple(t.contiguous() for t in grads)


def _gdn_backward_op_fake(do, q, k, v, beta, A, g_cumsum, q_rstd, k_rstd, g_dtype, *_schedule):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            g_cumsum.new_empty(g_cumsum.shape, dtype=g_dtype), beta.new_empty(beta.shape))


# ----------------------------------------------------------------------------- simple GLA (Mamba2 SSD)
def _gla_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> tuple[Tensor, Tensor]:
    heads = v.shape[2]
    q, k, v, g = _contiguous(_expand(q, heads)), _contiguous(_expand(k, heads)), _contiguous(v), _contiguous(g)
    with _device(q):
        chunk_indices, chunk_offsets = simple_gla.schedule(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)
        o, g_cumsum = simple_gla.simple_gla_forward(q, k, v, g, scale, cu_seqlens=cu_seqlens,
                                                    chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    return o, g_cumsum


def _gla_forward_fake(q, k, v, g, scale, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets):
    return q.new_empty(v.shape), g.new_empty(g.shape, dtype=torch.float32)


def _gla_backward_op(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor, g_dtype: torch.dtype, scale: float,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    heads, groups = v.shape[2], q.shape[2]
    qe, ke, v, do = _contiguous(_expand(q, heads)), _contiguous(_expand(k, heads)), _contiguous(v), _contiguous(do)
    with _device(q):
        chunk_indices, chunk_offsets = simple_gla.schedule(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_offsets)
        dq, dk, dv, dg = simple_gla.simple_gla_backward(do, qe, ke, v, g_cumsum, scale, cu_seqlens=cu_seqlens,
                                                        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    dq, dk = dq.to(qe.dtype), dk.to(ke.dtype)
    if groups != heads:  # the gradient of the expansion: each group sums its heads
        batch, tokens, _, dim = dq.shape
        dq = dq.view(batch, tokens, groups, heads // groups, dim).sum(3)
        dk = dk.view(batch, tokens, groups, heads // groups, dim).sum(3)
    return dq.contiguous(), dk.contiguous(), dv.to(v.dtype).contiguous(), dg.to(g_dtype).contiguous()


def _gla_backward_op_fake(do, q, k, v, g_cumsum, g_dtype, *_schedule):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            g_cumsum.new_empty(g_cumsum.shape, dtype=g_dtype))


KERNELS: dict[str, dict] = by_operation(
    causal_conv1d=dict(name="causal_conv1d", forward=_conv_forward, fake=_conv_forward_fake,
                       grads_of=("x", "weight", "bias"), backward=_conv_backward_op,
                       backward_fake=_conv_backward_op_fake),
    gated_delta_rule=dict(name="gated_delta_rule", forward=_gdn_forward, fake=_gdn_forward_fake,
                          grads_of=("q", "k", "v", "g", "beta"), outputs=("o", "A", "g_cumsum", "q_rstd", "k_rstd"),
                          backward=_gdn_backward_op, backward_fake=_gdn_backward_op_fake),
    ssd=dict(name="simple_gla", forward=_gla_forward, fake=_gla_forward_fake, grads_of=("q", "k", "v", "g"),
             outputs=("o", "g_cumsum"), backward=_gla_backward_op, backward_fake=_gla_backward_op_fake),
)
"""Per saveable operation (:data:`~fla_ac_isolation.op_names.SAVEABLE_OP_NAMES`), the keyword arguments of
:func:`~fla_ac_isolation.saveable_op.register_saveable_op` for its ``fla`` operator: its name, FLA's forward
and backward functions and their fakes."""
