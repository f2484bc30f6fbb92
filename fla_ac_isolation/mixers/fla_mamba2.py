"""Drop-in for FLA's ``fla.layers.Mamba2``, which ignores ``cu_seqlens`` (``docs/models/fla_mamba2.md``):
:class:`~fla_ac_isolation.mixers.NemotronHMamba2Mixer` with FLA's config names, gated norm and call convention.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fla_ac_isolation.mixers.nemotron_h import GroupedGatedRMSNorm, NemotronHMamba2Mixer
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["FlaGatedRMSNorm", "FlaMamba2"]

_FIELDS = ("hidden_size", "num_heads", "head_dim", "state_size", "expand", "n_groups", "conv_kernel",
           "use_conv_bias", "hidden_act", "D_has_hdim", "rmsnorm", "norm_before_gate", "dt_limit", "use_bias",
           "norm_eps", "chunk_size")
_INIT_FIELDS = {"A_init_range": (1, 16), "dt_min": 0.001, "dt_max": 0.1, "dt_init_floor": 1e-4}


class FlaGatedRMSNorm(GroupedGatedRMSNorm):
    """FLA's ``RMSNormGated`` (no bias) in torch: grouped RMS norm of ``x [..., I]`` with ``silu(z)`` applied before or,
    with ``norm_before_gate``, after it; float32 throughout, cast to ``x``'s dtype."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__(hidden_size, group_size, eps)
        self.register_parameter("bias", None)  # FLA's slot (always None there): the module declares the same names
        self.norm_before_gate = norm_before_gate

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [..., I]``, ``gate [..., I]`` or ``None`` -> ``[..., I]``, dtype of ``hidden_states``."""
        dtype = hidden_states.dtype
        x = hidden_states.float()
        if gate is not None and not self.norm_before_gate:
            x = x * F.silu(gate.float())
        grouped = x.unflatten(-1, (-1, self.group_size))
        out = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)
        out = out * self.weight.float()
        if gate is not None and self.norm_before_gate:
            out = out * F.silu(gate.float())
        return out.to(dtype)


class _SiluGate(nn.Module):
    """FLA's ``rmsnorm=False`` output: ``y * silu(gate)`` (no parameters)."""

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return hidden_states * F.silu(gate)


class FlaMamba2(NemotronHMamba2Mixer):
    """Our Mamba2 with flash-linear-attention's interface; replaces ``fla.layers.Mamba2`` (FLA 0.6). ``layer_idx``,
    ``backend`` and ``saveable`` as :class:`~fla_ac_isolation.mixers.NemotronHMamba2Mixer`.

    Args:
        config: with ``fla.models.Mamba2Config``'s fields (:meth:`config_from` reads them off an FLA layer):
            ``hidden_size``, ``num_heads`` (``None``/0: ``expand * D // head_dim``), ``head_dim``, ``state_size``,
            ``expand``, ``n_groups``, ``conv_kernel``, ``use_conv_bias``, ``hidden_act``, ``D_has_hdim``, ``rmsnorm``,
            ``norm_before_gate``, ``dt_limit`` (``(lo, hi)``), ``use_bias``, ``norm_eps``, ``chunk_size``.

    Parameters: FLA's names, shapes and ``state_dict`` order (``norm.weight`` only if ``rmsnorm``), initialised as
    FLA's constructor does (:meth:`init_fla_weights`). The SSD chunks by 64 tokens (FLA: 256): equal up to rounding.

    Raises:
        ValueError: a missing field; ``expand * hidden_size`` not ``num_heads * head_dim`` or not a multiple of
            ``head_dim``; ``num_heads`` not a multiple of ``n_groups``; non-SiLU ``hidden_act``; a bad ``dt_limit``.
        NotImplementedError: ``D_has_hdim=True``.
    """

    def __init__(self, config: Any, layer_idx: int | None = None, *, backend: str = "auto",
                 saveable: bool = False) -> None:
        missing = [name for name in _FIELDS if not hasattr(config, name)]
        if missing:
            raise ValueError(f"config ({type(config).__name__}) has no field(s) {missing}, which FlaMamba2 needs")
        hidden, head_dim = config.hidden_size, config.head_dim
        intermediate = int(config.expand * hidden)
        if intermediate % head_dim:
            raise ValueError(f"expand * hidden_size ({intermediate}) must be a multiple of head_dim ({head_dim})")
        heads = config.num_heads or intermediate // head_dim
        if heads * head_dim != intermediate:
            raise ValueError(f"num_heads * head_dim ({heads * head_dim}) must equal expand * hidden_size "
                             f"({intermediate})")
        if config.D_has_hdim:
            raise NotImplementedError("FlaMamba2 takes D [num_heads] only (D_has_hdim=False); got D_has_hdim=True")
        low, high = _dt_limit(config.dt_limit)
        nemotron = types.SimpleNamespace(
            hidden_size=hidden, mamba_num_heads=heads, mamba_head_dim=head_dim, n_groups=config.n_groups,
            ssm_state_size=config.state_size, conv_kernel=config.conv_kernel, use_conv_bias=config.use_conv_bias,
            use_bias=config.use_bias, mamba_hidden_act=config.hidden_act, chunk_size=config.chunk_size,
            time_step_min=low, layer_norm_epsilon=config.norm_eps,
        )
        super().__init__(nemotron, layer_idx, initialize_mixer_weights=False, backend=backend, saveable=saveable)
        self.config = config
        self.time_step_limit = (low, high)
        self.rmsnorm, self.norm_before_gate = bool(config.rmsnorm), bool(config.norm_before_gate)
        self.norm = (FlaGatedRMSNorm(intermediate, intermediate // config.n_groups, config.norm_eps,
                                     self.norm_before_gate) if self.rmsnorm else _SiluGate())
        if self.dt_bias.device.type != "meta":
            self.init_fla_weights()

    @staticmethod
    def config_from(upstream: nn.Module) -> types.SimpleNamespace:
        """The configuration of an FLA 0.6 ``Mamba2`` layer, read from its attributes."""
        return types.SimpleNamespace(
            hidden_size=upstream.hidden_size, num_heads=upstream.num_heads, head_dim=upstream.head_dim,
            state_size=upstream.ssm_state_size, expand=upstream.expand, n_groups=upstream.n_groups,
            conv_kernel=upstream.conv_kernel_size, use_conv_bias=upstream.use_conv_bias,
            hidden_act=upstream.activation, D_has_hdim=upstream.D_has_hdim, rmsnorm=upstream.rmsnorm,
            norm_before_gate=upstream.norm_before_gate, dt_limit=tuple(upstream.dt_limit),
            use_bias=upstream.use_bias, norm_eps=upstream.norm_eps, chunk_size=upstream.chunk_size,
            A_init_range=tuple(upstream.A_init_range), dt_min=upstream.dt_min, dt_max=upstream.dt_max,
        )

    @torch.no_grad()
    def init_fla_weights(self) -> None:
        """FLA's initialisation of ``A_log``, ``D`` and ``dt_bias`` (config's ``A_init_range``, ``dt_min``, ...)."""
        get = {name: getattr(self.config, name, default) for name, default in _INIT_FIELDS.items()}
        device = self.A_log.device
        self.A_log.copy_(torch.empty(self.num_heads, device=device).uniform_(*get["A_init_range"]).log())
        self.D.fill_(1.0)
        log_min, log_max = math.log(get["dt_min"]), math.log(get["dt_max"])
        dt = torch.exp(torch.rand(self.num_heads, device=device) * (log_max - log_min) + log_min)
        dt = dt.clamp(min=get["dt_init_floor"])
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        *,
        seqlens: LayerLocalSeqlens | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None, Any]:
        """``[B, T, D]`` -> ``(out [B, T, D], None, past_key_values)``, as FLA's layer returns; offsets from ``seqlens``
        or FLA's ``cu_seqlens``/``max_seqlen``, otherwise as :meth:`NemotronHMamba2Mixer.forward`.

        Raises:
            NotImplementedError: ``use_cache`` or ``past_key_values`` given.
        """
        if use_cache or past_key_values is not None:
            raise NotImplementedError("FlaMamba2 does not implement cached decoding: call the model with "
                                      "use_cache=False (and no past_key_values)")
        if hidden_states.shape[1] == 0 and seqlens is None and cu_seqlens is None:
            return hidden_states, None, past_key_values  # FLA's layer returns an empty input as is
        out = super().forward(hidden_states, seqlens, cu_seq_lens_q=cu_seqlens, max_length_q=max_seqlen,
                              attention_mask=attention_mask, **kwargs)
        return out, None, past_key_values

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.rmsnorm else ", rmsnorm=False")


def _dt_limit(value: Any) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit must be two numbers (lo, hi), got {value!r}") from None
    if not low <= high:
        raise ValueError(f"dt_limit must have lo <= hi, got {value!r}")
    return low, high
