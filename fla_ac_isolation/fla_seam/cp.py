"""FLA's context parallelism (``fla.ops.cp``): its per-rank metadata, built without a sync and copied per layer.

FLA 0.6 shards a packed batch across the ranks of a context-parallel (CP) group and passes recurrent and
conv state between them inside its CP-aware kernels (the gated delta rule and the causal conv take a
``cp_context``). The metadata is an ``FLACPContext`` (``fla/ops/cp/context.py``): the rank-local offsets
``cu_seqlens`` (device) and ``cu_seqlens_cpu`` (host), both int32, and host scalars saying where this
rank's documents start and end in the chain of ranks. ``build_cp_context`` computes it through
``get_cp_cu_seqlens``, which is memoised by argument identity (``fla.utils.tensor_cache``) and copies
``cu_seqlens`` to the host on a miss without ``cu_seqlens_cpu``.

This module is the only place that touches ``fla.ops.cp``:

* :func:`build_cp_context` - the context of one rank, built once per batch from HOST offsets with FLA's
  undecorated ``get_cp_cu_seqlens`` (no cache entry, no lookup, nothing read from the device);
* :func:`with_offsets` - the same context holding other offset tensors (``dataclasses.replace``, as FLA's
  own ``copy_for_backward`` does), which is how each layer gets a fresh context;
* :func:`build_cp_context_in_layer` - what models in the field do: FLA's cached ``build_cp_context`` from
  the one shared device ``cu_seqlens``, inside the layer (the unsafe ``field`` mode of
  the harness's ``modes.py``);
* :func:`is_cp_context` - whether an object is FLA's context.

FLA is imported inside each function, never at import.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

__all__ = ["build_cp_context", "build_cp_context_in_layer", "is_cp_context", "with_offsets"]


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

    Calls ``inspect.unwrap(fla.ops.cp.context.get_cp_cu_seqlens)`` (the function behind FLA's
    ``build_cp_context``) with ``cu_seqlens_cpu`` and an empty host placeholder as ``cu_seqlens``: FLA uses
    that argument only for its device and as a cache key, so nothing is read from a device and no entry
    is added to FLA's identity cache. The returned context's ``cu_seqlens`` and ``cu_seqlens_cpu`` are
    host tensors (int32, rank-local offsets); the caller moves its own copy to the device
    (:func:`with_offsets`).

    Args:
        cu_seqlens_cpu: ``[N + 1]`` int32/int64 host offsets of the WHOLE packed batch (every rank's tokens).
        world_size: CP degree ``W``.
        rank: this rank's index in the CP group, ``0 <= rank < W``.
        group: the CP process group (``None`` builds metadata only; FLA's kernels need the group).
        layout: ``"contiguous"`` (rank ``r`` holds tokens ``[r T/W, (r+1) T/W)``) or ``"zigzag"`` (parts
            ``r`` and ``2W - 1 - r`` of ``T / 2W`` tokens, concatenated).
        conv_kernel_size: width of the model's CP causal conv (FLA's ``conv1d_kernel_size``).

    Raises:
        ValueError: from FLA, when the token count does not divide as ``layout`` needs (callers validate
            first: :class:`~fla_ac_isolation.parallel.CPConfig`).
    """
    from fla.ops.cp.context import get_cp_cu_seqlens

    uncached = inspect.unwrap(get_cp_cu_seqlens)
    placeholder = torch.empty(0, dtype=torch.int32)
    return uncached(
        placeholder, cu_seqlens_cpu=cu_seqlens_cpu, world_size=world_size, rank=rank, group=group,
        conv1d_kernel_size=conv_kernel_size, layout=layout,
    )


def with_offsets(context: Any, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> Any:
    """A copy of ``context`` (an ``FLACPContext``) holding ``cu_seqlens`` and ``cu_seqlens_cpu``.

    ``dataclasses.replace`` copies the host scalars and the group and runs no tensor op, so the copy is
    invisible to dispatch modes (SAC, the audit). The CUDA-graph fields ``pre_num_ranks_dev`` /
    ``post_num_ranks_dev`` are never set by :func:`build_cp_context` and stay ``None``.
    """
    return dataclasses.replace(context, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


def build_cp_context_in_layer(
    cu_seqlens: torch.Tensor, *, group: Any, layout: str = "contiguous", conv_kernel_size: int | None = None
) -> Any:
    """FLA's ``build_cp_context(cu_seqlens, group, conv1d_kernel_size, layout=layout)``, called through.

    What a model does when each layer builds its CP metadata from the one shared ``cu_seqlens`` of the
    batch, without host offsets: FLA's identity cache misses in the first layer's forward (and copies
    ``cu_seqlens`` to the host there) and hits everywhere after, recompute included. The unsafe ``field``
    mode (the harness's ``modes.FieldCPSeqlens``) runs exactly this, on purpose.
    """
    from fla.ops.cp import build_cp_context as fla_build_cp_context

    return fla_build_cp_context(cu_seqlens, group, conv1d_kernel_size=conv_kernel_size, layout=layout)


def is_cp_context(obj: Any) -> bool:
    """Whether ``obj`` is FLA's ``FLACPContext`` (imports ``fla.ops.cp.context``)."""
    from fla.ops.cp.context import FLACPContext

    return isinstance(obj, FLACPContext)
