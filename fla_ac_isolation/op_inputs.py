"""What both backends of :mod:`fla_ac_isolation.ops` do to their inputs first: checks, compute dtype, Mamba2's ``dt``.

A leaf module (imports torch only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "autocast_caching", "check_activation", "check_conv", "check_groups", "check_heads", "check_kda_gates",
    "check_packed", "compute_dtype", "discretize_dt", "l2_normalize",
]


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs; float64 stays float64 (handy as a test oracle)."""
    return torch.promote_types(t.dtype, torch.float32)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim, in the dtype of ``x``: FLA's ``l2norm_fwd`` (its in-kernel
    L2 norm of q and k; ``eps`` its default)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def check_packed(name: str, t: torch.Tensor, cu_seqlens: torch.Tensor | None) -> None:
    """Packed input (``cu_seqlens`` given) has batch size 1.

    Raises:
        ValueError: naming ``name`` and its shape.
    """
    if cu_seqlens is not None and t.shape[0] != 1:
        raise ValueError(
            f"{name} must have batch size 1 when cu_seqlens is given (packed input), got shape {tuple(t.shape)}"
            f"{_autocast_replay_hint()}"
        )


def autocast_caching() -> bool:
    """Whether ``torch.autocast`` is on with its weight-cast cache (a recompute in the same autocast block then
    skips the forward's ``aten._to_copy``). The audit records it per pass."""
    if not torch.is_autocast_cache_enabled():
        return False
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda", "xpu", "mps", "hpu"))


def _autocast_replay_hint() -> str:
    """The likely cause of a shape error in a backward under ``torch.autocast`` with its cache on (torch #193338)."""
    in_backward = getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1
    if not (in_backward and autocast_caching()):
        return ""
    return ("; this ran in a backward under torch.autocast with its weight-cast cache on: if the layer is "
            "checkpointed with a SAC policy that saves aten._to_copy (torch's create_selective_checkpoint_contexts), "
            "the recompute skipped a weight cast its forward ran and SAC handed this op another op's saved tensor "
            "(torch issue #193338): checkpoint with fla_ac_isolation.policies.sac_context_fn(policy), call "
            "backward() outside the autocast block, or use torch.autocast(..., cache_enabled=False)")


def check_activation(activation: str | None) -> None:
    """The conv's activation is one FLA offers.

    Raises:
        ValueError: naming ``activation`` and the accepted values.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be 'silu', 'swish' or None (what FLA's conv offers), got {activation!r}")


def check_conv(x: torch.Tensor, weight: torch.Tensor, activation: str | None, cu_seqlens: torch.Tensor | None) -> None:
    """The reference conv's inputs: :func:`check_activation`, :func:`check_packed`, ``weight [D, W]`` for
    ``x [B, T, D]``.

    Raises:
        ValueError: naming the argument and what was expected.
    """
    check_activation(activation)
    check_packed("x", x, cu_seqlens)
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [D, W] with D = {x.shape[-1]}, got shape {tuple(weight.shape)}")


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q and k share ``H`` heads and v's ``HV`` heads are a multiple of ``H`` (GVA).

    Raises:
        ValueError: naming the three shapes.
    """
    if k.shape[2] != q.shape[2] or v.shape[2] % q.shape[2]:
        raise ValueError(
            f"q and k must share H heads and v's HV heads must be a multiple of H; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def check_kda_gates(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    """KDA's gates: ``g [B, T, HV, K]`` and ``beta [B, T, HV]`` for ``q [B, T, H, K]``, ``v [B, T, HV, V]``.

    Raises:
        ValueError: naming the expected and the given shapes.
    """
    batch, time, _, key_dim = q.shape
    heads = v.shape[2]
    if tuple(g.shape) != (batch, time, heads, key_dim) or tuple(beta.shape) != (batch, time, heads):
        raise ValueError(
            f"g must be [B, T, HV, K] = {[batch, time, heads, key_dim]} and beta [B, T, HV] = {[batch, time, heads]}, "
            f"got g {list(g.shape)} and beta {list(beta.shape)}"
        )


def check_groups(heads: int, B: torch.Tensor, C: torch.Tensor) -> None:
    """Mamba2's grouped ``B``/``C`` ``[B, T, G, N]`` must share ``G`` groups dividing the ``heads``.

    Raises:
        ValueError: naming the head and group counts.
    """
    groups = B.shape[2]
    if heads % groups or C.shape[2] != groups:
        raise ValueError(f"heads ({heads}) must be a multiple of the B/C groups ({groups}, {C.shape[2]})")


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)``, the Mamba2 time step ``[B, T, H]``, in :func:`compute_dtype`."""
    dt = dt.to(compute_dtype(dt))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt
