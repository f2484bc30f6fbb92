"""Cut a packed batch into microbatches for pipeline parallelism (or gradient accumulation), each with its own offsets.

Microbatches hold whole documents and one token count (pipelining sizes its receive buffers from the first); their
``[M, W]`` offsets are chunked on dim 0 by ``schedule.step(..., cu_seqlens=offsets)`` (``docs/pipeline-parallel.md``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fla_ac_isolation.fla_seam.layout import chunk_indices_for
from fla_ac_isolation.parallel.sharding import check_host_offsets
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["IGNORE_INDEX", "PackedMicrobatches", "split_packed_microbatches"]

IGNORE_INDEX = -100
"""The label of a token without a target (``cross_entropy``'s ``ignore_index``): the default pad of ``labels``."""


@dataclass(frozen=True)
class PackedMicrobatches:
    """A packed batch cut into ``M`` microbatches of ``tokens`` tokens each (:func:`split_packed_microbatches`).

    Attributes:
        tensors: every given tensor as ``[M, tokens, ...]``, padded with ``pad_values``, in :attr:`documents` order.
        cu_seqlens: ``[M, W]`` int32 offsets on the tensors' device (or ``device``): row ``i`` is microbatch ``i``'s
            documents, one padding document (maybe empty), then repeats of ``tokens``; a valid ``cu_seqlens`` each.
        cu_seqlens_cpu: the same offsets on the host.
        seq_lens: real document lengths per microbatch (padding excluded).
        documents: batch index of every document per microbatch (a document cut by ``split_documents`` appears twice).
        num_tokens: real tokens per microbatch.
        tokens: the common padded length ``T_mb``.
        chunk_indices: with ``chunk_indices=True``, FLA's ``[NT_i, 2]`` int64 host chunk schedule per row.
    """

    tensors: dict[str, torch.Tensor]
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    seq_lens: tuple[tuple[int, ...], ...]
    documents: tuple[tuple[int, ...], ...]
    num_tokens: tuple[int, ...]
    tokens: int
    chunk_indices: tuple[torch.Tensor, ...] | None = None

    @property
    def num_microbatches(self) -> int:
        """``M``."""
        return len(self.num_tokens)

    @property
    def padding(self) -> int:
        """Padding tokens over all microbatches: ``M * tokens - sum(num_tokens)``."""
        return self.num_microbatches * self.tokens - sum(self.num_tokens)

    def seqlens(self, index: int, seqlens_class: type[LayerLocalSeqlens] = LayerLocalSeqlens,
                **kwargs: Any) -> LayerLocalSeqlens:
        """Microbatch ``index``'s own ``seqlens`` for gradient accumulation in one process (under a schedule:
        :func:`~fla_ac_isolation.parallel.microbatch_seqlens`). ``IndexError`` outside ``[0, M)``.
        """
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_microbatches:
            raise IndexError(f"index must be an int in [0, {self.num_microbatches}), got {index!r}")
        return seqlens_class(self.cu_seqlens[index], cu_seqlens_cpu=self.cu_seqlens_cpu[index],
                             num_tokens=self.tokens, **kwargs)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _balanced(lens: list[int], m: int) -> list[list[int]]:
    """Longest-processing-time bin packing of documents into ``m`` microbatches, each kept in batch order."""
    bins: list[list[int]] = [[] for _ in range(m)]
    load = [0] * m
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        target = min(range(m), key=lambda b: (load[b], b))
        bins[target].append(i)
        load[target] += lens[i]
    return [sorted(b) for b in bins]


def _cut(offsets: list[int], m: int) -> list[list[tuple[int, int, int]]]:
    """``m`` contiguous pieces cut at ``p * T // m``: per piece, its ``(document, start, end)`` intervals."""
    total = offsets[-1]
    pieces: list[list[tuple[int, int, int]]] = []
    for p in range(m):
        lo, hi = p * total // m, (p + 1) * total // m
        last = p == m - 1
        pieces.append([(d, max(a, lo), min(b, hi)) for d, (a, b) in enumerate(itertools.pairwise(offsets))
                       if max(a, lo) < min(b, hi) or (a == b and (lo <= a < hi or (last and a == hi)))])
    return pieces


def split_packed_microbatches(
    tensors: Mapping[str, torch.Tensor],
    cu_seqlens_cpu: Sequence[int] | torch.Tensor,
    num_microbatches: int,
    *,
    tokens: int | None = None,
    pad_values: Mapping[str, int | float] | None = None,
    split_documents: bool = False,
    chunk_indices: bool = False,
    device: torch.device | str | None = None,
) -> PackedMicrobatches:
    """Cut a packed ``[1, T, ...]`` batch into ``num_microbatches`` microbatches of ``tokens`` tokens each.

    Documents stay whole (longest first, to the lightest microbatch), then one padding document. Pass the same
    ``tokens`` at every step (pipelining fixes its shapes at the first); shift labels *before* splitting and
    normalise the loss by the whole batch's target count.

    Args:
        tensors: packed ``[1, T, ...]`` tensors (``input_ids``, shifted ``labels``, ``hidden [1, T, D]``, ...).
        cu_seqlens_cpu: the batch's ``[N + 1]`` host offsets (``T = cu_seqlens_cpu[-1]``).
        num_microbatches: ``M``, from 1 to the number of non-empty documents (to ``T`` with ``split_documents``).
        tokens: tokens per microbatch; ``None``: the largest microbatch.
        pad_values: pad value per tensor name; default ``labels``: :data:`IGNORE_INDEX`, others 0.
        split_documents: cut at ``p * T // M`` instead; a crossing document becomes two (changing the model's output).
        chunk_indices: also compute FLA's chunk schedule per microbatch (host).
        device: where :attr:`PackedMicrobatches.cu_seqlens` lives; ``None``: the first tensor's device (else CPU).

    Raises:
        TypeError: non-tensor or non-mapping ``tensors``, non-int counts, non-bool flags, non-integer offsets.
        ValueError: malformed offsets; a tensor not ``[1, T, ...]``; ``num_microbatches`` out of range; ``tokens``
            below the largest microbatch or beyond int32.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to packed tensors, e.g. {{'input_ids': ids}}, got "
                        f"{type(tensors).__name__}")
    _check_int("num_microbatches", num_microbatches)
    for name, flag in (("split_documents", split_documents), ("chunk_indices", chunk_indices)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    offsets = check_host_offsets(cu_seqlens_cpu).tolist()
    total = offsets[-1]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2 or t.shape[0] != 1 or t.shape[1] != total:
            raise ValueError(f"tensors[{name!r}] must be packed as [1, T={total}, ...] (cu_seqlens_cpu[-1] tokens on "
                             f"dim 1), got shape {tuple(t.shape)}")
    lens = [b - a for a, b in itertools.pairwise(offsets)]
    nonempty = sum(1 for n in lens if n)
    most = total if split_documents else nonempty
    if not 1 <= num_microbatches <= max(most, 1):
        what = (f"the number of packed tokens ({total})" if split_documents else
                f"the number of non-empty documents ({nonempty}): documents are not split unless "
                "split_documents=True")
        raise ValueError(f"num_microbatches must be between 1 and {what}, got {num_microbatches}")
    if split_documents:
        pieces = _cut(offsets, num_microbatches)
    else:
        pieces = [[(d, offsets[d], offsets[d + 1]) for d in group] for group in _balanced(lens, num_microbatches)]
    sizes = [sum(b - a for _, a, b in piece) for piece in pieces]
    if tokens is None:
        tokens = max(sizes)
    _check_int("tokens", tokens)
    if tokens < max(sizes):
        raise ValueError(f"tokens={tokens} is smaller than the largest microbatch ({max(sizes)} tokens"
                         f"{'' if split_documents else ', documents are not split'})")
    if tokens >= 2**31:
        raise ValueError(f"tokens={tokens} does not fit int32 offsets (FLA's dtype)")
    rows = [[0, *itertools.accumulate(b - a for _, a, b in piece), tokens] for piece in pieces]
    width = max(len(row) for row in rows)
    host = torch.tensor([row + [tokens] * (width - len(row)) for row in rows], dtype=torch.int32)
    pads = dict(pad_values or {})
    out = {}
    for name, t in tensors.items():
        value = pads.get(name, IGNORE_INDEX if name == "labels" else 0)
        stacked = []
        for piece, size in zip(pieces, sizes):
            parts = [t[:, a:b] for _, a, b in piece]
            parts.append(t.new_full((1, tokens - size, *t.shape[2:]), value))
            stacked.append(torch.cat(parts, dim=1))
        out[name] = torch.cat(stacked, dim=0)
    if device is None:
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    return PackedMicrobatches(
        tensors=out,
        cu_seqlens=host.to(device),
        cu_seqlens_cpu=host,
        seq_lens=tuple(tuple(b - a for _, a, b in piece) for piece in pieces),
        documents=tuple(tuple(d for d, _, _ in piece) for piece in pieces),
        num_tokens=tuple(sizes),
        tokens=tokens,
        chunk_indices=tuple(chunk_indices_for(row) for row in host) if chunk_indices else None,
    )
