"""Per-layer ``cu_seqlens``: the isolation that makes FLA layers safe under activation checkpointing.

FLA memoises metadata derived from ``cu_seqlens`` by argument *identity* (``fla.utils.tensor_cache``).
When every layer receives the same ``cu_seqlens`` object, one checkpointed layer can miss that cache in
its forward and hit it in its recompute (or the reverse), so the recompute runs a different sequence of
aten ops and selective activation checkpointing replays saved tensors into the wrong ops.

:class:`LayerLocalSeqlens` is built once per model forward (validated there, once) and handed to every
layer. Each layer calls :meth:`LayerLocalSeqlens.local` *inside* its own forward, i.e. inside whatever
region is checkpointed, and receives tensors that are new Python objects with the same values. Forward
and recompute of a layer then both start with a cache miss, while FLA's reuse inside one layer (its
forward, its recompute, its backward) is kept.

Vocabulary: ``cu_seqlens`` ``[N + 1]`` integer offsets of ``N`` packed sequences
(documents); ``cu_seqlens_cpu`` the same offsets on the host; ``max_seqlen`` the longest document.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fla_ac_isolation.cp_interface import check_cp_argument
from fla_ac_isolation.fla_seam.layout import chunk_indices_for, chunk_offsets_for
from fla_ac_isolation.local_seqlens import LocalSeqlens, fresh_copy, host_to_device
from fla_ac_isolation.offsets import (
    INDEX_DTYPES,
    check_available,
    check_fits,
    check_index_tensor,
    check_num_tokens,
    check_offsets,
    check_positions,
    checked_host_copy,
    lengths,
    parse_device,
)

if TYPE_CHECKING:
    from fla_ac_isolation.cp_interface import CPBatchSeqlens
    from fla_ac_isolation.parallel.config import CPConfig
    from fla_ac_isolation.static_seqlens import StaticSeqlens

__all__ = ["LayerLocalSeqlens", "devices_match"]


def devices_match(actual: torch.device, expected: torch.device) -> bool:
    """Same device type, and same index where both name one (``cuda`` matches ``cuda:1``)."""
    if actual.type != expected.type:
        return False
    if expected.index is None or actual.index is None:
        return True
    return actual.index == expected.index


class LayerLocalSeqlens:
    """Packed-sequence boundaries that hand each layer its own ``cu_seqlens`` object.

    Build one per model forward (it validates its inputs once, here) and pass it to every layer. Inside
    its forward, each FLA-backed layer calls :meth:`local` and passes the returned tensors to FLA.

    Args:
        cu_seqlens: ``[N + 1]`` int32 or int64 tensor of document offsets: starts at 0, non-decreasing
            (zero-length documents are legal), last value = number of packed tokens ``T``. It must live on
            the device of the activations.
        max_seqlen: longest document in tokens. Computed when ``None``; when given, it must be an ``int``
            at least as large as the longest document (an upper bound is accepted, as in flash-attn).
        cu_seqlens_cpu: optional ``[N + 1]`` host (CPU) copy of ``cu_seqlens`` with equal values (int32 or
            int64, either way: FLA only reads it on the host). FLA uses host offsets to avoid
            device-to-host syncs; pass it when you have it.
        device: optional device the activations live on; ``cu_seqlens`` must be on it.
        num_tokens: optional packed token count ``T`` (``hidden_states.shape[1]``); when given, the last
            offset must equal it, checked before anything proportional to the offsets is allocated (see
            "Chunk schedule" below). Pass it whenever you have it.
        chunk_indices: precompute FLA's chunk schedule
            (:func:`~fla_ac_isolation.fla_seam.layout.chunk_indices_for`, of
            :data:`~fla_ac_isolation.fla_seam.layout.CHUNK_SIZE`-token chunks) once, here, and hand each
            layer a fresh copy as ``LocalSeqlens.chunk_indices``. The mixers pass it to FLA's conv and
            gated delta rule, which then skip ``prepare_chunk_indices`` and the
            blocking host-to-device copy it ends with (a stream synchronisation per call). ``False``
            restores FLA's own computation inside every layer call.
        cp: context parallelism (:class:`~fla_ac_isolation.parallel.CPConfig`: group, layout, conv width).
            ``cu_seqlens`` (and ``num_tokens``) then describe the WHOLE packed batch of all CP ranks, and
            FLA's CP context for this rank is built here, once, from the host offsets (no device-to-host
            sync); :meth:`local` hands each layer a fresh copy (``LocalSeqlens.cp_context``), and
            :meth:`check_tokens` expects this rank's ``T / W`` tokens. See ``docs/context-parallel.md``.
        static: graph-safe metadata (:class:`~fla_ac_isolation.static_seqlens.StaticSeqlens`): after
            validation, this batch's offsets, chunk schedule and chunk offsets are written, padded to the
            static bound, into ``static``'s buffers, in place (no allocation whose address a CUDA graph could
            miss), and :meth:`local` hands out fresh copies of those buffers. ``cu_seqlens`` may then be a
            host tensor (nothing is read back from the device) or live on ``static.device``; ``num_tokens``
            and ``cu_seqlens[-1]`` must be ``static.num_tokens``. The object is valid until the next batch is
            written into the same buffers. See ``docs/graphs.md``.

    Raises:
        TypeError: ``cu_seqlens``/``cu_seqlens_cpu`` is not a tensor, or not int32/int64; ``max_seqlen``
            or ``num_tokens`` is not an ``int``; ``chunk_indices`` is not a bool; ``cp`` is not a
            :class:`~fla_ac_isolation.parallel.CPConfig`; ``static`` is not a
            :class:`~fla_ac_isolation.static_seqlens.StaticSeqlens`.
        ValueError: ``cu_seqlens`` is not 1-D with at least 2 entries, does not start at 0, decreases,
            is a meta tensor, sits on another device than ``device``, or its last value differs from ``num_tokens``;
            ``cu_seqlens_cpu`` is not on the CPU or differs in shape or values (compared as int64, so an
            int32 copy of larger offsets cannot pass); ``max_seqlen`` is smaller than the longest
            document; ``num_tokens`` is negative; ``device`` is not a device; with ``cp``: ``cu_seqlens``
            off the CPU without ``cu_seqlens_cpu``, a token count that does not split as ``cp.layout``
            needs, an interval shorter than ``cp.conv_kernel_size - 1``
            (:meth:`~fla_ac_isolation.parallel.CPConfig.check_num_tokens`); with ``static``: ``cp`` or
            ``chunk_indices=False`` given too, ``cu_seqlens`` (or ``device``) on another device than the host
            or ``static.device``, more documents than ``static.max_docs``, a token count other than
            ``static.num_tokens``.
        RuntimeError: with ``static``, construction while the current CUDA stream captures a graph.

    Ownership: the object keeps its own snapshot, one clone of ``cu_seqlens`` (and of
    ``cu_seqlens_cpu``) taken here and validated; mutating or reusing the caller's tensors afterwards
    changes nothing that :meth:`local` hands out. On a GPU the clone is ordered on the current stream,
    so it sees the values written before this call and adds no synchronisation.

    Chunk schedule: ``sum(ceil(len / CHUNK_SIZE))`` rows over the documents, at most
    ``T / CHUNK_SIZE + N`` for consistent offsets (``T = cu_seqlens[-1]``). Every check on the values
    runs before it is allocated; with ``num_tokens`` given, a last offset that is not the token count is
    refused first, so one bad value cannot allocate a schedule sized by it. Without ``num_tokens``,
    ``cu_seqlens[-1]`` is trusted as ``T``. The mixers pass ``hidden_states.shape[1]`` when they wrap
    transformers' ``cu_seq_lens_q``.

    Cost: validation reads the offsets on the host once. With ``cu_seqlens`` on a GPU and no
    ``cu_seqlens_cpu`` that is one device-to-host copy (kept, and handed to every layer as
    ``cu_seqlens_cpu``); with ``cu_seqlens_cpu`` it is one comparison (also a device-to-host copy, of
    ``cu_seqlens``). The chunk schedule goes to the device through pinned memory without blocking the
    host. :meth:`local` never synchronises.

    Example::

        seqlens = LayerLocalSeqlens(cu_seqlens, cu_seqlens_cpu=cu_seqlens_host)
        for layer in model.layers:                 # checkpointed or not
            hidden = layer(hidden, seqlens=seqlens)
        # inside a layer's forward:
        local = seqlens.local()                    # fresh objects, same values
        fla_op(..., cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu,
               chunk_indices=local.chunk_indices)   # where the FLA op takes chunk_indices
    """

    __slots__ = (
        "_chunk_indices", "_chunk_offsets", "_cp", "_cu_seqlens", "_cu_seqlens_cpu", "_generation", "_host_given",
        "_static", "max_seqlen", "num_seqs", "num_tokens",
    )

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        num_tokens: int | None = None,
        chunk_indices: bool = True,
        cp: CPConfig | None = None,
        static: StaticSeqlens | None = None,
    ) -> None:
        check_index_tensor(cu_seqlens, "cu_seqlens")
        if cp is not None:
            check_cp_argument(cp, cu_seqlens, cu_seqlens_cpu)
        if not isinstance(chunk_indices, bool):
            raise TypeError(f"chunk_indices must be a bool (precompute FLA's chunk schedule), got {chunk_indices!r}")
        if static is not None:
            _check_static(static, cu_seqlens, device, cp, chunk_indices)
            device = None  # checked against static.device; cu_seqlens may be the host offsets
        if device is not None and not devices_match(cu_seqlens.device, parse_device(device)):
            raise ValueError(
                f"cu_seqlens must be on the activations' device {torch.device(device)}, got {cu_seqlens.device}"
            )
        if cu_seqlens.device.type == "meta":
            raise ValueError("cu_seqlens is a meta tensor, which holds no values; build it on the activations' device")
        check_num_tokens(num_tokens)
        # The snapshot: one clone of each caller tensor, validated and then kept, so that the caller may
        # reuse or mutate its own tensors afterwards. On a GPU the clone is stream-ordered (no sync).
        own = cu_seqlens.detach().clone()
        own_host = None if cu_seqlens_cpu is None else checked_host_copy(cu_seqlens_cpu, own)
        host = own_host if own_host is not None else (own if own.device.type == "cpu" else own.cpu())
        offsets = host.tolist()
        lens = check_offsets(offsets, num_tokens if cp is None else None)
        if cp is not None and num_tokens is not None and offsets[-1] != num_tokens:
            raise ValueError(
                f"cu_seqlens[-1] must equal num_tokens={num_tokens}, got {offsets[-1]}: with cp=, both count the "
                f"WHOLE packed batch of all {cp.world_size} CP ranks, not this rank's hidden_states.shape[1]"
            )
        longest = max(lens)
        if max_seqlen is None:
            max_seqlen = longest
        elif isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}")
        elif max_seqlen < longest:
            raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest document ({longest} tokens)")

        self._cu_seqlens = own
        self._cu_seqlens_cpu = host
        self._host_given = cu_seqlens_cpu is not None
        self.max_seqlen: int = max_seqlen
        self.num_tokens: int = offsets[-1]
        self.num_seqs: int = len(lens)
        schedule = chunk_indices and static is None
        self._chunk_indices = (
            host_to_device(chunk_indices_for(offsets).to(own.dtype), own.device) if schedule else None
        )
        self._chunk_offsets = (
            host_to_device(chunk_offsets_for(offsets).to(own.dtype), own.device) if schedule else None
        )
        self._static = static
        self._generation = static.fill(offsets) if static is not None else 0
        # under CP, the per-batch part comes from the CP object itself (parallel/ sits above this module)
        self._cp: CPBatchSeqlens | None = (
            None if cp is None else cp.batch_seqlens(host, cu_seqlens.device, chunk_indices=chunk_indices)
        )

    # ----------------------------------------------------------------------------------------- builders
    @classmethod
    def from_seq_lens(
        cls,
        seq_lens: Sequence[int],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.int32,
        *,
        with_cpu: bool = True,
        chunk_indices: bool | None = None,
        cp: CPConfig | None = None,
    ) -> LayerLocalSeqlens:
        """Build from document lengths, e.g. ``[5, 0, 17]`` -> ``cu_seqlens = [0, 5, 5, 22]``.

        Args:
            seq_lens: non-negative document lengths in tokens (zero is legal): Python ints or numpy
                integer scalars (``np.int64``, ... are exact integers and accepted); not floats, bools
                or tensors (pass a tensor as ``seq_lens.tolist()``).
            device: device of the activations (``cu_seqlens`` is created there); CPU when ``None``.
            dtype: ``torch.int32`` (FLA's and flash-attn's convention) or ``torch.int64``.
            with_cpu: also keep the host offsets as ``cu_seqlens_cpu`` (no sync needed later).
            chunk_indices: precompute FLA's chunk schedule (see the class); ``None``: the class default
                (``True``; ``False`` for the harness's ``modes.SharedSeqlens``).
            cp: context parallelism (see the class): ``seq_lens`` are then the documents of the whole batch.

        Raises:
            TypeError: ``seq_lens`` is not an iterable of lengths (``None``, a string), a length is not an
                integer, or ``dtype`` is not int32/int64.
            ValueError: ``seq_lens`` is empty or holds a negative length; the lengths add up to more
                than ``dtype`` can hold (``[2**31]`` with int32); ``device`` is not a device, or a CUDA
                device this process cannot use.
        """
        lens = lengths(seq_lens)
        if dtype not in INDEX_DTYPES:
            raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        offsets = [0, *itertools.accumulate(lens)]
        check_fits(offsets[-1], dtype, "seq_lens")
        target = None
        if device is not None:
            target = parse_device(device)
            check_available(target)
        host = torch.tensor(offsets, dtype=dtype)
        cu = host.to(target) if target is not None else host
        return cls(cu, cu_seqlens_cpu=host if with_cpu else None, **_given(chunk_indices=chunk_indices, cp=cp))

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, dtype: torch.dtype = torch.int32, *, chunk_indices: bool | None = None
    ) -> LayerLocalSeqlens:
        """Build from packed ``position_ids`` (the transformers convention).

        A new document starts wherever ``position_ids`` is 0, as transformers' packing collator writes it
        (``DataCollatorWithFlattening``); within a document the positions count up by one. Zero-length
        documents cannot be expressed this way.

        Args:
            position_ids: ``[T]`` or ``[1, T]`` integer tensor: ``0, 1, 2, ...`` per document.
            dtype: dtype of the resulting ``cu_seqlens`` (int32 or int64).
            chunk_indices: precompute FLA's chunk schedule (see the class); ``None``: the class default
                (``True``; ``False`` for the harness's ``modes.SharedSeqlens``).

        Raises:
            TypeError: ``position_ids`` is not an integer tensor.
            ValueError: batch size > 1, empty, a meta tensor, or positions that do not start each
                document at 0 and count up by one (``[0, 1, 2, 1, 2]``, ``[0, 1, 5, 6]``, negatives): the
                message names the first bad index; more tokens than ``dtype`` can hold.
        """
        if not isinstance(position_ids, torch.Tensor):
            raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
        if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
            raise TypeError(f"position_ids must be an integer tensor, got dtype {position_ids.dtype}")
        name = "position_ids"
        if position_ids.dim() == 2:
            if position_ids.shape[0] != 1:
                raise ValueError(
                    f"position_ids of packed sequences must have batch size 1, got shape {tuple(position_ids.shape)}"
                )
            position_ids, name = position_ids[0], "position_ids[0]"
        if position_ids.dim() != 1 or position_ids.numel() == 0:
            raise ValueError(f"position_ids must be [T] or [1, T] with T > 0, got shape {tuple(position_ids.shape)}")
        if position_ids.device.type == "meta":
            raise ValueError("position_ids is a meta tensor, which holds no values; pass the batch's real positions")
        host = position_ids.detach().cpu()
        check_positions(host, name)
        check_fits(host.numel(), dtype, name)
        starts = torch.nonzero(host == 0).flatten()
        offsets = torch.cat([starts, torch.tensor([host.numel()])]).to(dtype)
        return cls(offsets.to(position_ids.device), cu_seqlens_cpu=offsets, **_given(chunk_indices=chunk_indices))

    # --------------------------------------------------------------------------------------------- use
    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """Fresh ``cu_seqlens`` (and ``cu_seqlens_cpu``) objects for the calling layer.

        Call it inside the layer's forward, so inside its checkpointed region. Every call returns new
        tensor objects with the same values; the copies are invisible to dispatch modes (SAC replay,
        :class:`~fla_ac_isolation.ReplayAudit`) and to ``torch.compile``, so a SAC policy can never hand
        a recompute the forward's object back. No device-to-host synchronisation happens here.

        Returns:
            :class:`LocalSeqlens` ``(cu_seqlens, cu_seqlens_cpu, max_seqlen, chunk_indices)``.
            ``cu_seqlens_cpu`` is always set: the host offsets given at construction, or the copy that
            validation read; FLA then builds whatever index it still needs on the host, so a
            recompute's cache miss costs no device-to-host sync. ``chunk_indices`` is the schedule
            precomputed at construction (``None`` if built with ``chunk_indices=False``); FLA ops that
            take it skip their own ``prepare_chunk_indices`` and its blocking copy (docs/benchmarks.md).
            ``chunk_offsets`` (each document's first schedule row) comes with ``chunk_indices``. With
            ``static=``: fresh copies of the static buffers (padded; ``max_seqlen`` is the static bound).
            Under context parallelism (``cp=``): this rank's offsets and schedule and a fresh
            ``cp_context`` (see :class:`LocalSeqlens`); with ``whole_batch=True`` the GLOBAL offsets of
            the whole batch instead, fresh, with ``cp_context=None`` (for layers that run whole sequences:
            head-parallel Mamba2, gathered attention). Without ``cp``, ``whole_batch`` changes nothing.
        """
        if self._cp is not None and not whole_batch:
            return self._cp.local()
        if self._static is not None:
            if self._static.generation != self._generation:
                raise RuntimeError(
                    f"this LayerLocalSeqlens wrote batch {self._generation} into {self._static!r}, which now holds "
                    f"batch {self._static.generation}: build a new LayerLocalSeqlens(..., static=) per batch and "
                    "use one StaticSeqlens per batch in flight"
                )
            return self._static.local()
        chunk_indices = fresh_copy(self._chunk_indices) if self._chunk_indices is not None else None
        chunk_offsets = fresh_copy(self._chunk_offsets) if self._chunk_offsets is not None else None
        return LocalSeqlens(
            fresh_copy(self._cu_seqlens), fresh_copy(self._cu_seqlens_cpu), self.max_seqlen, chunk_indices,
            chunk_offsets=chunk_offsets,
        )

    def check_tokens(self, num_tokens: int, name: str = "hidden_states") -> None:
        """Reject a batch whose packed token count differs from ``cu_seqlens[-1]`` (under CP: ``T / W``).

        Raises:
            ValueError: naming ``name`` and ``cu_seqlens`` when ``num_tokens != cu_seqlens[-1]``.
        """
        if self._cp is not None:
            self._cp.check_tokens(num_tokens, name, self.num_tokens)
        elif num_tokens != self.num_tokens:
            raise ValueError(
                f"{name} has {num_tokens} packed tokens but cu_seqlens[-1] = {self.num_tokens}: "
                "the offsets must describe exactly the tokens of this batch"
            )

    @property
    def cp(self) -> CPConfig | None:
        """The context-parallel configuration given at construction, or ``None``."""
        return self._cp.config if self._cp is not None else None

    @property
    def device(self) -> torch.device:
        """Device of ``cu_seqlens`` (with ``static=``: of the static buffers)."""
        return self._static.device if self._static is not None else self._cu_seqlens.device

    @property
    def dtype(self) -> torch.dtype:
        """Integer dtype of ``cu_seqlens`` (int32 or int64; with ``static=``: of the static buffers)."""
        return self._static.dtype if self._static is not None else self._cu_seqlens.dtype

    def seq_lens(self) -> list[int]:
        """Document lengths in tokens, from the host offsets (no sync)."""
        offsets = self._cu_seqlens_cpu.tolist()
        return [b - a for a, b in itertools.pairwise(offsets)]

    def __repr__(self) -> str:
        return (
            f"LayerLocalSeqlens(num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, "
            f"max_seqlen={self.max_seqlen}, device={self.device}, dtype={self.dtype}, "
            f"cu_seqlens_cpu={'given' if self._host_given else 'not given'}, "
            f"chunk_indices={'precomputed' if self._chunk_indices is not None else 'off'}"
            + (f", cp={self._cp!r}" if self._cp is not None else "")
            + (f", static={self._static!r})" if self._static is not None else ")")
        )


def _check_static(static: object, cu_seqlens: torch.Tensor, device: object, cp: object, chunk_indices: bool) -> None:
    """The checks ``static=`` adds at construction (see :class:`LayerLocalSeqlens`)."""
    from fla_ac_isolation.static_seqlens import StaticSeqlens

    if not isinstance(static, StaticSeqlens):
        raise TypeError(f"static must be a StaticSeqlens, got {type(static).__name__}")
    if cp is not None:
        raise ValueError("static= and cp= cannot be combined: static buffers hold whole-batch offsets only")
    if not chunk_indices:
        raise ValueError("static= always hands out the padded chunk schedule; do not pass chunk_indices=False with it")
    if device is not None and not devices_match(static.device, parse_device(device)):
        raise ValueError(f"device={torch.device(device)} differs from the static buffers' device {static.device}")
    if cu_seqlens.device.type != "cpu" and not devices_match(cu_seqlens.device, static.device):
        raise ValueError(
            f"cu_seqlens must be host offsets or live on the static buffers' device {static.device}, "
            f"got {cu_seqlens.device}"
        )


def _given(**kwargs: object) -> dict[str, object]:
    """The keyword arguments that are not ``None`` (so the class's own default applies to the others)."""
    return {k: v for k, v in kwargs.items() if v is not None}
