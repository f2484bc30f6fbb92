"""The Gated DeltaNet token mixer shared by Qwen3.5(-MoE) and Qwen3.8-Flash-Next.

Gated Delta Networks (Yang, Kautz and Hatamizadeh, 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", arXiv:2412.06464) keep a matrix state per value head and update it, token by token, with a
decayed delta-rule write. The layer here follows transformers' ``Qwen3_5MoeGatedDeltaNet`` (5.24)
parameter for parameter, so checkpoints load unchanged:

1. four input projections: ``in_proj_qkv`` (q, k, v together), ``in_proj_z`` (output gate), ``in_proj_b``
   (write strength ``beta = sigmoid(b)``) and ``in_proj_a`` (decay ``g = -exp(A_log) * softplus(a +
   dt_bias)``);
2. a depthwise causal conv (``conv1d``, no bias) + SiLU over q, k, v;
3. the chunked gated delta rule with in-kernel L2 norm of q and k and grouped value attention;
4. a per-head RMSNorm followed by the output gate (``norm``), then ``out_proj``.

What differs from transformers: packed documents are kept apart (the conv and the recurrence restart at
every ``cu_seqlens`` offset), each call takes this layer's own ``cu_seqlens`` objects through
:meth:`~fla_ac_isolation.LayerLocalSeqlens.local` inside ``forward`` (safe under activation
checkpointing), and the backend is chosen explicitly (``fla`` kernels on CUDA, the pure-torch
``reference`` elsewhere). Cached generation is not implemented.

Context parallelism: with ``seqlens`` built with ``cp=CPConfig(...)``, ``hidden_states`` is this rank's
shard ``[1, T / W, D]`` and the layer runs FLA's CP-aware conv and gated delta rule with the fresh
``cp_context`` of ``seqlens.local()`` (same parameters; FLA exchanges conv history and states between
ranks). The gradients of the replicated parameters (``conv1d.weight`` included) are then this rank's
part: sum them over the CP group, as a data-parallel reduction over the CP ranks does.

The model-specific classes (:mod:`.qwen3_5_moe`, :mod:`.qwen3_8`) only choose the output gate.
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
)
from fla_ac_isolation.mixers._cp import check_cp_conv
from fla_ac_isolation.ops.backend import check_backend, check_saveable, resolve_backend
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]

_GATES = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then multiplied by ``activation(gate)``.

    Numerically the same as transformers' ``Qwen3_5MoeRMSNormGated`` / ``Qwen4ExpTextRMSNormGated``: the
    normalisation runs in float32, is cast back to the input dtype before the weight is applied, and the
    gate is applied in float32.

    Args:
        hidden_size: size of the normalised (last) dim, the value head dim.
        eps: added to the mean square. Default ``1e-6``.
        activation: ``"silu"`` (Qwen3.5) or ``"sigmoid"`` (Qwen3.8-Flash-Next). Default ``"silu"``.

    Raises:
        ValueError: unknown ``activation``.
    """

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
        config: a transformers text config with the Qwen3.5 linear-attention fields (a multimodal config
            is reduced to its text config).
        layer_idx: index of this layer in the decoder (kept as ``layer_idx``; ``layer_type`` is read
            from ``config.layer_types``).
        backend: ``"auto"`` (default: FLA kernels for CUDA inputs, reference elsewhere), ``"fla"`` or
            ``"reference"``.
        output_gate: activation of the output gate, ``"silu"`` or ``"sigmoid"``. Default ``"silu"``.
        saveable: route the conv and the gated delta rule through custom operators whose outputs a
            selective-AC policy can save (``ops(..., saveable=True)``; save them with
            :func:`fla_ac_isolation.policies.save_fla_ops`). Same parameters, same ``state_dict``.
            Default ``False``.

    Config fields read: ``hidden_size``, ``linear_num_key_heads`` (``H``), ``linear_num_value_heads``
    (``HV``), ``linear_key_head_dim`` (``K``), ``linear_value_head_dim`` (``V``),
    ``linear_conv_kernel_dim`` (``W``), ``hidden_act`` (conv activation), ``rms_norm_eps``,
    ``layer_types``.

    Parameters (names and shapes as transformers): ``in_proj_qkv.weight [2*H*K + HV*V, D]``,
    ``in_proj_z.weight [HV*V, D]``, ``in_proj_b.weight [HV, D]``, ``in_proj_a.weight [HV, D]``,
    ``conv1d.weight [2*H*K + HV*V, 1, W]``, ``dt_bias [HV]``, ``A_log [HV]``, ``norm.weight [V]``,
    ``out_proj.weight [D, HV*V]``.

    Raises:
        TypeError: ``saveable`` is not a bool.
        ValueError: unknown ``backend``; a missing config field; ``HV`` not a multiple of ``H``;
            ``hidden_act`` other than SiLU (FLA's conv offers only SiLU); unknown ``output_gate``;
            ``layer_idx`` outside ``config.layer_types``.
        TypeError: ``layer_idx`` is not an ``int`` (or ``None``).
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
        """Mix ``hidden_states [B, T, D]`` along time; returns ``[B, T, D]`` in the same dtype.

        Args:
            hidden_states: ``[B, T, D]``; ``B == 1`` when packed. Its dtype must be that of the weights
                (fp32 weights take fp32 input: nothing is cast) unless ``torch.autocast`` is active for its
                device, where autocast casts per op as in transformers. ``T == 0`` works when packed
                (zero-length documents) and is refused unpacked.
            seqlens: packed-document offsets for the whole model forward; this layer calls
                ``seqlens.local()`` here. ``None``: each batch row is one document.
            cu_seq_lens_q: transformers' packed keyword (``[N + 1]`` int offsets), used when ``seqlens``
                is ``None``; wrapped and localised the same way.
            max_length_q: transformers' longest-document keyword, used with ``cu_seq_lens_q``.
            attention_mask: ``None`` or a 2-D ``[B, T]`` padding mask (padded positions are zeroed first).
            cache: must be ``None`` (no cached decoding).
            cache_params: must be ``None``.
            past_key_values: must be ``None``.
            **kwargs: other transformers keywords (``position_ids``, ``cu_seq_lens_k``, ...) are ignored.

        Raises:
            ValueError: wrong hidden size or rank; packed input with ``B > 1``; token count differs from
                ``cu_seqlens[-1]``; offsets on another device; bad ``cu_seq_lens_q`` or attention mask;
                ``T == 0`` without offsets.
            TypeError: ``hidden_states`` not a float tensor, or (outside autocast) of another dtype than the
                weights, naming both; ``seqlens`` of the wrong type; non-integer offsets.
            NotImplementedError: a cache was passed; context parallelism with the reference backend or with
                ``saveable=True``.
        """
        reject_cache(cache=cache, cache_params=cache_params, past_key_values=past_key_values)
        batch, tokens = check_hidden_states(hidden_states, self.hidden_size, self.in_proj_qkv.weight)
        local = resolve_seqlens(
            seqlens, hidden_states,
            cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, seq_idx=kwargs.get("seq_idx"),
        )
        varlen = {
            "cu_seqlens": local.cu_seqlens if local is not None else None,
            "cu_seqlens_cpu": local.cu_seqlens_cpu if local is not None else None,
            "backend": resolve_backend(self.backend, hidden_states),
            "saveable": self.saveable,
        }
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
