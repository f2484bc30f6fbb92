"""Drop-in for transformers' ``Qwen4ExpTextGatedDeltaNet``, the linear-attention layer of Qwen3.8-Flash-Next."""

from __future__ import annotations

from typing import Any

from fla_ac_isolation.mixers._common import config_field, text_config
from fla_ac_isolation.mixers.gated_deltanet import GatedDeltaNet

__all__ = ["Qwen3_8FlashNextGatedDeltaNet"]


class Qwen3_8FlashNextGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet of Qwen3.8-Flash-Next: the output gate is ``config.output_gate_type`` (else ``hidden_act``);
    otherwise as :class:`~fla_ac_isolation.mixers.gated_deltanet.GatedDeltaNet`.

    Raises:
        ValueError: as :class:`GatedDeltaNet`; that gate missing or not ``"silu"``/``"sigmoid"``.
    """

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        config = text_config(config)
        gate = getattr(config, "output_gate_type", None) or config_field(config, "hidden_act")
        if gate not in ("silu", "sigmoid"):
            raise ValueError(f"output_gate_type must be 'silu' or 'sigmoid', got {gate!r}")
        super().__init__(config, layer_idx, backend=backend, output_gate=gate, saveable=saveable)
