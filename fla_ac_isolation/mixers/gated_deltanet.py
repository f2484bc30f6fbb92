"""Our path for transformers' Gated DeltaNet classes (arXiv:2412.06464): Qwen3.5(-MoE), Qwen3.8-Flash-Next
(``Qwen4ExpTextGatedDeltaNet``), Qwen3-Next, OLMo-hybrid, Lara-mini. Their projections differ, read off the module:

* ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3.5, Qwen3.8, Lara-mini);
* ``in_proj_qkvz``, ``in_proj_ba`` split by the class's own ``fix_query_key_value_ordering`` (Qwen3-Next);
* ``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``, ``g_proj`` with ``o_norm``/``o_proj`` and
  ``allow_neg_eigval`` (OLMo-hybrid).

Then, as the replaced forward: the short causal conv + SiLU (restarted at every document here), ``beta = sigmoid(b)``,
``g = -exp(A_log) * softplus(a + dt_bias)``, the gated delta rule (restarted at every document), the class's own gated
RMSNorm and output projection. Under context parallelism (``seqlens`` a
:class:`~fla_ac_isolation.parallel.CPSeqlens`) ``hidden_states`` is this rank's ``[1, T / W, D]`` and replicated
parameters' gradients are this rank's part, to be summed over the CP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fla_ac_isolation import ops
from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens
from fla_ac_isolation.mixers.base import DropIn, apply_padding_mask
from fla_ac_isolation.ops.backend import resolve_backend

__all__ = ["GatedDeltaNetPath"]


class GatedDeltaNetPath(DropIn):
    """The packed training path of a transformers Gated DeltaNet (the class it is mixed into holds the parameters).

    Raises (at construction or swap):
        ValueError: ``hidden_act`` other than SiLU (the only conv activation FLA offers); value heads not a
            multiple of key heads.
    """

    def check_supported(self) -> None:
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' (the conv activation FLA offers), got {self.activation!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mixed_qkv [B, T, 2*H*K + HV*V], b [B, T, HV], a [B, T, HV], z or None)``: the class's projections."""
        batch, tokens = hidden_states.shape[:2]
        if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: fused projections, reordered by the class itself
            q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                 self.in_proj_ba(hidden_states))
            mixed = torch.cat([x.reshape(batch, tokens, -1) for x in (q, k, v)], dim=-1)
            return mixed, b, a, z
        if hasattr(self, "q_proj"):  # OLMo-hybrid: separate projections, its gate after the core (g_proj)
            mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)],
                              dim=-1)
            return mixed, self.b_proj(hidden_states), self.a_proj(hidden_states), None
        z = self.in_proj_z(hidden_states).reshape(batch, tokens, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(hidden_states), self.in_proj_b(hidden_states), self.in_proj_a(hidden_states), z

    def packed_forward(self, hidden_states: torch.Tensor, local: LocalSeqlens | None,
                       attention_mask: torch.Tensor | None, seqlens: PackedSeqlens | None) -> torch.Tensor:
        batch, tokens = hidden_states.shape[:2]
        # every op gets this call's fresh offsets (local: cu_seqlens, its chunk schedule, FLA's CP context)
        kw = dict(seqlens=local, backend=resolve_backend(self.backend, hidden_states), saveable=self.saveable)
        if local is not None and local.cp_context is not None:
            from fla_ac_isolation.parallel.gdn_cp import check_cp_conv

            check_cp_conv(local.cp_context, self.backend, hidden_states, self.conv_kernel_size, self.saveable)
        hidden_states = apply_padding_mask(hidden_states, attention_mask)

        # 1. Projections; 2. short causal conv + SiLU, restarted at every document.
        mixed, b, a, z = self._project(hidden_states)
        mixed = ops.causal_conv1d(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation,
                                  **kw)
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, tokens, self.num_k_heads, self.head_k_dim)      # [B, T, H, K]
        key = key.reshape(batch, tokens, self.num_k_heads, self.head_k_dim)          # [B, T, H, K]
        value = value.reshape(batch, tokens, self.num_v_heads, self.head_v_dim)      # [B, T, HV, V]

        # 3. Gates: beta in (0, 1) (OLMo-hybrid may double it); g = log decay <= 0, in float32.
        beta = b.sigmoid()
        if getattr(self, "allow_neg_eigval", False):
            beta = beta * 2.0
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        # 4. Gated delta rule (q, k L2-normalised inside; value heads share key heads in groups).
        core = ops.chunk_gated_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True, **kw)

        # 5. The class's gated RMSNorm and output projection.
        if z is None:  # OLMo-hybrid
            gate = self.g_proj(hidden_states).reshape(-1, self.head_v_dim)
            core = self.o_norm(core.reshape(-1, self.head_v_dim), gate)
            return self.o_proj(core.reshape(batch, tokens, self.value_dim))
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(batch, tokens, self.value_dim))

    def extra_repr(self) -> str:
        return (f"key_heads={self.num_k_heads}, value_heads={self.num_v_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, " + super().extra_repr())
