"""Drop-in token mixers for transformers models, correct on packed sequences and safe under AC.

* :class:`Qwen3_5MoeGatedDeltaNet` - for ``Qwen3_5MoeGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``.
* :class:`Qwen3_8FlashNextGatedDeltaNet` - for ``Qwen4ExpTextGatedDeltaNet`` (Qwen3.8-Flash-Next).
* :class:`NemotronHMamba2Mixer` - for ``NemotronHMamba2Mixer``.
* :class:`OlmoNemotronMamba2Mixer` - the same Mamba2 with OLMo-core's interface, for its ``NemotronMamba2Mixer``.
* :class:`FlaMamba2` - the same Mamba2 with flash-linear-attention's interface, for ``fla.layers.Mamba2``.
* :class:`KimiLinearDeltaAttention` - for ``KimiLinearDeltaAttention`` (Kimi-Linear).
* :class:`Glm5NextTextLinearAttention` - for ``Glm5NextTextLinearAttention`` (GLM-5-next).
* :class:`BailingHybridDeltaAttention` - for ``BailingHybridDeltaAttention`` (Bailing hybrid).
* :class:`GatedDeltaNet` - the shared Gated DeltaNet core; :class:`KimiDeltaAttention` - the shared Kimi Delta
  Attention core.

Every mixer is built from ``(config, layer_idx)`` with transformers' parameter names, and its forward is
``forward(hidden_states [B, T, D], seqlens: LayerLocalSeqlens | None = None, *, cu_seq_lens_q=None, ...)
-> [B, T, D]``; it calls ``seqlens.local()`` inside, so each layer (and each checkpointed region) gets
its own ``cu_seqlens`` objects. ``hidden_states`` must have the weights' dtype (a ``TypeError`` names both
otherwise; nothing is cast) unless ``torch.autocast`` is active, which casts per op as in transformers.
"""

from fla_ac_isolation.mixers.fla_mamba2 import FlaMamba2
from fla_ac_isolation.mixers.gated_deltanet import GatedDeltaNet
from fla_ac_isolation.mixers.kda import (
    BailingHybridDeltaAttention,
    Glm5NextTextLinearAttention,
    KimiDeltaAttention,
    KimiLinearDeltaAttention,
)
from fla_ac_isolation.mixers.nemotron_h import NemotronHMamba2Mixer
from fla_ac_isolation.mixers.olmo_core import OlmoNemotronMamba2Mixer
from fla_ac_isolation.mixers.qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from fla_ac_isolation.mixers.qwen3_8 import Qwen3_8FlashNextGatedDeltaNet

__all__ = [
    "BailingHybridDeltaAttention",
    "FlaMamba2",
    "GatedDeltaNet",
    "Glm5NextTextLinearAttention",
    "KimiDeltaAttention",
    "KimiLinearDeltaAttention",
    "NemotronHMamba2Mixer",
    "OlmoNemotronMamba2Mixer",
    "Qwen3_5MoeGatedDeltaNet",
    "Qwen3_8FlashNextGatedDeltaNet",
]
