"""Drop-in token mixers (transformers, OLMo-core, FLA interfaces), correct on packed sequences and safe under AC.

Each is built from ``(config, layer_idx)`` with the upstream parameter names. The forward shared by the
transformers-style mixers (each adds only its own differences)::

    forward(hidden_states [B, T, D], seqlens: LayerLocalSeqlens | None = None, *, cu_seq_lens_q=None,
            max_length_q=None, attention_mask=None, cache=None, cache_params=None, past_key_values=None,
            **kwargs) -> [B, T, D], the dtype of hidden_states

* ``hidden_states``: ``B == 1`` when packed, ``T == 0`` only then; the weights' dtype unless under ``torch.autocast``.
* ``seqlens``: the model's offsets, localised inside (``seqlens.local()``, per layer and AC region). ``None``: one
  document per row, or transformers' ``cu_seq_lens_q [N + 1]``/``max_length_q`` when given (wrapped the same way).
* ``attention_mask``: ``None`` or a 2-D ``[B, T]`` padding mask. Caches must be ``None``; other keywords are ignored.

Raises: ``ValueError`` for a wrong shape, packed ``B > 1``, a token count other than ``cu_seqlens[-1]``, offsets on
another device, a bad ``cu_seq_lens_q`` or mask, unpacked ``T == 0``, ``backend="fla"`` on CPU outside Triton's
interpreter; ``TypeError`` for a non-float or mismatched dtype (outside autocast), ``seqlens`` of the wrong type,
non-integer offsets; ``NotImplementedError`` for a cache.
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
