"""The registry of model families: the upstream classes our drop-ins replace, their configs, the CP
capability. Other libraries' FLA-backed classes, and which drop-in replaces which, are
:mod:`fla_ac_isolation.foreign_classes`. Imports neither transformers, OLMo-core nor the mixers.
"""

from __future__ import annotations

from dataclasses import dataclass

from fla_ac_isolation.foreign_classes import DROP_IN_NAMES, UpstreamMixer, named

__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "Family",
    "upstream_mixers",
]

@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: registry key, also the ``--model`` name of the regression and the audit.
        title: the model's name in prose (``"Qwen3.5-MoE"``).
        upstream: the classes our mixer replaces, first the family's own (whose config class configures ours).
        layer: the kind of FLA-backed mixer: ``"gdn"`` (a gated delta rule, KDA's included) or ``"mamba2"``.
        fla_cp: under context parallelism its mixers run FLA's CP kernels (else head-parallel or no CP).
    """

    name: str
    title: str
    upstream: tuple[UpstreamMixer, ...]
    layer: str
    fla_cp: bool

    @property
    def mixer(self) -> str:
        """Our drop-in's class name in :mod:`fla_ac_isolation.mixers` for the family's own upstream class."""
        return self.drop_in_name()

    def drop_in_name(self, upstream: UpstreamMixer | None = None) -> str:
        """The name of our drop-in replacing ``upstream`` (default: the family's own class) in
        :mod:`fla_ac_isolation.mixers`."""
        return DROP_IN_NAMES[(upstream or self.upstream[0]).qualified]

    def config_class(self) -> type:
        """The transformers config class of the family's own upstream mixer (imports transformers).

        Raises:
            ImportError: transformers is not installed.
        """
        return self.upstream[0].config_class()


_HF = "transformers.models"


def _hf(folder: str, name: str) -> UpstreamMixer:
    """transformers' class ``name`` of ``models/<folder>``, as ``FLA_BACKED_MIXERS`` names it."""
    found = named(f"{_HF}.{folder}.modeling_{folder}.{name}")
    if not isinstance(found, UpstreamMixer):
        raise TypeError(f"{found.qualified} is named as leaking, not as handing FLA its offsets")
    return found


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # Qwen3.5-MoE, and every other transformers Gated DeltaNet: same path, each class its own drop-in
        Family(
            "qwen3_5_moe", "Qwen3.5-MoE",
            (_hf("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"), _hf("qwen3_5", "Qwen3_5GatedDeltaNet"),
             _hf("qwen3_next", "Qwen3NextGatedDeltaNet"), _hf("olmo_hybrid", "OlmoHybridGatedDeltaNet"),
             _hf("lara_mini", "LaraMiniGatedDeltaNet")),
            layer="gdn", fla_cp=True,
        ),
        Family(
            "qwen3_8", "Qwen3.8-Flash-Next",
            (_hf("qwen4_exp", "Qwen4ExpTextGatedDeltaNet"),),
            layer="gdn", fla_cp=True,
        ),
        Family(
            "nemotron_h", "Nemotron-H",
            (
                # transformers' torch path and mamba_ssm: no FLA call, so nothing to isolate (offsets empty)
                UpstreamMixer(f"{_HF}.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer",
                              f"{_HF}.nemotron_h.configuration_nemotron_h.NemotronHConfig"),
                # OLMo-core 3.0: pure-torch SSD that drops cu_doc_lens; configured by its attributes
                UpstreamMixer("olmo_core.nn.attention.recurrent", "NemotronMamba2Mixer", None),
                # flash-linear-attention 0.6: never reads cu_seqlens (the FLA rule names it leaking); configured by
                # its attributes (fla.models' Mamba2Block builds it from keywords)
                UpstreamMixer("fla.layers.mamba2", "Mamba2", None),
            ),
            layer="mamba2", fla_cp=False,
        ),
        # Kimi Delta Attention (a gated delta rule, decay per key channel: layer "gdn"). transformers' three call
        # chunk_kda without offsets (LEAKING_MIXERS; offsets empty here); the drop-ins keep documents apart. No FLA
        # CP path (the mixers refuse CP seqlens).
        Family(
            "kimi_linear", "Kimi-Linear",
            (
                UpstreamMixer(f"{_HF}.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention",
                              f"{_HF}.kimi_linear.configuration_kimi_linear.KimiLinearConfig"),
                UpstreamMixer(f"{_HF}.glm5_next.modeling_glm5_next", "Glm5NextTextLinearAttention",
                              f"{_HF}.glm5_next.configuration_glm5_next.Glm5NextTextConfig"),
                UpstreamMixer(f"{_HF}.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridDeltaAttention",
                              f"{_HF}.bailing_hybrid.configuration_bailing_hybrid.BailingHybridConfig"),
            ),
            layer="gdn", fla_cp=False,
        ),
    )
}
"""Every family by name."""

FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)


def upstream_mixers() -> list[tuple[UpstreamMixer, Family]]:
    """Every upstream class with the family whose mixer replaces it, in registry order."""
    return [(upstream, family) for family in FAMILIES.values() for upstream in family.upstream]
