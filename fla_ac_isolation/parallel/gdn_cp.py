"""The Gated DeltaNet drop-ins' CP checks: run at the mixer's boundary before FLA's CP kernels, raising errors that
name the argument (imported by ``mixers/gated_deltanet.py`` only when a CP context arrives)."""

from __future__ import annotations

from typing import Any

import torch

from fla_ac_isolation.ops.backend import check_cp_backend

__all__ = ["check_cp_conv"]


def check_cp_conv(
    cp_context: Any, backend: str, hidden_states: torch.Tensor, conv_kernel_size: int, saveable: bool = False
) -> None:
    """Check that a mixer with a causal conv of width ``conv_kernel_size`` can run under ``cp_context``.

    Raises:
        NotImplementedError: a ``backend`` without CP kernels, or ``saveable=True``.
        ValueError: the context's conv width is ``None`` or below ``conv_kernel_size``, or it has no process group.
    """
    check_cp_backend(cp_context, backend, hidden_states, saveable)
    width = cp_context.conv1d_kernel_size
    if width is None or width < conv_kernel_size:
        raise ValueError(
            f"CPConfig.conv_kernel_size must be at least this layer's conv width ({conv_kernel_size}), got {width}: "
            "FLA's CP conv needs it, and every rank must hold conv_kernel_size - 1 tokens of history"
        )
    if cp_context.group is None:
        raise ValueError(
            "seqlens was built with CPConfig(world_size=..., rank=...) and no group: that describes the layout "
            "only; FLA's CP kernels need the CP process group (CPConfig(group=...))"
        )
