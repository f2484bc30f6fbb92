"""Drop-in for transformers' ``Qwen4ExpTextGatedDeltaNet``, the linear-attention layer of Qwen3.8-Flash-Next.

Same constructor ``(config, layer_idx)``, same parameter names and shapes, same numbers on unpacked
input; in addition, packed documents are kept apart and each call localises its ``cu_seqlens`` (see
:mod:`fla_ac_isolation.mixers.gated_deltanet`).

Upstream (transformers 5.24): ``transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextGatedDeltaNet``
with ``Qwen4ExpTextConfig``. It is the Qwen3.5 layer with one difference: the output gate's activation is
``config.output_gate_type`` (``"sigmoid"`` for Qwen3.8-Flash-Next), falling back to ``config.hidden_act``.
"""

from __future__ import annotations

from typing import Any

from fla_ac_isolation.mixers._common import config_field, text_config
from fla_ac_isolation.mixers.gated_deltanet import GatedDeltaNet

__all__ = ["Qwen3_8FlashNextGatedDeltaNet"]


class Qwen3_8FlashNextGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet of Qwen3.8-Flash-Next (transformers' ``Qwen4ExpTextGatedDeltaNet``), packed-sequence safe.

    Args:
        config: ``Qwen4ExpTextConfig`` (or its multimodal parent). Reads the fields listed on
            :class:`~fla_ac_isolation.mixers.gated_deltanet.GatedDeltaNet`, plus ``output_gate_type``.
        layer_idx: index of the layer in the decoder.
        backend: ``"auto"`` | ``"fla"`` | ``"reference"`` (keyword only; default ``"auto"``).
        saveable: FLA's calls as custom operators SAC can save (keyword only; default ``False``), see
            :class:`~fla_ac_isolation.mixers.gated_deltanet.GatedDeltaNet`.

    Raises:
        ValueError: as :class:`GatedDeltaNet`; ``output_gate_type`` (or ``hidden_act``) missing or not
            ``"silu"``/``"sigmoid"``.

    ``forward(hidden_states [B, T, D], seqlens=None, *, cu_seq_lens_q=None, ...) -> [B, T, D]``.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        config = text_config(config)
        gate = getattr(config, "output_gate_type", None) or config_field(config, "hidden_act")
        if gate not in ("silu", "sigmoid"):
            raise ValueError(f"output_gate_type must be 'silu' or 'sigmoid', got {gate!r}")
        super().__init__(config, layer_idx, backend=backend, output_gate=gate, saveable=saveable)
