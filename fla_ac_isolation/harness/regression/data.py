"""Deterministic packed SFT batches for the regression, different on every rank and built from ``(seed, step,
rank)`` alone (no data is communicated). Each step packs a zero-length document and a long one; step 1 is sparse
(some experts get no token). The loss is a token sum over the global target count, so rank gradients add up."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from fla_ac_isolation.parallel import CPConfig, split_packed_microbatches

__all__ = [
    "CP_SCHEDULE",
    "PP_MAX_MICROBATCHES",
    "PP_SCHEDULE",
    "PackedBatch",
    "cp_batch",
    "global_batch",
    "pp_batch",
    "pp_global_batch",
    "pp_microbatch_note",
    "pp_microbatch_tokens",
    "rank_batch",
]

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
    """The batch of ``rank`` (of ``world``) at ``step``."""
    lens = _doc_lens(seed, step, rank, world, max_doc_len)
    docs = _tokens(seed, step, rank, lens, vocab_size)
    total = sum(_targets(_doc_lens(seed, step, r, world, max_doc_len)) for r in range(world))
    return PackedBatch(torch.cat(docs)[None], _labels(docs)[None], tuple(lens), total)


def global_batch(
    step: int, world: int, *, seed: int = 0, vocab_size: int = 256, max_doc_len: int = 64
) -> PackedBatch:
    """All ``world`` ranks' batches of ``step`` packed into one."""
    parts = [rank_batch(step, r, world, seed=seed, vocab_size=vocab_size, max_doc_len=max_doc_len)
             for r in range(world)]
    return PackedBatch(
        torch.cat([p.input_ids for p in parts], dim=1),
        torch.cat([p.labels for p in parts], dim=1),
        tuple(n for p in parts for n in p.seq_lens),
        parts[0].num_targets_global,
    )


CP_SCHEDULE: dict[str, tuple[tuple[int, ...], ...]] = {
    "contiguous": ((10, 0, 30, 88), (10, 0, 20, 70, 28)),
    "zigzag": ((10, 0, 20, 70, 28), (10, 0, 30, 88)),
}
"""Document lengths of the context-parallel batch per layout, per step (cycled)."""


def cp_padding_note(cp: int, layout: str) -> str | None:
    """What :func:`cp_batch` pads, as one line for the report; None if nothing."""
    parts = CPConfig(world_size=cp, rank=0, layout=layout).num_parts
    pads = sorted({-sum(lens) % parts for lens in CP_SCHEDULE[layout]})
    if pads == [0]:
        return None
    tokens = "/".join(str(sum(lens)) for lens in CP_SCHEDULE[layout])
    return (
        f"CP batch padded: {tokens} tokens do not split into {parts} equal parts ({layout}, CP={cp}); each step "
        f"appends one document of {'/'.join(map(str, pads))} token(s) whose labels are ignored (the CP=1 reference "
        "trains on the same padded batch)"
    )


def cp_batch(
    step: int, *, layout: str = "contiguous", multiple: int = 1, seed: int = 0, vocab_size: int = 256
) -> PackedBatch:
    """The one global batch of ``step`` under context parallelism (every CP rank shards it).

    Args:
        step: training step (``CP_SCHEDULE[layout]`` is cycled).
        layout: the CP layout (step 0 packs the batch made for its cuts).
        multiple: the token count is padded up to a multiple of it with a last document of ``-100`` labels.
        seed: token ids.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
    """
    schedule = CP_SCHEDULE[layout]
    lens = list(schedule[step % len(schedule)])
    docs = _tokens(seed, step, 0, lens, vocab_size)
    labels = _labels(docs)
    pad = -sum(lens) % multiple
    if pad:
        lens.append(pad)
        docs.append(torch.zeros(pad, dtype=torch.int64))
        labels = torch.cat([labels, torch.full((pad,), IGNORE_INDEX)])
    return PackedBatch(torch.cat(docs)[None], labels[None], tuple(lens), int((labels != IGNORE_INDEX).sum()))


PP_SCHEDULE: tuple[tuple[int, ...], ...] = (
    (13, 0, 70, 7, 21, 5, 33, 9, 1, 17),
    (40, 3, 0, 25, 60, 11, 2, 30),
    (9, 48, 0, 22, 5, 31, 14, 27),
)
"""Document lengths of the pipeline-parallel batches per step (cycled), before each rank's last document."""

PP_MAX_MICROBATCHES = min(sum(1 for n in lens if n) for lens in PP_SCHEDULE) + 1
"""The most microbatches a PP run may ask for: the non-empty documents of the smallest batch (8)."""


def _pp_lens(step: int, rank: int) -> list[int]:
    return [*PP_SCHEDULE[step % len(PP_SCHEDULE)], 1 + 10 * rank]


def pp_batch(step: int, rank: int, world: int, *, seed: int = 0, vocab_size: int = 256) -> PackedBatch:
    """Data-parallel rank ``rank``'s (of ``world``) batch at ``step`` under pipeline parallelism."""
    lens = _pp_lens(step, rank)
    docs = _tokens(seed, step, rank, lens, vocab_size)
    total = sum(_targets(_pp_lens(step, r)) for r in range(world))
    return PackedBatch(torch.cat(docs)[None], _labels(docs)[None], tuple(lens), total)


def pp_global_batch(step: int, world: int, *, seed: int = 0, vocab_size: int = 256) -> PackedBatch:
    """Every data-parallel rank's :func:`pp_batch` of ``step`` packed into one."""
    parts = [pp_batch(step, r, world, seed=seed, vocab_size=vocab_size) for r in range(world)]
    return PackedBatch(
        torch.cat([p.input_ids for p in parts], dim=1),
        torch.cat([p.labels for p in parts], dim=1),
        tuple(n for p in parts for n in p.seq_lens),
        parts[0].num_targets_global,
    )


def pp_microbatch_tokens(steps: int, world: int, microbatches: int) -> int:
    """The one token count of every microbatch of a PP run (the largest over all steps and ranks)."""
    most = 0
    for step in range(steps):
        for rank in range(world):
            lens = _pp_lens(step, rank)
            offsets = [0, *(int(x) for x in torch.tensor(lens).cumsum(0))]
            most = max(most, split_packed_microbatches({}, offsets, microbatches).tokens)
    return most


def pp_microbatch_note(steps: int, world: int, microbatches: int) -> str:
    """The PP run's microbatches (token count, padding), as one line for the report."""
    tokens = pp_microbatch_tokens(steps, world, microbatches)
    real = sum(sum(_pp_lens(step, rank)) for step in range(steps) for rank in range(world))
    padded = tokens * microbatches * steps * world
    return (
        f"PP microbatches: each data-parallel rank's batch is cut into {microbatches} microbatches of whole documents "
        f"(longest first, to the lightest), each padded to {tokens} tokens with one document whose labels are ignored "
        f"({100 * (padded - real) / padded:.0f}% padding over the run); no-ac runs the same schedule, no-ac-pp1 the "
        "whole batches on one rank"
    )
