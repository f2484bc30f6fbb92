"""Drop-in for OLMo-core's ``NemotronMamba2Mixer``: our packed-correct Mamba2 behind OLMo-core's interface.

OLMo-core 3.0's ``olmo_core.nn.attention.recurrent.NemotronMamba2Mixer`` is transformers' Nemotron-H Mamba2
mixer, parameter for parameter (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
``out_proj``; same shapes), with a pure-torch SSD that

* drops ``cu_doc_lens`` (``del kwargs``): conv and scan run across packed documents;
* is not causal across its own chunks: the inter-chunk state sum runs over the *target* chunk axis
  (``recurrent.py:779``, ``(decay_chunk[..., None, None] * states_permuted[:, :, None, ...]).sum(dim=2)``),
  so any output before the last ``chunk_size``-token chunk depends on later tokens.

:class:`OlmoNemotronMamba2Mixer` is :class:`~fla_ac_isolation.mixers.NemotronHMamba2Mixer` (conv and scan
restarted at every document, ``cu_seqlens`` localised inside ``forward``) with OLMo-core's call convention
(``forward(x, cu_doc_lens=None, max_doc_len=None, **kwargs)``; ``B > 1`` packed rows are flattened, as
OLMo-core's ``KimiDeltaAttention`` does) and the rest of its ``SequenceMixer`` interface. It is what
:func:`~fla_ac_isolation.swap_mixers` puts in place of OLMo-core's class, on the same tensors.
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
    """Our Mamba2 with OLMo-core's ``SequenceMixer`` interface; replaces OLMo-core's ``NemotronMamba2Mixer``.

    Args:
        config: fields as read by :class:`~fla_ac_isolation.mixers.NemotronHMamba2Mixer`; for an OLMo-core
            module, :meth:`config_from` builds them from its attributes.
        layer_idx: the block index (``layer_idx`` of OLMo-core's module).
        backend: ``"auto"`` (default) | ``"fla"`` | ``"reference"``, keyword only.

    Parameters: OLMo-core's names, shapes and ``state_dict`` order (``dt_bias [H]``, ``A_log [H]``,
    ``D [H]``, ``in_proj.weight [I + E + H, D]``, ``conv1d.weight [E, 1, W]``, ``conv1d.bias [E]``,
    ``norm.weight [I]``, ``out_proj.weight [D, I]``). Built empty: initialise with :meth:`init_weights`
    (OLMo-core's own initialisation) or share an OLMo-core module's tensors (:func:`~fla_ac_isolation.swap_mixers`).

    Numerics against OLMo-core's class: equal up to rounding on inputs of at most its ``chunk_size`` tokens
    (one of its chunks); on longer ones OLMo-core's is not causal (module docstring) and this one is, so the
    numbers change even on unpacked batches. ``softplus(dt + dt_bias)`` runs in float32 here (OLMo-core: the
    parameter dtype), and the scan chunks by 64 tokens whatever ``chunk_size`` says.
    """

    def __init__(self, config: Any, layer_idx: int | None = None, *, backend: str = "auto") -> None:
        super().__init__(config, layer_idx, initialize_mixer_weights=False, backend=backend)
        modules = dict(self._modules)
        self._modules.clear()
        self._modules.update({name: modules[name] for name in _OLMO_ORDER})

    @staticmethod
    def config_from(upstream: nn.Module) -> types.SimpleNamespace:
        """The configuration of an OLMo-core 3.0 ``NemotronMamba2Mixer``, read from its attributes
        (``AttributeError`` else)."""
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
            x: ``[B, T, D]``; with ``cu_doc_lens`` the rows are one packed sequence, flattened to
                ``[1, B * T, D]`` here and restored after.
            cu_doc_lens: OLMo-core's ``[N + 1]`` int32 offsets over the flattened batch (0 to ``B * T``).
            max_doc_len: the longest document.
            attention_mask: ``None`` or a ``[B, T]`` padding mask.
            **kwargs: OLMo-core's other block keywords (rotary tables, ...), ignored as OLMo-core does.

        Raises:
            ValueError: invalid ``cu_doc_lens`` (as :class:`~fla_ac_isolation.LayerLocalSeqlens`), a token count
                other than ``cu_doc_lens[-1]``, a bad ``attention_mask``.
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
        """OLMo-core's own ``init_weights`` (same keywords), run by the replaced module on this one's tensors;
        ``RuntimeError`` when this module was not made by :func:`~fla_ac_isolation.swap_mixers`."""
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
