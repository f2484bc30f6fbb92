"""What one layer sees (:class:`LocalSeqlens`) and the copy that makes it fresh; imports nothing from this package."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["LocalSeqlens", "fresh_copy", "host_to_device"]


class LocalSeqlens(NamedTuple):
    """What one layer call sees: fresh tensors (new objects per call), equal in value to the model-level ones.

    Attributes:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets on the activations' device.
        cu_seqlens_cpu: ``[N + 1]`` host offsets (``None`` only from the harness's shared mode without them).
        max_seqlen: longest document, in tokens.
        chunk_indices: ``[NT, 2]`` rows ``(document, chunk)`` of FLA's 64-token chunks, dtype and device of
            ``cu_seqlens``; ``None`` when not precomputed.
        cp_context: under CP, FLA's ``FLACPContext`` holding the tensors above (then RANK-LOCAL int32); else ``None``.
        chunk_offsets: ``[N + 1]`` first ``chunk_indices`` row of each document (FLA's ``prepare_chunk_offsets``);
            ``None`` with ``chunk_indices`` and under CP.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor | None
    max_seqlen: int
    chunk_indices: torch.Tensor | None = None
    cp_context: Any = None
    chunk_offsets: torch.Tensor | None = None


@torch.compiler.disable
def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """A no-grad clone of ``t`` that no dispatch mode (a SAC policy saving ``aten.clone``) or compiled graph sees."""
    with _disable_current_modes(), torch.no_grad():
        return t.clone()


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without blocking the host (pinned staging on CUDA); ``host`` itself on the CPU."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
