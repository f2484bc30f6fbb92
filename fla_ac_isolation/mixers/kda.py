"""The Kimi Delta Attention (KDA) token mixer of Kimi-Linear, GLM-5-next and Bailing hybrid, packed-correct.

Kimi Delta Attention (Kimi Team, 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture",
arXiv:2510.26692) is the gated delta rule with a decay per key channel. transformers 5.24 ships it three
times with the same maths and parameter names, differing only in the forget gate (read in
``transformers/models/{kimi_linear,glm5_next,bailing_hybrid}/modeling_*.py``):

1. projections ``q_proj``, ``k_proj``, ``v_proj`` (no bias), concatenated;
2. one depthwise causal conv (``conv1d``, no bias) + SiLU over the ``3 * H * K`` channels, split back;
3. the forget gate ``forget_gate`` -> log decay ``g [B, T, H, K]`` (:class:`LowRankForgetGate` for Kimi and
   GLM-5-next, :class:`FullRankForgetGate` for Bailing);
4. ``beta = sigmoid(b_proj(h))``;
5. KDA with q and k L2-normalised inside and scale ``K ** -0.5`` (:func:`fla_ac_isolation.ops.chunk_kda`);
6. a sigmoid-gated RMSNorm per head (``o_norm``, :class:`SigmoidGatedRMSNorm`) with the output gate
   ``g_b_proj(g_a_proj(h))`` (Bailing: ``g_proj(h)``), then ``o_proj``.

What differs from transformers: packed documents are kept apart. transformers' kernel wrapper hands FLA's
``chunk_kda`` only FLA's own parameter names, so ``cu_seq_lens_q`` never reaches it, and its torch conv
ignores document bounds: a packed document's output depends on the documents before it. Here the conv and
KDA restart at every ``cu_seqlens`` offset, and each call takes this layer's own offsets through
:meth:`~fla_ac_isolation.LayerLocalSeqlens.local` inside ``forward``, which it must: a KDA layer that hands
FLA one ``cu_seqlens`` object shared by checkpointed layers inherits FLA's cache fault (bf16, a policy
saving every ``_to_copy``: ``Autograd not support dtype: Int``). The backend is explicit (``fla`` kernels
on CUDA, the pure-torch ``reference`` elsewhere). Cached generation and context parallelism are refused.

The model-specific classes (:class:`KimiLinearDeltaAttention`, :class:`Glm5NextTextLinearAttention`,
:class:`BailingHybridDeltaAttention`) only choose the gates and the dtypes transformers forces.
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
)
from fla_ac_isolation.ops.backend import check_backend, check_saveable, resolve_backend
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


# ---------------------------------------------------------------------------------------------- gates
def _init_decay(A_log: torch.Tensor, dt_bias: torch.Tensor, zero_A_log: bool = False) -> None:
    """transformers' ``_init_weights`` of the forget gates (FLA's): ``A = U(1, 16)`` (GLM-5-next with a lower
    bound: ``A_log = 0``), ``dt_bias = softplus^-1(exp(U(log 1e-3, log 1e-1)))``."""
    with torch.no_grad():
        A_log.copy_(torch.zeros_like(A_log) if zero_A_log else torch.empty_like(A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class LowRankForgetGate(nn.Module):
    """Kimi-Linear's and GLM-5-next's forget gate: hidden states ``[B, T, D]`` -> log decay ``[B, T, H, K]`` float32.

    ``x = f_b_proj(f_a_proj(h)) + dt_bias`` (in float32, per head and key channel), then
    ``-exp(A_log) * softplus(x)`` (softplus as ``log(1 + exp(x))``, ``x`` above 20 kept), or, with a
    ``lower_bound``, ``lower_bound * sigmoid(exp(A_log) * x)`` (GLM-5-next's bounded gate).

    Follows ``KimiLinearForgetGate`` / ``Glm5NextTextForgetGate`` (transformers 5.24).

    Args:
        hidden_size: ``D``.
        num_heads: ``H``.
        head_dim: ``K``.
        per_head_A_log: ``A_log`` is ``[H]`` float32 (GLM-5-next); ``False``: ``[1, 1, H, 1]`` in the
            default dtype (Kimi-Linear).
        lower_bound: GLM-5-next's ``linear_lower_bound``; ``None`` for the softplus gate.

    Parameters: ``f_a_proj.weight [K, D]``, ``f_b_proj.weight [H*K, K]``, ``dt_bias [H*K]`` float32, ``A_log``.
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
    """Bailing hybrid's forget gate: hidden states ``[B, T, D]`` -> log decay ``[B, T, H, K]`` in their dtype.

    ``x = f_proj(h) + dt_bias`` (float32), then ``lower_bound * sigmoid(exp(A_log) * x)`` when ``safe_gate``
    (Bailing's default, ``kda_lower_bound = -5``), else ``-exp(A_log) * softplus(x)``; cast to the dtype of
    the hidden states as transformers does. Follows ``BailingHybridForgetGate`` (transformers 5.24).

    Args:
        hidden_size: ``D``.
        num_heads: ``H``.
        head_dim: ``K``.
        safe_gate: the config's ``kda_safe_gate``.
        lower_bound: the config's ``kda_lower_bound``.

    Parameters: ``A_log [H]`` float32, ``dt_bias [H*K]`` float32, ``f_proj.weight [H*K, D]``.
    """

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
    """RMSNorm over the last dim times ``sigmoid(gate)``, all in float32, cast back to the input dtype.

    Numerically transformers' ``KimiLinearRMSNormGated`` (and GLM-5-next's, Bailing's): unlike the Qwen
    norm, the weight is applied in float32 before the cast.

    Args:
        hidden_size: size of the normalised (last) dim, the head dim ``K``.
        eps: added to the mean square. Default ``1e-6``.
    """

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


# ---------------------------------------------------------------------------------------------- mixer
class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention mixer with packed-sequence isolation; the base of the three drop-ins.

    Args:
        config: a transformers text config with the KDA fields below.
        layer_idx: index of this layer in the decoder (kept as ``layer_idx``; ``layer_type`` is read from
            ``config.layer_types`` when it has one).
        backend: ``"auto"`` (default: FLA kernels for CUDA inputs, reference elsewhere), ``"fla"`` or
            ``"reference"``.
        forget_gate: builds the forget gate from ``(hidden_size, num_heads, head_dim)``: a module mapping
            ``[B, T, D]`` to the log decay ``[B, T, H, K]``. Default: Kimi-Linear's
            (:class:`LowRankForgetGate` with ``A_log [1, 1, H, 1]``, softplus).
        low_rank_output_gate: output gate ``g_b_proj(g_a_proj(h))`` registered before ``o_norm`` (Kimi,
            GLM-5-next); ``False``: ``g_proj(h)`` registered after ``o_proj`` (Bailing). Registration follows
            transformers, so ``state_dict()`` and ``parameters()`` list the same tensors in the same order.
        conv_dtype: dtype of ``conv1d`` (GLM-5-next and Bailing force float32; ``None``: the default dtype).
            The conv computes in it and returns the input dtype, as transformers' torch conv does.
        saveable: must be ``False``: KDA has no custom operator (``ops(..., saveable=True)``) yet. Taken so
            that code building every family's mixer with ``saveable=`` gets a clear refusal.

    Config fields read: ``hidden_size`` (``D``), ``linear_num_heads`` (``H``), ``linear_head_dim`` (``K``),
    ``linear_conv_kernel_dim`` (``W``), ``hidden_act`` (conv activation), ``rms_norm_eps``, ``layer_types``.

    Parameters (names and shapes as transformers): ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``
    ``[H*K, D]``, ``conv1d.weight [3*H*K, 1, W]``, ``forget_gate.*``, ``b_proj.weight [H, D]``, the output
    gate (``g_a_proj.weight [K, D]`` and ``g_b_proj.weight [H*K, K]``, or ``g_proj.weight [H*K, D]``),
    ``o_norm.weight [K]``, ``o_proj.weight [D, H*K]``.

    Raises:
        ValueError: unknown ``backend``; a missing config field; ``hidden_act`` other than SiLU (FLA's conv
            offers only SiLU); ``layer_idx`` outside ``config.layer_types``.
        TypeError: ``layer_idx`` is not an ``int`` (or ``None``); ``saveable`` is not a bool.
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
        """Mix ``hidden_states [B, T, D]`` along time; returns ``[B, T, D]`` in the same dtype.

        Args:
            hidden_states: ``[B, T, D]``; ``B == 1`` when packed. Its dtype must be that of the weights
                (``q_proj``) unless ``torch.autocast`` is active for its device. ``T == 0`` works when
                packed (zero-length documents) and is refused unpacked.
            seqlens: packed-document offsets for the whole model forward; this layer calls
                ``seqlens.local()`` here. ``None``: each batch row is one document.
            cu_seq_lens_q: transformers' packed keyword (``[N + 1]`` int offsets), used when ``seqlens`` is
                ``None``; wrapped and localised the same way.
            max_length_q: transformers' longest-document keyword, used with ``cu_seq_lens_q``.
            attention_mask: ``None`` or a 2-D ``[B, T]`` padding mask (padded positions are zeroed first).
            cache: must be ``None`` (no cached decoding).
            cache_params: must be ``None``.
            past_key_values: must be ``None``.
            **kwargs: other transformers keywords (``position_ids``, ``cu_seq_lens_k``, ``input_ids``, ...)
                are ignored.

        Raises:
            ValueError: wrong hidden size or rank; packed input with ``B > 1``; token count differs from
                ``cu_seqlens[-1]``; offsets on another device; bad ``cu_seq_lens_q`` or attention mask;
                ``T == 0`` without offsets; ``backend='fla'`` on CPU tensors outside Triton's interpreter.
            TypeError: ``hidden_states`` not a float tensor, or (outside autocast) of another dtype than the
                weights; ``seqlens`` of the wrong type; non-integer offsets.
            NotImplementedError: a cache was passed; ``seqlens`` built for context parallelism.
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
        varlen = {
            "cu_seqlens": local.cu_seqlens if local is not None else None,
            "cu_seqlens_cpu": local.cu_seqlens_cpu if local is not None else None,
            "backend": resolve_backend(self.backend, hidden_states),
        }
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


# ------------------------------------------------------------------------------------ the three drop-ins
class KimiLinearDeltaAttention(KimiDeltaAttention):
    """Drop-in for transformers' ``KimiLinearDeltaAttention`` (``transformers.models.kimi_linear``, config
    ``KimiLinearConfig``): softplus forget gate with ``A_log [1, 1, H, 1]``, low-rank output gate.

    Args:
        config: ``KimiLinearConfig``.
        layer_idx: index of the layer in the decoder.
        backend: ``"auto"`` | ``"fla"`` | ``"reference"`` (keyword only; default ``"auto"``).
        saveable: must be ``False`` (keyword only), see :class:`KimiDeltaAttention`.

    Shapes, config fields, parameters and errors: see :class:`KimiDeltaAttention`.
    ``forward(hidden_states [B, T, D], seqlens=None, *, cu_seq_lens_q=None, ...) -> [B, T, D]``.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        super().__init__(config, layer_idx, backend=backend, saveable=saveable)


class Glm5NextTextLinearAttention(KimiDeltaAttention):
    """Drop-in for transformers' ``Glm5NextTextLinearAttention`` (``transformers.models.glm5_next``, config
    ``Glm5NextTextConfig``): Kimi's layer with ``A_log [H]`` float32, a float32 ``conv1d`` and, when
    ``config.linear_lower_bound`` is set (default ``-5.0``), the bounded gate ``lower_bound * sigmoid(...)``.

    Args:
        config: ``Glm5NextTextConfig``; reads ``linear_lower_bound`` besides :class:`KimiDeltaAttention`'s fields.
        layer_idx: index of the layer in the decoder.
        backend: ``"auto"`` | ``"fla"`` | ``"reference"`` (keyword only; default ``"auto"``).
        saveable: must be ``False`` (keyword only), see :class:`KimiDeltaAttention`.

    Raises:
        ValueError: as :class:`KimiDeltaAttention`; ``linear_lower_bound`` missing.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        bound = config_field(text_config(config), "linear_lower_bound")

        def gate(d: int, h: int, k: int) -> nn.Module:
            return LowRankForgetGate(d, h, k, per_head_A_log=True, lower_bound=bound)

        super().__init__(config, layer_idx, backend=backend, forget_gate=gate, conv_dtype=torch.float32,
                         saveable=saveable)


class BailingHybridDeltaAttention(KimiDeltaAttention):
    """Drop-in for transformers' ``BailingHybridDeltaAttention`` (``transformers.models.bailing_hybrid``,
    config ``BailingHybridConfig``): full-rank gates (``forget_gate.f_proj``, ``g_proj``), ``A_log [H]`` and
    ``conv1d`` in float32, the bounded gate when ``kda_safe_gate`` (default) with ``kda_lower_bound``.

    Args:
        config: ``BailingHybridConfig``; reads ``kda_safe_gate`` and ``kda_lower_bound`` besides
            :class:`KimiDeltaAttention`'s fields.
        layer_idx: index of the layer in the decoder.
        backend: ``"auto"`` | ``"fla"`` | ``"reference"`` (keyword only; default ``"auto"``).
        saveable: must be ``False`` (keyword only), see :class:`KimiDeltaAttention`.

    Raises:
        ValueError: as :class:`KimiDeltaAttention`; ``kda_safe_gate`` or ``kda_lower_bound`` missing.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        text = text_config(config)
        safe, bound = config_field(text, "kda_safe_gate"), config_field(text, "kda_lower_bound")

        def gate(d: int, h: int, k: int) -> nn.Module:
            return FullRankForgetGate(d, h, k, safe_gate=safe, lower_bound=bound)

        super().__init__(config, layer_idx, backend=backend, forget_gate=gate, low_rank_output_gate=False,
                         conv_dtype=torch.float32, saveable=saveable)
