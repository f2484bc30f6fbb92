"""Deterministic packed SFT batches for the regression, different on every rank.

Every rank builds every rank's batch from ``(seed, step, rank)`` alone, so no data is communicated and
an EP=1 run can process the *same global batch* (all ranks' documents packed one after another).

Shape of the schedule (``T`` packed tokens per rank and step, ``N`` documents):

* ordinary steps: 2 to 4 documents of 1 to ``max_doc_len`` tokens, one of at least 72 tokens (two FLA
  chunks or more), a zero-length document at a random place and a final document of ``1 + 10 * r``
  tokens on rank ``r``; lengths are drawn per rank, so token counts and expert traffic differ between
  ranks;
* step 1 (when ``steps >= 2``) is a *sparse* step: rank 0 packs ``[2, 0]`` and the other ranks ``[0, 1]``
  tokens, i.e. 2 + (world - 1) tokens routed to ``top_k`` experts each; with 16 experts, top-4 and
  EP=2 that is at most 12 routings, so at least 4 experts receive no token at all.

Labels are next-token targets within a document; the last token of each document has no target
(``-100``). The loss is the sum of token cross-entropies over all ranks divided by the global number of
targets, so per-rank gradients add up to the gradient of the global mean.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

__all__ = ["PackedBatch", "global_batch", "rank_batch"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedBatch:
    """One rank's packed batch for one step.

    Attributes:
        input_ids: ``[1, T]`` int64 token ids.
        labels: ``[1, T]`` int64 targets, ``-100`` where a document ends.
        seq_lens: document lengths (zeros included); ``sum(seq_lens) == T``.
        num_targets_global: targets summed over every rank of this step (the loss denominator).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    seq_lens: tuple[int, ...]
    num_targets_global: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _doc_lens(seed: int, step: int, rank: int, world: int, max_doc_len: int) -> list[int]:
    if step == 1:
        return [2, 0] if rank == 0 else [0, 1]
    rng = random.Random(f"fla-ac-isolation/{seed}/{step}/{rank}")
    count = rng.randint(3, 5)
    lens = [rng.randint(1, max_doc_len) for _ in range(count - 1)]
    lens.append(max(72, max_doc_len // 2 + 10 * rank))  # two or more 64-token chunks
    lens.insert(rng.randint(0, len(lens)), 0)  # a zero-length document
    lens.append(1 + 10 * rank)  # uneven totals across ranks
    return lens


def _tokens(seed: int, step: int, rank: int, lens: list[int], vocab_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 1_009 + rank) % (2**31))
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lens]


def _labels(docs: list[torch.Tensor]) -> torch.Tensor:
    pieces = []
    for doc in docs:
        if doc.numel():
            pieces.append(torch.cat([doc[1:], torch.tensor([IGNORE_INDEX])]))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)


def _targets(lens: list[int]) -> int:
    return sum(max(n - 1, 0) for n in lens)


def rank_batch(
    step: int, rank: int, world: int, *, seed: int = 0, vocab_size: int = 256, max_doc_len: int = 64
) -> PackedBatch:
    """The batch of ``rank`` (of ``world``) at ``step``; pure function of its arguments."""
    lens = _doc_lens(seed, step, rank, world, max_doc_len)
    docs = _tokens(seed, step, rank, lens, vocab_size)
    total = sum(_targets(_doc_lens(seed, step, r, world, max_doc_len)) for r in range(world))
    return PackedBatch(torch.cat(docs)[None], _labels(docs)[None], tuple(lens), total)


def global_batch(
    step: int, world: int, *, seed: int = 0, vocab_size: int = 256, max_doc_len: int = 64
) -> PackedBatch:
    """All ``world`` ranks' batches of ``step`` packed into one (what an EP=1 run over them sees)."""
    parts = [rank_batch(step, r, world, seed=seed, vocab_size=vocab_size, max_doc_len=max_doc_len)
             for r in range(world)]
    return PackedBatch(
        torch.cat([p.input_ids for p in parts], dim=1),
        torch.cat([p.labels for p in parts], dim=1),
        tuple(n for p in parts for n in p.seq_lens),
        parts[0].num_targets_global,
    )
