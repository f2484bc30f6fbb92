"""The tiny decoders' attention: causal per document over ``cu_seqlens``, plain ``scaled_dot_product_attention``
with a boolean mask. Under CP each rank's queries attend to the keys and values of all ranks, gathered."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fla_ac_isolation.local_seqlens import PackedSeqlens
from fla_ac_isolation.parallel import CPConfig, cp_token_index, gather_unshard

__all__ = ["AttentionLayout", "PackedAttention"]


class AttentionLayout(NamedTuple):
    """Per-forward attention inputs, built once from the document offsets.

    Attributes:
        mask: ``[T, T]`` bool, True where query ``i`` may attend key ``j`` (same document, ``j <= i``);
            under CP ``[T / W, T]``: the rows of this rank's tokens, keys in packed order.
        positions: ``[T]`` int64 position of each token in its document (RoPE); under CP ``[T / W]``.
        cp: the CP configuration when the batch is sharded (keys and values are then gathered).
    """

    mask: torch.Tensor
    positions: torch.Tensor
    cp: CPConfig | None = None

    @classmethod
    def from_seqlens(cls, seqlens: PackedSeqlens, device: torch.device) -> AttentionLayout:
        lens = torch.tensor(seqlens.seq_lens(), dtype=torch.int64)
        doc = torch.repeat_interleave(torch.arange(lens.numel()), lens)              # [T] document id
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(doc.numel()) - starts[doc]                          # [T]
        causal = torch.ones(doc.numel(), doc.numel(), dtype=torch.bool).tril()
        mask = causal & (doc[:, None] == doc[None, :])
        if seqlens.cp is not None:  # this rank's query rows, every key
            index = cp_token_index(seqlens.num_tokens, seqlens.cp)
            mask, positions = mask[index], positions[index]
        return cls(mask.to(device), positions.to(device), seqlens.cp)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PackedAttention(nn.Module):
    """Causal multi-head attention restricted to each packed document (GQA, optional gate/RoPE/qk-norm).

    Args:
        hidden_size: model width ``D``.
        num_heads: query heads.
        num_kv_heads: key/value heads; ``num_heads % num_kv_heads == 0``.
        head_dim: channels per head.
        gated: a per-channel ``sigmoid`` output gate from ``q_proj`` (Qwen3.5).
        qk_norm: per-head RMSNorm of q and k.
        rotary_dim: channels per head that RoPE rotates (even; 0 = no positional encoding).
        rope_theta: RoPE base.
        eps: RMSNorm epsilon.

    Forward: ``hidden_states [1, T, D]``, :class:`AttentionLayout` -> ``[1, T, D]``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        gated: bool,
        qk_norm: bool,
        rotary_dim: int,
        rope_theta: float = 10_000.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gated, self.rotary_dim, self.rope_theta = gated, rotary_dim, rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * (2 if gated else 1), bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=eps) if qk_norm else None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.rotary_dim:
            return x
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, self.rotary_dim, 2, device=x.device, dtype=torch.float32) / self.rotary_dim
        )
        angles = positions.float()[:, None] * inv_freq[None]                          # [T, R/2]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None]               # [1, T, 1, R]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        rot = (rot.float() * cos + _rotate_half(rot.float()) * sin).to(x.dtype)
        return torch.cat([rot, rest], dim=-1)

    def forward(self, hidden_states: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        batch, tokens, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, tokens, self.num_heads, -1)
        gate = None
        if self.gated:
            q, gate = q.split(self.head_dim, dim=-1)                                   # [B, T, H, Dh] each
        k = self.k_proj(hidden_states).view(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, layout.positions), self._rope(k, layout.positions)
        if layout.cp is not None:  # context parallelism: every rank's keys and values, packed order
            k, v = gather_unshard(k, layout.cp), gather_unshard(v, layout.cp)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=layout.mask
        ).transpose(1, 2)                                                              # [B, T, H, Dh]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, tokens, -1))
