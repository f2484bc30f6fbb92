"""fla_ac_isolation: make flash-linear-attention (FLA) layers safe under activation checkpointing.

Every public name (``__all__``) is imported on first access, so ``import fla_ac_isolation`` imports nothing else,
not even torch (pytest imports this package through its plugin in every run). The drop-in mixers live in
:mod:`fla_ac_isolation.mixers`.
"""

from __future__ import annotations

import importlib
from typing import Any

from fla_ac_isolation import fla_seam as _fla_seam  # noqa: F401  (stdlib only: makes a known-bad FLA install's import fail clearly)

__version__ = "0.5.0"

# name -> module that defines it; resolved on first access (PEP 562)
_LAZY = {
    "LayerLocalSeqlens": "fla_ac_isolation.seqlens",
    "LocalSeqlens": "fla_ac_isolation.local_seqlens",
    "PackedSeqlens": "fla_ac_isolation.local_seqlens",
    "StaticSeqlens": "fla_ac_isolation.graphs",
    "checkpoint_layers": "fla_ac_isolation.policies",
    "probe_tensor_cache": "fla_ac_isolation.fla_seam.cache",
    "tensor_cache_disabled": "fla_ac_isolation.fla_seam.cache",
    "CPConfig": "fla_ac_isolation.parallel",
    "ReplayAudit": "fla_ac_isolation.audit",
    "ReplayDivergenceError": "fla_ac_isolation.audit",
    "swap_mixers": "fla_ac_isolation.swap",
    "restore_mixers": "fla_ac_isolation.swap",
    "isolate_seqlens": "fla_ac_isolation.isolate",
    "IsolationHandle": "fla_ac_isolation.isolate",
    "LeakingMixerWarning": "fla_ac_isolation.isolate",
}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fla_ac_isolation' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
