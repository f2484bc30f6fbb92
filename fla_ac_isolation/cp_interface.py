"""What :class:`~fla_ac_isolation.LayerLocalSeqlens` needs from its ``cp=`` argument: an interface the core owns.

Context parallelism (CP) sits above the core. ``parallel/`` implements this interface
(:class:`~fla_ac_isolation.parallel.CPConfig` is a :class:`CPSplit`; its per-batch part is
:class:`~fla_ac_isolation.parallel.seqlens_cp.CPSeqlens`), and ``seqlens.py`` talks to CP only through it,
so the core never imports ``parallel/``.

* :class:`CPSplit` - how a packed batch is split across the CP ranks; builds the per-batch part once.
* :class:`CPBatchSeqlens` - that per-batch part: a fresh FLA CP context per layer call.
* :func:`check_cp_argument` - what ``LayerLocalSeqlens(..., cp=...)`` checks before anything else.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from fla_ac_isolation.local_seqlens import LocalSeqlens

__all__ = ["CPBatchSeqlens", "CPSplit", "check_cp_argument"]


class CPBatchSeqlens(Protocol):
    """This rank's CP metadata for one batch, built once by :meth:`CPSplit.batch_seqlens`.

    Attributes:
        config: the :class:`CPSplit` it was built from.
        num_tokens: tokens this rank holds, ``T / W``.
        max_seqlen: longest document piece on this rank, in tokens.
    """

    config: CPSplit
    num_tokens: int
    max_seqlen: int

    def local(self) -> LocalSeqlens:
        """Fresh rank-local offsets, chunk schedule and CP context (what ``LayerLocalSeqlens.local()`` returns)."""

    def shared(self) -> LocalSeqlens:
        """The same objects on every call (the unsafe shared mode)."""

    def check_tokens(self, num_tokens: int, name: str, total: int) -> None:
        """Refuse ``num_tokens`` (named ``name``) unless it is this rank's share of the ``total`` tokens.

        Raises:
            ValueError: naming ``name`` and what this rank holds.
        """


class CPSplit(abc.ABC):
    """How a packed batch is split across the ranks of a CP group (``LayerLocalSeqlens(..., cp=)``).

    Implemented by :class:`~fla_ac_isolation.parallel.CPConfig`. An implementation has an int attribute
    ``world_size`` (the CP degree ``W``) and builds its per-batch part with :meth:`batch_seqlens`.
    """

    __slots__ = ()

    @abc.abstractmethod
    def batch_seqlens(self, host: torch.Tensor, device: torch.device, *, chunk_indices: bool) -> CPBatchSeqlens:
        """This rank's part of one batch, built once, outside every checkpointed region.

        Args:
            host: ``[N + 1]`` GLOBAL host offsets of the whole batch, already validated.
            device: the activations' device (where the rank-local offsets go).
            chunk_indices: precompute the rank-local chunk schedule (FLA's ``chunk_indices``).

        Raises:
            ValueError: the batch does not split as this CP layout needs.
        """


def check_cp_argument(cp: object, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None) -> None:
    """What ``LayerLocalSeqlens(..., cp=...)`` checks before anything else.

    Raises:
        TypeError: ``cp`` is not a :class:`CPSplit` (a :class:`~fla_ac_isolation.parallel.CPConfig`).
        ValueError: ``cu_seqlens`` is not on the CPU and no ``cu_seqlens_cpu`` is given: FLA's CP metadata
            is computed on the host, and reading device offsets there is a device-to-host sync.
    """
    if not isinstance(cp, CPSplit):
        raise TypeError(f"cp must be a fla_ac_isolation.parallel.CPConfig or None, got {type(cp).__name__}")
    if cu_seqlens_cpu is None and cu_seqlens.device.type != "cpu":
        raise ValueError(
            f"cp=CPConfig(...) needs the host offsets cu_seqlens_cpu when cu_seqlens is on {cu_seqlens.device}: "
            "FLA's CP metadata is computed on the host, and reading device offsets there is a device-to-host "
            "sync; pass cu_seqlens_cpu= (or build with LayerLocalSeqlens.from_seq_lens)"
        )
