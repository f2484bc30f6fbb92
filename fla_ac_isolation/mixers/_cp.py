"""What a mixer checks before it runs under context parallelism (CP), at its forward's boundary.

The Gated DeltaNet mixers run FLA's CP-aware conv and gated delta rule on this rank's shard when
``LocalSeqlens.cp_context`` is set; these checks turn what would otherwise fail deep inside FLA (an
assertion, a collective on the wrong group, a conv history read past the previous rank) into errors
that name the argument.
"""

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
        NotImplementedError: the mixer's ``backend`` has no CP kernels, or the mixer was built with
            ``saveable=True`` (FLA's CP kernels are not custom operators;
            :func:`~fla_ac_isolation.ops.backend.check_cp_backend`).
        ValueError: the context's ``conv_kernel_size`` is ``None`` or smaller than this layer's conv width
            (the interval-length check of ``CPConfig`` then did not cover this conv), or the context has no
            process group (a ``CPConfig`` built with ``world_size``/``rank`` only, for metadata).
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
