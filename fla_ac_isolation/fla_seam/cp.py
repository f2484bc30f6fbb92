"""FLA's context parallelism (``fla.ops.cp``, the library's only module touching it): the per-rank ``FLACPContext``
(``fla/ops/cp/context.py``), built once per batch without a sync and copied per layer with fresh offsets.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

__all__ = ["build_cp_context", "with_offsets"]


def build_cp_context(
    cu_seqlens_cpu: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    group: Any = None,
    layout: str = "contiguous",
    conv_kernel_size: int | None = None,
) -> Any:
    """This rank's ``FLACPContext`` from the GLOBAL host offsets, with no device-to-host sync.

    Calls FLA's undecorated ``get_cp_cu_seqlens`` (FLA's cache gets no entry). The context's ``cu_seqlens`` /
    ``cu_seqlens_cpu`` are rank-local int32 host tensors; give each layer a device copy with :func:`with_offsets`.

    Args:
        cu_seqlens_cpu: ``[N + 1]`` int32/int64 host offsets of the WHOLE packed batch (every rank's tokens).
        world_size: CP degree ``W``.
        rank: this rank's index in the CP group, ``0 <= rank < W``.
        group: the CP process group (``None`` builds metadata only; FLA's kernels need the group).
        layout: ``"contiguous"`` (rank ``r`` holds tokens ``[r T/W, (r+1) T/W)``) or ``"zigzag"`` (parts
            ``r`` and ``2W - 1 - r`` of ``T / 2W`` tokens, concatenated).
        conv_kernel_size: width of the model's CP causal conv (FLA's ``conv1d_kernel_size``).

    Raises:
        ValueError: from FLA, when the token count does not divide as ``layout`` needs (see
            :class:`~fla_ac_isolation.parallel.CPConfig`).
    """
    from fla.ops.cp.context import get_cp_cu_seqlens

    uncached = inspect.unwrap(get_cp_cu_seqlens)
    placeholder = torch.empty(0, dtype=torch.int32)
    return uncached(
        placeholder, cu_seqlens_cpu=cu_seqlens_cpu, world_size=world_size, rank=rank, group=group,
        conv1d_kernel_size=conv_kernel_size, layout=layout,
    )


def with_offsets(context: Any, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> Any:
    """A copy of ``context`` holding ``cu_seqlens`` and ``cu_seqlens_cpu`` (``dataclasses.replace``: no tensor op,
    so invisible to dispatch modes)."""
    return dataclasses.replace(context, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)

