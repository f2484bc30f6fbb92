"""Drop-in for OLMo-core 3.0's ``NemotronMamba2Mixer``, whose torch SSD drops ``cu_doc_lens`` and is not causal
across its chunks (``docs/olmo-core.md``): :class:`~fla_ac_isolation.mixers.NemotronHMamba2Mixer` behind
OLMo-core's ``SequenceMixer`` interface.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from fla_ac_isolation.mixers.lending import lent_to_original
from fla_ac_isolation.mixers.nemotron_h import NemotronHMamba2Mixer

__all__ = ["OlmoNemotronMamba2Mixer"]

_OLMO_ORDER = ("in_proj", "conv1d", "norm", "out_proj")  # OLMo-core's registration order (state_dict order)


class OlmoNemotronMamba2Mixer(NemotronHMamba2Mixer):
    """Our Mamba2 with OLMo-core's ``SequenceMixer`` interface; replaces OLMo-core's ``NemotronMamba2Mixer``. Arguments
    as :class:`~fla_ac_isolation.mixers.NemotronHMamba2Mixer` (:meth:`config_from` builds ``config``).

    Parameters: OLMo-core's names, shapes and ``state_dict`` order, built empty: initialise with
    :meth:`init_weights` or share an OLMo-core module's tensors (:func:`~fla_ac_isolation.swap_mixers`). Equal to
    OLMo-core's up to rounding on inputs of at most one of its chunks (``softplus(dt + dt_bias)`` in float32 here).
    """

    def __init__(self, config: Any, layer_idx: int | None = None, *, backend: str = "auto") -> None:
        super().__init__(config, layer_idx, initialize_mixer_weights=False, backend=backend)
        modules = dict(self._modules)
        self._modules.clear()
        self._modules.update({name: modules[name] for name in _OLMO_ORDER})

    @staticmethod
    def config_from(upstream: nn.Module) -> types.SimpleNamespace:
        """The configuration of an OLMo-core 3.0 ``NemotronMamba2Mixer``, read from its attributes."""
        return types.SimpleNamespace(
            hidden_size=upstream.d_model, mamba_num_heads=upstream.num_heads, mamba_head_dim=upstream.head_dim,
            n_groups=upstream.n_groups, ssm_state_size=upstream.ssm_state_size,
            conv_kernel=upstream.conv_kernel_size, use_conv_bias=upstream.conv1d.bias is not None,
            use_bias=upstream.in_proj.bias is not None, mamba_hidden_act="silu", chunk_size=upstream.chunk_size,
            time_step_min=upstream.time_step_min, layer_norm_epsilon=upstream.norm.variance_epsilon,
        )

    def forward(
        self,
        x: torch.Tensor,
        cu_doc_lens: torch.Tensor | None = None,
        max_doc_len: int | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``, documents kept apart.

        Args:
            x: ``[B, T, D]``; with ``cu_doc_lens`` the rows are one packed sequence (flattened here, restored after).
            cu_doc_lens: OLMo-core's ``[N + 1]`` int32 offsets over the flattened batch (0 to ``B * T``).
            max_doc_len: the longest document.
            attention_mask: ``None`` or a ``[B, T]`` padding mask.
            **kwargs: OLMo-core's other block keywords, ignored.

        Raises:
            ValueError: invalid ``cu_doc_lens`` or one whose last offset is not the token count; a bad mask.
        """
        flatten = cu_doc_lens is not None and x.dim() == 3 and x.shape[0] > 1
        if flatten:
            batch, tokens = x.shape[:2]
            x = x.reshape(1, batch * tokens, x.shape[-1])
            attention_mask = None if attention_mask is None else attention_mask.reshape(1, batch * tokens)
        out = super().forward(x, cu_seq_lens_q=cu_doc_lens, max_length_q=max_doc_len, attention_mask=attention_mask)
        return out.reshape(batch, tokens, -1) if flatten else out

    @torch.no_grad()
    def init_weights(self, **kwargs: Any) -> None:
        """OLMo-core's own ``init_weights`` run on this module's tensors; ``RuntimeError`` unless made by
        :func:`~fla_ac_isolation.swap_mixers`."""
        with lent_to_original(self) as olmo:
            olmo.init_weights(**kwargs)

    def num_flops_per_token(self, seq_len: int) -> int:
        """0, as OLMo-core's class reports (its SSD is not counted)."""
        del seq_len
        return 0

    def apply_tp(self, *args: Any, **kwargs: Any) -> None:
        """Raises ``NotImplementedError``, as OLMo-core's class does."""
        raise NotImplementedError("Tensor parallelism is not implemented for OlmoNemotronMamba2Mixer")

    def apply_cp(self, *args: Any, **kwargs: Any) -> None:
        """Raises ``NotImplementedError``, as OLMo-core's class does."""
        raise NotImplementedError("Context parallelism is not implemented for OlmoNemotronMamba2Mixer")
