"""A Mamba2 drop-in under context parallelism, head-parallel (Ulysses): an all-to-all to every token of this
rank's heads, the conv and SSD on whole documents with the GLOBAL offsets, an all-to-all back. Same parameters as
without CP; every gradient is this rank's part, to be summed over the CP group. Imported by ``mixers/mamba2.py``
only when a :class:`~fla_ac_isolation.parallel.CPSeqlens` arrives.
"""

from __future__ import annotations

from typing import Any

import torch

from fla_ac_isolation import ops
from fla_ac_isolation.ops.backend import resolve_backend
from fla_ac_isolation.parallel.config import CPConfig
from fla_ac_isolation.parallel.head_parallel import heads_to_sequence, sequence_to_heads
from fla_ac_isolation.parallel.seqlens_cp import CPSeqlens
from fla_ac_isolation.seqlens import devices_match

__all__ = ["head_parallel_forward", "head_shard"]


def head_shard(mixer: Any, cp: CPConfig) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """``(channels, heads, groups)``: per rank ``d``, the int64 indices into ``in_proj``'s ``x B C | dt`` output it
    computes; this rank's head indices; the number of B/C groups it receives.

    Raises:
        ValueError: ``mamba_num_heads`` not divisible by ``cp.world_size``, or a B/C group split unevenly.
    """
    H, P, G, N, W = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size, cp.world_size
    if H % W:
        raise ValueError(
            f"head-parallel context parallelism needs mamba_num_heads ({H}) divisible by the CP degree ({W}): "
            "each rank runs whole sequences for mamba_num_heads / W heads"
        )
    per_rank, per_group = H // W, H // G
    channels, mine = [], None
    for d in range(W):
        heads = torch.arange(d * per_rank, (d + 1) * per_rank)
        groups = torch.unique(heads // per_group)
        if per_rank % groups.numel() or not torch.equal(
            heads // per_group - groups[0], torch.arange(per_rank) // (per_rank // groups.numel())
        ):
            raise ValueError(
                f"head-parallel context parallelism over {W} ranks splits the B/C groups of mamba_num_heads={H}, "
                f"n_groups={G} unevenly (rank {d} holds heads {heads.tolist()}); use a CP degree that divides "
                "n_groups or is a multiple of it"
            )
        x = (heads[:, None] * P + torch.arange(P)).flatten()
        b = H * P + (groups[:, None] * N + torch.arange(N)).flatten()
        c = H * P + G * N + (groups[:, None] * N + torch.arange(N)).flatten()
        channels.append(torch.cat([x, b, c, mixer.conv_dim + heads]))
        if d == cp.rank:
            mine = (heads, groups.numel())
    return channels, mine[0], mine[1]


def _check(mixer: Any, hidden_states: torch.Tensor, seqlens: CPSeqlens, attention_mask: Any) -> None:
    if hidden_states.shape[0] != 1:
        raise ValueError(
            f"packed input (cu_seqlens given) must have batch size 1, got hidden_states of shape "
            f"{tuple(hidden_states.shape)}; flatten the batch into one row"
        )
    seqlens.check_tokens(hidden_states.shape[1], name="hidden_states")
    if not devices_match(seqlens.device, hidden_states.device):
        raise ValueError(f"cu_seqlens is on {seqlens.device} but hidden_states is on {hidden_states.device}")
    if seqlens.cp.group is None:
        raise ValueError(
            "seqlens was built with CPConfig(world_size=..., rank=...) and no group: head-parallel context "
            "parallelism needs the CP process group for its all-to-alls (CPConfig(group=...))"
        )
    if attention_mask is not None:
        raise ValueError(
            "attention_mask (a padding mask) is not supported under context parallelism: packed batches hold no "
            "padding; pass attention_mask=None"
        )


def head_parallel_forward(
    mixer: Any, hidden_states: torch.Tensor, seqlens: CPSeqlens, *, attention_mask: Any = None
) -> torch.Tensor:
    """A Mamba2 drop-in's forward (:class:`~fla_ac_isolation.mixers.mamba2.Mamba2Path`) under ``seqlens.cp``: this
    rank's ``[1, T / W, D]`` shard -> ``[1, T / W, D]``.

    Raises:
        ValueError: see :func:`head_shard`; batch size > 1; a token count other than ``T / W``; offsets on another
            device; a CP config without a group; an ``attention_mask``.
    """
    _check(mixer, hidden_states, seqlens, attention_mask)
    cp = seqlens.cp
    channels, heads, groups = head_shard(mixer, cp)
    whole = seqlens.local(whole_batch=True)  # fresh GLOBAL offsets: each rank runs whole documents
    backend = resolve_backend(mixer.backend, hidden_states)
    dtype, local_tokens = hidden_states.dtype, hidden_states.shape[1]
    H_r, P, N = heads.numel(), mixer.head_dim, mixer.ssm_state_size

    # 1. in_proj on this rank's tokens; 2. all-to-all: every token of this rank's channels.
    gate, xbc, dt = mixer.split_projection(mixer.in_proj(hidden_states))
    full = sequence_to_heads(torch.cat([xbc, dt], dim=-1), channels, cp)             # [1, T, C_r + H_r]
    conv_channels = channels[cp.rank][:-H_r]
    xbc_r, dt_r = full.split([conv_channels.numel(), H_r], dim=-1)
    tokens = full.shape[1]

    # 3. the existing conv and SSD on whole documents, with this rank's slices of the parameters.
    bias = mixer.conv1d.bias.index_select(0, conv_channels) if mixer.conv1d.bias is not None else None
    xbc_r = ops.causal_conv1d(
        xbc_r, mixer.conv1d.weight.squeeze(1).index_select(0, conv_channels), bias, activation="silu",
        seqlens=whole, backend=backend, saveable=mixer.saveable,
    )
    x, B, C = xbc_r.split([H_r * P, groups * N, groups * N], dim=-1)
    y = ops.ssd(
        x.reshape(1, tokens, H_r, P), dt_r, -torch.exp(mixer.A_log.float()).index_select(0, heads),
        B.reshape(1, tokens, groups, N), C.reshape(1, tokens, groups, N),
        D=mixer.D.index_select(0, heads), dt_bias=mixer.dt_bias.index_select(0, heads),
        dt_limit=mixer.dt_clamp(), seqlens=whole, backend=backend, saveable=mixer.saveable,
    )                                                                                # [1, T, H_r, P]

    # 4. back to this rank's tokens, every head; gated norm and out_proj on the shard.
    y = heads_to_sequence(y, cp)                                                     # [1, T / W, H, P]
    y = mixer.gated_norm(y.reshape(1, local_tokens, mixer.intermediate_size), gate)
    return mixer.out_proj(y.to(dtype))
