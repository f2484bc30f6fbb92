""":class:`CPSeqlens`: a packed batch's offsets under context parallelism, a sibling of
:class:`~fla_ac_isolation.LayerLocalSeqlens`. Built once per batch from the WHOLE batch's offsets: FLA's CP context
for this rank (host offsets, no sync); each layer call gets a fresh context holding fresh rank-local offsets (FLA
caches per ``cu_seqlens`` object).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from fla_ac_isolation.fla_seam.cp import build_cp_context, with_offsets
from fla_ac_isolation.fla_seam.layout import chunk_indices_for
from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens, fresh_copy, host_to_device
from fla_ac_isolation.offsets import check_index_tensor, check_num_tokens, offsets_of_lengths
from fla_ac_isolation.parallel.config import CPConfig
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["CPSeqlens"]


class CPSeqlens(PackedSeqlens):
    """The WHOLE packed batch's offsets on one CP rank: :meth:`local` hands each layer call this rank's fresh offsets
    with FLA's CP context, ``local(whole_batch=True)`` the whole batch's (head-parallel Mamba2, gathered attention).

    ``num_seqs``, ``num_tokens``, ``max_seqlen`` and :meth:`seq_lens` describe the whole batch; a layer's input is
    this rank's ``T / W`` tokens (:meth:`check_tokens`), cut by :func:`~fla_ac_isolation.parallel.shard_packed_batch`.

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of the whole batch (all ranks' tokens), on the activations' device.
        max_seqlen, cu_seqlens_cpu, device, chunk_indices: as in :class:`~fla_ac_isolation.LayerLocalSeqlens`;
            ``cu_seqlens_cpu`` is required for device offsets.
        cp: this rank's :class:`~fla_ac_isolation.parallel.CPConfig`.
        num_tokens: optional ``T`` of the whole batch, checked against ``cu_seqlens[-1]``.

    Raises:
        TypeError: ``cp`` is not a ``CPConfig``; as ``LayerLocalSeqlens``.
        ValueError: device offsets without ``cu_seqlens_cpu`` (FLA computes CP metadata on the host); a batch that
            does not split (:meth:`CPConfig.check_num_tokens`); as ``LayerLocalSeqlens``.
        FlaFeatureError: fla-core < 0.6 (no CP).

    Usage: ``docs/context-parallel.md``.
    """

    __slots__ = ("_chunk_indices", "_context", "_cp", "_local_max_seqlen", "_local_tokens", "_whole")

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        *,
        cp: CPConfig,
        device: torch.device | str | None = None,
        num_tokens: int | None = None,
        chunk_indices: bool = True,
    ) -> None:
        if not isinstance(cp, CPConfig):
            raise TypeError(f"cp must be a fla_ac_isolation.parallel.CPConfig, got {type(cp).__name__}")
        check_index_tensor(cu_seqlens, "cu_seqlens")
        if cu_seqlens_cpu is None and cu_seqlens.device.type != "cpu":
            raise ValueError(
                f"CPSeqlens needs the host offsets cu_seqlens_cpu when cu_seqlens is on {cu_seqlens.device}: FLA's "
                "CP metadata is computed on the host, and reading device offsets there is a device-to-host sync; "
                "pass cu_seqlens_cpu= (or build with CPSeqlens.from_seq_lens)"
            )
        check_num_tokens(num_tokens)
        whole = LayerLocalSeqlens(cu_seqlens, max_seqlen, cu_seqlens_cpu, device=device, chunk_indices=chunk_indices)
        if num_tokens is not None and whole.num_tokens != num_tokens:
            raise ValueError(
                f"cu_seqlens[-1] must equal num_tokens={num_tokens}, got {whole.num_tokens}: under CP, both count "
                f"the WHOLE packed batch of all {cp.world_size} CP ranks, not this rank's hidden_states.shape[1]"
            )
        cp.check_num_tokens(whole.num_tokens)
        from fla_ac_isolation.fla_seam.features import require

        require("cp", where=f"CPSeqlens(cp=CPConfig(layout={cp.layout!r}))")
        host = torch.tensor([0, *itertools.accumulate(whole.seq_lens())], dtype=whole.dtype)
        context = build_cp_context(host, world_size=cp.world_size, rank=cp.rank, group=cp.group, layout=cp.layout,
                                   conv_kernel_size=cp.conv_kernel_size)
        local_host = context.cu_seqlens_cpu  # int32, rank-local
        self._context = with_offsets(context, host_to_device(local_host, whole.device), local_host)
        self._chunk_indices = (
            host_to_device(chunk_indices_for(local_host).to(torch.int32), whole.device) if chunk_indices else None
        )
        self._whole, self._cp = whole, cp
        self._local_tokens = cp.local_num_tokens(whole.num_tokens)
        self._local_max_seqlen = int((local_host[1:] - local_host[:-1]).max())

    @classmethod
    def from_seq_lens(
        cls,
        seq_lens: Sequence[int],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.int32,
        *,
        cp: CPConfig,
        with_cpu: bool = True,
        chunk_indices: bool | None = None,
    ) -> CPSeqlens:
        """Build from the WHOLE batch's document lengths (as
        :meth:`LayerLocalSeqlens.from_seq_lens <fla_ac_isolation.LayerLocalSeqlens.from_seq_lens>`) and ``cp``."""
        cu, host = offsets_of_lengths(seq_lens, device, dtype)
        extra = {} if chunk_indices is None else {"chunk_indices": chunk_indices}
        return cls(cu, cu_seqlens_cpu=host if with_cpu else None, cp=cp, **extra)

    @torch.compiler.disable
    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """Fresh rank-local offsets, chunk schedule and ``FLACPContext`` (holding those same offsets); with
        ``whole_batch=True`` fresh offsets of the whole batch and no ``cp_context``."""
        if whole_batch:
            return self._whole.local()
        cu_seqlens, cu_seqlens_cpu = fresh_copy(self._context.cu_seqlens), fresh_copy(self._context.cu_seqlens_cpu)
        chunk_indices = fresh_copy(self._chunk_indices) if self._chunk_indices is not None else None
        context = with_offsets(self._context, cu_seqlens, cu_seqlens_cpu)
        return LocalSeqlens(cu_seqlens, cu_seqlens_cpu, self._local_max_seqlen, chunk_indices, context)

    def check_tokens(self, num_tokens: int, name: str = "hidden_states") -> None:
        """``ValueError`` naming ``name`` and this rank's share unless ``num_tokens`` is ``T / W``."""
        if num_tokens != self._local_tokens:
            cp = self._cp
            raise ValueError(
                f"{name} has {num_tokens} packed tokens but CP rank {cp.rank} of {cp.world_size} holds "
                f"{self._local_tokens} of the cu_seqlens[-1] = {self.num_tokens} tokens ({cp.layout} layout): "
                "shard the batch with fla_ac_isolation.parallel.shard_packed_batch"
            )

    @property
    def cp(self) -> CPConfig:
        """The :class:`~fla_ac_isolation.parallel.CPConfig` this batch was built for."""
        return self._cp

    @property
    def num_seqs(self) -> int:
        return self._whole.num_seqs

    @property
    def num_tokens(self) -> int:
        return self._whole.num_tokens

    @property
    def max_seqlen(self) -> int:
        return self._whole.max_seqlen

    @property
    def device(self) -> torch.device:
        return self._whole.device

    @property
    def dtype(self) -> torch.dtype:
        """Integer dtype of the whole batch's offsets (the rank-local ones are int32, as FLA builds them)."""
        return self._whole.dtype

    def seq_lens(self) -> list[int]:
        """The whole batch's document lengths in tokens (no sync)."""
        return self._whole.seq_lens()

    def __repr__(self) -> str:
        c = self._cp
        return (f"CPSeqlens(num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, max_seqlen={self.max_seqlen}, "
                f"device={self.device}, layout={c.layout!r}, rank={c.rank}/{c.world_size}, "
                f"local_tokens={self._local_tokens})")
