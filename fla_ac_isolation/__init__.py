"""fla_ac_isolation: make flash-linear-attention (FLA) layers safe under activation checkpointing.

Public names:

* :class:`LayerLocalSeqlens` (``seqlens``) / :class:`LocalSeqlens` (``local_seqlens``) - per-layer
  ``cu_seqlens`` isolation; :class:`StaticSeqlens` (``static_seqlens``) - the same metadata in static,
  padded buffers, for CUDA graphs replayed across packings.
* :func:`tensor_cache_disabled`, :func:`probe_tensor_cache` - FLA's cache seam (``fla_cache``).
* :mod:`fla_ac_isolation.policies` - SAC policies from the field and :func:`checkpoint_layers`.

Further names are imported lazily (on first access) so that ``import fla_ac_isolation`` stays light; they
are listed by ``dir(fla_ac_isolation)`` and ``__all__``: ``ReplayAudit`` and ``ReplayDivergenceError``
(``audit``), ``CPConfig`` (``parallel``), ``swap_mixers`` / ``restore_mixers`` (``swap``),
``isolate_seqlens`` / ``IsolationHandle`` / ``LeakingMixerWarning`` (``isolate``) and the drop-in mixers (``mixers``).

The harness (regression, command, runners, tiny models, CPU serving, test support) lives in ``harness/``; its
0.3 import paths (``fla_ac_isolation.modes``, ``fla_ac_isolation.regression``, ...) still import, as deprecated
aliases that warn (``_moved``).
"""

from __future__ import annotations

import importlib
from typing import Any

from fla_ac_isolation._moved import install_aliases as _install_aliases
from fla_ac_isolation.fla_cache import probe_tensor_cache, tensor_cache_disabled
from fla_ac_isolation.local_seqlens import LocalSeqlens
from fla_ac_isolation.policies import checkpoint_layers
from fla_ac_isolation.seqlens import LayerLocalSeqlens
from fla_ac_isolation.static_seqlens import StaticSeqlens

__version__ = "0.3.0"

_install_aliases()

# name -> module that defines it; resolved on first access (PEP 562)
_LAZY = {
    "CPConfig": "fla_ac_isolation.parallel",
    "ReplayAudit": "fla_ac_isolation.audit",
    "ReplayDivergenceError": "fla_ac_isolation.audit",
    "swap_mixers": "fla_ac_isolation.swap",
    "restore_mixers": "fla_ac_isolation.swap",
    "isolate_seqlens": "fla_ac_isolation.isolate",
    "IsolationHandle": "fla_ac_isolation.isolate",
    "LeakingMixerWarning": "fla_ac_isolation.isolate",
    "Qwen3_5MoeGatedDeltaNet": "fla_ac_isolation.mixers",
    "Qwen3_8FlashNextGatedDeltaNet": "fla_ac_isolation.mixers",
    "NemotronHMamba2Mixer": "fla_ac_isolation.mixers",
}

__all__ = [
    "LayerLocalSeqlens",
    "LocalSeqlens",
    "StaticSeqlens",
    "checkpoint_layers",
    "probe_tensor_cache",
    "tensor_cache_disabled",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fla_ac_isolation' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
