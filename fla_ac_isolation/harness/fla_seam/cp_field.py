"""The unsafe ``field`` mode's side of FLA's context parallelism: FLA's cached ``build_cp_context`` called in
each layer, as models do (:class:`~fla_ac_isolation.harness.modes.FieldCPSeqlens`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["build_cp_context_in_layer"]


def build_cp_context_in_layer(
    cu_seqlens: torch.Tensor, *, group: Any, layout: str = "contiguous", conv_kernel_size: int | None = None
) -> Any:
    """FLA's cached ``build_cp_context``, called through: what models do per layer from one shared ``cu_seqlens``
    (FLA's cache misses in the first layer, hits everywhere after, recompute included; the unsafe ``field`` mode)."""
    from fla.ops.cp import build_cp_context as fla_build_cp_context

    return fla_build_cp_context(cu_seqlens, group, conv1d_kernel_size=conv_kernel_size, layout=layout)
