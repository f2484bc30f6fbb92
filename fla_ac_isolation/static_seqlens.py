"""Graph-safe varlen metadata (``docs/graphs.md``): offsets and FLA's chunk schedule in static buffers, padded to
a bound and refilled in place, so a captured CUDA graph replays for any packing of the same token count.
"""

from __future__ import annotations

import itertools

import torch

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE, chunk_indices_for, chunk_offsets_for
from fla_ac_isolation.local_seqlens import LocalSeqlens, fresh_copy
from fla_ac_isolation.offsets import INDEX_DTYPES, check_available, check_fits, parse_device

__all__ = ["StaticSeqlens", "max_chunks_for", "padded_metadata"]


def max_chunks_for(num_tokens: int, max_docs: int, chunk_size: int = CHUNK_SIZE) -> int:
    """The most chunk-schedule rows of ``num_tokens`` tokens in at most ``max_docs`` documents:
    ``(num_tokens + (chunk_size - 1) * max_docs) // chunk_size``, and at least one (the padding row)."""
    return max(1, (num_tokens + (chunk_size - 1) * max_docs) // chunk_size)


def padded_metadata(
    offsets: list[int], num_tokens: int, max_docs: int, chunk_size: int = CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cu_seqlens [max_docs + 2], chunk_indices [max_chunks, 2], chunk_offsets [max_docs + 2])``, int64 on the
    host, for validated ``offsets`` from 0 to ``num_tokens``: padded with empty documents, and with schedule rows
    ``(max_docs, 0)`` on the last, empty document (FLA's GDN, simple GLA and conv kernels write nothing there).

    Raises:
        ValueError: more than ``max_docs`` documents; ``offsets[-1] != num_tokens``.
    """
    docs = len(offsets) - 1
    if docs > max_docs:
        raise ValueError(
            f"the batch has {docs} documents but the static buffers hold at most max_docs={max_docs}: build the "
            "StaticSeqlens with a larger max_docs, or run this batch without them (eager)"
        )
    if offsets[-1] != num_tokens:
        raise ValueError(f"cu_seqlens[-1] must equal the static num_tokens={num_tokens}, got {offsets[-1]}")
    padded = list(offsets) + [num_tokens] * (max_docs + 1 - docs)                 # [max_docs + 2]
    rows = chunk_indices_for(offsets, chunk_size)                                   # [NT, 2]
    spare = max_chunks_for(num_tokens, max_docs, chunk_size) - rows.shape[0]
    filler = torch.tensor([[max_docs, 0]], dtype=torch.int64).expand(spare, 2)    # the empty document max_docs
    return (torch.tensor(padded, dtype=torch.int64), torch.cat([rows, filler]),
            chunk_offsets_for(padded, chunk_size))


class StaticSeqlens:
    """Device buffers for a batch's offsets and chunk schedule, padded to a bound, refilled in place per batch.

    One per packed-batch shape: a graph captured with it replays for every batch of ``num_tokens`` tokens in at
    most ``max_docs`` documents (empty ones count). Fill it with ``LayerLocalSeqlens(cu_seqlens, static=static)``.

    Attributes:
        cu_seqlens: ``[max_docs + 2]`` device buffer; ``chunk_indices`` ``[max_chunks, 2]``;
            ``chunk_offsets`` ``[max_docs + 2]``; ``cu_seqlens_cpu`` ``[max_docs + 2]`` padded host offsets.
            Fixed addresses; the last filled batch's values.
        max_chunks: schedule rows, :func:`max_chunks_for`.
        generation: how many batches have been filled in.

    Raises:
        TypeError: ``num_tokens``/``max_docs`` not ints; ``dtype`` not int32/int64.
        ValueError: ``num_tokens`` or ``max_docs`` below 1; a count ``dtype`` cannot hold; an unusable ``device``.

    Example::

        static = StaticSeqlens(num_tokens=32768, max_docs=64, device="cuda")
        for batch in loader:
            seqlens = LayerLocalSeqlens(batch.cu_seqlens_cpu, static=static)   # fills the buffers in place
            graph.replay()                       # a graph captured with an earlier batch's seqlens
    """

    __slots__ = ("chunk_indices", "chunk_offsets", "cu_seqlens", "cu_seqlens_cpu", "device", "dtype", "generation",
                 "max_chunks", "max_docs", "num_tokens")

    def __init__(self, num_tokens: int, max_docs: int, *, device: torch.device | str,
                 dtype: torch.dtype = torch.int32) -> None:
        for name, value in (("num_tokens", num_tokens), ("max_docs", max_docs)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if dtype not in INDEX_DTYPES:
            raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        check_fits(num_tokens, dtype, "num_tokens")
        self.device = parse_device(device)
        check_available(self.device)
        self.dtype = dtype
        self.num_tokens = num_tokens
        self.max_docs = max_docs
        self.max_chunks = max_chunks_for(num_tokens, max_docs)
        cu, rows, starts = padded_metadata([0, num_tokens], num_tokens, max_docs)  # one document until filled
        self.cu_seqlens = cu.to(self.device, dtype)
        self.chunk_indices = rows.to(self.device, dtype)
        self.chunk_offsets = starts.to(self.device, dtype)
        self.cu_seqlens_cpu = cu.to(dtype)
        self.generation = 0

    def fill(self, offsets: list[int]) -> int:
        """Write the padded metadata of validated ``offsets`` into the buffers (on CUDA: on the current stream,
        so fill on the stream that replays); returns the new generation.

        Raises:
            ValueError: see :func:`padded_metadata`.
            RuntimeError: called during graph capture (the write would be replayed for every later batch).
        """
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "StaticSeqlens.fill (LayerLocalSeqlens(..., static=)) ran while a CUDA graph is being captured: "
                "fill the static buffers before capture and before each replay, outside the captured region"
            )
        cu, rows, starts = padded_metadata(offsets, self.num_tokens, self.max_docs)
        for buffer, host in ((self.cu_seqlens, cu), (self.chunk_indices, rows), (self.chunk_offsets, starts)):
            host = host.to(self.dtype)
            if self.device.type == "cuda":
                host = host.pin_memory()
            buffer.copy_(host, non_blocking=self.device.type == "cuda")
        self.cu_seqlens_cpu.copy_(cu)
        self.generation += 1
        return self.generation

    def local(self) -> LocalSeqlens:
        """Fresh copies of the buffers for one layer call: ``max_seqlen`` is ``num_tokens``, no ``cp_context``."""
        return LocalSeqlens(fresh_copy(self.cu_seqlens), fresh_copy(self.cu_seqlens_cpu), self.num_tokens,
                            fresh_copy(self.chunk_indices), None, fresh_copy(self.chunk_offsets))

    def seq_lens(self) -> list[int]:
        """Lengths of the filled batch's documents, padding included (zero-length tail), from the host copy."""
        offsets = self.cu_seqlens_cpu.tolist()
        return [b - a for a, b in itertools.pairwise(offsets)]

    def __repr__(self) -> str:
        return (f"StaticSeqlens(num_tokens={self.num_tokens}, max_docs={self.max_docs}, max_chunks={self.max_chunks}, "
                f"device={self.device}, dtype={self.dtype}, generation={self.generation})")
