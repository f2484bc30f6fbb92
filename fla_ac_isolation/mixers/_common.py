"""Input handling shared by the mixers' ``forward``: argument checks, packed offsets, padding mask."""

from __future__ import annotations

from typing import Any

import torch

from fla_ac_isolation.local_seqlens import LocalSeqlens
from fla_ac_isolation.ops.backend import resolve_backend
from fla_ac_isolation.seqlens import LayerLocalSeqlens, devices_match


def check_hidden_states(hidden_states: Any, hidden_size: int, weight: torch.Tensor) -> tuple[int, int]:
    """``(B, T)`` of ``hidden_states [B, T, hidden_size]`` of ``weight``'s dtype (outside autocast), else raises."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states must be a floating-point tensor, got dtype {hidden_states.dtype}")
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden_states must be [B, T, hidden_size={hidden_size}], got shape {tuple(hidden_states.shape)}"
        )
    if hidden_states.dtype != weight.dtype and not torch.is_autocast_enabled(hidden_states.device.type):
        raise TypeError(
            f"hidden_states has dtype {hidden_states.dtype} but this mixer's weights are {weight.dtype}: cast "
            "one to the other (hidden_states.to(dtype) or mixer.to(dtype)) or run under torch.autocast"
        )
    return hidden_states.shape[0], hidden_states.shape[1]


def reject_cache(**caches: Any) -> None:
    """``NotImplementedError`` naming the first non-``None`` cache argument (no cached decoding here)."""
    for name, value in caches.items():
        if value is not None:
            raise NotImplementedError(
                f"{name} is not supported: this mixer computes full (packed) sequences for training and "
                "keeps no recurrent or conv state; use the transformers class for cached generation"
            )


def resolve_seqlens(
    seqlens: LayerLocalSeqlens | None,
    hidden_states: torch.Tensor,
    *,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> LocalSeqlens | None:
    """This layer's own offsets (``seqlens.local()``) or ``None`` unpacked; call it inside the mixer's forward.

    ``seqlens`` wins over ``cu_seq_lens_q`` (their document counts must agree); a lone ``cu_seq_lens_q`` is wrapped
    per call (one host read: pass ``seqlens`` to avoid it).
    """
    batch, tokens = hidden_states.shape[0], hidden_states.shape[1]
    if seqlens is None and cu_seq_lens_q is None:
        _check_unpacked(hidden_states, seq_idx)
        return None
    if seqlens is not None and not isinstance(seqlens, LayerLocalSeqlens):
        raise TypeError(
            f"seqlens must be a fla_ac_isolation.LayerLocalSeqlens or None, got {type(seqlens).__name__}; "
            "pass raw offsets as cu_seq_lens_q="
        )
    if batch != 1:
        raise ValueError(
            f"packed input (cu_seqlens given) must have batch size 1, got hidden_states of shape "
            f"{tuple(hidden_states.shape)}; flatten the batch into one row"
        )
    if seqlens is None:
        seqlens = _wrap_cu_seq_lens_q(cu_seq_lens_q, max_length_q, hidden_states)
    elif isinstance(cu_seq_lens_q, torch.Tensor) and cu_seq_lens_q.numel() != seqlens.num_seqs + 1:
        raise ValueError(
            f"cu_seq_lens_q has {cu_seq_lens_q.numel()} offsets but seqlens describes {seqlens.num_seqs} "
            "documents; pass one of them or make them agree"
        )
    seqlens.check_tokens(tokens, name="hidden_states")
    if not devices_match(seqlens.device, hidden_states.device):
        raise ValueError(
            f"cu_seqlens is on {seqlens.device} but hidden_states is on {hidden_states.device}; "
            "build the LayerLocalSeqlens on the activations' device"
        )
    return seqlens.local()


def _check_unpacked(hidden_states: torch.Tensor, seq_idx: Any) -> None:
    """Refuse ``seq_idx`` or ``T == 0`` on an unpacked batch."""
    if seq_idx is not None:
        raise ValueError(
            "seq_idx is not supported; describe packed documents with seqlens=LayerLocalSeqlens(...) "
            "or cu_seq_lens_q= (otherwise state would flow across documents)"
        )
    if hidden_states.shape[1] == 0:
        raise ValueError(
            f"hidden_states has no tokens (shape {tuple(hidden_states.shape)}) and no offsets: an unpacked "
            "batch needs T >= 1 (packed, pass seqlens= describing zero-length documents)"
        )


def _wrap_cu_seq_lens_q(cu_seq_lens_q: Any, max_length_q: Any, hidden_states: torch.Tensor) -> LayerLocalSeqlens:
    """``cu_seq_lens_q`` validated against ``hidden_states`` (device, token count)."""
    if isinstance(max_length_q, torch.Tensor):
        max_length_q = int(max_length_q)
    try:
        return LayerLocalSeqlens(
            cu_seq_lens_q, max_seqlen=max_length_q, device=hidden_states.device, num_tokens=hidden_states.shape[1]
        )
    except (TypeError, ValueError) as err:
        raise type(err)(f"cu_seq_lens_q is not valid packed-sequence offsets: {err}") from err


def varlen_kwargs(local: LocalSeqlens | None, backend: str, hidden_states: torch.Tensor, **extra: Any) -> dict:
    """Every op's keywords for one mixer call: ``cu_seqlens``/``cu_seqlens_cpu``, the resolved backend, ``extra``."""
    return {
        "cu_seqlens": local.cu_seqlens if local is not None else None,
        "cu_seqlens_cpu": local.cu_seqlens_cpu if local is not None else None,
        "backend": resolve_backend(backend, hidden_states),
        **extra,
    }


def apply_padding_mask(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded positions of a 2-D ``[B, T]`` mask (1 = token), as transformers does; ``None`` passes."""
    if attention_mask is None:
        return hidden_states
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            "attention_mask must be None or a 2-D [B, T] padding mask matching hidden_states "
            f"{tuple(hidden_states.shape[:2])}, got shape {tuple(attention_mask.shape)}"
        )
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def text_config(config: Any) -> Any:
    """The text part of a (possibly multimodal) transformers config; a text config is returned as is."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def config_field(config: Any, name: str) -> Any:
    """``getattr(config, name)``; ``ValueError`` naming the field and the config class when missing."""
    if not hasattr(config, name):
        raise ValueError(f"config ({type(config).__name__}) has no field {name!r}, which this mixer needs")
    return getattr(config, name)


def layer_type(config: Any, layer_idx: int | None) -> str | None:
    """``config.layer_types[layer_idx]``, ``None`` without either; raises for a bad ``layer_idx``."""
    if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int)):
        raise TypeError(f"layer_idx must be an int (this layer's index in the decoder) or None, got {layer_idx!r}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer_idx is None:
        return None
    if not -len(layer_types) <= layer_idx < len(layer_types):
        raise ValueError(
            f"layer_idx={layer_idx} is outside config.layer_types ({len(layer_types)} layers); "
            "pass the config of the model this layer belongs to"
        )
    return layer_types[layer_idx]
