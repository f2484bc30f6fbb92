"""The model families this package covers, once: our mixer, the upstream classes it replaces, their configs.

Every part that lists families reads this registry: :func:`~fla_ac_isolation.swap_mixers` (which upstream
classes it replaces, and by what), the regression and the audit (``--model`` choices; the tiny decoders
of :mod:`fla_ac_isolation.regression.model` are keyed by these names) and the tests.

* ``qwen3_5_moe`` (Qwen3.5-MoE): ``Qwen3_5MoeGatedDeltaNet`` replaces transformers'
  ``Qwen3_5MoeGatedDeltaNet`` and the dense ``Qwen3_5GatedDeltaNet``;
* ``qwen3_8`` (Qwen3.8-Flash-Next): ``Qwen3_8FlashNextGatedDeltaNet`` replaces ``Qwen4ExpTextGatedDeltaNet``;
* ``nemotron_h`` (Nemotron-H): ``NemotronHMamba2Mixer`` replaces ``NemotronHMamba2Mixer``.

Nothing here imports transformers or the mixers; :meth:`Family.mixer_class` and
:meth:`UpstreamMixer.resolve` import on demand.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

__all__ = ["FAMILIES", "FAMILY_NAMES", "Family", "UpstreamMixer", "upstream_mixers"]


@dataclass(frozen=True)
class UpstreamMixer:
    """A mixer class of another library that one of our mixers replaces (matched by module and name).

    Attributes:
        module: the module defining the class (``transformers.models.qwen3_5_moe.modeling_qwen3_5_moe``).
        name: the class name there (``Qwen3_5MoeGatedDeltaNet``).
        config: the config class its model is built from, ``"module.Class"``.
    """

    module: str
    name: str
    config: str

    @property
    def qualified(self) -> str:
        """``"module.Class"``."""
        return f"{self.module}.{self.name}"

    def matches(self, module: nn.Module) -> bool:
        """``module`` is exactly this class (a subclass is not: it may change ``forward``)."""
        cls = type(module)
        return cls.__module__ == self.module and cls.__qualname__ == self.name

    def resolve(self) -> type:
        """Import and return the class.

        Raises:
            ImportError: its library is not installed.
        """
        return getattr(importlib.import_module(self.module), self.name)

    def config_class(self) -> type:
        """Import and return the config class."""
        module, _, name = self.config.rpartition(".")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: registry key, also the ``--model`` name of the regression and the audit.
        title: the model's name in prose (``"Qwen3.5-MoE"``).
        mixer: our drop-in's class name in :mod:`fla_ac_isolation.mixers`.
        upstream: the classes our mixer replaces, first the family's own.
    """

    name: str
    title: str
    mixer: str
    upstream: tuple[UpstreamMixer, ...]

    def mixer_class(self) -> type[nn.Module]:
        """Our drop-in's class (imports :mod:`fla_ac_isolation.mixers`)."""
        return getattr(importlib.import_module("fla_ac_isolation.mixers"), self.mixer)


_HF = "transformers.models"

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeGatedDeltaNet",
            (
                UpstreamMixer(f"{_HF}.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet",
                              f"{_HF}.qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeTextConfig"),
                UpstreamMixer(f"{_HF}.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet",
                              f"{_HF}.qwen3_5.configuration_qwen3_5.Qwen3_5TextConfig"),
            ),
        ),
        Family(
            "qwen3_8", "Qwen3.8-Flash-Next", "Qwen3_8FlashNextGatedDeltaNet",
            (
                UpstreamMixer(f"{_HF}.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextGatedDeltaNet",
                              f"{_HF}.qwen4_exp.configuration_qwen4_exp.Qwen4ExpTextConfig"),
            ),
        ),
        Family(
            "nemotron_h", "Nemotron-H", "NemotronHMamba2Mixer",
            (
                UpstreamMixer(f"{_HF}.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer",
                              f"{_HF}.nemotron_h.configuration_nemotron_h.NemotronHConfig"),
            ),
        ),
    )
}
"""Every family by name."""

FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)


def upstream_mixers() -> list[tuple[UpstreamMixer, Family]]:
    """Every upstream class with the family whose mixer replaces it, in registry order."""
    return [(upstream, family) for family in FAMILIES.values() for upstream in family.upstream]
