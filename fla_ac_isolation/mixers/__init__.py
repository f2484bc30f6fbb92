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

Every mixer is built from ``(config, layer_idx)`` with transformers' parameter names. The forward shared by the
transformers-style mixers (each adds only its own differences)::

    forward(hidden_states [B, T, D], seqlens: LayerLocalSeqlens | None = None, *, cu_seq_lens_q=None,
            max_length_q=None, attention_mask=None, cache=None, cache_params=None, past_key_values=None,
            **kwargs) -> [B, T, D], the dtype of hidden_states

* ``hidden_states``: ``B == 1`` when packed; ``T == 0`` only when packed. Its dtype must be the weights'
  (nothing is cast) unless ``torch.autocast`` is active for its device.
* ``seqlens``: the model forward's offsets; the mixer calls ``seqlens.local()`` inside, so each layer (and each
  checkpointed region) gets its own ``cu_seqlens`` objects. ``None``: each batch row is one document, or
  transformers' ``cu_seq_lens_q [N + 1]`` / ``max_length_q`` when given, wrapped and localised the same way.
* ``attention_mask``: ``None`` or a 2-D ``[B, T]`` padding mask (padded positions are zeroed).
* ``cache``, ``cache_params``, ``past_key_values``: must be ``None`` (no cached decoding); other transformers
  keywords are ignored.

Raises: ``ValueError`` for a wrong hidden size or rank, packed input with ``B > 1``, a token count other than
``cu_seqlens[-1]``, offsets on another device, a bad ``cu_seq_lens_q`` or mask, ``T == 0`` without offsets;
``TypeError`` for a non-float ``hidden_states``, another dtype than the weights outside autocast (naming both),
``seqlens`` of the wrong type, non-integer offsets; ``NotImplementedError`` for a cache.
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
