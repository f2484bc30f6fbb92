"""Graph-safe varlen metadata: the offsets and FLA's chunk schedule in static buffers, padded to a bound.

A CUDA graph replays the kernels it captured with the arguments it captured: the addresses of their tensors
and every host value (grid sizes, tensor sizes, scalars). FLA's varlen kernels take both from the packing of
the batch: the schedule's row count ``NT`` sizes the grids of the chunk kernels and the chunk-state tensors,
the document count ``N`` the grids of the state passes, and the offsets and the schedule are read from device
memory. A graph captured for one packing therefore cannot run another, unless

* **the sizes are fixed**: ``cu_seqlens`` is padded to ``max_docs + 1`` documents with zero-length documents
  (the last offset repeated; the last document is always one of them), and the schedule to
  :attr:`StaticSeqlens.max_chunks` rows whose extra rows ``(max_docs, 0)`` point at that zero-length
  document. FLA's GDN, simple GLA and conv kernels mask every load and store of a zero-length document, so
  those rows compute nothing and write nothing (padded chunk-state rows and conv weight-gradient partials
  stay unused or zero); the numbers of the real documents are unchanged (tests: bit for bit under Triton's
  interpreter). FLA 0.6 has no sentinel check in these kernels (its ``-1`` rows, FLA #1212, are for KDA
  only), hence rows that point at a real, empty document;
* **the values live at fixed addresses**: :class:`StaticSeqlens` owns the device buffers, and
  ``LayerLocalSeqlens(..., static=static)`` validates each batch's offsets and writes their padded metadata
  into them, in place, on the current stream, before the graph is replayed (or the layers run eagerly).

Fresh objects stay fresh. :meth:`StaticSeqlens.local` hands each layer call a clone of each buffer (the
isolation's fresh copy). While a graph is captured the clones are captured too, so every replay re-reads the
buffers into each layer's own copies; FLA's identity cache sees a new object per layer call during capture and
in eager steps, never one shared between layers, and a replay runs no Python, so it consults no cache.
A layer's forward and its recompute therefore miss FLA's cache alike, as without graphs. The copies matter
twice here: the buffers keep their identity from batch to batch, so handing FLA the buffers themselves would
let its identity cache return an earlier batch's metadata in eager steps (the tests show it), besides sharing
one object between layers.

Host values: ``LocalSeqlens.max_seqlen`` is the bound ``num_tokens`` (a per-batch value would be frozen into a
graph), and ``cu_seqlens_cpu`` the padded host offsets of the current batch (correct in eager steps; nothing
this library runs reads them once ``chunk_indices`` and ``chunk_offsets`` are given, and a graph would freeze
any host read made during capture).

Sizes: ``NT = sum(ceil(len_i / 64))`` over the documents is at most ``(T + 63 * N) // 64``, so
``max_chunks = (num_tokens + 63 * max_docs) // 64`` holds every packing of ``num_tokens`` tokens in at most
``max_docs`` documents. Padding costs a few idle programs per kernel (``max_chunks - NT`` chunk rows,
``max_docs + 1 - N`` documents).
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
    host: the metadata of ``offsets`` padded as the module docstring says.

    Args:
        offsets: ``N + 1`` validated offsets (non-decreasing, from 0 to ``num_tokens``) with ``N <= max_docs``.
        num_tokens: the packed token count ``T`` (``offsets[-1]``).
        max_docs: the document bound.

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

    Build one per packed-batch shape (token count and document bound) and keep it for the whole run; a
    CUDA graph captured with it replays correctly for every batch of ``num_tokens`` tokens in at most
    ``max_docs`` documents. Fill it with ``LayerLocalSeqlens(cu_seqlens, static=static)`` (validation and
    the in-place write) and hand that object to the layers, as without graphs.

    Args:
        num_tokens: packed tokens ``T`` of every batch (``hidden_states.shape[1]``).
        max_docs: the most documents a batch may hold (zero-length ones count).
        device: the activations' device.
        dtype: dtype of the offsets and schedule, ``torch.int32`` (default) or ``torch.int64``.

    Attributes:
        cu_seqlens: ``[max_docs + 2]`` device buffer; ``chunk_indices`` ``[max_chunks, 2]``;
            ``chunk_offsets`` ``[max_docs + 2]``; ``cu_seqlens_cpu`` ``[max_docs + 2]`` host copy of the
            padded offsets. Their addresses never change; their values are the last filled batch's.
        max_chunks: schedule rows, :func:`max_chunks_for`.
        generation: how many batches have been filled in.

    Raises:
        TypeError: ``num_tokens``/``max_docs`` not ints; ``dtype`` not int32/int64.
        ValueError: ``num_tokens < 1`` or ``max_docs < 1``; offsets that ``dtype`` cannot hold; ``device``
            not a device, or a CUDA device this process cannot use.

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
        """Write the padded metadata of ``offsets`` into the buffers, in place; returns the new generation.

        Called by ``LayerLocalSeqlens(..., static=self)`` after it validated ``offsets`` (``N + 1`` ints
        from 0 to ``num_tokens``). On CUDA the writes are host-to-device copies from fresh pinned memory on
        the current stream, without blocking the host; work queued earlier on that stream (a replay reading
        the previous batch) is ordered before them. Fill on the stream that replays the graph.

        Raises:
            ValueError: see :func:`padded_metadata`.
            RuntimeError: called while the current stream is capturing a graph (the write would be captured
                with this batch's values and replayed for every later batch).
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
        """Fresh copies of the buffers for one layer call (see the module docstring): ``max_seqlen`` is
        ``num_tokens``, ``cp_context`` is ``None``."""
        return LocalSeqlens(fresh_copy(self.cu_seqlens), fresh_copy(self.cu_seqlens_cpu), self.num_tokens,
                            fresh_copy(self.chunk_indices), None, fresh_copy(self.chunk_offsets))

    def seq_lens(self) -> list[int]:
        """Lengths of the filled batch's documents, padding included (zero-length tail), from the host copy."""
        offsets = self.cu_seqlens_cpu.tolist()
        return [b - a for a, b in itertools.pairwise(offsets)]

    def __repr__(self) -> str:
        return (f"StaticSeqlens(num_tokens={self.num_tokens}, max_docs={self.max_docs}, max_chunks={self.max_chunks}, "
                f"device={self.device}, dtype={self.dtype}, generation={self.generation})")
