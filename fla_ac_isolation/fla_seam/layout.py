"""FLA's chunk layout: the chunk size of its varlen kernels, the chunk schedule (``[NT, 2]`` rows ``(document,
chunk)``) computed on the host, and FLA's own identity-cached index helpers, called through.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

__all__ = [
    "CHUNK_SIZE",
    "chunk_indices_for",
    "chunk_offsets_for",
    "conv_takes_chunk_indices",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "prepare_position_ids",
]

CHUNK_SIZE = 64
"""Chunk length in tokens of FLA's varlen conv, gated delta rule and simple GLA kernels (fla-core 0.6)."""


def _steps(offsets: Sequence[int] | torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[N]`` document lengths (int64, host) of checked ``offsets``; see :func:`chunk_indices_for` for the errors."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    offsets = torch.as_tensor(offsets, dtype=torch.int64, device="cpu")
    if offsets.dim() != 1 or offsets.numel() == 0:
        raise ValueError(f"offsets must be 1-D with N + 1 >= 1 entries, got shape {tuple(offsets.shape)}")
    steps = offsets[1:] - offsets[:-1]
    if bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0]) + 1
        here, before = int(offsets[i]), int(offsets[i - 1])
        raise ValueError(f"offsets must be non-decreasing, but offsets[{i}]={here} < offsets[{i - 1}]={before}")
    return steps


def chunk_indices_for(offsets: Sequence[int] | torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """FLA's chunk schedule of packed documents: ``[NT, 2]`` int64 rows ``(document, chunk)``, on the host.

    Row ``r``: the ``r``-th chunk of the batch is chunk ``i`` of document ``n`` (none for empty documents). The
    values of ``fla.ops.utils.index.prepare_chunk_indices``, computed without it: FLA's cache gets no entry.

    Args:
        offsets: ``N + 1`` non-decreasing ints (the values of ``cu_seqlens``): a sequence or a host tensor.
        chunk_size: tokens per chunk.

    Raises:
        ValueError: ``chunk_size`` is not a positive int; ``offsets`` is not 1-D with at least one entry,
            or decreases (the message names the first decreasing index).
    """
    steps = _steps(offsets, chunk_size)                                                          # [N]
    chunks = (steps + chunk_size - 1).div(chunk_size, rounding_mode="floor")                     # [N]
    document = torch.repeat_interleave(torch.arange(chunks.numel()), chunks)                     # [NT]
    first_row = chunks.cumsum(0) - chunks                                                        # [N]
    chunk = torch.arange(document.numel()) - first_row[document]                                 # [NT]
    return torch.stack([document, chunk], dim=1)


def chunk_offsets_for(offsets: Sequence[int] | torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Each document's first row in the chunk schedule: ``[N + 1]`` int64 on the host, ``[0, c_0, c_0 + c_1, ...]``
    with ``c_i = ceil(len_i / chunk_size)`` (the values of FLA's ``prepare_chunk_offsets``; the last is ``NT``).

    Raises:
        ValueError: as :func:`chunk_indices_for`.
    """
    steps = _steps(offsets, chunk_size)
    chunks = (steps + chunk_size - 1).div(chunk_size, rounding_mode="floor")
    return torch.cat([chunks.new_zeros(1), chunks.cumsum(0)])


@functools.cache
def conv_takes_chunk_indices() -> bool:
    """Whether FLA's Triton conv uses :data:`CHUNK_SIZE`-token chunks (read from its signature): only then may it
    be handed a schedule from :func:`chunk_indices_for`, which it would otherwise misread silently."""
    from fla_ac_isolation.fla_seam import features

    ops = features.module("conv_ops")
    name = features.conv_chunk_parameter()  # chunk_size (fla-core 0.6) or BT (0.5.2)
    sizes = {
        inspect.signature(fn).parameters[name].default
        for fn in (ops.CausalConv1dFunction.forward, inspect.unwrap(ops.causal_conv1d_bwd))
        if name in inspect.signature(fn).parameters
    }
    return sizes == {CHUNK_SIZE}


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int, *, cu_seqlens_cpu: torch.Tensor | None = None):
    """FLA's cached ``prepare_chunk_indices`` (``[NT, 2]`` rows on the device of ``cu_seqlens``), called through."""
    from fla.ops.utils.index import prepare_chunk_indices as fla_prepare_chunk_indices

    return fla_prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int):
    """FLA's cached ``prepare_chunk_offsets`` (``[N + 1]`` first chunk row of each document), called through."""
    from fla.ops.utils.index import prepare_chunk_offsets as fla_prepare_chunk_offsets

    return fla_prepare_chunk_offsets(cu_seqlens, chunk_size)


def prepare_position_ids(cu_seqlens: torch.Tensor):
    """FLA's cached ``prepare_position_ids`` (``[T]`` position of each token in its document), called through."""
    from fla.ops.utils.index import prepare_position_ids as fla_prepare_position_ids

    return fla_prepare_position_ids(cu_seqlens)
