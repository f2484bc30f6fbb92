"""Pipeline parallelism (PP) with ``torch.distributed.pipelining``: the per-microbatch ``seqlens`` of a stage call
(``docs/pipeline-parallel.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["microbatch_seqlens"]


def microbatch_seqlens(
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    seqlens_class: type[LayerLocalSeqlens] = LayerLocalSeqlens,
    **kwargs: Any,
) -> LayerLocalSeqlens:
    """One microbatch's ``seqlens`` from the offsets row a schedule hands a stage call (build it once per call); its
    token-count check catches a microbatch received into a buffer of another size (gloo does not).

    Args:
        cu_seqlens: one microbatch's ``[1, W]`` or ``[W]`` int32/int64 row, on the activations' device.
        num_tokens: the stage input's ``hidden_states.shape[1]``; must equal the row's last offset.
        cu_seqlens_cpu: the same row on the host (saves a device-to-host copy).
        seqlens_class: :class:`~fla_ac_isolation.LayerLocalSeqlens` or a mode's class; ``kwargs`` go to it.

    Raises:
        TypeError: ``cu_seqlens`` is not a tensor.
        ValueError: a row not ``[1, W]`` or ``[W]`` (e.g. unchunked ``[M, W]`` offsets), or as the class raises.
    """
    rows = {"cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu}
    for name, row in rows.items():
        if row is None:
            continue
        if not isinstance(row, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (one microbatch's offsets), got {type(row).__name__}")
        if not (row.dim() == 1 or (row.dim() == 2 and row.shape[0] == 1)):
            raise ValueError(f"{name} must be one microbatch's offsets row, [1, W] or [W] (the schedule chunks the "
                             f"[M, W] offsets on dim 0), got shape {tuple(row.shape)}")
    host = None if cu_seqlens_cpu is None else cu_seqlens_cpu.reshape(-1)
    return seqlens_class(cu_seqlens.reshape(-1), cu_seqlens_cpu=host, num_tokens=num_tokens, **kwargs)
