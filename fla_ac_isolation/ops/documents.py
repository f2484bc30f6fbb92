"""The documents of a packed batch and their chunks, as FLA's kernels see them: the reference backends' schedule,
asked of FLA's identity-cached index helpers as the kernels ask and checked against the offsets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fla_ac_isolation.fla_seam.layout import prepare_chunk_indices, prepare_chunk_offsets

__all__ = ["PackedDocument", "packed_documents"]


class PackedDocument(NamedTuple):
    """One document of a packed batch: its token range and the token ranges of its chunks."""

    start: int
    end: int
    chunks: list[tuple[int, int]]


def _chunk_ranges(start: int, end: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, end)) for s in range(start, end, chunk_size)]


def _refuse_offsets(end: int, num_tokens: int, name: str) -> None:
    """The offsets end at ``end``, the input has ``num_tokens`` tokens: bad input, unless in a recompute."""
    said = f"{name} ends at {end} but the input has {num_tokens} tokens: the offsets do not match the tokens"
    if torch._C._current_graph_task_id() == -1:  # not in a backward: no recompute involved
        raise ValueError(f"{said} (the last offset must be the packed token count T of the inputs [1, T, ...])")
    raise RuntimeError(f"{said} in a backward (a checkpointed region's recompute): the recompute got other offsets "
                       f"or inputs than its forward; was one cu_seqlens object shared by checkpointed layers?")


def packed_documents(
    num_tokens: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    chunk_size: int,
    *,
    recurrent: bool,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> list[PackedDocument]:
    """The documents of a batch and their chunks, as FLA's kernels would see them (one per batch row without
    ``cu_seqlens``): the schedule is ``chunk_indices`` or FLA's ``prepare_chunk_indices``, grouped per document by
    ``chunk_offsets`` or ``prepare_chunk_offsets`` when ``recurrent``; empty documents are left out.

    Raises:
        ValueError: outside a backward, the offsets do not end at ``num_tokens`` (wrong offsets for the input).
        RuntimeError: in a backward (a checkpointed region's recompute), the offsets do not end at ``num_tokens``;
            or the schedule contradicts the offsets (e.g. a SAC replay misaligned by a shared ``cu_seqlens``).
    """
    if cu_seqlens is None:
        return [PackedDocument(0, num_tokens, _chunk_ranges(0, num_tokens, chunk_size))]

    offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    if offsets[-1] != num_tokens:
        _refuse_offsets(offsets[-1], num_tokens, "cu_seqlens_cpu" if cu_seqlens_cpu is not None else "cu_seqlens")
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
    rows = chunk_indices.tolist()
    if recurrent:
        if chunk_offsets is None:
            chunk_offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
        chunk_offsets = chunk_offsets.tolist()
        groups = [(n, rows[chunk_offsets[n]:chunk_offsets[n + 1]]) for n in range(len(offsets) - 1)]
    else:
        by_doc: dict[int, list] = {}
        last = len(offsets) - 2  # a padded schedule's extra rows are (last, 0), the last document being empty
        for row in rows:
            if row == [last, 0] and offsets[last] == offsets[last + 1]:
                continue
            by_doc.setdefault(int(row[0]), []).append(row)
        groups = sorted(by_doc.items())

    documents = []
    for n, doc_rows in groups:
        if not doc_rows:
            continue
        start, end = offsets[n], offsets[n + 1]
        chunks = []
        for seq, i in doc_rows:
            lo = start + i * chunk_size
            if seq != n or not start <= lo < end:
                raise RuntimeError(
                    "FLA's chunk metadata does not match cu_seqlens (document "
                    f"{n}, chunk row {(seq, i)}); was one cu_seqlens object shared by checkpointed layers?"
                )
            chunks.append((lo, min(lo + chunk_size, end)))
        documents.append(PackedDocument(start, end, chunks))
    covered = sum(hi - lo for doc in documents for lo, hi in doc.chunks)
    if covered != num_tokens:
        raise RuntimeError(
            f"FLA's chunk metadata covers {covered} tokens but the input has {num_tokens}; "
            "was one cu_seqlens object shared by checkpointed layers?"
        )
    return documents
