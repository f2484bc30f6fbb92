"""Our path for the Mamba2 mixers (arXiv:2405.21060) of three libraries, packed-correct: transformers'
``NemotronHMamba2Mixer``, OLMo-core's ``NemotronMamba2Mixer`` (drops ``cu_doc_lens``) and flash-linear-attention's
``fla.layers.Mamba2`` (ignores ``cu_seqlens``). One projection ``in_proj`` -> output gate | ``x B C`` | ``dt``; the
short causal conv (+ bias) and SiLU, then the SSD scan (:func:`fla_ac_isolation.ops.ssd`, FLA's simple GLA on
CUDA), both restarted at every document with no host synchronisation (CUDA-graph capturable); the class's gated
RMSNorm; ``out_proj``. Under context parallelism transformers' class runs head-parallel
(:mod:`fla_ac_isolation.parallel.mamba2_cp`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from fla_ac_isolation import ops
from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens
from fla_ac_isolation.mixers.base import DropIn, apply_padding_mask
from fla_ac_isolation.ops.backend import resolve_backend

__all__ = ["FlaMamba2Path", "Mamba2Path", "NemotronHMamba2Path", "OlmoMamba2Path", "grouped_gated_rms_norm"]


def grouped_gated_rms_norm(y: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, group_size: int,
                           eps: float, norm_before_gate: bool = False) -> torch.Tensor:
    """``y [..., I]`` times ``silu(gate)`` (before the norm, or after with ``norm_before_gate``), RMS-normalised in
    groups of ``group_size`` channels, times ``weight [I]``; float32 inside, ``y``'s dtype out: FLA's
    ``RMSNormGated`` (no bias) in torch."""
    x = y.float()
    if gate is not None and not norm_before_gate:
        x = x * F.silu(gate.float())
    grouped = x.unflatten(-1, (-1, group_size))
    out = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        out = out * weight.float()
    if gate is not None and norm_before_gate:
        out = out * F.silu(gate.float())
    return out.to(y.dtype)


class Mamba2Path(DropIn):
    """The packed training path of a Mamba2 class (the class it is mixed into holds the parameters: ``in_proj``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``; widths ``num_heads`` (``H``), ``head_dim``
    (``P``), ``n_groups`` (``G``), ``ssm_state_size`` (``N``), ``intermediate_size``, ``conv_dim``).

    Raises (at construction or swap):
        ValueError: an activation other than SiLU; ``H`` not a multiple of ``G``.
    """

    def check_supported(self) -> None:
        if getattr(self, "activation", "silu") not in ("silu", "swish"):
            raise ValueError(f"the Mamba2 activation must be 'silu' (the conv activation FLA offers), got "
                             f"{self.activation!r}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")

    def dt_clamp(self) -> tuple[float, float]:
        """``(min, max)`` of the discretised time step, as the replaced class clamps it."""
        low, high = self.time_step_limit
        return float(low), float(high)

    def gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The class's gated RMSNorm of ``y [..., I]`` with ``gate [..., I]``."""
        return self.norm(y, gate)

    def split_projection(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``in_proj``'s output -> ``(gate [B, T, I], xbc [B, T, I + 2GN], dt [B, T, H])``."""
        return projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)

    def packed_forward(self, hidden_states: torch.Tensor, local: LocalSeqlens | None,
                       attention_mask: torch.Tensor | None, seqlens: PackedSeqlens | None) -> torch.Tensor:
        if seqlens is not None and seqlens.cp is not None:  # context parallelism: head-parallel
            from fla_ac_isolation.parallel.mamba2_cp import head_parallel_forward

            return head_parallel_forward(self, hidden_states, seqlens, attention_mask=attention_mask)
        batch, tokens = hidden_states.shape[:2]
        # every op gets this call's fresh offsets (local: cu_seqlens, its chunk schedule and first rows)
        kw = dict(seqlens=local, backend=resolve_backend(self.backend, hidden_states), saveable=self.saveable)
        dtype, groups_n = hidden_states.dtype, self.n_groups * self.ssm_state_size

        # 1. One projection, split into the output gate, the conv input (x, B, C) and the time step.
        hidden_states = apply_padding_mask(hidden_states, attention_mask)
        gate, xbc, dt = self.split_projection(self.in_proj(hidden_states))

        # 2. Short causal conv (with bias) + SiLU, restarted at every document.
        xbc = ops.causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu", **kw)
        xbc = apply_padding_mask(xbc, attention_mask)
        x, B, C = xbc.split([self.intermediate_size, groups_n, groups_n], dim=-1)

        # 3. SSD scan with per-document state reset; A < 0 in float32.
        y = ops.ssd(
            x.reshape(batch, tokens, self.num_heads, self.head_dim),        # [B, T, H, P]
            dt,                                                             # [B, T, H]
            -torch.exp(self.A_log.float()),                                 # [H]
            B.reshape(batch, tokens, self.n_groups, self.ssm_state_size),   # [B, T, G, N]
            C.reshape(batch, tokens, self.n_groups, self.ssm_state_size),   # [B, T, G, N]
            D=self.D, dt_bias=self.dt_bias, dt_limit=self.dt_clamp(), **kw,
        )

        # 4. The class's gated RMSNorm, output projection.
        y = self.gated_norm(y.reshape(batch, tokens, self.intermediate_size), gate)
        return self.out_proj(y.to(dtype))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.n_groups}, "
                f"state={self.ssm_state_size}, " + super().extra_repr())


class NemotronHMamba2Path(Mamba2Path):
    """transformers' ``NemotronHMamba2Mixer``: its ``time_step_limit`` (5.25: ``config.time_step_limit``; before:
    ``(time_step_min, inf)``), its ``NemotronHRMSNormGated``."""


class OlmoMamba2Path(Mamba2Path):
    """OLMo-core 3.0's ``NemotronMamba2Mixer``: ``forward(x, *, attention_mask=None, cu_doc_lens=, max_doc_len=)``;
    with ``cu_doc_lens`` over the flattened batch (``0`` to ``B * T``) the rows are one packed sequence (flattened
    here, restored after). dt clamped at ``time_step_min``; no cache."""

    def dt_clamp(self) -> tuple[float, float]:
        return float(self.time_step_min), math.inf

    def split_projection(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # OLMo-core splits off two leading MLP parts it does not use (d_mlp wide each; 0 unless configured)
        d_mlp = (projected.shape[-1] - self.intermediate_size - self.conv_dim - self.num_heads) // 2
        _, _, gate, xbc, dt = projected.split(
            [d_mlp, d_mlp, self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        return gate, xbc, dt

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        flatten = kwargs.get("cu_doc_lens") is not None and hidden_states.dim() == 3 and hidden_states.shape[0] > 1
        if not flatten:
            return super().forward(hidden_states, *args, **kwargs)
        batch, tokens = hidden_states.shape[:2]
        mask = kwargs.get("attention_mask")
        if mask is not None:
            kwargs["attention_mask"] = mask.reshape(1, batch * tokens)
        out = super().forward(hidden_states.reshape(1, batch * tokens, -1), *args, **kwargs)
        return out.reshape(batch, tokens, -1)


class FlaMamba2Path(Mamba2Path):
    """flash-linear-attention 0.6's ``fla.layers.Mamba2``: returns ``(out, None, past_key_values)``; its ``dt_limit``;
    its ``RMSNormGated`` on the ``fla`` backend (a pure-torch one of the same maths on the reference backend), or
    with ``rmsnorm=False`` ``y * silu(gate)``; an empty input returned as is, as FLA's layer does.

    Raises (at construction or swap):
        NotImplementedError: ``D_has_hdim=True`` (``D [H * P]``).
    """

    def check_supported(self) -> None:
        super().check_supported()
        if self.D_has_hdim:
            raise NotImplementedError("the Mamba2 drop-in takes D [num_heads] only (D_has_hdim=False); got "
                                      "D_has_hdim=True")

    def dt_clamp(self) -> tuple[float, float]:
        low, high = self.dt_limit
        return float(low), float(high)

    def gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.norm is None:  # rmsnorm=False
            return y * F.silu(gate)
        if resolve_backend(self.backend, y) == "fla":
            return self.norm(y, gate)
        return grouped_gated_rms_norm(y, gate, self.norm.weight, self.intermediate_size // self.n_groups,
                                      self.norm_eps, self.norm_before_gate)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if hidden_states.dim() == 3 and hidden_states.shape[1] == 0 and not any(
                kwargs.get(k) is not None for k in ("seqlens", "cu_seqlens")):
            return hidden_states, None, kwargs.get("past_key_values")
        return super().forward(hidden_states, *args, **kwargs)

    def wrap_output(self, out: torch.Tensor, bound: dict[str, Any]) -> tuple[torch.Tensor, None, Any]:
        return out, None, bound.get("past_key_values")

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.rmsnorm else ", rmsnorm=False")
