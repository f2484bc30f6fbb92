"""Per-layer ``cu_seqlens`` (:class:`LayerLocalSeqlens`): fresh offset objects for every layer call.

FLA caches ``cu_seqlens``-derived metadata by identity (``fla.utils.tensor_cache``); a shared object can miss in a
checkpointed layer's forward and hit in its recompute, which then runs other ops than SAC saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from fla_ac_isolation.fla_seam.layout import chunk_indices_for, chunk_offsets_for
from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens, fresh_copy, host_to_device
from fla_ac_isolation.offsets import (
    check_fits,
    check_index_tensor,
    check_num_tokens,
    check_offsets,
    check_positions,
    offsets_of_lengths,
    parse_device,
    snapshot,
)

__all__ = ["LayerLocalSeqlens", "devices_match"]


def devices_match(actual: torch.device, expected: torch.device) -> bool:
    """Same device type, and same index where both name one (``cuda`` matches ``cuda:1``)."""
    if actual.type != expected.type:
        return False
    if expected.index is None or actual.index is None:
        return True
    return actual.index == expected.index


class LayerLocalSeqlens(PackedSeqlens):
    """Packed-sequence boundaries that hand each layer its own ``cu_seqlens`` object.

    Build one per model forward (validated once, on a snapshot clone; one device-to-host copy unless
    ``cu_seqlens_cpu`` is given) and pass it to every layer, which calls :meth:`local` inside its forward. Its
    siblings: :class:`~fla_ac_isolation.parallel.CPSeqlens` (context parallelism) and
    :class:`~fla_ac_isolation.graphs.StaticSeqlens` (CUDA graphs).

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets on the activations' device: from 0, non-decreasing (empty
            documents are legal), ending at the packed token count ``T``.
        max_seqlen: longest document in tokens (an upper bound is accepted); computed when ``None``.
        cu_seqlens_cpu: optional ``[N + 1]`` host copy (equal values); spares FLA device-to-host syncs.
        device: optional activations' device; ``cu_seqlens`` must be on it.
        num_tokens: optional ``T`` (``hidden_states.shape[1]``), checked against ``cu_seqlens[-1]``.
        chunk_indices: precompute FLA's chunk schedule once (so FLA skips ``prepare_chunk_indices`` and its
            blocking copy); ``False``: FLA computes it.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: malformed offsets (not 1-D, not from 0, decreasing, meta or wrong device, last value !=
            ``num_tokens``); ``cu_seqlens_cpu`` off the CPU or with other values; ``max_seqlen`` below the longest
            document.

    Usage: ``docs/own-model.md``.
    """

    __slots__ = (
        "_chunk_indices", "_chunk_offsets", "_cu_seqlens", "_cu_seqlens_cpu", "_host_given", "max_seqlen",
        "num_seqs", "num_tokens",
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
    ) -> None:
        check_index_tensor(cu_seqlens, "cu_seqlens")
        if not isinstance(chunk_indices, bool):
            raise TypeError(f"chunk_indices must be a bool (precompute FLA's chunk schedule), got {chunk_indices!r}")
        if device is not None and not devices_match(cu_seqlens.device, parse_device(device)):
            raise ValueError(
                f"cu_seqlens must be on the activations' device {torch.device(device)}, got {cu_seqlens.device}"
            )
        check_num_tokens(num_tokens)
        own, host = snapshot(cu_seqlens, cu_seqlens_cpu)
        offsets = host.tolist()
        lens = check_offsets(offsets, num_tokens)
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
        self._chunk_indices = self._chunk_offsets = None
        if chunk_indices:
            self._chunk_indices = host_to_device(chunk_indices_for(offsets).to(own.dtype), own.device)
            self._chunk_offsets = host_to_device(chunk_offsets_for(offsets).to(own.dtype), own.device)

    @classmethod
    def from_seq_lens(
        cls,
        seq_lens: Sequence[int],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.int32,
        *,
        with_cpu: bool = True,
        chunk_indices: bool | None = None,
    ) -> LayerLocalSeqlens:
        """Build from document lengths, e.g. ``[5, 0, 17]`` -> ``cu_seqlens = [0, 5, 5, 22]``.

        Args:
            seq_lens: non-negative lengths in tokens: ints or numpy integers (a tensor: ``.tolist()``).
            device: the activations' device; CPU when ``None``.
            dtype: ``torch.int32`` (FLA's convention) or ``torch.int64``.
            with_cpu: also keep the host offsets as ``cu_seqlens_cpu``.
            chunk_indices: as in the class; ``None`` keeps the class default.

        Raises:
            TypeError: ``seq_lens`` is not an iterable of integers, or ``dtype`` is not int32/int64.
            ValueError: no or a negative length; a total ``dtype`` cannot hold; a bad or unusable ``device``.
        """
        cu, host = offsets_of_lengths(seq_lens, device, dtype)
        return cls(cu, cu_seqlens_cpu=host if with_cpu else None, **_given(chunk_indices=chunk_indices))

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, dtype: torch.dtype = torch.int32, *, chunk_indices: bool | None = None
    ) -> LayerLocalSeqlens:
        """Build from packed ``position_ids`` (a document starts at each 0); empty documents cannot be expressed.

        Args:
            position_ids: ``[T]`` or ``[1, T]`` integer tensor, ``0, 1, 2, ...`` per document.
            dtype: dtype of ``cu_seqlens`` (int32 or int64).
            chunk_indices: as in the class; ``None`` keeps the class default.

        Raises:
            TypeError: ``position_ids`` is not an integer tensor.
            ValueError: batch size > 1, empty, meta, positions that do not count up by one from each 0, or more
                tokens than ``dtype`` holds.
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

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """Fresh offsets (new objects, same values, no sync) for the calling layer; call it inside its forward.

        Returns:
            :class:`LocalSeqlens` with ``cu_seqlens_cpu`` set (``whole_batch`` makes no difference here).
        """
        has_schedule = self._chunk_indices is not None
        return LocalSeqlens(
            fresh_copy(self._cu_seqlens), fresh_copy(self._cu_seqlens_cpu), self.max_seqlen,
            fresh_copy(self._chunk_indices) if has_schedule else None,
            chunk_offsets=fresh_copy(self._chunk_offsets) if has_schedule else None,
        )

    def check_tokens(self, num_tokens: int, name: str = "hidden_states") -> None:
        """Raise ``ValueError`` naming ``name`` unless ``num_tokens == cu_seqlens[-1]``."""
        if num_tokens != self.num_tokens:
            raise ValueError(
                f"{name} has {num_tokens} packed tokens but cu_seqlens[-1] = {self.num_tokens}: "
                "the offsets must describe exactly the tokens of this batch"
            )

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
            f"chunk_indices={'precomputed' if self._chunk_indices is not None else 'off'})"
        )


def _given(**kwargs: object) -> dict[str, object]:
    """The keyword arguments that are not ``None``."""
    return {k: v for k, v in kwargs.items() if v is not None}
