"""FLA's chunk layout: the chunk size of its varlen kernels, the chunk schedule, and its index helpers.

FLA's chunked kernels (the causal conv, the gated delta rule, simple GLA) cut every packed document into
:data:`CHUNK_SIZE`-token chunks and walk them in the order of a *chunk schedule*: ``[NT, 2]`` rows
``(document, chunk within the document)``, built by ``fla.ops.utils.index.prepare_chunk_indices`` and
memoised there by argument identity. This module states those facts once:

* :data:`CHUNK_SIZE` and :func:`conv_takes_chunk_indices` (whether FLA's conv uses the same chunk size,
  read from its signature: a schedule for another size would be misread silently);
* :func:`chunk_indices_for` - the same schedule, computed on the host without FLA's cache (what
  :class:`~fla_ac_isolation.LayerLocalSeqlens` precomputes once per batch), and :func:`chunk_offsets_for`,
  each document's first row in it (FLA's ``prepare_chunk_offsets``, which sizes the chunk states);
* :func:`prepare_chunk_indices`, :func:`prepare_chunk_offsets`, :func:`prepare_position_ids` - FLA's own
  cached helpers, called through unchanged, for the reference backend (which must hit and miss FLA's cache
  where the kernels do) and the fault stack.

FLA is imported on first call, never at import.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

from fla_ac_isolation.fla_seam import features

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

    Row ``r`` says that the ``r``-th chunk of the packed batch is chunk ``i`` (``chunk_size`` tokens, the
    last one shorter) of document ``n``; zero-length documents have no rows. This is the layout of
    ``fla.ops.utils.index.prepare_chunk_indices`` (the tests compare the two). It is computed here rather
    than through FLA's helper because that helper is memoised by argument identity: calling it would add
    entries to the very cache whose hits and misses the isolation keeps identical between a layer's
    forward and its recompute.

    Size: ``NT = sum(ceil(len / chunk_size))`` rows, at most ``(offsets[-1] - offsets[0]) / chunk_size + N``
    for non-decreasing offsets; the per-document counts (``[N]``) are checked before the ``[NT]`` rows
    are allocated, so inconsistent offsets (a decrease, whose positive steps would add up to more
    chunks than the span holds) are refused instead of reaching ``repeat_interleave``.

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
    with ``c_i = ceil(len_i / chunk_size)``; the last entry is the schedule's row count ``NT``.

    The values of ``fla.ops.utils.index.prepare_chunk_offsets(cu_seqlens, chunk_size)`` (the tests compare
    the two), computed on the host for the reason given in :func:`chunk_indices_for`. FLA's state kernels
    (``chunk_fwd_kernel_h``, ``chunk_bwd_kernel_dh``, the gated delta rule's) read it as ``split_offsets`` /
    ``chunk_offsets``: where a document's chunk states start.

    Raises:
        ValueError: as :func:`chunk_indices_for`.
    """
    steps = _steps(offsets, chunk_size)
    chunks = (steps + chunk_size - 1).div(chunk_size, rounding_mode="floor")
    return torch.cat([chunks.new_zeros(1), chunks.cumsum(0)])


@functools.cache
def conv_takes_chunk_indices() -> bool:
    """Whether FLA's Triton conv cuts time into :data:`CHUNK_SIZE`-token chunks in forward and backward.

    Only then may the conv be handed a schedule from :func:`chunk_indices_for`; FLA's conv has a fixed
    chunk size (a default argument), read here from its signature.
    """
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
