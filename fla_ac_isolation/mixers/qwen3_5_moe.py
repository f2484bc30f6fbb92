"""Drop-in for transformers' ``Qwen3_5MoeGatedDeltaNet`` (and the dense ``Qwen3_5GatedDeltaNet``).

Same constructor ``(config, layer_idx)``, same parameter names and shapes, same numbers on unpacked
input; in addition, packed documents (``seqlens`` or transformers' ``cu_seq_lens_q``) are kept apart and
each call localises its ``cu_seqlens`` (see :mod:`fla_ac_isolation.mixers.gated_deltanet`).

Upstream (transformers 5.24): ``transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet``
with ``Qwen3_5MoeTextConfig``; ``transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet`` with
``Qwen3_5TextConfig`` is the same layer. The output gate is SiLU in both.

Example::

    from fla_ac_isolation import LayerLocalSeqlens
    from fla_ac_isolation.mixers import Qwen3_5MoeGatedDeltaNet

    mixer = Qwen3_5MoeGatedDeltaNet(config, layer_idx=0)
    mixer.load_state_dict(hf_model.model.layers[0].linear_attn.state_dict())
    seqlens = LayerLocalSeqlens.from_seq_lens([5, 17, 41], device="cuda")
    out = mixer(hidden_states, seqlens)            # hidden_states [1, 63, hidden_size]
"""

from __future__ import annotations

from typing import Any

from fla_ac_isolation.mixers.gated_deltanet import GatedDeltaNet

__all__ = ["Qwen3_5MoeGatedDeltaNet"]


class Qwen3_5MoeGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet of Qwen3.5 and Qwen3.5-MoE, packed-sequence safe.

    Args:
        config: ``Qwen3_5MoeTextConfig`` or ``Qwen3_5TextConfig`` (or their multimodal parents).
        layer_idx: index of the layer in the decoder.
        backend: ``"auto"`` | ``"fla"`` | ``"reference"`` (keyword only; default ``"auto"``).
        saveable: FLA's calls as custom operators SAC can save (keyword only; default ``False``), see
            :class:`~fla_ac_isolation.mixers.gated_deltanet.GatedDeltaNet`.

    Shapes, config fields, parameters and errors: see :class:`~fla_ac_isolation.mixers.gated_deltanet.GatedDeltaNet`.
    ``forward(hidden_states [B, T, D], seqlens=None, *, cu_seq_lens_q=None, ...) -> [B, T, D]``.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        super().__init__(config, layer_idx, backend=backend, output_gate="silu", saveable=saveable)
