"""The interface ``LayerLocalSeqlens(..., cp=)`` talks to, so the core never imports ``parallel/`` (which
implements it: ``CPConfig`` is a :class:`CPSplit`).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from fla_ac_isolation.local_seqlens import LocalSeqlens

__all__ = ["CPBatchSeqlens", "CPSplit", "check_cp_argument"]


class CPBatchSeqlens(Protocol):
    """This rank's CP metadata for one batch (``num_tokens``: this rank's ``T / W``; ``max_seqlen``: its longest
    document piece), built once by :meth:`CPSplit.batch_seqlens`."""

    config: CPSplit
    num_tokens: int
    max_seqlen: int

    def local(self) -> LocalSeqlens:
        """Fresh rank-local offsets, chunk schedule and CP context (what ``LayerLocalSeqlens.local()`` returns)."""

    def shared(self) -> LocalSeqlens:
        """The same objects on every call (the unsafe shared mode)."""

    def check_tokens(self, num_tokens: int, name: str, total: int) -> None:
        """Raise ``ValueError`` naming ``name`` unless ``num_tokens`` is this rank's share of ``total``."""


class CPSplit(abc.ABC):
    """How a packed batch is split across a CP group of ``world_size`` (``W``) ranks."""

    __slots__ = ()

    @abc.abstractmethod
    def batch_seqlens(self, host: torch.Tensor, device: torch.device, *, chunk_indices: bool) -> CPBatchSeqlens:
        """This rank's part of one batch, from the validated ``[N + 1]`` GLOBAL host offsets; tensors on ``device``.

        Raises:
            ValueError: the batch does not split as this CP layout needs.
        """


def check_cp_argument(cp: object, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None) -> None:
    """Raise ``TypeError`` unless ``cp`` is a :class:`CPSplit`, ``ValueError`` for device offsets without
    ``cu_seqlens_cpu`` (FLA computes CP metadata on the host)."""
    if not isinstance(cp, CPSplit):
        raise TypeError(f"cp must be a fla_ac_isolation.parallel.CPConfig or None, got {type(cp).__name__}")
    if cu_seqlens_cpu is None and cu_seqlens.device.type != "cpu":
        raise ValueError(
            f"cp=CPConfig(...) needs the host offsets cu_seqlens_cpu when cu_seqlens is on {cu_seqlens.device}: "
            "FLA's CP metadata is computed on the host, and reading device offsets there is a device-to-host "
            "sync; pass cu_seqlens_cpu= (or build with LayerLocalSeqlens.from_seq_lens)"
        )
