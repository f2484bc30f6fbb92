"""Head-parallel context parallelism (Ulysses): trade a sequence shard for a head shard and back, for mixers without
an FLA CP kernel. Each function is one differentiable all-to-all plus a reorder between FLA's layout and packed order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fla_ac_isolation.parallel.config import CPConfig
from fla_ac_isolation.parallel.sharding import rank_token_index, unshard

__all__ = ["heads_to_sequence", "sequence_to_heads"]


def _all_to_all(send: torch.Tensor, out_splits: list[int], in_splits: list[int], cp: CPConfig) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(send, out_splits, in_splits, cp.group))


def _check(local: torch.Tensor, cp: CPConfig, name: str) -> None:
    if not isinstance(cp, CPConfig) or cp.group is None:
        raise ValueError(f"{name} needs a CPConfig with a process group, got {cp!r}")
    if local.dim() < 2 or local.shape[0] != 1:
        raise ValueError(f"{name} expects packed input [1, T, ...], got shape {tuple(local.shape)}")


def sequence_to_heads(local: torch.Tensor, channels: Sequence[torch.Tensor], cp: CPConfig) -> torch.Tensor:
    """``[1, T / W, C]`` (this rank's tokens, ``cp.layout`` order) -> ``[1, T, len(channels[cp.rank])]`` (every token in
    packed order, this rank's channels); ``channels[d]``: the int64 channel indices rank ``d`` computes.

    Raises:
        ValueError: ``len(channels) != W``; ``cp`` without a group; input not ``[1, T / W, C]``.
    """
    _check(local, cp, "sequence_to_heads")
    world = cp.world_size
    if len(channels) != world:
        raise ValueError(f"channels must hold one index tensor per CP rank ({world}), got {len(channels)}")
    tokens = local.shape[1]
    pieces = [local[0].index_select(-1, idx.to(local.device)) for idx in channels]     # [T/W, C_d] per rank d
    send = torch.cat([p.reshape(-1) for p in pieces])
    mine = channels[cp.rank].numel()
    recv = _all_to_all(send, [tokens * mine] * world, [p.numel() for p in pieces], cp)
    shards = list(recv.reshape(world, tokens, mine)[:, None].unbind(0))                 # [1, T/W, C_r] per source
    return unshard(shards, cp.layout, dim=1)


def heads_to_sequence(full: torch.Tensor, cp: CPConfig) -> torch.Tensor:
    """``[1, T, H_r, ...]`` -> ``[1, T / W, W * H_r, ...]``: this rank's tokens, rank ``s``'s heads in block ``s``;
    ``ValueError`` for ``cp`` without a group or input not ``[1, T, ...]``."""
    _check(full, cp, "heads_to_sequence")
    world, tokens = cp.world_size, full.shape[1]
    local = tokens // world
    order = torch.cat([rank_token_index(tokens, world, d, cp.layout) for d in range(world)])   # destination-major
    send = full[0].index_select(0, order.to(full.device)).reshape(-1)
    recv = _all_to_all(send, [send.numel() // world] * world, [send.numel() // world] * world, cp)
    per_source = recv.reshape(world, local, *full.shape[2:])                               # [W, T/W, H_r, ...]
    return per_source.transpose(0, 1).flatten(1, 2)[None]                                 # [1, T/W, W*H_r, ...]
