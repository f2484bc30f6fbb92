""":class:`CPConfig`: what FLA's context parallelism needs besides the offsets (group, layout, conv width).

FLA cuts the ``T`` packed tokens into equal intervals, no padding: ``contiguous``: rank ``r`` holds interval ``r``
of ``W``; ``zigzag``: parts ``r`` and ``2W - 1 - r`` of ``2W`` (local order ``[front; back]``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

__all__ = ["LAYOUTS", "CPConfig"]

LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")
"""FLA's CP layouts."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CPConfig:
    """One context-parallel (CP) group as FLA's CP kernels see it; :class:`~fla_ac_isolation.parallel.CPSeqlens`
    takes it.

    Args:
        group: the CP process group; ``None``: metadata only (tests, sharding off-rank), with ``world_size``/``rank``.
        layout: ``"contiguous"`` or ``"zigzag"``.
        conv_kernel_size: the model's widest CP causal conv: every interval must hold ``conv_kernel_size - 1``
            tokens (FLA's CP conv reads history from the previous interval only). ``None``: no CP conv.
        world_size: CP degree ``W``; ``None``: the group's (else it must equal it).
        rank: this process's index in the group; ``None``: the group's.

    Raises:
        ValueError: unknown ``layout``; neither ``group`` nor ``world_size``/``rank``; ``world_size``/``rank`` out
            of range or not the group's; ``conv_kernel_size < 1``; a ``group`` this process is not in (or no
            ``torch.distributed``).
        TypeError: a non-int ``world_size``, ``rank`` or ``conv_kernel_size``.
    """

    group: Any = None
    layout: str = "contiguous"
    conv_kernel_size: int | None = None
    world_size: int | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"CPConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        for name in ("world_size", "rank", "conv_kernel_size"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise TypeError(f"CPConfig.{name} must be an int, got {type(value).__name__}")
        if self.conv_kernel_size is not None and self.conv_kernel_size < 1:
            raise ValueError(f"CPConfig.conv_kernel_size must be >= 1, got {self.conv_kernel_size}")
        if self.group is not None:
            self._resolve_from_group()
        elif self.world_size is None or self.rank is None:
            raise ValueError(
                "CPConfig needs the CP process group (group=...) or, for metadata only, world_size= and rank=; "
                f"got group=None, world_size={self.world_size}, rank={self.rank}"
            )
        if self.world_size < 1:
            raise ValueError(f"CPConfig.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"CPConfig.rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.layout == "zigzag":
            from fla_ac_isolation.fla_seam.features import require

            require("cp", where="CPConfig(layout='zigzag')")

    def _resolve_from_group(self) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("CPConfig.group is given but torch.distributed is not initialised in this process")
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if rank < 0:
            raise ValueError("this process is not a member of CPConfig.group")
        if self.world_size is not None and self.world_size != size:
            raise ValueError(
                f"CPConfig.world_size={self.world_size} differs from the size of CPConfig.group ({size} ranks); "
                "leave world_size=None to read it from the group"
            )
        if self.rank is not None and self.rank != rank:
            raise ValueError(f"CPConfig.rank={self.rank} differs from this process's rank in CPConfig.group ({rank})")
        object.__setattr__(self, "world_size", size)
        object.__setattr__(self, "rank", rank)

    @property
    def num_parts(self) -> int:
        """Intervals the batch is cut into: ``W`` (contiguous) or ``2W`` (zigzag)."""
        return self.world_size * (1 if self.layout == "contiguous" else 2)

    def check_num_tokens(self, num_tokens: int, name: str = "cu_seqlens[-1]") -> int:
        """The interval length ``T / num_parts`` of the GLOBAL token count ``num_tokens`` (named ``name``).

        Raises:
            TypeError: ``num_tokens`` is not an integer.
            ValueError: not a positive multiple of :attr:`num_parts`, or an interval shorter than
                ``conv_kernel_size - 1``.
        """
        try:  # ints, numpy integers and 0-d integer tensors; not floats or bools
            num_tokens = operator.index(num_tokens if not isinstance(num_tokens, bool) else None)
        except TypeError:
            raise TypeError(f"{name} must be an int (a packed token count), got {type(num_tokens).__name__}") from None
        parts = self.num_parts
        if num_tokens < parts or num_tokens % parts:
            need = "world_size" if self.layout == "contiguous" else "2 * world_size"
            padded = -(-max(num_tokens, 1) // parts) * parts
            raise ValueError(
                f"{name} = {num_tokens} packed tokens cannot be split by the {self.layout} CP layout over "
                f"{self.world_size} ranks: it needs a positive multiple of {need} = {parts}; pad the batch to "
                f"{padded} tokens (e.g. with a document whose labels are all ignored)"
            )
        part_len = num_tokens // parts
        if self.conv_kernel_size is not None and part_len < self.conv_kernel_size - 1:
            raise ValueError(
                f"each CP interval of the {self.layout} layout holds {part_len} tokens ({name} = {num_tokens} over "
                f"{parts} intervals), fewer than conv_kernel_size - 1 = {self.conv_kernel_size - 1}: FLA's CP conv "
                "takes its history from the previous interval only; use fewer ranks or a longer batch"
            )
        return part_len

    def local_num_tokens(self, num_tokens: int) -> int:
        """Tokens each rank holds, ``T / W`` (after :meth:`check_num_tokens`)."""
        return num_tokens // self.world_size
