"""fla_ac_isolation: make flash-linear-attention (FLA) layers safe under activation checkpointing.

Public names:

* :class:`LayerLocalSeqlens` / :class:`LocalSeqlens` - per-layer ``cu_seqlens`` isolation (``seqlens``).
* :func:`tensor_cache_disabled`, :func:`probe_tensor_cache` - FLA's cache seam (``fla_cache``).
* :mod:`fla_ac_isolation.policies` - SAC policies from the field and :func:`checkpoint_layers`.

Further names (mixers, ``swap_mixers``, ``isolate_seqlens``, ``ReplayAudit``) are imported lazily so that ``import
fla_ac_isolation`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from fla_ac_isolation.fla_cache import probe_tensor_cache, tensor_cache_disabled
from fla_ac_isolation.policies import checkpoint_layers
from fla_ac_isolation.seqlens import LayerLocalSeqlens, LocalSeqlens

__version__ = "0.2.0"

# name -> module that defines it; resolved on first access (PEP 562)
_LAZY = {
    "ReplayAudit": "fla_ac_isolation.audit",
    "swap_mixers": "fla_ac_isolation.swap",
    "restore_mixers": "fla_ac_isolation.swap",
    "isolate_seqlens": "fla_ac_isolation.isolate",
    "Qwen3_5MoeGatedDeltaNet": "fla_ac_isolation.mixers",
    "Qwen3_8FlashNextGatedDeltaNet": "fla_ac_isolation.mixers",
    "NemotronHMamba2Mixer": "fla_ac_isolation.mixers",
}

__all__ = [
    "LayerLocalSeqlens",
    "LocalSeqlens",
    "checkpoint_layers",
    "probe_tensor_cache",
    "tensor_cache_disabled",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fla_ac_isolation' has no attribute {name!r}")
