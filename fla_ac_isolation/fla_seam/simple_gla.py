"""Mamba2's SSD core, FLA 0.6's simple GLA, without its per-call host syncs: the schedule is given, the state count
is ``NT = len(chunk_indices)`` (padded schedules accepted), and FLA's kernels are launched as its wrappers launch
them (FLA's numbers bit for bit; no backend dispatch, initial/final state or ``g_gamma``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE

__all__ = ["SimpleGLAFunction", "schedule", "simple_gla", "simple_gla_backward", "simple_gla_forward",
           "state_backward", "state_forward"]


def schedule(
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """``(chunk_indices [NT, 2], chunk_offsets [N + 1])``: the given ones, else FLA's cached helpers' (a host sync;
    pass both to avoid it); ``(None, None)`` without ``cu_seqlens``."""
    if cu_seqlens is None:
        return None, None
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, CHUNK_SIZE)
    return chunk_indices, chunk_offsets


def _sizes(k: Tensor, v: Tensor, cu_seqlens: Tensor | None, chunk_indices: Tensor | None) -> tuple[int, int]:
    """``(N sequences, NS state chunks)``: both read on the host, never from device values."""
    batch, tokens = k.shape[:2]
    if cu_seqlens is None:
        return batch, -(-tokens // CHUNK_SIZE)
    return cu_seqlens.shape[0] - 1, chunk_indices.shape[0]


def state_forward(
    k: Tensor, v: Tensor, g_cumsum: Tensor, *, cu_seqlens: Tensor | None, chunk_indices: Tensor | None,
    chunk_offsets: Tensor | None, states_in_fp32: bool,
) -> Tensor:
    """The chunk states ``h [B, NS, H, K, V]``: FLA's ``chunk_fwd_kernel_h`` launched as ``chunk_fwd_h`` does.

    ``k [B, T, H, K]``, ``v [B, T, H, V]`` contiguous; ``g_cumsum [B, T, H]`` fp32 in log2 units. ``h`` is fp32
    with ``states_in_fp32``, else the dtype of ``k``.
    """
    import triton
    from fla.ops.common.chunk_h import chunk_fwd_kernel_h

    _, tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    sequences, chunks = _sizes(k, v, cu_seqlens, chunk_indices)
    h = k.new_empty(k.shape[0], chunks, heads, key_dim, value_dim, dtype=torch.float if states_in_fp32 else k.dtype)

    def grid(meta):
        return (triton.cdiv(key_dim, meta["BK"]) * triton.cdiv(value_dim, meta["BV"]) * sequences * heads,)

    chunk_fwd_kernel_h[grid](
        k=k, v=v, h=h, g=g_cumsum, g_gamma=None, gk=None, gv=None, h0=None, ht=None, cu_seqlens=cu_seqlens,
        split_offsets=chunk_offsets, T=tokens, H=heads, K=key_dim, V=value_dim, BT=CHUNK_SIZE, BS=CHUNK_SIZE,
        USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False, STATE_V_FIRST=False,
    )
    return h


def state_backward(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, g_cumsum: Tensor, scale: float, *, cu_seqlens: Tensor | None,
    chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> Tensor:
    """The state gradients ``dh [B, NS, H, K, V]`` fp32: FLA's ``chunk_bwd_kernel_dh`` launched as ``chunk_bwd_dh``
    does."""
    import triton
    from fla.ops.common.chunk_h import chunk_bwd_kernel_dh

    _, tokens, heads, key_dim = k.shape
    value_dim, query_heads = v.shape[-1], q.shape[2]
    sequences, chunks = _sizes(k, v, cu_seqlens, chunk_indices)
    dh = k.new_empty(k.shape[0], chunks, query_heads, key_dim, value_dim, dtype=torch.float)

    def grid(meta):
        return (triton.cdiv(key_dim, meta["BK"]) * triton.cdiv(value_dim, meta["BV"]) * sequences * heads,)

    chunk_bwd_kernel_dh[grid](
        q=q, g=g_cumsum, g_gamma=None, gk=None, gv=None, do=do, dh=dh, dht=None, dh0=None, cu_seqlens=cu_seqlens,
        split_offsets=chunk_offsets, scale=scale, T=tokens, HQ=query_heads, H=heads, K=key_dim, V=value_dim,
        BT=CHUNK_SIZE, BS=CHUNK_SIZE, NG=query_heads // heads, USE_G=True, USE_G_GAMMA=False, USE_GK=False,
        USE_GV=False, STATE_V_FIRST=False,
    )
    return dh


def simple_gla_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, *, cu_seqlens: Tensor | None,
    chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(o [B, T, H, V] in the dtype of q, g_cumsum [B, T, H] fp32)``: FLA's ``ChunkSimpleGLAFunction.forward``.

    ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H]`` (log decay), contiguous, on the current device.
    """
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    g_cumsum = chunk_local_cumsum(g, chunk_size=CHUNK_SIZE, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                  chunk_indices=chunk_indices)
    h = state_forward(k, v, g_cumsum, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                      chunk_offsets=chunk_offsets, states_in_fp32=False)
    o = chunk_fwd_o(q=q, k=k, v=v, g=g_cumsum, g_gamma=None, h=h, scale=scale, cu_seqlens=cu_seqlens,
                    chunk_size=CHUNK_SIZE, chunk_indices=chunk_indices, state_v_first=False)
    return o.to(q.dtype), g_cumsum


def simple_gla_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor, scale: float, *, cu_seqlens: Tensor | None,
    chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg)`` (``dg`` fp32): FLA's ``ChunkSimpleGLAFunction.backward``; ``do [B, T, H, V]``
    contiguous, the rest as :func:`simple_gla_forward` took and returned them."""
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv
    from fla.ops.utils import chunk_local_cumsum

    varlen = {"cu_seqlens": cu_seqlens, "chunk_size": CHUNK_SIZE, "chunk_indices": chunk_indices}
    h = state_forward(k, v, g_cumsum, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                      chunk_offsets=chunk_offsets, states_in_fp32=True)
    dh = state_backward(q, k, v, do, g_cumsum, scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                        chunk_offsets=chunk_offsets)
    dq, dk, _, dg = chunk_bwd_dqkwg(q=q, k=k, v=v, g=g_cumsum, g_gamma=None, h=h, do=do, dh=dh, scale=scale,
                                    state_v_first=False, **varlen)
    dv = chunk_bwd_dv(q=q, k=k, g=g_cumsum, g_gamma=None, do=do, dh=dh, scale=scale, state_v_first=False, **varlen)
    dg = chunk_local_cumsum(dg, chunk_size=CHUNK_SIZE, reverse=True, cu_seqlens=cu_seqlens,
                            chunk_indices=chunk_indices).to(g_cumsum)
    return dq, dk, dv, dg


def _device(t: Tensor):
    """FLA's ``input_guard`` device context: kernels launch on the device of the inputs."""
    import contextlib

    if t.device.type == "cpu":
        return contextlib.nullcontext()
    from fla.utils import custom_device_ctx

    return custom_device_ctx(t.device.index)


class SimpleGLAFunction(torch.autograd.Function):
    """Simple GLA as one autograd function, as FLA's ``chunk_simple_gla(q, k, v, g, scale=, cu_seqlens=)``.

    ``apply(q, k, v, g, scale, cu_seqlens, chunk_indices, chunk_offsets) -> o [B, T, H, V]`` (dtype of ``q``).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, scale, cu_seqlens, chunk_indices, chunk_offsets):
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        with _device(q):
            o, g_cumsum = simple_gla_forward(q, k, v, g, scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                             chunk_offsets=chunk_offsets)
        ctx.save_for_backward(q, k, v, g_cumsum, cu_seqlens, chunk_indices, chunk_offsets)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g_cumsum, cu_seqlens, chunk_indices, chunk_offsets = ctx.saved_tensors
        with _device(q):
            dq, dk, dv, dg = simple_gla_backward(do.contiguous(), q, k, v, g_cumsum, ctx.scale, cu_seqlens=cu_seqlens,
                                                 chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
        return dq.to(q), dk.to(k), dv.to(v), dg, None, None, None, None


@torch.compiler.disable
def simple_gla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, cu_seqlens: Tensor | None,
    chunk_indices: Tensor | None, chunk_offsets: Tensor | None,
) -> Tensor:
    """:class:`SimpleGLAFunction` ``.apply``, kept out of ``torch.compile`` graphs as FLA's ``chunk_simple_gla`` is."""
    return SimpleGLAFunction.apply(q, k, v, g, scale, cu_seqlens, chunk_indices, chunk_offsets)
