"""Drop-in for transformers' ``NemotronHMamba2Mixer`` (Mamba2, arXiv:2405.21060), correct on packed sequences.

Same parameters as transformers; the conv and the SSD scan (:func:`fla_ac_isolation.ops.ssd`) restart at every
``cu_seqlens`` offset, with no host synchronisation (CUDA-graph capturable: ``docs/graphs.md``). Under context
parallelism it runs head-parallel (:mod:`fla_ac_isolation.mixers.nemotron_h_cp`).
"""

from __future__ import annotations

import math
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

__all__ = ["GroupedGatedRMSNorm", "NemotronHMamba2Mixer"]


class GroupedGatedRMSNorm(nn.Module):
    """``y * silu(gate)``, RMS-normalised in groups of ``group_size`` channels, times ``weight [hidden_size]``;
    numerically transformers' ``NemotronHRMSNormGated``. ``ValueError`` if ``hidden_size % group_size``."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of group_size ({group_size})")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.group_size = group_size

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [..., I]``, ``gate [..., I]`` or ``None`` -> ``[..., I]`` (dtype of the weight product)."""
        input_dtype = hidden_states.dtype
        x = hidden_states.float()
        if gate is not None:
            x = x * F.silu(gate.float())
        grouped = x.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * grouped.flatten(-2).to(input_dtype)


def _time_step_limit(config: Any) -> tuple[float, float]:
    """The dt clamp of transformers' ``NemotronHMamba2Mixer``: ``(time_step_min, inf)`` up to transformers 5.24,
    ``config.time_step_limit`` from 5.25 (its modeling file changed; the config holds both fields in each)."""
    try:
        from importlib.metadata import version

        major, minor = (int(part) for part in version("transformers").split(".")[:2])
    except Exception:  # no transformers: the config is the user's own
        major, minor = 0, 0
    if (major, minor) >= (5, 25) and hasattr(config, "time_step_limit"):
        low, high = config.time_step_limit
        return float(low), float(high)
    return config_field(config, "time_step_min"), math.inf


class NemotronHMamba2Mixer(nn.Module):
    """Mamba2 mixer of Nemotron-H, packed-sequence safe; drop-in for transformers' class of that name.

    Args:
        config: ``NemotronHConfig``: ``hidden_size`` (``D``), ``mamba_num_heads`` (``H``), ``mamba_head_dim``
            (``P``), ``n_groups`` (``G``), ``ssm_state_size`` (``N``), ``conv_kernel`` (``W``),
            ``use_conv_bias``, ``use_bias``, ``mamba_hidden_act``, ``chunk_size`` (kept; both backends chunk
            by 64 tokens), ``time_step_min`` (transformers <= 5.24) or ``time_step_limit`` (>= 5.25: the dt clamp
            follows the installed transformers), ``layer_norm_epsilon``, ``layer_types``.
        layer_idx: index of the layer.
        initialize_mixer_weights: run :meth:`init_nemotron_h_weights`.
        backend: ``"auto"`` | ``"fla"`` | ``"reference"``.
        saveable: run the conv and the SSD scan as custom operators a SAC policy can save
            (:func:`fla_ac_isolation.policies.save_fla_ops`).

    Parameters (as transformers; ``I = H * P``, ``E = I + 2*G*N``): ``in_proj [I + E + H, D]``, ``conv1d [E, 1, W]``
    (+ bias), ``dt_bias``/``A_log``/``D [H]``, ``norm [I]``, ``out_proj [D, I]`` (biases if ``use_bias``).

    Raises:
        TypeError: ``saveable`` not a bool; ``layer_idx`` not an ``int`` (or ``None``).
        ValueError: unknown ``backend``; a missing config field; ``H`` not a multiple of ``G``;
            ``mamba_hidden_act`` other than SiLU; ``layer_idx`` outside ``config.layer_types``.
    """

    def __init__(
        self,
        config: Any,
        layer_idx: int | None = None,
        initialize_mixer_weights: bool = True,
        *,
        backend: str = "auto",
        saveable: bool = False,
    ) -> None:
        super().__init__()
        config = text_config(config)
        self.config = config
        self.backend = check_backend(backend)
        self.saveable = check_saveable(saveable)
        self.num_heads = config_field(config, "mamba_num_heads")
        self.hidden_size = config_field(config, "hidden_size")
        self.ssm_state_size = config_field(config, "ssm_state_size")
        self.conv_kernel_size = config_field(config, "conv_kernel")
        self.head_dim = config_field(config, "mamba_head_dim")
        self.intermediate_size = self.num_heads * self.head_dim
        self.layer_idx = layer_idx
        self.use_conv_bias = config_field(config, "use_conv_bias")
        self.activation = config_field(config, "mamba_hidden_act")
        self.n_groups = config_field(config, "n_groups")
        self.chunk_size = config_field(config, "chunk_size")
        self.time_step_limit = _time_step_limit(config)
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        if self.activation not in ("silu", "swish"):
            raise ValueError(
                f"mamba_hidden_act must be 'silu' (the conv activation FLA offers), got {self.activation!r}"
            )

        # Registration order follows transformers so that state_dict() lists the same keys in the same order.
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            bias=self.use_conv_bias,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
        )
        use_bias = config_field(config, "use_bias")
        projection_size = self.intermediate_size + self.conv_dim + self.num_heads  # gate | x B C | dt
        self.in_proj = nn.Linear(self.hidden_size, projection_size, bias=use_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GroupedGatedRMSNorm(
            self.intermediate_size,
            group_size=self.intermediate_size // self.n_groups,
            eps=config_field(config, "layer_norm_epsilon"),
        )
        self.D = nn.Parameter(torch.empty(self.num_heads))
        if initialize_mixer_weights and self.dt_bias.device.type != "meta":
            self.init_nemotron_h_weights()
        self.out_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=use_bias)

        self.layer_type = layer_type(config, layer_idx)

    @torch.no_grad()
    def init_nemotron_h_weights(self) -> None:
        """``A_log = log(1, 2, ..., H)``, ``D = 1``, ``dt_bias = 1`` (transformers' mixer initialisation)."""
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        self.dt_bias.fill_(1.0)

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
        """``[B, T, D]`` -> ``[B, T, D]``: the forward of :mod:`fla_ac_isolation.mixers` (the mask also zeroes the conv
        output). Under context parallelism also ``ValueError`` for ``H`` not divisible by the CP degree or a mask.
        """
        reject_cache(cache=cache, cache_params=cache_params, past_key_values=past_key_values)
        batch, tokens = check_hidden_states(hidden_states, self.hidden_size, self.in_proj.weight)
        if isinstance(seqlens, LayerLocalSeqlens) and seqlens.cp is not None:  # context parallelism
            from fla_ac_isolation.mixers.nemotron_h_cp import head_parallel_forward

            return head_parallel_forward(self, hidden_states, seqlens, attention_mask=attention_mask)
        local = resolve_seqlens(
            seqlens, hidden_states,
            cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, seq_idx=kwargs.get("seq_idx"),
        )
        varlen = varlen_kwargs(local, self.backend, hidden_states, saveable=self.saveable)
        chunk_indices = local.chunk_indices if local is not None else None  # FLA's chunk schedule, precomputed
        chunk_offsets = local.chunk_offsets if local is not None else None  # its first row per document
        dtype = hidden_states.dtype
        groups_n = self.n_groups * self.ssm_state_size

        # 1. One projection, split into the output gate, the conv input (x, B, C) and the time step.
        hidden_states = apply_padding_mask(hidden_states, attention_mask)
        gate, xbc, dt = self.in_proj(hidden_states).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )                                                                   # [B,T,I], [B,T,I+2GN], [B,T,H]

        # 2. Short causal conv (with bias) + SiLU, restarted at every document.
        xbc = ops.causal_conv1d(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation,
            chunk_indices=chunk_indices, **varlen,
        )
        xbc = apply_padding_mask(xbc, attention_mask)
        x, B, C = xbc.split([self.intermediate_size, groups_n, groups_n], dim=-1)

        # 3. SSD scan with per-document state reset; A < 0 in float32.
        A = -torch.exp(self.A_log.float())                                  # [H]
        y = ops.ssd(
            x.reshape(batch, tokens, self.num_heads, self.head_dim),        # [B, T, H, P]
            dt,                                                             # [B, T, H]
            A,
            B.reshape(batch, tokens, self.n_groups, self.ssm_state_size),   # [B, T, G, N]
            C.reshape(batch, tokens, self.n_groups, self.ssm_state_size),   # [B, T, G, N]
            D=self.D,
            dt_bias=self.dt_bias,
            dt_limit=self.time_step_limit,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
            **varlen,
        )

        # 4. Gated grouped RMSNorm, output projection.
        y = self.norm(y.reshape(batch, tokens, self.intermediate_size), gate)
        return self.out_proj(y.to(dtype))

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.n_groups}, "
            f"state={self.ssm_state_size}, backend={self.backend!r}"
            + (", saveable=True" if self.saveable else "")
        )
