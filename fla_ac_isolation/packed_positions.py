"""Packed batches described by ``position_ids`` alone (transformers' ``DataCollatorWithFlattening`` by default):
the hook :func:`~fla_ac_isolation.swap_mixers` puts on the model that holds the drop-ins.

transformers' decoder layers do not hand ``position_ids`` to their linear-attention mixers, so a mixer cannot see
that its row holds several documents. The hook sits on the nearest module above each mixer whose ``forward`` takes
``position_ids`` (its decoder layer): when a call passes ``position_ids`` that restart (a position not one more than
the one before it), no ``attention_mask`` and none of the mixers' offsets keywords, it passes the offsets on as
``seqlens=``, which every drop-in reads. They are built once per batch
(:meth:`~fla_ac_isolation.LayerLocalSeqlens.from_position_ids`, one host read for the model's ``position_ids``
object, which every layer gets). Restarting positions in a batch of several rows raise (a packed row must be the only
one). ``torch.compile(fullgraph=True)`` cannot trace the host read: pass ``seqlens=`` yourself there.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["HOOK_ATTRIBUTE", "OFFSETS_KEYWORDS", "install_packed_positions", "packed_offsets_from_positions",
           "remove_packed_positions"]

HOOK_ATTRIBUTE = "_fla_ac_packed_positions"
"""Where a hooked module keeps the ``RemovableHandle`` of the hook (in its ``__dict__``)."""

OFFSETS_KEYWORDS = ("seqlens", "cu_seqlens", "cu_seq_lens_q", "seq_idx")
"""Keywords that already carry the offsets: the hook then does nothing."""


_SEEN: dict[int, tuple[weakref.ref, LayerLocalSeqlens | None]] = {}  # one verdict per position_ids object


@torch.compiler.disable
def packed_offsets_from_positions(position_ids: Any) -> LayerLocalSeqlens | None:
    """The offsets of ``position_ids`` ``[B, T]`` (or transformers' ``[3 or 4, B, T]`` multimodal positions, whose
    first row is the text's) when they restart inside a row, else ``None``. Judged once per tensor object (every
    decoder layer gets the model's one ``position_ids``): one host read per batch.

    Raises:
        ValueError: positions restart in a batch of more than one row.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() or position_ids.dim() not in (
            2, 3) or position_ids.shape[-1] < 2:
        return None
    seen = _SEEN.get(id(position_ids))
    if seen is not None and seen[0]() is position_ids:
        return seen[1]
    with _disable_current_modes(), torch.no_grad():  # invisible to SAC and the audit
        found = _from_positions(position_ids)
    for key in [k for k, (ref, _) in _SEEN.items() if ref() is None]:
        del _SEEN[key]
    _SEEN[id(position_ids)] = (weakref.ref(position_ids), found)
    return found


def _from_positions(position_ids: torch.Tensor) -> LayerLocalSeqlens | None:
    if position_ids.dim() == 3:
        position_ids = position_ids[0]
    steps = position_ids.diff(dim=-1)
    restarts = (steps != 1).any(dim=-1).cpu()
    if not bool(restarts.any()):
        return None
    if position_ids.shape[0] != 1:
        raise ValueError(
            f"position_ids restart inside rows {restarts.nonzero().flatten().tolist()} of a batch of "
            f"{position_ids.shape[0]}: packed documents must share one row (batch size 1), e.g. "
            "DataCollatorWithFlattening(return_flash_attn_kwargs=True)")
    return LayerLocalSeqlens.from_position_ids(position_ids)


class _PackedPositionsHook:
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if any(kwargs.get(k) is not None for k in OFFSETS_KEYWORDS) or kwargs.get("attention_mask") is not None:
            return None
        seqlens = packed_offsets_from_positions(kwargs.get("position_ids"))
        if seqlens is None:
            return None
        return args, {**kwargs, "seqlens": seqlens}


def _takes_position_ids(module: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def install_packed_positions(model: nn.Module, paths: list[str]) -> list[str]:
    """Hook the nearest module above each of ``paths`` (mixers in ``model``) whose forward takes ``position_ids``;
    returns the hooked paths (``[]``: no such module, e.g. OLMo-core and FLA models, which pass offsets)."""
    hooked = []
    for path in paths:
        parts = path.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            where = ".".join(parts[:depth])
            module = model.get_submodule(where)
            if _takes_position_ids(module):
                if HOOK_ATTRIBUTE not in vars(module):
                    handle = module.register_forward_pre_hook(_PackedPositionsHook(), with_kwargs=True)
                    vars(module)[HOOK_ATTRIBUTE] = handle
                hooked.append(where)
                break
    return sorted(set(hooked))


def remove_packed_positions(model: nn.Module) -> None:
    """Remove every hook :func:`install_packed_positions` put on ``model`` or below it."""
    for module in model.modules():
        handle = vars(module).pop(HOOK_ATTRIBUTE, None)
        if handle is not None:
            handle.remove()
