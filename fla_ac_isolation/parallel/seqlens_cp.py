"""The context-parallel half of :class:`~fla_ac_isolation.LayerLocalSeqlens`: FLA's CP context, built once per batch
from the GLOBAL host offsets. Each layer needs a fresh context holding its own offsets (FLA caches per
``cu_seqlens`` object), so :meth:`CPSeqlens.local` makes one per call; :meth:`CPSeqlens.shared` is the unsafe mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fla_ac_isolation.fla_seam.cp import build_cp_context, with_offsets
from fla_ac_isolation.fla_seam.layout import chunk_indices_for
from fla_ac_isolation.local_seqlens import LocalSeqlens, fresh_copy, host_to_device

if TYPE_CHECKING:
    from fla_ac_isolation.parallel.config import CPConfig

__all__ = ["CPSeqlens"]


class CPSeqlens:
    """This rank's CP metadata for one batch, from the validated ``[N + 1]`` GLOBAL ``host`` offsets; rank-local tensors
    go to ``device``. ``ValueError`` when the batch does not split (:meth:`CPConfig.check_num_tokens`)."""

    __slots__ = ("_chunk_indices", "_context", "config", "max_seqlen", "num_tokens")

    def __init__(self, cp: CPConfig, host: torch.Tensor, device: torch.device, *, chunk_indices: bool) -> None:
        total = int(host[-1])
        cp.check_num_tokens(total)
        context = build_cp_context(host, world_size=cp.world_size, rank=cp.rank, group=cp.group, layout=cp.layout,
                                   conv_kernel_size=cp.conv_kernel_size)
        local_host = context.cu_seqlens_cpu  # int32, rank-local
        self._context = with_offsets(context, host_to_device(local_host, device), local_host)
        self._chunk_indices = (
            host_to_device(chunk_indices_for(local_host).to(torch.int32), device) if chunk_indices else None
        )
        self.config = cp
        self.num_tokens = cp.local_num_tokens(total)
        self.max_seqlen = int((local_host[1:] - local_host[:-1]).max())

    @torch.compiler.disable
    def local(self) -> LocalSeqlens:
        """Fresh rank-local offsets, chunk schedule and ``FLACPContext`` (holding those same offsets)."""
        cu_seqlens, cu_seqlens_cpu = fresh_copy(self._context.cu_seqlens), fresh_copy(self._context.cu_seqlens_cpu)
        chunk_indices = fresh_copy(self._chunk_indices) if self._chunk_indices is not None else None
        context = with_offsets(self._context, cu_seqlens, cu_seqlens_cpu)
        return LocalSeqlens(cu_seqlens, cu_seqlens_cpu, self.max_seqlen, chunk_indices, context)

    def check_tokens(self, num_tokens: int, name: str, total: int) -> None:
        """``ValueError`` naming ``name`` and this rank's share unless ``num_tokens`` is ``T / W`` of ``total``."""
        if num_tokens != self.num_tokens:
            cp = self.config
            raise ValueError(
                f"{name} has {num_tokens} packed tokens but CP rank {cp.rank} of {cp.world_size} holds "
                f"{self.num_tokens} of the cu_seqlens[-1] = {total} tokens ({cp.layout} layout): "
                "shard the batch with fla_ac_isolation.parallel.shard_packed_batch"
            )

    def shared(self) -> LocalSeqlens:
        """The one context of the batch and its offsets, the same objects on every call (UNSAFE under AC)."""
        c = self._context
        return LocalSeqlens(c.cu_seqlens, c.cu_seqlens_cpu, self.max_seqlen, self._chunk_indices, c)

    def __repr__(self) -> str:
        c = self.config
        return f"CPSeqlens(layout={c.layout!r}, rank={c.rank}/{c.world_size}, local_tokens={self.num_tokens})"
