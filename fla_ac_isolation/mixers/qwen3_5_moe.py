"""Drop-in for transformers' ``Qwen3_5MoeGatedDeltaNet`` and the dense ``Qwen3_5GatedDeltaNet`` (SiLU output gate)."""

from __future__ import annotations

from typing import Any

from fla_ac_isolation.mixers.gated_deltanet import GatedDeltaNet

__all__ = ["Qwen3_5MoeGatedDeltaNet"]


class Qwen3_5MoeGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet of Qwen3.5 and Qwen3.5-MoE, packed-sequence safe; arguments, parameters and errors as
    :class:`~fla_ac_isolation.mixers.gated_deltanet.GatedDeltaNet` (``output_gate="silu"``)."""

    def __init__(self, config: Any, layer_idx: int, *, backend: str = "auto", saveable: bool = False) -> None:
        super().__init__(config, layer_idx, backend=backend, output_gate="silu", saveable=saveable)
