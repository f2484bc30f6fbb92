"""The model families this package covers, once: our mixer, the upstream classes it replaces, their configs,
and the FLA-backed mixers of other libraries that :func:`~fla_ac_isolation.isolate_seqlens` hooks.

Every part that lists families or upstream classes reads this registry: :func:`~fla_ac_isolation.swap_mixers`
(which upstream classes it replaces, and by what), :func:`~fla_ac_isolation.isolate_seqlens` (which classes
call FLA with packed offsets, through which arguments), the regression and the audit (``--model`` choices;
the tiny decoders of :mod:`fla_ac_isolation.regression.model` are keyed by these names) and the tests.

* ``qwen3_5_moe`` (Qwen3.5-MoE): ``Qwen3_5MoeGatedDeltaNet`` replaces transformers'
  ``Qwen3_5MoeGatedDeltaNet`` and the dense ``Qwen3_5GatedDeltaNet``;
* ``qwen3_8`` (Qwen3.8-Flash-Next): ``Qwen3_8FlashNextGatedDeltaNet`` replaces ``Qwen4ExpTextGatedDeltaNet``;
* ``nemotron_h`` (Nemotron-H): ``NemotronHMamba2Mixer`` replaces transformers' ``NemotronHMamba2Mixer``, and
  ``OlmoNemotronMamba2Mixer`` (the same mixer behind OLMo-core's interface) replaces OLMo-core's
  ``NemotronMamba2Mixer``.

:data:`FLA_BACKED_MIXERS` lists every upstream class that hands packed offsets to FLA: the three
transformers GDN classes above, torchtitan's Qwen3.5 ``GatedDeltaNet``, OLMo-core's ``GatedDeltaNet`` and
``KimiDeltaAttention`` (the last three have no drop-in here; their own code is kept and isolated).

Nothing here imports transformers, OLMo-core, torchtitan or the mixers; :meth:`Family.mixer_class` and
:meth:`UpstreamMixer.resolve` import on demand.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

__all__ = ["FAMILIES", "FAMILY_NAMES", "FLA_BACKED_MIXERS", "Family", "UpstreamMixer", "upstream_mixers"]


@dataclass(frozen=True)
class UpstreamMixer:
    """A mixer class of another library: one of our mixers replaces it, or it is isolated in place.

    Attributes:
        module: the module defining the class (``transformers.models.qwen3_5_moe.modeling_qwen3_5_moe``).
        name: the class name there (``Qwen3_5MoeGatedDeltaNet``).
        config: the config class its model is built from, ``"module.Class"``; ``None`` when the module
            carries its own configuration as attributes (OLMo-core), which the replacement reads.
        offsets: the arguments of its ``forward`` (keyword or positional) that carry packed offsets to FLA:
            integer ``[N + 1]`` tensors, or NamedTuples holding them (torchtitan's ``VarlenMetadata``).
            Empty when the class never calls FLA with offsets (nothing for ``isolate_seqlens`` to do).
        fla_keywords: FLA keywords (``cu_seqlens_cpu``, ``chunk_indices``) that its ``forward`` hands on to
            FLA's kernel unchanged when passed as keywords, so ``isolate_seqlens`` may add them.
        replacement: our class replacing it (in :mod:`fla_ac_isolation.mixers`) when it is not the
            family's own mixer (another interface around the same maths); ``None``: the family's mixer.
    """

    module: str
    name: str
    config: str | None
    offsets: tuple[str, ...] = ()
    fla_keywords: tuple[str, ...] = ()
    replacement: str | None = None

    @property
    def qualified(self) -> str:
        """``"module.Class"``."""
        return f"{self.module}.{self.name}"

    def matches(self, module: nn.Module) -> bool:
        """``module`` is exactly this class (a subclass is not: it may change ``forward``)."""
        cls = type(module)
        return cls.__module__ == self.module and cls.__qualname__ == self.name

    def in_hierarchy(self, module: nn.Module) -> type | None:
        """The class of ``module``'s hierarchy (its MRO) that is this class, or ``None``.

        FSDP2's ``fully_shard`` swaps a module's class for a dynamic subclass (``FSDPGatedDeltaNet``), and
        a user may subclass too; both still run this class's code unless they override ``forward``.
        """
        return next(
            (cls for cls in type(module).__mro__ if cls.__module__ == self.module and cls.__qualname__ == self.name),
            None,
        )

    def resolve(self) -> type:
        """Import and return the class.

        Raises:
            ImportError: its library is not installed.
        """
        return getattr(importlib.import_module(self.module), self.name)

    def config_class(self) -> type:
        """Import and return the config class.

        Raises:
            ValueError: the class has no config class (``config`` is ``None``).
        """
        if self.config is None:
            raise ValueError(f"{self.qualified} is configured by its own attributes, not by a config class")
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

    def mixer_class(self, upstream: UpstreamMixer | None = None) -> type[nn.Module]:
        """Our drop-in's class, or the one replacing ``upstream`` (imports :mod:`fla_ac_isolation.mixers`)."""
        name = upstream.replacement if upstream is not None and upstream.replacement else self.mixer
        return getattr(importlib.import_module("fla_ac_isolation.mixers"), name)


_HF = "transformers.models"
_HF_OFFSETS = ("cu_seq_lens_q", "cu_seq_lens_k")
# transformers' kernel wrapper (use_kernel_func_from_hub_with_fallback) passes on every keyword that is a
# parameter of FLA's chunk_gated_delta_rule; the GDN forward hands its **kwargs to it.
_HF_FLA_KEYWORDS = ("cu_seqlens_cpu", "chunk_indices")

_QWEN3_5_MOE_GDN = UpstreamMixer(
    f"{_HF}.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet",
    f"{_HF}.qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeTextConfig", _HF_OFFSETS, _HF_FLA_KEYWORDS,
)
_QWEN3_5_GDN = UpstreamMixer(
    f"{_HF}.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet",
    f"{_HF}.qwen3_5.configuration_qwen3_5.Qwen3_5TextConfig", _HF_OFFSETS, _HF_FLA_KEYWORDS,
)
_QWEN3_8_GDN = UpstreamMixer(
    f"{_HF}.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextGatedDeltaNet",
    f"{_HF}.qwen4_exp.configuration_qwen4_exp.Qwen4ExpTextConfig", _HF_OFFSETS, _HF_FLA_KEYWORDS,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeGatedDeltaNet",
            (_QWEN3_5_MOE_GDN, _QWEN3_5_GDN),
        ),
        Family(
            "qwen3_8", "Qwen3.8-Flash-Next", "Qwen3_8FlashNextGatedDeltaNet",
            (_QWEN3_8_GDN,),
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
            ),
        ),
    )
}
"""Every family by name."""

FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)

FLA_BACKED_MIXERS: tuple[UpstreamMixer, ...] = (
    _QWEN3_5_MOE_GDN,
    _QWEN3_5_GDN,
    _QWEN3_8_GDN,
    # torchtitan 0.3: the block passes one VarlenMetadata (cu_seq_q, cu_seq_k, ...) positionally; the mixer
    # builds its host offsets itself and takes no chunk schedule
    UpstreamMixer("torchtitan.models.qwen3_5.model", "GatedDeltaNet", None, ("attention_masks",)),
    # OLMo-core 3.0: one cu_doc_lens per batch, as a keyword, to every block; its dispatch functions hand
    # FLA cu_seqlens only (no host offsets, no chunk schedule)
    UpstreamMixer("olmo_core.nn.attention.recurrent", "GatedDeltaNet", None, ("cu_doc_lens",)),
    UpstreamMixer("olmo_core.nn.attention.kda", "KimiDeltaAttention", None, ("cu_doc_lens",)),
)
"""Every upstream class that hands packed offsets to FLA: what :func:`~fla_ac_isolation.isolate_seqlens` hooks."""


def upstream_mixers() -> list[tuple[UpstreamMixer, Family]]:
    """Every upstream class with the family whose mixer replaces it, in registry order."""
    return [(upstream, family) for family in FAMILIES.values() for upstream in family.upstream]
