"""Our path for transformers' Kimi Delta Attention classes (KDA, arXiv:2510.26692): Kimi-Linear's
``KimiLinearDeltaAttention``, GLM-5-next's ``Glm5NextTextLinearAttention``, Bailing hybrid's
``BailingHybridDeltaAttention``. Same maths as the replaced forward, with the conv and KDA restarted at every
document: ``q_proj``/``k_proj``/``v_proj`` through one short causal conv + SiLU, the class's own ``forget_gate``
(log decay per key channel ``[B, T, H, K]``), ``beta = sigmoid(b_proj(h))``, KDA (q, k L2-normalised inside), the
class's ``o_norm`` with its output gate (``g_b_proj(g_a_proj(h))``, or Bailing's ``g_proj(h)``), ``o_proj``.

transformers' own classes hand FLA's ``chunk_kda`` no offsets (its kernel wrapper keeps only ``chunk_kda``'s
parameter names), so their packed documents mix; the drop-ins keep them apart. No context-parallel path.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fla_ac_isolation import ops
from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens
from fla_ac_isolation.mixers.base import DropIn, apply_padding_mask
from fla_ac_isolation.ops.backend import resolve_backend

__all__ = ["KimiDeltaAttentionPath"]


class KimiDeltaAttentionPath(DropIn):
    """The packed training path of a transformers KDA class (the class it is mixed into holds the parameters).

    Raises (at construction or swap):
        ValueError: ``hidden_act`` other than SiLU.
        NotImplementedError: ``saveable=True`` (FLA's ``chunk_kda`` is not wrapped as a custom operator).
    """

    saveable_ops = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_forget_gate()

    @torch.no_grad()
    def init_forget_gate(self) -> None:
        """The forget gate's ``A_log`` and ``dt_bias`` drawn as transformers' ``_init_weights`` draws them (FLA's
        initialisation: ``A = exp(A_log)`` in [1, 16], or ``A_log = 0`` under GLM-5-next's lower bound;
        ``softplus(dt_bias)`` in [1e-3, 1e-1]). The replaced class leaves them empty until its model's
        ``post_init``; a drop-in built on its own (not swapped in) draws them here, so it computes finite values."""
        gate = self.forget_gate
        if gate.A_log.device.type == "meta":
            return
        if getattr(gate, "safe_gate_lower_bound", None) is not None:
            gate.A_log.zero_()
        else:
            gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(gate.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def check_supported(self) -> None:
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' (the conv activation FLA offers), got {self.activation!r}")

    def packed_forward(self, hidden_states: torch.Tensor, local: LocalSeqlens | None,
                       attention_mask: torch.Tensor | None, seqlens: PackedSeqlens | None) -> torch.Tensor:
        if local is not None and local.cp_context is not None:
            raise NotImplementedError(f"{type(self).__name__} has no context-parallel path: pass a "
                                      "LayerLocalSeqlens, not a CPSeqlens (whole sequences on every rank)")
        batch, tokens = hidden_states.shape[:2]
        kw = dict(seqlens=local, backend=resolve_backend(self.backend, hidden_states))  # this call's fresh offsets
        hidden_states = apply_padding_mask(hidden_states, attention_mask)
        heads = (batch, tokens, self.num_heads, self.head_dim)

        # 1-2. q, k, v through one short causal conv + SiLU, restarted at every document.
        qkv = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
        qkv = ops.causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation,
                                **kw)
        query, key, value = (x.reshape(heads) for x in qkv.split([self.qkv_dim] * 3, dim=-1))   # [B, T, H, K]

        # 3-4. The class's forget gate: log decay [B, T, H, K]; write strength beta in (0, 1) [B, T, H].
        # (the class's gate reshapes with -1: no tokens, no gate to compute)
        g = self.forget_gate(hidden_states) if tokens else hidden_states.new_zeros(heads, dtype=torch.float32)
        beta = torch.sigmoid(self.b_proj(hidden_states))

        # 5. Kimi Delta Attention, zero state at every document start.
        core = ops.chunk_kda(query, key, value, g, beta, use_qk_l2norm_in_kernel=True, **kw)

        # 6. The class's gated RMSNorm with its output gate, output projection.
        low_rank = hasattr(self, "g_a_proj")
        gate = self.g_b_proj(self.g_a_proj(hidden_states)) if low_rank else self.g_proj(hidden_states)
        core = self.o_norm(core, gate.reshape(heads))
        return self.o_proj(core.reshape(batch, tokens, self.qkv_dim))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, " + super().extra_repr()
