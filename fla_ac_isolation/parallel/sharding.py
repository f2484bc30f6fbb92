"""Cut a packed batch across context-parallel ranks as FLA's layouts expect, and put it back together. Shift labels
*before* sharding (a rank's last target is the next rank's first token) and normalise the loss by the GLOBAL
target count.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fla_ac_isolation.fla_seam.cp import build_cp_context
from fla_ac_isolation.parallel.config import LAYOUTS, CPConfig

__all__ = [
    "CPShard",
    "check_host_offsets",
    "cp_token_index",
    "gather_unshard",
    "rank_token_index",
    "shard_packed_batch",
    "unshard",
]


def _check_cp(cp: object) -> CPConfig:
    if not isinstance(cp, CPConfig):
        raise TypeError(f"cp must be a fla_ac_isolation.parallel.CPConfig, got {type(cp).__name__}")
    return cp


def rank_token_index(num_tokens: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """:func:`cp_token_index` for any ``rank`` (``num_tokens`` already checked): host int64 ``[T / W]``."""
    if layout == "contiguous":
        part = num_tokens // world_size
        return torch.arange(rank * part, (rank + 1) * part)
    part = num_tokens // (2 * world_size)
    back = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * part, (rank + 1) * part), torch.arange(back * part, (back + 1) * part)])


def cp_token_index(num_tokens: int, cp: CPConfig) -> torch.Tensor:
    """Global positions of the tokens rank ``cp.rank`` holds, in its local order: host int64 ``[T / W]``
    (``fla.ops.cp.context.get_cp_cu_seqlens``'s layout).

    Raises:
        ValueError: ``num_tokens`` does not split (:meth:`CPConfig.check_num_tokens`).
        TypeError: ``cp`` not a :class:`CPConfig`; ``num_tokens`` not an integer.
    """
    cp = _check_cp(cp)
    cp.check_num_tokens(num_tokens, name="num_tokens")
    return rank_token_index(operator.index(num_tokens), cp.world_size, cp.rank, cp.layout)


def _document_positions(offsets: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64 position of every token inside its document (global offsets, host)."""
    lens = offsets[1:] - offsets[:-1]
    starts = torch.repeat_interleave(offsets[:-1], lens)
    return torch.arange(int(offsets[-1])) - starts


@dataclass(frozen=True)
class CPShard:
    """One rank's share of a packed batch (:func:`shard_packed_batch`).

    Attributes:
        tensors: every given tensor cut along ``dim`` to this rank's ``T / W`` tokens, in FLA's local order.
        position_ids: ``[1, T / W]`` host int64 position of each local token in its document (GLOBAL: a
            document begun on an earlier rank continues its count).
        token_index: host int64 ``[T / W]`` global positions (:func:`cp_token_index`).
        cu_seqlens: host int32 rank-local offsets, FLA's ``FLACPContext.cu_seqlens_cpu``.
        num_tokens: the global packed token count ``T``.
    """

    tensors: dict[str, torch.Tensor]
    position_ids: torch.Tensor
    token_index: torch.Tensor
    cu_seqlens: torch.Tensor
    num_tokens: int


def _check_dim(dim: object) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int (the token dimension), got {type(dim).__name__}")


def check_host_offsets(cu_seqlens_cpu: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Host int64 ``[N + 1]`` offsets from a list or host tensor of integers; ``TypeError`` for non-integers,
    ``ValueError`` unless 1-D, on the host, from 0, non-decreasing, with at least 2 entries."""
    if isinstance(cu_seqlens_cpu, torch.Tensor) and cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be host offsets, got a tensor on {cu_seqlens_cpu.device}")
    if not isinstance(cu_seqlens_cpu, (torch.Tensor, Sequence)) or isinstance(cu_seqlens_cpu, (str, bytes)):
        raise TypeError(f"cu_seqlens_cpu must be a list or host tensor of ints, got {type(cu_seqlens_cpu).__name__}")
    raw = torch.as_tensor(cu_seqlens_cpu)
    if raw.is_floating_point() or raw.is_complex() or raw.dtype == torch.bool:
        raise TypeError(f"cu_seqlens_cpu must hold integer offsets, got dtype {raw.dtype}")
    offsets = raw.to(torch.int64)
    if offsets.dim() != 1 or offsets.numel() < 2 or int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(
            "cu_seqlens_cpu must be 1-D, non-decreasing offsets starting at 0 (N + 1 >= 2 entries), got "
            f"{offsets.tolist()}"
        )
    return offsets


def shard_packed_batch(
    tensors: Mapping[str, torch.Tensor], cu_seqlens_cpu: Sequence[int] | torch.Tensor, cp: CPConfig, *, dim: int = 1
) -> CPShard:
    """Rank ``cp.rank``'s share of a packed batch, cut as FLA's ``cp.layout`` expects.

    Args:
        tensors: packed tensors with ``T`` entries along ``dim`` (``input_ids [1, T]``, shifted ``labels``, ...).
        cu_seqlens_cpu: the GLOBAL ``[N + 1]`` host offsets (``T = cu_seqlens_cpu[-1]``).
        cp: the CP group, layout and conv width.
        dim: the token dimension of every tensor.

    Raises:
        ValueError: ``T`` does not split; a tensor without ``T`` entries along ``dim``; malformed offsets.
        TypeError: ``cp`` not a :class:`CPConfig`; non-tensor or non-mapping ``tensors``; non-integer offsets
            or ``dim``.
    """
    cp = _check_cp(cp)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to packed tensors, e.g. {{'input_ids': ids}}, got "
                        f"{type(tensors).__name__}")
    _check_dim(dim)
    offsets = check_host_offsets(cu_seqlens_cpu)
    num_tokens = int(offsets[-1])
    cp.check_num_tokens(num_tokens)
    for name, t in tensors.items():  # before the index is built: its size comes from the offsets
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if not -t.dim() <= dim < t.dim() or t.shape[dim] != num_tokens:
            raise ValueError(
                f"tensors[{name!r}] must have cu_seqlens_cpu[-1] = {num_tokens} entries along dim {dim}, "
                f"got shape {tuple(t.shape)}"
            )
    index = rank_token_index(num_tokens, cp.world_size, cp.rank, cp.layout)
    out = {name: t.index_select(dim, index.to(t.device)) for name, t in tensors.items()}
    context = build_cp_context(offsets, world_size=cp.world_size, rank=cp.rank, layout=cp.layout,
                               conv_kernel_size=cp.conv_kernel_size)
    positions = _document_positions(offsets)[index][None]
    return CPShard(out, positions, index, context.cu_seqlens_cpu, num_tokens)


def _inverse_order(num_tokens: int, world_size: int, layout: str) -> torch.Tensor:
    order = torch.cat([rank_token_index(num_tokens, world_size, r, layout) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_tokens)
    return inverse


def unshard(shards: Sequence[torch.Tensor], layout: str = "contiguous", *, dim: int = 1) -> torch.Tensor:
    """The global tensor (packed order along ``dim``) from ``shards[r]``, rank ``r``'s local tensor: the inverse of
    :func:`shard_packed_batch`, differentiable.

    Raises:
        ValueError: unknown ``layout``; no shards; a shard without ``dim``; unequal shards; an odd zigzag shard.
        TypeError: ``shards`` not a list or tuple of tensors; ``dim`` not an int.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(shards, (list, tuple)):
        raise TypeError(f"shards must be a list of tensors, one per CP rank, got {type(shards).__name__}")
    if not shards:
        raise ValueError("shards must hold one tensor per CP rank, got none")
    _check_dim(dim)
    for r, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{r}] must be a torch.Tensor, got {type(s).__name__}")
        if not -s.dim() <= dim < s.dim():
            raise ValueError(f"shards[{r}] has no dim {dim} (the token dimension), got shape {tuple(s.shape)}")
    local = shards[0].shape[dim]
    if any(s.shape[dim] != local for s in shards):
        raise ValueError(f"every shard must hold the same number of tokens along dim {dim}, got "
                         f"{[s.shape[dim] for s in shards]}")
    if layout == "zigzag" and local % 2:
        raise ValueError(f"zigzag shards hold two equal parts, got {local} tokens per shard")
    stacked = torch.cat(list(shards), dim=dim)  # rank-major, local order
    inverse = _inverse_order(local * len(shards), len(shards), layout)
    return stacked.index_select(dim, inverse.to(stacked.device))


def gather_unshard(local: torch.Tensor, cp: CPConfig, *, dim: int = 1) -> torch.Tensor:
    """Every rank's ``local`` tensor gathered over ``cp.group`` (differentiable) and put in packed order, e.g. for full
    attention under CP; ``ValueError`` when ``cp.group`` is ``None``."""
    import torch.distributed._functional_collectives as funcol

    cp = _check_cp(cp)
    if cp.group is None:
        raise ValueError("gather_unshard needs CPConfig.group (this CPConfig holds world_size/rank only)")
    if cp.world_size == 1:
        return local
    # torch >= 2.13 names it all_gather_single_autograd; older torch all_gather_tensor_autograd (same op)
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    dim = dim % local.dim()
    gathered = funcol.wait_tensor(gather(local.movedim(dim, 0).contiguous(), 0, cp.group))  # rank-major
    return unshard(list(gathered.chunk(cp.world_size, dim=0)), cp.layout, dim=0).movedim(0, dim)
