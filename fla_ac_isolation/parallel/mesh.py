"""The parallel layout of a run: :class:`ParallelMesh`, every parallel degree as one field, validated once.

What follows from the degrees comes from here and nowhere else: the number of processes
(:attr:`ParallelMesh.world`) and where a rank sits (:meth:`ParallelMesh.coordinates`). The process groups are
torchtitan 0.3's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``) of these degrees
(``dp_shard = dp``, no FSDP, no TP), which the regression builds; :meth:`ParallelMesh.build` (torch's
``DeviceMesh`` directly) is deprecated. The layout is ``ParallelDims``'s:

* the ranks form a ``(pp, dp, cp)`` grid (torchtitan's dense order, without ``tp``), rank
  ``r = (pp_index * dp + dp_index) * cp + cp_index``;
* expert parallelism borrows its ranks from the data- and context-parallel ranks of a stage (torchtitan's
  sparse mesh ``(dp_replicate, efsdp, ep)`` with ``efsdp = dp_shard * cp / ep``); this package shards
  experts over all of them or none, so ``ep`` is 1 or ``dp * cp`` (``efsdp = 1``: no expert FSDP);
* the gradients of replicated parameters are summed over the ``dp * cp`` ranks of a stage (torchtitan's
  ``loss`` mesh).

``dp`` left out (``None``) is derived so that a run of ``ep`` expert-parallel ranks keeps its meaning: the
``ep`` ranks are data-parallel ranks (``dp = ep``) without context parallelism, and borrowed from the
``cp`` ranks (``dp = 1``) with it. ``pp`` multiplies the world: each data-parallel rank's stages sit on ``pp``
ranks (the mesh's ``"pp"`` dimension is their pipeline group), and expert parallelism stays inside a stage's
ranks (``ParallelMesh(ep=2, pp=2)``: 4 ranks, EP over the 2 data-parallel ranks of each stage).

Example::

    ParallelMesh(ep=2).world               # 2: two data-parallel ranks, experts sharded over both
    ParallelMesh(cp=2, ep=2).world         # 2: EP borrows the two CP ranks
    ParallelMesh(ep=2, pp=2).world         # 4: two pipeline stages, EP over the two data-parallel ranks of each
    ParallelMesh(cp=2, ep=4)               # ValueError: ep (4) must be 1 or equal cp (2) ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MESH_DIMS", "ParallelMesh"]

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp")
"""The dimensions of the rank grid, outermost first (:meth:`ParallelMesh.build` adds the flattened ``dp_cp``)."""


def _check_degree(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ParallelMesh:
    """The parallel degrees of a run (see the module docstring for the layout and the rules).

    Attributes:
        dp: data-parallel degree; ``None`` (the default) derives it: ``ep`` without context parallelism
            (the EP ranks are data-parallel ranks), else 1.
        ep: expert-parallel degree: 1 (experts replicated) or ``dp * cp`` (experts sharded over every
            data- and context-parallel rank of a stage).
        cp: context-parallel degree (FLA's CP; 1 = none).
        pp: pipeline-parallel degree (ranks a data-parallel rank's stages are spread over); multiplies
            :attr:`world`.

    Raises:
        ValueError: a degree that is not an int >= 1 (naming the field), or ``ep`` that is neither 1 nor
            ``dp * cp`` (naming both and where the EP ranks come from).
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
        """``{"pp": .., "dp": .., "cp": ..}`` of ``rank`` in the ``(pp, dp, cp)`` grid (row-major, as
        ``DeviceMesh`` lays out ``range(world)``).

        Raises:
            ValueError: ``rank`` is not an int in ``[0, world)``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank must be an int in [0, {self.world}) (the mesh's world), got {rank!r}")
        coords = {}
        for name, size in reversed(tuple(zip(MESH_DIMS, self.shape))):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in MESH_DIMS}

    def build(self, device_type: str) -> dict[str, Any]:
        """Deprecated: torch's ``DeviceMesh`` of this layout over the default process group, as its one-dimensional
        meshes by name: :data:`MESH_DIMS` and ``"dp_cp"`` (``dp`` and ``cp`` flattened: a stage's gradient group,
        torchtitan's ``loss`` mesh). Use torchtitan's ``ParallelDims(dp_replicate=1, dp_shard=dp, cp=cp, tp=1,
        pp=pp, ep=ep, world_size=world)`` (what the regression builds) or ``init_device_mesh`` instead.

        Every rank of the default group must call it (it creates process groups).

        Args:
            device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL), as ``init_device_mesh`` takes it.

        Raises:
            RuntimeError: no default process group, or one whose size is not :attr:`world`.
        """
        import warnings

        warnings.warn(
            "ParallelMesh.build is deprecated: build torchtitan's ParallelDims(dp_replicate=1, dp_shard=mesh.dp, "
            "cp=mesh.cp, tp=1, pp=mesh.pp, ep=mesh.ep, world_size=mesh.world), as the regression does, or "
            "torch.distributed.device_mesh.init_device_mesh(device_type, mesh.shape, mesh_dim_names=MESH_DIMS)",
            DeprecationWarning, stacklevel=2,
        )
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized() or dist.get_world_size() != self.world:
            found = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise RuntimeError(f"the mesh {self.shape} of {MESH_DIMS} needs a default process group of "
                               f"{self.world} ranks, found {found}")
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        meshes = {name: mesh[name] for name in MESH_DIMS}
        meshes["dp_cp"] = mesh["dp", "cp"]._flatten("dp_cp")  # torch's way to a group over several dimensions
        return meshes
