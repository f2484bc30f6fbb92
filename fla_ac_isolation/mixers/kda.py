"""The Kimi Delta Attention (KDA, arXiv:2510.26692) mixer of Kimi-Linear, GLM-5-next and Bailing hybrid: transformers'
three classes (same maths and names, different forget gates) with the conv and KDA restarted at every offset.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
from fla_ac_isolation.ops.backend import check_backend, check_saveable
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = [
    "BailingHybridDeltaAttention",
    "FullRankForgetGate",
    "Glm5NextTextLinearAttention",
    "KimiDeltaAttention",
    "KimiLinearDeltaAttention",
    "LowRankForgetGate",
    "SigmoidGatedRMSNorm",
]


def _init_decay(A_log: torch.Tensor, dt_bias: torch.Tensor, zero_A_log: bool = False) -> None:
    """transformers' forget-gate initialisation of ``A_log`` (zero for GLM-5-next's bounded gate) and ``dt_bias``."""
    with torch.no_grad():
        A_log.copy_(torch.zeros_like(A_log) if zero_A_log else torch.empty_like(A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class LowRankForgetGate(nn.Module):
    """Kimi-Linear's and GLM-5-next's forget gate (``KimiLinearForgetGate`` / ``Glm5NextTextForgetGate``):
    ``[B, T, D]`` -> log decay ``[B, T, H, K]`` float32, bounded by ``lower_bound`` when given (GLM-5-next).

    Parameters: ``f_a_proj.weight [K, D]``, ``f_b_proj.weight [H*K, K]``, ``dt_bias [H*K]`` float32, ``A_log``:
    ``[H]`` float32 with ``per_head_A_log`` (GLM-5-next), else ``[1, 1, H, 1]`` in the default dtype (Kimi-Linear).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, per_head_A_log: bool,
                 lower_bound: float | None = None) -> None:
        super().__init__()
        self.head_dim, self.num_heads = head_dim, num_heads
        self.qkv_dim = head_dim * num_heads
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.qkv_dim, dtype=torch.float32))
        shape = (num_heads,) if per_head_A_log else (1, 1, num_heads, 1)
        self.A_log = nn.Parameter(torch.empty(shape, dtype=torch.float32 if per_head_A_log else None))
        self.safe_gate_lower_bound = lower_bound
        _init_decay(self.A_log, self.dt_bias, zero_A_log=lower_bound is not None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (*hidden_states.shape[:2], self.num_heads, self.head_dim)
        x = (self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias.float().view(1, 1, -1)).view(shape)
        rate = self.A_log.float().view(1, 1, self.num_heads, 1).exp()
        if self.safe_gate_lower_bound is not None:
            return self.safe_gate_lower_bound * torch.sigmoid(rate * x)
        return -rate * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


class FullRankForgetGate(nn.Module):
    """Bailing hybrid's forget gate (``BailingHybridForgetGate``): ``[B, T, D]`` -> log decay ``[B, T, H, K]`` in the
    input dtype, bounded by ``lower_bound`` when ``safe_gate``. Parameters: ``A_log [H]`` float32, ``dt_bias [H*K]``
    float32, ``f_proj.weight [H*K, D]``."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, safe_gate: bool,
                 lower_bound: float) -> None:
        super().__init__()
        self.head_dim, self.num_heads = head_dim, num_heads
        self.qkv_dim = head_dim * num_heads
        self.safe_gate, self.lower_bound = safe_gate, lower_bound
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.qkv_dim, dtype=torch.float32))
        self.f_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        _init_decay(self.A_log, self.dt_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (*hidden_states.shape[:2], self.num_heads, self.head_dim)
        x = self.f_proj(hidden_states).float().view(shape) + self.dt_bias.view(1, 1, self.num_heads, self.head_dim)
        rate = self.A_log.exp().view(1, 1, self.num_heads, 1)
        gate = self.lower_bound * torch.sigmoid(rate * x) if self.safe_gate else -rate * F.softplus(x)
        return gate.to(hidden_states.dtype)


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over the last dim ``K`` times ``sigmoid(gate)``, numerically transformers' ``KimiLinearRMSNormGated``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.activation = "sigmoid"

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., K]``, ``gate`` of the same shape -> same shape, dtype of ``hidden_states``."""
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x * torch.sigmoid(gate.float())).to(hidden_states.dtype)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention mixer with packed-sequence isolation; the base of the three drop-ins.

    Args:
        config: a transformers text config with ``hidden_size`` (``D``), ``linear_num_heads`` (``H``),
            ``linear_head_dim`` (``K``), ``linear_conv_kernel_dim`` (``W``), ``hidden_act``, ``rms_norm_eps``
            and optionally ``layer_types``.
        layer_idx: index of this layer in the decoder.
        backend: ``"auto"`` (FLA kernels for CUDA inputs, reference elsewhere), ``"fla"`` or ``"reference"``.
        forget_gate: ``(D, H, K)`` -> a module ``[B, T, D]`` -> log decay ``[B, T, H, K]``; default Kimi-Linear's.
        low_rank_output_gate: ``g_b_proj(g_a_proj(h))`` before ``o_norm`` (Kimi, GLM-5-next); ``False``:
            ``g_proj(h)`` after ``o_proj`` (Bailing); registered so ``state_dict()`` order matches transformers.
        conv_dtype: dtype ``conv1d`` computes in (``None``: the default dtype); returns the input dtype.
        saveable: must be ``False`` (no KDA custom operator yet).

    Parameters (as transformers): ``q_proj``, ``k_proj``, ``v_proj`` ``[H*K, D]``, ``conv1d [3*H*K, 1, W]``,
    ``forget_gate.*``, ``b_proj [H, D]``, ``g_a_proj [K, D]`` + ``g_b_proj [H*K, K]`` or ``g_proj [H*K, D]``,
    ``o_norm [K]``, ``o_proj [D, H*K]``.

    Raises:
        ValueError: unknown ``backend``; a missing config field; non-SiLU ``hidden_act``; a bad ``layer_idx``.
        TypeError: ``layer_idx`` not an ``int`` (or ``None``); ``saveable`` not a bool.
        NotImplementedError: ``saveable=True``.
    """

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        *,
        backend: str = "auto",
        forget_gate: Callable[[int, int, int], nn.Module] | None = None,
        low_rank_output_gate: bool = True,
        conv_dtype: torch.dtype | None = None,
        saveable: bool = False,
    ) -> None:
        super().__init__()
        config = text_config(config)
        self.backend = check_backend(backend)
        self.saveable = check_saveable(saveable)
        if saveable:
            raise NotImplementedError(
                "saveable=True is not implemented for Kimi Delta Attention: FLA's chunk_kda is not wrapped as a "
                "custom operator here; use saveable=False (the mixer still isolates its offsets)"
            )
        self.hidden_size = config_field(config, "hidden_size")
        self.num_heads = config_field(config, "linear_num_heads")
        self.head_dim = config_field(config, "linear_head_dim")
        self.qkv_dim = self.head_dim * self.num_heads
        self.conv_kernel_size = config_field(config, "linear_conv_kernel_dim")
        self.layer_idx = layer_idx
        self.activation = config_field(config, "hidden_act")
        self.layer_norm_epsilon = config_field(config, "rms_norm_eps")
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' (the conv activation FLA offers), got {self.activation!r}")
        self.layer_type = layer_type(config, layer_idx)
        if forget_gate is None:
            def forget_gate(d: int, h: int, k: int) -> nn.Module:
                return LowRankForgetGate(d, h, k, per_head_A_log=False)

        self.q_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.conv_dim = 3 * self.qkv_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                padding=self.conv_kernel_size - 1, bias=False, dtype=conv_dtype)
        self.forget_gate = forget_gate(self.hidden_size, self.num_heads, self.head_dim)
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.low_rank_output_gate = low_rank_output_gate
        if low_rank_output_gate:
            self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, eps=self.layer_norm_epsilon)
        self.o_proj = nn.Linear(self.qkv_dim, self.hidden_size, bias=False)
        if not low_rank_output_gate:
            self.g_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)

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
        for ``seqlens`` built with ``cp=``.
        """
        reject_cache(cache=cache, cache_params=cache_params, past_key_values=past_key_values)
        batch, tokens = check_hidden_states(hidden_states, self.hidden_size, self.q_proj.weight)
        local = resolve_seqlens(
            seqlens, hidden_states,
            cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, seq_idx=kwargs.get("seq_idx"),
        )
        if local is not None and local.cp_context is not None:
            raise NotImplementedError(
                f"{type(self).__name__} has no context-parallel path: pass seqlens built without cp= "
                "(whole sequences on every rank)"
            )
        varlen = varlen_kwargs(local, self.backend, hidden_states)
        hidden_states = apply_padding_mask(hidden_states, attention_mask)
        heads = (batch, tokens, self.num_heads, self.head_dim)

        # 1-2. q, k, v through one short causal conv + SiLU, restarted at every document.
        qkv = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
        qkv = ops.causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation,
                                chunk_indices=local.chunk_indices if local is not None else None, **varlen)
        query, key, value = (x.reshape(heads) for x in qkv.split([self.qkv_dim] * 3, dim=-1))   # [B, T, H, K]

        # 3-4. Gates: log decay per key channel [B, T, H, K]; write strength beta in (0, 1) [B, T, H].
        g = self.forget_gate(hidden_states)
        beta = torch.sigmoid(self.b_proj(hidden_states))

        # 5. Kimi Delta Attention (q, k L2-normalised inside), zero state at every document start.
        core = ops.chunk_kda(query, key, value, g, beta, use_qk_l2norm_in_kernel=True, **varlen)

        # 6. Per-head RMSNorm with the sigmoid output gate, output projection.
        low_rank = self.low_rank_output_gate
        gate = self.g_b_proj(self.g_a_proj(hidden_states)) if low_rank else self.g_proj(hidden_states)
        core = self.o_norm(core, gate.reshape(heads))
        return self.o_proj(core.reshape(batch, tokens, self.qkv_dim))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend!r}"


class KimiLinearDeltaAttention(KimiDeltaAttention):
    """Drop-in for transformers' ``KimiLinearDeltaAttention`` (``KimiLinearConfig``): softplus forget gate with
    ``A_log [1, 1, H, 1]``, low-rank output gate; otherwise :class:`KimiDeltaAttention`."""

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        super().__init__(config, layer_idx, backend=backend, saveable=saveable)


class Glm5NextTextLinearAttention(KimiDeltaAttention):
    """Drop-in for transformers' ``Glm5NextTextLinearAttention``: ``A_log [H]`` and ``conv1d`` in float32, the gate
    bounded by ``config.linear_lower_bound`` (``ValueError`` when missing); otherwise :class:`KimiDeltaAttention`."""

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        bound = config_field(text_config(config), "linear_lower_bound")

        def gate(d: int, h: int, k: int) -> nn.Module:
            return LowRankForgetGate(d, h, k, per_head_A_log=True, lower_bound=bound)

        super().__init__(config, layer_idx, backend=backend, forget_gate=gate, conv_dtype=torch.float32,
                         saveable=saveable)


class BailingHybridDeltaAttention(KimiDeltaAttention):
    """Drop-in for transformers' ``BailingHybridDeltaAttention``: full-rank gates (:class:`FullRankForgetGate`,
    ``g_proj``), ``conv1d`` in float32, ``kda_safe_gate``/``kda_lower_bound`` required (``ValueError`` when missing);
    otherwise :class:`KimiDeltaAttention`."""

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        text = text_config(config)
        safe, bound = config_field(text, "kda_safe_gate"), config_field(text, "kda_lower_bound")

        def gate(d: int, h: int, k: int) -> nn.Module:
            return FullRankForgetGate(d, h, k, safe_gate=safe, lower_bound=bound)

        super().__init__(config, layer_idx, backend=backend, forget_gate=gate, low_rank_output_gate=False,
                         conv_dtype=torch.float32, saveable=saveable)
