"""What one layer sees (:class:`LocalSeqlens`), what hands it out (:class:`PackedSeqlens`, the base of the three
forms) and the copy that makes it fresh; imports nothing from this package."""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["LocalSeqlens", "PackedSeqlens", "fresh_copy", "host_to_device"]


class LocalSeqlens(NamedTuple):
    """What one layer call sees: fresh tensors (new objects per call), equal in value to the model-level ones.

    Attributes:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets on the activations' device.
        cu_seqlens_cpu: ``[N + 1]`` host offsets (``None`` only from the harness's shared mode without them).
        max_seqlen: longest document, in tokens.
        chunk_indices: ``[NT, 2]`` rows ``(document, chunk)`` of FLA's 64-token chunks, dtype and device of
            ``cu_seqlens``; ``None`` when not precomputed.
        cp_context: under CP, FLA's ``FLACPContext`` holding the tensors above (then RANK-LOCAL int32); else ``None``.
        chunk_offsets: ``[N + 1]`` first ``chunk_indices`` row of each document (FLA's ``prepare_chunk_offsets``);
            ``None`` with ``chunk_indices`` and under CP.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor | None
    max_seqlen: int
    chunk_indices: torch.Tensor | None = None
    cp_context: Any = None
    chunk_offsets: torch.Tensor | None = None


class PackedSeqlens(abc.ABC):
    """A packed batch's offsets, validated once, handing every layer call fresh ones (:meth:`local`): what the
    drop-in mixers take as ``seqlens``. Three forms: :class:`~fla_ac_isolation.LayerLocalSeqlens` (the batch),
    :class:`~fla_ac_isolation.parallel.CPSeqlens` (context parallelism) and
    :class:`~fla_ac_isolation.graphs.StaticSeqlens` (CUDA graphs).

    Attributes:
        num_seqs: documents ``N`` (empty ones count).
        num_tokens: packed tokens ``T`` of the whole batch (``cu_seqlens[-1]``; under CP all ranks' tokens).
        max_seqlen: longest document in tokens, or an upper bound.
    """

    __slots__ = ()

    num_seqs: int
    num_tokens: int
    max_seqlen: int

    @abc.abstractmethod
    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """Fresh offsets (new objects, no host sync) for the calling layer; call it inside its forward.
        ``whole_batch``: under CP the whole batch's offsets instead of this rank's; else no difference."""

    @abc.abstractmethod
    def check_tokens(self, num_tokens: int, name: str = "hidden_states") -> None:
        """``ValueError`` naming ``name`` unless a layer input of ``num_tokens`` packed tokens fits these offsets."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Device of the offsets ``local()`` hands out (the activations')."""

    @property
    @abc.abstractmethod
    def dtype(self) -> torch.dtype:
        """Integer dtype of ``cu_seqlens`` (int32 or int64)."""

    @abc.abstractmethod
    def seq_lens(self) -> list[int]:
        """Document lengths in tokens, from the host offsets (no sync)."""

    @property
    def cp(self) -> Any:
        """The :class:`~fla_ac_isolation.parallel.CPConfig` of a CP batch; ``None`` otherwise."""
        return None


@torch.compiler.disable
def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """A no-grad clone of ``t`` that no dispatch mode (a SAC policy saving ``aten.clone``) or compiled graph sees."""
    with _disable_current_modes(), torch.no_grad():
        return t.clone()


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without blocking the host (pinned staging on CUDA); ``host`` itself on the CPU."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
