"""Where one rank runs (:class:`RankContext`), how its process starts (:func:`setup_process`) and
:func:`all_reduce` over its groups."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from fla_ac_isolation.harness.regression.expert_parallel import expert_parallel_dims
from fla_ac_isolation.harness.regression.mesh import ParallelMesh
from fla_ac_isolation.harness.regression.spec import RegressionSpec

__all__ = ["RankContext", "all_reduce", "setup_process"]



@dataclass
class RankContext:
    """Where this rank runs: its rank, mesh, device and torchtitan's built ``ParallelDims`` (``None`` on one rank).
    Build it with :meth:`create` on every rank (the process groups are created collectively)."""

    rank: int
    mesh: ParallelMesh
    device: torch.device
    dims: Any = None

    @classmethod
    def create(cls, rank: int, mesh: ParallelMesh, device: torch.device) -> RankContext:
        """This rank's context; with more than one rank, builds the mesh's process groups (every rank calls it)."""
        return cls(rank, mesh, device, expert_parallel_dims(mesh) if mesh.world > 1 else None)

    @property
    def world(self) -> int:
        """The number of ranks."""
        return self.mesh.world

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's place in the mesh: ``{"pp": .., "dp": .., "cp": ..}``."""
        return self.mesh.coordinates(self.rank)

    def _group(self, axis: str) -> Any:
        return None if self.dims is None else self.dims.get_optional_mesh(axis, include_singleton_axes=True).get_group()

    @property
    def group(self) -> Any:
        """The group gradients and statistics are summed over (torchtitan's ``loss`` mesh); ``None`` on one rank."""
        return self._group("loss")

    @property
    def cp_group(self) -> Any:
        """This rank's context-parallel group; ``None`` on one rank."""
        return self._group("cp")

    @property
    def pp_group(self) -> Any:
        """This rank's pipeline group; ``None`` on one rank."""
        return self._group("pp")


def setup_process(spec: RegressionSpec, rank: int) -> tuple[torch.device, list[str], contextlib.ExitStack]:
    """Device, notes for the report, and the contexts held for the process's life (FLA's interpreter backend,
    or FLA's kernels served on the CPU for a user's mixer (:attr:`RegressionSpec.serves_fla_on_cpu`), then
    what ``spec.rank_setup`` returned, entered inside them). Hold the returned stack while training.

    Raises:
        RuntimeError: ``kernels="interpreter"`` without ``TRITON_INTERPRET=1`` in this process's environment.
    """
    import warnings

    from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan

    warnings.filterwarnings("ignore", message=".*[Aa]utocast.*")
    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    notes = ensure_torch_compat()
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # ranks share the cores; one thread each is also deterministic
        device = torch.device("cpu")
    setup_torchtitan(spec.device)
    held = contextlib.ExitStack()
    if spec.kernels == "interpreter":
        from fla_ac_isolation.harness.fla_seam.interpreter import cpu_cp_kernels

        held.enter_context(cpu_cp_kernels())
    elif spec.serves_fla_on_cpu:  # as `check` does on a CPU: FLA's Triton kernels cannot run there
        from fla_ac_isolation.harness.reference_kernels import reference_kernels

        held.enter_context(reference_kernels())
    if spec.rank_setup is not None:
        out = spec.rank_setup()
        if hasattr(out, "__enter__"):
            held.enter_context(out)  # kept entered until the process ends; the caller holds `held`
    return device, notes, held


def all_reduce(t: torch.Tensor, ctx: RankContext, op: str = "sum", *, everyone: bool = False) -> torch.Tensor:
    """Sum (or max) ``t`` in place over ``ctx.group``, or with ``everyone`` over every rank; no-op on one rank."""
    if ctx.world > 1:
        import torch.distributed as dist

        group = None if everyone else ctx.group
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t
