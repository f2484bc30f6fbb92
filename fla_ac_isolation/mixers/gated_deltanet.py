"""The Gated DeltaNet token mixer (arXiv:2412.06464) shared by Qwen3.5(-MoE) and Qwen3.8-Flash-Next.

Mirrors transformers' ``Qwen3_5MoeGatedDeltaNet``, except that the conv and the recurrence restart at every
``cu_seqlens`` offset. Under context parallelism (``seqlens`` built with ``cp=``) ``hidden_states`` is this rank's
``[1, T / W, D]`` and replicated parameters' gradients are this rank's part, to be summed over the CP group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fla_ac_isolation import ops
from fla_ac_isolation.mixers._common import (
    apply_padding_mask,
    check_hidden_states,
    config_field,
    layer_type,
    reject_cache,
    resolve_seqlens,
    text_config,
    varlen_kwargs,
)
from fla_ac_isolation.mixers._cp import check_cp_conv
from fla_ac_isolation.ops.backend import check_backend, check_saveable
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]

_GATES = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim times ``activation(gate)`` (``"silu"`` or ``"sigmoid"``), numerically transformers'
    ``Qwen3_5MoeRMSNormGated``; ``ValueError`` for another ``activation``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__()
        if activation not in _GATES:
            raise ValueError(f"activation must be one of {sorted(_GATES)}, got {activation!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.activation = activation

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., hidden_size]``, ``gate`` of the same shape -> same shape and dtype."""
        input_dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = self.weight * x.to(input_dtype)
        return (x * _GATES[self.activation](gate.float())).to(input_dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer with packed-sequence isolation; the base of the Qwen drop-ins.

    Args:
        config: a transformers (text) config with ``hidden_size`` (``D``), ``linear_num_key_heads`` (``H``),
            ``linear_num_value_heads`` (``HV``), ``linear_key_head_dim`` (``K``), ``linear_value_head_dim``
            (``V``), ``linear_conv_kernel_dim`` (``W``), ``hidden_act``, ``rms_norm_eps``, ``layer_types``.
        layer_idx: index of this layer in the decoder.
        backend: ``"auto"`` (FLA kernels for CUDA inputs, reference elsewhere), ``"fla"`` or ``"reference"``.
        output_gate: ``"silu"`` or ``"sigmoid"``.
        saveable: run the conv and the gated delta rule as custom operators a SAC policy can save
            (:func:`fla_ac_isolation.policies.save_fla_ops`).

    Parameters (as transformers): ``in_proj_qkv [2*H*K + HV*V, D]``, ``in_proj_z [HV*V, D]``,
    ``in_proj_b``/``in_proj_a [HV, D]``, ``conv1d [2*H*K + HV*V, 1, W]``, ``dt_bias``/``A_log [HV]``,
    ``norm [V]``, ``out_proj [D, HV*V]``.

    Raises:
        TypeError: ``saveable`` not a bool; ``layer_idx`` not an ``int`` (or ``None``).
        ValueError: unknown ``backend`` or ``output_gate``; a missing config field; ``HV`` not a multiple of
            ``H``; ``hidden_act`` other than SiLU; ``layer_idx`` outside ``config.layer_types``.
    """

    def __init__(
        self, config: Any, layer_idx: int, *, backend: str = "auto", output_gate: str = "silu", saveable: bool = False
    ) -> None:
        super().__init__()
        config = text_config(config)
        self.backend = check_backend(backend)
        self.saveable = check_saveable(saveable)
        self.hidden_size = config_field(config, "hidden_size")
        self.num_v_heads = config_field(config, "linear_num_value_heads")
        self.num_k_heads = config_field(config, "linear_num_key_heads")
        self.head_k_dim = config_field(config, "linear_key_head_dim")
        self.head_v_dim = config_field(config, "linear_value_head_dim")
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config_field(config, "linear_conv_kernel_dim")
        self.layer_idx = layer_idx
        self.activation = config_field(config, "hidden_act")
        self.layer_norm_epsilon = config_field(config, "rms_norm_eps")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of linear_num_key_heads "
                f"({self.num_k_heads})"
            )
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' (the conv activation FLA offers), got {self.activation!r}")

        # Registration order follows transformers so that state_dict() lists the same keys in the same order.
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            bias=False,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        # A in [0.01, 16) so that log(A) is finite; decay per token is exp(-A * softplus(a + dt_bias)).
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=self.layer_norm_epsilon, activation=output_gate)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

        self.layer_type = layer_type(config, layer_idx)

        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        seqlens: LayerLocalSeqlens | None = None,
        *,
        cu_seq_lens_q: torch.Tensor | None = None,
        max_length_q: int | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        cache_params: Any = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``[B, T, D]`` -> ``[B, T, D]``: the forward of :mod:`fla_ac_isolation.mixers`; also ``NotImplementedError``
        for context parallelism with the reference backend or ``saveable=True``.
        """
        reject_cache(cache=cache, cache_params=cache_params, past_key_values=past_key_values)
        batch, tokens = check_hidden_states(hidden_states, self.hidden_size, self.in_proj_qkv.weight)
        local = resolve_seqlens(
            seqlens, hidden_states,
            cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, seq_idx=kwargs.get("seq_idx"),
        )
        varlen = varlen_kwargs(local, self.backend, hidden_states, saveable=self.saveable)
        chunk_indices = local.chunk_indices if local is not None else None  # FLA's chunk schedule, precomputed
        cp_context = local.cp_context if local is not None else None  # FLA's CP metadata (context parallelism)
        if cp_context is not None:
            check_cp_conv(cp_context, self.backend, hidden_states, self.conv_kernel_size, self.saveable)
        hidden_states = apply_padding_mask(hidden_states, attention_mask)

        # 1. Projections: q, k, v (through the conv), output gate z, write strength b, decay input a.
        mixed_qkv = self.in_proj_qkv(hidden_states)                                   # [B, T, 2*H*K + HV*V]
        z = self.in_proj_z(hidden_states).reshape(batch, tokens, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(hidden_states)                                             # [B, T, HV]
        a = self.in_proj_a(hidden_states)                                             # [B, T, HV]

        # 2. Short causal conv + SiLU, restarted at every document.
        mixed_qkv = ops.causal_conv1d(
            mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation,
            chunk_indices=chunk_indices, cp_context=cp_context, **varlen,
        )
        query, key, value = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, tokens, self.num_k_heads, self.head_k_dim)       # [B, T, H, K]
        key = key.reshape(batch, tokens, self.num_k_heads, self.head_k_dim)           # [B, T, H, K]
        value = value.reshape(batch, tokens, self.num_v_heads, self.head_v_dim)       # [B, T, HV, V]

        # 3. Gates: beta in (0, 1); g = log decay <= 0, in float32 (A_log.exp() could overflow fp16).
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        # 4. Gated delta rule (q, k L2-normalised inside; value heads share key heads in groups).
        core = ops.chunk_gated_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True,
                                           chunk_indices=chunk_indices, cp_context=cp_context, **varlen)

        # 5. Per-head RMSNorm, output gate, output projection.
        core = self.norm(core, z)                                                     # [B, T, HV, V]
        return self.out_proj(core.reshape(batch, tokens, self.value_dim))

    def extra_repr(self) -> str:
        return (
            f"key_heads={self.num_k_heads}, value_heads={self.num_v_heads}, head_k_dim={self.head_k_dim}, "
            f"head_v_dim={self.head_v_dim}, gate={self.norm.activation}, backend={self.backend!r}"
            + (", saveable=True" if self.saveable else "")
        )
