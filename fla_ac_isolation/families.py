"""The registry of model families: our drop-in mixer, the upstream classes it replaces, their configs, the
regression's tiny decoder, CP capability and layer widths. Other libraries' FLA-backed classes are
:mod:`fla_ac_isolation.foreign_classes`. Imports neither transformers, OLMo-core nor the mixers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fla_ac_isolation.foreign_classes import ForeignClass, LeakingMixer, UpstreamMixer, named

__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "LAYERS",
    "Family",
    "TinyRecipe",
    "drop_in_for",
    "family_for_layer",
    "layer_fields",
    "leak_remedy",
    "remedy",
    "upstream_mixers",
]

LAYERS: tuple[str, ...] = ("gdn", "mamba2")
"""The kinds of FLA-backed mixer a family's layers run: Gated DeltaNet, or Mamba2 (FLA's simple GLA as its SSD)."""


def layer_fields(layer: str, hidden: int) -> dict[str, int]:
    """transformers config fields of a ``layer`` mixer at model width ``hidden`` (``D``), as the benchmarks run it.

    GDN: ``K = V = min(128, D // 4)``, ``D // K`` heads. Mamba2: ``P = min(64, D // 4)``, ``H = 2 * D // P`` heads,
    ``G = min(8, H)`` groups, state ``N = min(128, D)``.

    Raises:
        ValueError: ``hidden`` does not split into whole heads, or ``layer`` is not one of :data:`LAYERS`.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    if hidden < 16 or hidden % 4:
        raise ValueError(f"--hidden must be a multiple of 4 and at least 16, got {hidden}")
    if layer == "gdn":
        head_dim = min(128, hidden // 4)
        if hidden % head_dim:
            raise ValueError(f"--hidden {hidden} does not split into GDN heads of {head_dim}")
        heads = hidden // head_dim
        return dict(
            hidden_size=hidden, linear_num_key_heads=heads, linear_num_value_heads=heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        )
    head_dim = min(64, hidden // 4)
    if (2 * hidden) % head_dim:
        raise ValueError(f"--hidden {hidden} does not split into Mamba2 heads of {head_dim}")
    heads = 2 * hidden // head_dim
    groups = min(8, heads)
    if heads % groups:
        raise ValueError(f"--hidden {hidden} gives {heads} Mamba2 heads, not a multiple of {groups} groups")
    return dict(
        hidden_size=hidden, mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=min(128, hidden),
        n_groups=groups, conv_kernel=4, expand=2, chunk_size=64,
    )


@dataclass(frozen=True)
class TinyRecipe:
    """How the regression builds a family's tiny decoder (from :meth:`Family.config_class`).

    Attributes:
        layout: ``"qwen"`` (three mixer blocks then a gated attention block, each with an MoE; ``layer_types``)
            or ``"nemotron_h"`` (Mamba2 / MoE / attention / MoE blocks; ``layers_block_type``).
        attention_type: the config's name of the attention layers.
        config: further config fields the family sets, as ``(name, value)`` pairs.
    """

    layout: str
    attention_type: str = "full_attention"
    config: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: registry key, also the ``--model`` name of the regression and the audit.
        title: the model's name in prose (``"Qwen3.5-MoE"``).
        mixer: our drop-in's class name in :mod:`fla_ac_isolation.mixers` (for the family's own upstream class).
        upstream: the classes our mixer replaces, first the family's own (whose config class configures ours).
        layer: the kind of FLA-backed mixer, one of :data:`LAYERS`.
        fla_cp: under context parallelism its mixers run FLA's CP kernels (else head-parallel or no CP).
        tiny: how the regression builds its tiny decoder.
    """

    name: str
    title: str
    mixer: str
    upstream: tuple[UpstreamMixer, ...]
    layer: str
    fla_cp: bool
    tiny: TinyRecipe

    def drop_in_name(self, upstream: UpstreamMixer | None = None) -> str:
        """The name of our drop-in replacing ``upstream`` (default: the family's own class) in
        :mod:`fla_ac_isolation.mixers`."""
        return upstream.replacement if upstream is not None and upstream.replacement else self.mixer

    def config_class(self) -> type:
        """The transformers config class of the family's own upstream mixer (imports transformers).

        Raises:
            ImportError: transformers is not installed.
        """
        return self.upstream[0].config_class()

    def layer_fields(self, hidden: int) -> dict[str, int]:
        """:func:`layer_fields` of this family's :attr:`layer` at model width ``hidden``."""
        return layer_fields(self.layer, hidden)


_HF = "transformers.models"


def _hf(folder: str, name: str, own_drop_in: bool = False) -> UpstreamMixer:
    """transformers' class ``name`` of ``models/<folder>``, as ``FLA_BACKED_MIXERS`` names it; with
    ``own_drop_in``, replaced by a drop-in of the same name (not the family's own)."""
    found = named(f"{_HF}.{folder}.modeling_{folder}.{name}")
    if not isinstance(found, UpstreamMixer):
        raise TypeError(f"{found.qualified} is named as leaking, not as handing FLA its offsets")
    return dataclasses.replace(found, replacement=name) if own_drop_in else found


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # Qwen3.5-MoE, and every other transformers Gated DeltaNet: same path, each class its own drop-in
        Family(
            "qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeGatedDeltaNet",
            (_hf("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"), _hf("qwen3_5", "Qwen3_5GatedDeltaNet", True),
             _hf("qwen3_next", "Qwen3NextGatedDeltaNet", True), _hf("olmo_hybrid", "OlmoHybridGatedDeltaNet", True),
             _hf("lara_mini", "LaraMiniGatedDeltaNet", True)),
            layer="gdn", fla_cp=True, tiny=TinyRecipe("qwen"),
        ),
        Family(
            "qwen3_8", "Qwen3.8-Flash-Next", "Qwen3_8FlashNextGatedDeltaNet",
            (_hf("qwen4_exp", "Qwen4ExpTextGatedDeltaNet"),),
            layer="gdn", fla_cp=True,
            tiny=TinyRecipe("qwen", attention_type="indexed_attention", config=(("output_gate_type", "sigmoid"),)),
        ),
        Family(
            "nemotron_h", "Nemotron-H", "NemotronHMamba2Mixer",
            (
                # transformers' torch path and mamba_ssm: no FLA call, so nothing to isolate (offsets empty)
                UpstreamMixer(f"{_HF}.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer",
                              f"{_HF}.nemotron_h.configuration_nemotron_h.NemotronHConfig"),
                # OLMo-core 3.0: pure-torch SSD that drops cu_doc_lens; configured by its attributes
                UpstreamMixer("olmo_core.nn.attention.recurrent", "NemotronMamba2Mixer", None,
                              replacement="OlmoNemotronMamba2Mixer"),
                # flash-linear-attention 0.6: never reads cu_seqlens (the FLA rule names it leaking); configured by
                # its attributes (fla.models' Mamba2Block builds it from keywords)
                UpstreamMixer("fla.layers.mamba2", "Mamba2", None, replacement="FlaMamba2"),
            ),
            layer="mamba2", fla_cp=False, tiny=TinyRecipe("nemotron_h"),
        ),
        # Kimi Delta Attention (a gated delta rule, decay per key channel: layer "gdn"). transformers' three call
        # chunk_kda without offsets (LEAKING_MIXERS; offsets empty here); the drop-ins keep documents apart. Tiny
        # decoder: the "qwen" layout with KDA widths; no FLA CP path (the mixers refuse CP seqlens).
        Family(
            "kimi_linear", "Kimi-Linear", "KimiLinearDeltaAttention",
            (
                UpstreamMixer(f"{_HF}.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention",
                              f"{_HF}.kimi_linear.configuration_kimi_linear.KimiLinearConfig"),
                UpstreamMixer(f"{_HF}.glm5_next.modeling_glm5_next", "Glm5NextTextLinearAttention",
                              f"{_HF}.glm5_next.configuration_glm5_next.Glm5NextTextConfig",
                              replacement="Glm5NextTextLinearAttention"),
                UpstreamMixer(f"{_HF}.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridDeltaAttention",
                              f"{_HF}.bailing_hybrid.configuration_bailing_hybrid.BailingHybridConfig",
                              replacement="BailingHybridDeltaAttention"),
            ),
            layer="gdn", fla_cp=False,
            tiny=TinyRecipe("qwen", config=(("linear_num_heads", 4), ("linear_head_dim", 16), ("pad_token_id", None),
                                            ("bos_token_id", None), ("eos_token_id", None))),
        ),
    )
}
"""Every family by name."""

FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)


def drop_in_for(entry: ForeignClass) -> tuple[UpstreamMixer, Family] | None:
    """``(upstream, family)`` whose drop-in :func:`~fla_ac_isolation.swap_mixers` puts in place of ``entry``'s class,
    or ``None``."""
    return next(((u, f) for u, f in upstream_mixers() if u.qualified == entry.qualified), None)


def upstream_mixers() -> list[tuple[UpstreamMixer, Family]]:
    """Every upstream class with the family whose mixer replaces it, in registry order."""
    return [(upstream, family) for family in FAMILIES.values() for upstream in family.upstream]


def family_for_layer(layer: str) -> Family:
    """The first family (registry order) whose mixer is a ``layer`` (:data:`LAYERS`).

    Raises:
        ValueError: ``layer`` is not one of :data:`LAYERS`.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    return next(family for family in FAMILIES.values() if family.layer == layer)


def remedy(entry: LeakingMixer) -> str:
    """What to do about a class that drops its offsets: ``swap_mixers`` where a drop-in exists, else
    ``entry.otherwise``."""
    return _remedy(entry, entry.otherwise)


def leak_remedy(entry: UpstreamMixer) -> str | None:
    """What to do about ``entry.leak()`` (as :func:`remedy`); ``None`` without ``leaks_without``."""
    return None if entry.leaks_without is None else _remedy(entry, entry.leaks_without.otherwise)


def _remedy(entry: ForeignClass, otherwise: str) -> str:
    found = drop_in_for(entry)
    if found is None:
        return f"no drop-in here: {otherwise}"
    upstream, family = found
    return f"use swap_mixers(model) (drop-in fla_ac_isolation.mixers.{upstream.replacement or family.mixer})"


def _deprecated_method(old: str, function: Any) -> Any:
    """A deprecated method ``old`` (``"LeakingMixer.remedy"``) that warns, then calls ``function``."""

    def method(self: ForeignClass) -> Any:
        import warnings

        warnings.warn(f"{old}() is deprecated since 0.4.0: call fla_ac_isolation.families.{function.__name__}(entry)",
                      DeprecationWarning, stacklevel=2)
        return function(self)

    method.__name__, method.__qualname__ = old.split(".")[1], old
    method.__doc__ = f"Deprecated since 0.4.0: :func:`{function.__name__}` (``{function.__name__}(entry)``)."
    return method


# 0.3's methods of the classes that moved to foreign_classes, which cannot call the families (it is below them):
# attached here, where 0.3 defined the classes; every 0.3 way to an entry imports this module
LeakingMixer.remedy = _deprecated_method("LeakingMixer.remedy", remedy)
UpstreamMixer.leak_remedy = _deprecated_method("UpstreamMixer.leak_remedy", leak_remedy)

# 0.3 names that moved to :mod:`fla_ac_isolation.foreign_classes`: still importable from here, with a warning
_MOVED_TO_FOREIGN_CLASSES = ("FLA_BACKED_MIXERS", "FLA_LAYER_MODULES", "LEAKING_MIXERS", "PackageLeak",
                             "fla_layer_mixer", "foreign_mixer")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_FOREIGN_CLASSES:
        import warnings

        from fla_ac_isolation import foreign_classes

        warnings.warn(f"fla_ac_isolation.families.{name} is deprecated (its 0.3 place): import it from "
                      f"fla_ac_isolation.foreign_classes", DeprecationWarning, stacklevel=2)
        return getattr(foreign_classes, name)
    raise AttributeError(f"module 'fla_ac_isolation.families' has no attribute {name!r}")
