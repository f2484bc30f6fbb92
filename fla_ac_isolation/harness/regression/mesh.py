"""The parallel layout of a regression run: :class:`ParallelMesh`, every parallel degree as one field, validated once.

The ranks form a ``(pp, dp, cp)`` grid as torchtitan 0.3's ``ParallelDims`` lays them out (no FSDP, no TP):
rank ``r = (pp_index * dp + dp_index) * cp + cp_index``. Expert parallelism borrows the ``dp * cp`` ranks of a
stage, over which replicated parameters' gradients are summed. ``ParallelMesh(ep=2).world`` is 2 (two
data-parallel ranks), ``ParallelMesh(cp=2, ep=2).world`` 2 (EP on the CP ranks), ``ParallelMesh(ep=2, pp=2).world`` 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MESH_DIMS", "ParallelMesh"]

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp")
"""The dimensions of the rank grid, outermost first."""


def _check_degree(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ParallelMesh:
    """The parallel degrees of a run (layout: the module docstring).

    Attributes:
        dp: data-parallel degree; ``None`` (the default): ``ep`` without context parallelism, else 1.
        ep: expert-parallel degree: 1 (experts replicated) or ``dp * cp``.
        cp: context-parallel degree (FLA's CP; 1 = none).
        pp: pipeline-parallel degree; multiplies :attr:`world`.

    Raises:
        ValueError: a degree that is not an int >= 1, or ``ep`` neither 1 nor ``dp * cp``.
    """

    dp: int | None = None
    ep: int = 1
    cp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("ep", "cp", "pp"):
            _check_degree(name, getattr(self, name))
        if self.dp is None:
            object.__setattr__(self, "dp", self.ep if self.cp == 1 else 1)
        _check_degree("dp", self.dp)
        borrowed = self.dp * self.cp
        if self.ep not in (1, borrowed):
            if self.cp == 1:
                raise ValueError(f"ep ({self.ep}) must be 1 or equal dp ({self.dp}): the EP ranks are the data-"
                                 "parallel ranks")
            if self.dp == 1:
                raise ValueError(
                    f"ep ({self.ep}) must be 1 or equal cp ({self.cp}): the EP ranks are borrowed from the {self.cp} "
                    "CP ranks (one process per CP rank)"
                )
            raise ValueError(
                f"ep ({self.ep}) must be 1 or equal dp * cp ({borrowed}): the EP ranks are borrowed from the "
                f"{borrowed} data- and context-parallel ranks of a stage"
            )

    @property
    def world(self) -> int:
        """The number of processes: ``pp * dp * cp``."""
        return self.pp * self.dp * self.cp

    @property
    def shape(self) -> tuple[int, ...]:
        """The degrees of :data:`MESH_DIMS`: ``(pp, dp, cp)``."""
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": .., "dp": .., "cp": ..}`` of ``rank`` in the row-major ``(pp, dp, cp)`` grid; ``ValueError`` unless
        ``rank`` is an int in ``[0, world)``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank must be an int in [0, {self.world}) (the mesh's world), got {rank!r}")
        coords = {}
        for name, size in reversed(tuple(zip(MESH_DIMS, self.shape))):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in MESH_DIMS}
