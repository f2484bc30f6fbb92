"""What one layer sees, and the fresh copy that hands it out: a leaf every layer above may import.

* :class:`LocalSeqlens` - the offsets one layer call receives from
  :meth:`~fla_ac_isolation.LayerLocalSeqlens.local` (fresh objects, equal in value to the model-level ones).
* :func:`fresh_copy` - the copy behind every fresh object: invisible to dispatch modes (SAC, the audit) and
  to ``torch.compile``. :class:`~fla_ac_isolation.LayerLocalSeqlens`, the CP half
  (:mod:`fla_ac_isolation.parallel.seqlens_cp`) and :func:`~fla_ac_isolation.isolate_seqlens` all use it.
* :func:`host_to_device` - host offsets to the activations' device without blocking the host.

This module imports nothing from this package.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["LocalSeqlens", "fresh_copy", "host_to_device"]


class LocalSeqlens(NamedTuple):
    """What one layer sees: fresh tensors, equal in value to the model-level ones.

    Attributes:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets, on the activations' device; a new object per call.
        cu_seqlens_cpu: ``[N + 1]`` host copy of the offsets (a new object per call). ``None`` only from
            the harness's ``modes.SharedSeqlens`` built without host offsets.
        max_seqlen: length of the longest document, in tokens.
        chunk_indices: ``[NT, 2]`` rows ``(document, chunk within the document)`` of FLA's
            :data:`~fla_ac_isolation.fla_seam.layout.CHUNK_SIZE`-token chunks, dtype of ``cu_seqlens``, on its
            device (a new object per call); FLA's ``chunk_indices`` argument, so the kernel skips
            ``prepare_chunk_indices`` and its host-to-device copy. ``None`` when the
            :class:`~fla_ac_isolation.LayerLocalSeqlens` was built with
            ``chunk_indices=False`` and from the harness's ``modes.SharedSeqlens``.
        cp_context: under context parallelism (``LayerLocalSeqlens(..., cp=...)``), FLA's ``FLACPContext``
            for this layer, holding the very ``cu_seqlens``/``cu_seqlens_cpu`` objects above (then the
            RANK-LOCAL int32 offsets, ``max_seqlen`` the longest local piece and ``chunk_indices`` the
            local schedule); pass it to FLA's CP-aware conv and gated delta rule. ``None`` without CP.
        chunk_offsets: ``[N + 1]`` first row of each document in ``chunk_indices`` (FLA's
            ``prepare_chunk_offsets``), dtype of ``cu_seqlens``, on its device, a new object per call; the
            Mamba2 SSD passes it with ``chunk_indices`` to FLA's state kernels, which then need no host read
            of the chunk count. ``None`` wherever ``chunk_indices`` is ``None``, and under CP.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor | None
    max_seqlen: int
    chunk_indices: torch.Tensor | None = None
    cp_context: Any = None
    chunk_offsets: torch.Tensor | None = None


@torch.compiler.disable
def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``t`` (same values, dtype and device, a new object) that no dispatch mode ever sees.

    Hiding the copy from ``TorchDispatchMode`` stacks matters: a SAC policy that saves ``aten.clone`` (or
    ``alias``/``_to_copy``) would otherwise hand the recompute the very tensor object that the forward
    produced, and FLA's identity cache would hit in the recompute after missing in the forward. The copy
    is also kept out of ``torch.compile`` graphs so that each call yields a new object. Integer offset
    tensors never require grad, so nothing is lost for autograd (the copy is made under ``no_grad``).
    """
    with _disable_current_modes(), torch.no_grad():
        return t.clone()


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host (pinned staging on CUDA).

    Returns ``host`` itself when ``device`` is the CPU.
    """
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
