"""Drop-in token mixers, correct on packed sequences and safe under AC: subclasses of the classes they replace with
one path of ours (:mod:`~fla_ac_isolation.mixers.base`). A drop-in is made when first asked for, from the installed
library: ``fla_ac_isolation.mixers.Qwen3_5MoeGatedDeltaNet`` imports transformers' class it subclasses.

Each takes the replaced class's arguments plus ``backend`` and ``saveable``, and the replaced forward's arguments
plus packed offsets (:data:`~fla_ac_isolation.mixers.offsets_keywords.SOURCES`: ``seqlens``, ``cu_seqlens``,
``cu_seq_lens_q``, ``seq_idx``, ``cu_doc_lens``). Which drop-in replaces which class: :data:`DROP_INS`.
"""

from __future__ import annotations

import importlib
from typing import Any

from fla_ac_isolation.families import Family, upstream_mixers
from fla_ac_isolation.foreign_classes import UpstreamMixer
from fla_ac_isolation.mixers.base import DropIn, PackedCacheWarning

__all__ = ["DROP_INS", "DropIn", "PackedCacheWarning", "drop_in_class", "family_drop_in"]

_PATHS: dict[str, str] = {
    # the replaced class (module.Class) -> our path (module:Class of this package)
    "transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer": "mamba2:NemotronHMamba2Path",
    "olmo_core.nn.attention.recurrent.NemotronMamba2Mixer": "mamba2:OlmoMamba2Path",
    "fla.layers.mamba2.Mamba2": "mamba2:FlaMamba2Path",
}
_BY_FAMILY_LAYER = {"qwen3_5_moe": "gated_deltanet:GatedDeltaNetPath", "qwen3_8": "gated_deltanet:GatedDeltaNetPath",
                    "kimi_linear": "kda:KimiDeltaAttentionPath"}

DROP_INS: dict[str, UpstreamMixer] = {family.drop_in_name(upstream): upstream for upstream, family in upstream_mixers()}
"""``{drop-in name: the class it replaces}`` (from :data:`fla_ac_isolation.families.FAMILIES`)."""

_MADE: dict[str, type[DropIn]] = {}


def _path_of(name: str) -> type[DropIn]:
    upstream = DROP_INS[name]
    family = next(f for u, f in upstream_mixers() if u is upstream)
    module, _, cls = (_PATHS.get(upstream.qualified) or _BY_FAMILY_LAYER[family.name]).partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def drop_in_class(name: str) -> type[DropIn]:
    """The drop-in named ``name`` (a key of :data:`DROP_INS`), made on first call: ``class name(<our path>,
    <the replaced class>)``.

    Raises:
        KeyError: no drop-in of that name.
        ImportError: the library of the replaced class is not installed (or has no such class in this release).
    """
    if name not in DROP_INS:
        raise KeyError(f"no drop-in mixer named {name!r}; there are {sorted(DROP_INS)}")
    if name not in _MADE:
        upstream = DROP_INS[name]
        try:
            replaced = upstream.resolve()
        except AttributeError as err:
            raise ImportError(f"{upstream.qualified} is not in the installed {upstream.framework}: {err}") from err
        path = _path_of(name)
        doc = (f"Drop-in for {upstream.framework}'s ``{upstream.name}`` (``{upstream.module}``), packed-sequence "
               f"safe: :class:`~fla_ac_isolation.mixers.base.DropIn` over "
               f":class:`~{path.__module__}.{path.__qualname__}`.")
        cls = type(name, (path, replaced), {
            "__module__": __name__, "__qualname__": name, "__doc__": doc, "replaced": replaced,
            # `kernelize` keeps our forward (a hub layer may not keep documents apart): skipped by its condition,
            # and under a name no kernels mapping holds where the installed kernels has no conditions
            "kernel_layer_name": f"fla_ac_isolation.{name}",
            "kernel_condition": staticmethod(lambda module: False),
        })
        _MADE[name] = cls
    return _MADE[name]


def family_drop_in(family: Family, upstream: UpstreamMixer | None = None) -> type[DropIn]:
    """The drop-in of ``family`` replacing ``upstream`` (default: the family's own upstream class)."""
    return drop_in_class(family.drop_in_name(upstream))


def __getattr__(name: str) -> Any:
    if name in DROP_INS:
        return drop_in_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *DROP_INS])
