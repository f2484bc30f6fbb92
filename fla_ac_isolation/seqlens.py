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
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fla_ac_isolation.fla_seam.layout import chunk_indices_for

if TYPE_CHECKING:
    from fla_ac_isolation.parallel.config import CPConfig

__all__ = ["LayerLocalSeqlens", "LocalSeqlens", "devices_match"]

_INDEX_DTYPES = (torch.int32, torch.int64)



class LocalSeqlens(NamedTuple):
    """What one layer sees: fresh tensors, equal in value to the model-level ones.

    Attributes:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets, on the activations' device; a new object per call.
        cu_seqlens_cpu: ``[N + 1]`` host copy of the offsets (a new object per call). ``None`` only from
            :class:`~fla_ac_isolation.modes.SharedSeqlens` built without host offsets.
        max_seqlen: length of the longest document, in tokens.
        chunk_indices: ``[NT, 2]`` rows ``(document, chunk within the document)`` of FLA's
            :data:`~fla_ac_isolation.fla_seam.layout.CHUNK_SIZE`-token chunks, dtype of ``cu_seqlens``, on its
            device (a new object per call); FLA's ``chunk_indices`` argument, so the kernel skips
            ``prepare_chunk_indices`` and its host-to-device copy. ``None`` when the
            :class:`LayerLocalSeqlens` was built with
            ``chunk_indices=False`` and from :class:`~fla_ac_isolation.modes.SharedSeqlens`.
        cp_context: under context parallelism (``LayerLocalSeqlens(..., cp=...)``), FLA's ``FLACPContext``
            for this layer, holding the very ``cu_seqlens``/``cu_seqlens_cpu`` objects above (then the
            RANK-LOCAL int32 offsets, ``max_seqlen`` the longest local piece and ``chunk_indices`` the
            local schedule); pass it to FLA's CP-aware conv and gated delta rule. ``None`` without CP.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor | None
    max_seqlen: int
    chunk_indices: torch.Tensor | None = None
    cp_context: Any = None


@torch.compiler.disable
def _fresh(t: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``t`` that no dispatch mode (SAC, audit, ...) ever sees.

    Hiding the copy from ``TorchDispatchMode`` stacks matters: a SAC policy that saves ``aten.clone`` (or
    ``alias``/``_to_copy``) would otherwise hand the recompute the very tensor object that the forward
    produced, and FLA's identity cache would hit in the recompute after missing in the forward. The copy
    is also kept out of ``torch.compile`` graphs so that each call yields a new object. Integer offset
    tensors never require grad, so nothing is lost for autograd.
    """
    with _disable_current_modes(), torch.no_grad():
        return t.clone()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host (pinned staging on CUDA)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
        num_tokens: optional packed token count ``T``; when given, the last offset must equal it.
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

    Raises:
        TypeError: ``cu_seqlens``/``cu_seqlens_cpu`` is not a tensor, or not int32/int64; ``max_seqlen``
            is not an ``int``; ``chunk_indices`` is not a bool; ``cp`` is not a
            :class:`~fla_ac_isolation.parallel.CPConfig`.
        ValueError: ``cu_seqlens`` is not 1-D with at least 2 entries, does not start at 0, decreases,
            is a meta tensor, sits on another device than ``device``, or its last value differs from ``num_tokens``;
            ``cu_seqlens_cpu`` is not on the CPU or differs in shape or values; ``max_seqlen`` is smaller
            than the longest document; with ``cp``: ``cu_seqlens`` off the CPU without ``cu_seqlens_cpu``,
            a token count that does not split as ``cp.layout`` needs, an interval shorter than
            ``cp.conv_kernel_size - 1`` (:meth:`~fla_ac_isolation.parallel.CPConfig.check_num_tokens`).

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
        "_chunk_indices", "_cp", "_cu_seqlens", "_cu_seqlens_cpu", "_host_given", "max_seqlen", "num_seqs",
        "num_tokens",
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
    ) -> None:
        _check_index_tensor(cu_seqlens, "cu_seqlens")
        if cp is not None:
            from fla_ac_isolation.parallel.seqlens_cp import check_cp_arguments

            check_cp_arguments(cp, cu_seqlens, cu_seqlens_cpu)
        if not isinstance(chunk_indices, bool):
            raise TypeError(f"chunk_indices must be a bool (precompute FLA's chunk schedule), got {chunk_indices!r}")
        if device is not None and not devices_match(cu_seqlens.device, torch.device(device)):
            raise ValueError(
                f"cu_seqlens must be on the activations' device {torch.device(device)}, got {cu_seqlens.device}"
            )
        if cu_seqlens.device.type == "meta":
            raise ValueError("cu_seqlens is a meta tensor, which holds no values; build it on the activations' device")
        if cu_seqlens_cpu is not None:
            _check_index_tensor(cu_seqlens_cpu, "cu_seqlens_cpu")
            if cu_seqlens_cpu.device.type != "cpu":
                raise ValueError(f"cu_seqlens_cpu must be a CPU tensor, got device {cu_seqlens_cpu.device}")
            if cu_seqlens_cpu.shape != cu_seqlens.shape:
                raise ValueError(
                    f"cu_seqlens_cpu must have the shape of cu_seqlens {tuple(cu_seqlens.shape)}, "
                    f"got {tuple(cu_seqlens_cpu.shape)}"
                )
            host = cu_seqlens_cpu
            device_values = cu_seqlens.to(device="cpu", dtype=host.dtype)
            if not torch.equal(device_values, host):
                i = int(torch.nonzero(device_values != host)[0])
                raise ValueError(
                    f"cu_seqlens_cpu must hold the same values as cu_seqlens, but cu_seqlens_cpu[{i}]="
                    f"{int(host[i])} != cu_seqlens[{i}]={int(device_values[i])}"
                )
        else:
            host = cu_seqlens.detach().cpu()
        offsets = host.tolist()
        if offsets[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
        lens = [b - a for a, b in itertools.pairwise(offsets)]
        bad = next((i for i, n in enumerate(lens) if n < 0), None)
        if bad is not None:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad + 1}]={offsets[bad + 1]} < "
                f"cu_seqlens[{bad}]={offsets[bad]}"
            )
        if num_tokens is not None and offsets[-1] != num_tokens:
            raise ValueError(
                f"cu_seqlens[-1] must equal the packed token count num_tokens={num_tokens} (hidden_states.shape[1] "
                f"when packed), got {offsets[-1]}"
            )
        longest = max(lens)
        if max_seqlen is None:
            max_seqlen = longest
        elif isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}")
        elif max_seqlen < longest:
            raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest document ({longest} tokens)")

        self._cu_seqlens = cu_seqlens.detach()
        self._cu_seqlens_cpu = cu_seqlens_cpu.detach() if cu_seqlens_cpu is not None else host
        self._host_given = cu_seqlens_cpu is not None
        self.max_seqlen: int = max_seqlen
        self.num_tokens: int = offsets[-1]
        self.num_seqs: int = len(lens)
        self._chunk_indices = (
            _to_device(chunk_indices_for(host).to(cu_seqlens.dtype), cu_seqlens.device) if chunk_indices else None
        )
        self._cp = None
        if cp is not None:
            from fla_ac_isolation.parallel.seqlens_cp import CPSeqlens

            self._cp = CPSeqlens(cp, host, cu_seqlens.device, chunk_indices=chunk_indices)

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
            seq_lens: non-negative document lengths in tokens (zero is legal).
            device: device of the activations (``cu_seqlens`` is created there); CPU when ``None``.
            dtype: ``torch.int32`` (FLA's and flash-attn's convention) or ``torch.int64``.
            with_cpu: also keep the host offsets as ``cu_seqlens_cpu`` (no sync needed later).
            chunk_indices: precompute FLA's chunk schedule (see the class); ``None``: the class default
                (``True``; ``False`` for :class:`~fla_ac_isolation.modes.SharedSeqlens`).
            cp: context parallelism (see the class): ``seq_lens`` are then the documents of the whole batch.

        Raises:
            ValueError: ``seq_lens`` is empty or holds a negative length.
            TypeError: ``dtype`` is not int32/int64 or a length is not an int.
        """
        lens = list(seq_lens)
        if not lens:
            raise ValueError("seq_lens must hold at least one document length")
        for i, n in enumerate(lens):
            if isinstance(n, bool) or not isinstance(n, int):
                hint = " (pass a tensor as seq_lens.tolist())" if isinstance(n, torch.Tensor) else ""
                raise TypeError(f"seq_lens[{i}] must be an int, got {type(n).__name__}{hint}")
            if n < 0:
                raise ValueError(f"seq_lens[{i}] must be >= 0, got {n}")
        if dtype not in _INDEX_DTYPES:
            raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        host = torch.tensor(offsets, dtype=dtype)
        cu = host.to(device) if device is not None else host.clone()
        return cls(cu, cu_seqlens_cpu=host if with_cpu else None, **_given(chunk_indices=chunk_indices, cp=cp))

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, dtype: torch.dtype = torch.int32, *, chunk_indices: bool | None = None
    ) -> LayerLocalSeqlens:
        """Build from packed ``position_ids`` (the transformers convention).

        A new document starts wherever ``position_ids`` is 0, as transformers' packing collator writes it
        (``DataCollatorWithFlattening``). Zero-length documents cannot be expressed this way.

        Args:
            position_ids: ``[T]`` or ``[1, T]`` integer tensor whose first value is 0.
            dtype: dtype of the resulting ``cu_seqlens`` (int32 or int64).
            chunk_indices: precompute FLA's chunk schedule (see the class); ``None``: the class default
                (``True``; ``False`` for :class:`~fla_ac_isolation.modes.SharedSeqlens`).

        Raises:
            TypeError: ``position_ids`` is not an integer tensor.
            ValueError: batch size > 1, empty, or the first position is not 0.
        """
        if not isinstance(position_ids, torch.Tensor):
            raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
        if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
            raise TypeError(f"position_ids must be an integer tensor, got dtype {position_ids.dtype}")
        if position_ids.dim() == 2:
            if position_ids.shape[0] != 1:
                raise ValueError(
                    f"position_ids of packed sequences must have batch size 1, got shape {tuple(position_ids.shape)}"
                )
            position_ids = position_ids[0]
        if position_ids.dim() != 1 or position_ids.numel() == 0:
            raise ValueError(f"position_ids must be [T] or [1, T] with T > 0, got shape {tuple(position_ids.shape)}")
        host = position_ids.detach().cpu()
        if int(host[0]) != 0:
            raise ValueError(f"position_ids must start at 0 (a document start), got {int(host[0])}")
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
            Under context parallelism (``cp=``): this rank's offsets and schedule and a fresh
            ``cp_context`` (see :class:`LocalSeqlens`); with ``whole_batch=True`` the GLOBAL offsets of
            the whole batch instead, fresh, with ``cp_context=None`` (for layers that run whole sequences:
            head-parallel Mamba2, gathered attention). Without ``cp``, ``whole_batch`` changes nothing.
        """
        if self._cp is not None and not whole_batch:
            return self._cp.local()
        chunk_indices = _fresh(self._chunk_indices) if self._chunk_indices is not None else None
        return LocalSeqlens(_fresh(self._cu_seqlens), _fresh(self._cu_seqlens_cpu), self.max_seqlen, chunk_indices)

    def check_tokens(self, num_tokens: int, name: str = "hidden_states") -> None:
        """Reject a batch whose packed token count differs from ``cu_seqlens[-1]`` (under CP: ``T / W``).

        Raises:
            ValueError: naming ``name`` and ``cu_seqlens`` when ``num_tokens != cu_seqlens[-1]``.
        """
        if self._cp is not None and num_tokens != self._cp.num_tokens:
            cp = self._cp.config
            raise ValueError(
                f"{name} has {num_tokens} packed tokens but CP rank {cp.rank} of {cp.world_size} holds "
                f"{self._cp.num_tokens} of the cu_seqlens[-1] = {self.num_tokens} tokens ({cp.layout} layout): "
                "shard the batch with fla_ac_isolation.parallel.shard_packed_batch"
            )
        if self._cp is None and num_tokens != self.num_tokens:
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
        """Device of ``cu_seqlens``."""
        return self._cu_seqlens.device

    @property
    def dtype(self) -> torch.dtype:
        """Integer dtype of ``cu_seqlens`` (int32 or int64)."""
        return self._cu_seqlens.dtype

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
            + (f", cp={self._cp!r})" if self._cp is not None else ")")
        )


def _given(**kwargs: object) -> dict[str, object]:
    """The keyword arguments that are not ``None`` (so the class's own default applies to the others)."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _check_index_tensor(t: object, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32/int64 offsets, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64 offsets, got dtype {t.dtype}")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with N + 1 >= 2 offsets for N documents, got shape {tuple(t.shape)}"
        )
