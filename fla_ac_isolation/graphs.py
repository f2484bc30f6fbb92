"""CUDA graphs (``docs/graphs.md``): :class:`StaticSeqlens`, offsets and FLA's chunk schedule in static buffers,
padded to a bound and refilled in place, so a captured CUDA graph replays for any packing of the same token count.
An optional part above the core: nothing in ``seqlens.py``, ``local_seqlens.py`` or ``offsets.py`` imports it.
"""

from __future__ import annotations

import torch

from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE, chunk_indices_for, chunk_offsets_for
from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens, fresh_copy
from fla_ac_isolation.offsets import (
    INDEX_DTYPES,
    check_available,
    check_fits,
    check_index_tensor,
    check_offsets,
    parse_device,
    snapshot,
)
from fla_ac_isolation.seqlens import devices_match

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


class StaticSeqlens(PackedSeqlens):
    """Device buffers for a batch's offsets and chunk schedule, padded to a bound, refilled in place per batch: the
    ``seqlens`` a CUDA graph is captured with (a sibling of :class:`~fla_ac_isolation.LayerLocalSeqlens`).

    One per packed-batch shape: a graph captured with it replays for every batch of ``num_tokens`` tokens in at
    most ``max_docs`` documents (empty ones count). :meth:`fill` writes each batch in; pass the object itself to
    the layers, whose :meth:`local` copies the buffers (inside a captured graph: at replay). It always describes
    the batch filled last, in eager steps too: fill the next batch only when the last one's step is done.

    Attributes:
        cu_seqlens: ``[max_docs + 2]`` device buffer; ``chunk_indices`` ``[max_chunks, 2]``;
            ``chunk_offsets`` ``[max_docs + 2]``; ``cu_seqlens_cpu`` ``[max_docs + 2]`` padded host offsets.
            Fixed addresses; the last filled batch's values.
        max_chunks: schedule rows, :func:`max_chunks_for`.
        max_seqlen: ``num_tokens``, the bound :meth:`local` hands out (valid for every batch).
        generation: how many batches have been filled in.

    Raises:
        TypeError: ``num_tokens``/``max_docs`` not ints; ``dtype`` not int32/int64.
        ValueError: ``num_tokens`` or ``max_docs`` below 1; a count ``dtype`` cannot hold; an unusable ``device``.

    Usage: ``docs/graphs.md``.
    """

    __slots__ = ("_lens", "chunk_indices", "chunk_offsets", "cu_seqlens", "cu_seqlens_cpu", "device", "dtype",
                 "generation", "max_chunks", "max_docs", "num_tokens")

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
        self._lens: list[int] | None = None

    def fill(self, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> None:
        """Validate one batch's offsets (as :class:`~fla_ac_isolation.LayerLocalSeqlens` does) and write their padded
        metadata into the buffers (on CUDA: on the current stream, so fill on the stream that replays).

        Args:
            cu_seqlens: ``[N + 1]`` int32/int64 offsets from 0 to ``num_tokens``, ``N <= max_docs``: host offsets
                (no sync) or on the buffers' device.
            cu_seqlens_cpu: optional host copy of device ``cu_seqlens`` (equal values): spares a sync.

        Raises:
            TypeError: offsets of the wrong type or dtype.
            ValueError: malformed offsets (as ``LayerLocalSeqlens``), offsets on another device, more than
                ``max_docs`` documents, ``cu_seqlens[-1] != num_tokens``; nothing is written then.
            RuntimeError: called during CUDA graph capture (the write would be replayed for every later batch).
        """
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "StaticSeqlens.fill ran while a CUDA graph is being captured: fill the static buffers before "
                "capture and before each replay, outside the captured region"
            )
        check_index_tensor(cu_seqlens, "cu_seqlens")
        if cu_seqlens.device.type != "cpu" and not devices_match(cu_seqlens.device, self.device):
            raise ValueError(
                f"cu_seqlens must be host offsets or live on the static buffers' device {self.device}, "
                f"got {cu_seqlens.device}"
            )
        _, host = snapshot(cu_seqlens, cu_seqlens_cpu)
        offsets = host.tolist()
        lens = check_offsets(offsets, None)
        cu, rows, starts = padded_metadata(offsets, self.num_tokens, self.max_docs)
        for buffer, values in ((self.cu_seqlens, cu), (self.chunk_indices, rows), (self.chunk_offsets, starts)):
            values = values.to(self.dtype)
            if self.device.type == "cuda":
                values = values.pin_memory()
            buffer.copy_(values, non_blocking=self.device.type == "cuda")
        self.cu_seqlens_cpu.copy_(cu)
        self._lens = lens
        self.generation += 1

    def _filled(self) -> list[int]:
        if self._lens is None:
            raise RuntimeError(f"{self!r} holds no batch yet: call fill(cu_seqlens) before handing it to a layer")
        return self._lens

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """Fresh copies of the buffers for one layer call: ``max_seqlen`` is ``num_tokens``, no ``cp_context``
        (``whole_batch`` makes no difference). ``RuntimeError`` before the first :meth:`fill`."""
        self._filled()
        return LocalSeqlens(fresh_copy(self.cu_seqlens), fresh_copy(self.cu_seqlens_cpu), self.num_tokens,
                            fresh_copy(self.chunk_indices), None, fresh_copy(self.chunk_offsets))

    def check_tokens(self, num_tokens: int, name: str = "hidden_states") -> None:
        """Raise ``ValueError`` naming ``name`` unless ``num_tokens`` is the static ``num_tokens``."""
        if num_tokens != self.num_tokens:
            raise ValueError(
                f"{name} has {num_tokens} packed tokens but the static buffers hold batches of num_tokens="
                f"{self.num_tokens}: every batch of one StaticSeqlens has its token count"
            )

    @property
    def max_seqlen(self) -> int:
        return self.num_tokens

    @property
    def num_seqs(self) -> int:
        """Documents of the batch filled last (without the padding). ``RuntimeError`` before the first fill."""
        return len(self._filled())

    def seq_lens(self) -> list[int]:
        """Document lengths of the batch filled last (without the padding). ``RuntimeError`` before the first fill."""
        return list(self._filled())

    def __repr__(self) -> str:
        return (f"StaticSeqlens(num_tokens={self.num_tokens}, max_docs={self.max_docs}, max_chunks={self.max_chunks}, "
                f"device={self.device}, dtype={self.dtype}, generation={self.generation})")
