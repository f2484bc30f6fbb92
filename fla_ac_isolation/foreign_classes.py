"""Other libraries' FLA-backed classes: which hand packed offsets to FLA (:data:`FLA_BACKED_MIXERS`), which drop
them (:data:`LEAKING_MIXERS`), the rule for FLA's own layers (:func:`fla_layer_mixer`), and which of them a drop-in
of :mod:`fla_ac_isolation.mixers` replaces (:data:`DROP_IN_NAMES`, names only). Matched by module and class name;
nothing here imports those libraries or the mixers. ``docs/foreign-classes.md``'s table is rendered from here.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

from torch import nn

__all__ = [
    "DROP_IN_NAMES",
    "FLA_BACKED_MIXERS",
    "FLA_LAYER_MODULES",
    "LEAKING_MIXERS",
    "ForeignClass",
    "LeakingMixer",
    "PackageLeak",
    "UpstreamMixer",
    "drop_in_name",
    "fla_layer_mixer",
    "foreign_mixer",
    "is_drop_in",
    "leak_remedy",
    "named",
    "remedy",
]

_FRAMEWORKS = (("transformers.", "transformers"), ("torchtitan.", "torchtitan"), ("olmo_core.", "OLMo-core"),
               ("fla.", "flash-linear-attention"))


@dataclass(frozen=True)
class ForeignClass:
    """A class of another library, named by its module and class name (never imported to be matched).

    Attributes:
        module: the module defining the class (``transformers.models.qwen3_5_moe.modeling_qwen3_5_moe``).
        name: the class name there (``Qwen3_5MoeGatedDeltaNet``).
    """

    module: str
    name: str

    @property
    def qualified(self) -> str:
        """``"module.Class"``."""
        return f"{self.module}.{self.name}"

    @property
    def framework(self) -> str:
        """The library in prose: ``transformers``, ``torchtitan``, ``OLMo-core`` or ``flash-linear-attention``."""
        return next((name for prefix, name in _FRAMEWORKS if self.module.startswith(prefix)), self.module)

    def matches(self, module: nn.Module) -> bool:
        """``module`` is exactly this class (a subclass is not: it may change ``forward``)."""
        cls = type(module)
        return cls.__module__ == self.module and cls.__qualname__ == self.name

    def in_hierarchy(self, module: nn.Module) -> type | None:
        """The class of ``module``'s MRO that is this class (FSDP2 subclasses it), or ``None``."""
        mro = type(module).__mro__
        return next((cls for cls in mro if cls.__module__ == self.module and cls.__qualname__ == self.name), None)

    def resolve(self) -> type:
        """Import and return the class.

        Raises:
            ImportError: its library is not installed.
        """
        return getattr(importlib.import_module(self.module), self.name)


@dataclass(frozen=True)
class PackageLeak:
    """A class handing FLA its offsets still mixes packed documents unless ``package`` imports (its fallback is
    blind to document bounds; isolation cannot change that).

    Attributes:
        package: the import name (``"causal_conv1d"``); why: what runs instead, in a clause;
        otherwise: what to do where :func:`~fla_ac_isolation.swap_mixers` has no drop-in.
    """

    package: str
    why: str
    otherwise: str

    def applies(self) -> bool:
        """``package`` cannot be imported here (not installed or broken)."""
        try:
            importlib.import_module(self.package)
        except Exception:
            return True
        return False


@dataclass(frozen=True)
class UpstreamMixer(ForeignClass):
    """A mixer class of another library: one of our mixers replaces it, or it is isolated in place.

    Attributes:
        config: its model's config class, ``"module.Class"``; ``None`` when configured by its attributes (OLMo-core).
        offsets: the ``forward`` arguments carrying packed offsets to FLA (``[N + 1]`` integer tensors or
            NamedTuples holding them); empty: no FLA call with offsets.
        fla_keywords: FLA keywords (``cu_seqlens_cpu``, ``chunk_indices``) its ``forward`` hands on to FLA.
        leaks_without: the package whose absence makes it mix packed documents (:class:`PackageLeak`), or ``None``.
    """

    config: str | None = None
    offsets: tuple[str, ...] = ()
    fla_keywords: tuple[str, ...] = ()
    leaks_without: PackageLeak | None = None

    def leak(self) -> str | None:
        """How its packed documents mix in this environment (:attr:`leaks_without` applies), else ``None``."""
        return self.leaks_without.why if self.leaks_without is not None and self.leaks_without.applies() else None

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
class LeakingMixer(ForeignClass):
    """A mixer class of another library that drops packed offsets, so its documents mix (no isolation fixes that;
    :func:`~fla_ac_isolation.swap_mixers` does where a drop-in exists).

    Attributes:
        why: how the offsets are lost, in a clause (``"runs its Mamba2 over the packed row ..."``).
        otherwise: what to do where ``swap_mixers`` has no drop-in for it.
    """

    why: str = ""
    otherwise: str = "train it on unpacked batches (one document per row)"


_HF = "transformers.models"
_HF_OFFSETS = ("cu_seq_lens_q", "cu_seq_lens_k")
# transformers' kernel wrapper passes on every keyword of FLA's chunk_gated_delta_rule from the GDN's **kwargs
_HF_FLA_KEYWORDS = ("cu_seqlens_cpu", "chunk_indices")

# transformers binds causal_conv1d_fn at import: causal-conv1d's kernel if that package imports, else a torch conv
# over the packed row. The kernel keeps documents apart by seq_idx ([B, T], handed on from the GDN's **kwargs), not
# by cu_seq_lens_q (read from source, not measured).
_HF_CONV_LEAK = PackageLeak(
    "causal_conv1d",
    "its short conv runs transformers' torch causal_conv1d_fn across document boundaries (the causal_conv1d "
    "package cannot be imported here)",
    "install causal_conv1d (CUDA) and pass seq_idx (DataCollatorWithFlattening(return_seq_idx=True)), or expect "
    "documents to mix in the conv",
)


def _hf_gdn(folder: str, name: str, config: str) -> UpstreamMixer:
    """A transformers Gated DeltaNet (offsets ``cu_seq_lens_q``, FLA keywords passed on, conv needs causal_conv1d)."""
    return UpstreamMixer(f"{_HF}.{folder}.modeling_{folder}", name, f"{_HF}.{folder}.configuration_{folder}.{config}",
                         _HF_OFFSETS, _HF_FLA_KEYWORDS, leaks_without=_HF_CONV_LEAK)


FLA_BACKED_MIXERS: tuple[UpstreamMixer, ...] = (
    _hf_gdn("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeTextConfig"),
    _hf_gdn("qwen3_5", "Qwen3_5GatedDeltaNet", "Qwen3_5TextConfig"),
    _hf_gdn("qwen4_exp", "Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextConfig"),
    _hf_gdn("qwen3_next", "Qwen3NextGatedDeltaNet", "Qwen3NextConfig"),
    _hf_gdn("olmo_hybrid", "OlmoHybridGatedDeltaNet", "OlmoHybridConfig"),
    _hf_gdn("lara_mini", "LaraMiniGatedDeltaNet", "LaraMiniConfig"),
    # torchtitan 0.3: one VarlenMetadata (cu_seq_q, cu_seq_k, ...), positional; no host offsets or chunk schedule
    UpstreamMixer("torchtitan.models.qwen3_5.model", "GatedDeltaNet", None, ("attention_masks",)),
    # OLMo-core 3.0: one cu_doc_lens per batch, a keyword, to every block; FLA gets cu_seqlens only
    UpstreamMixer("olmo_core.nn.attention.recurrent", "GatedDeltaNet", None, ("cu_doc_lens",)),
    UpstreamMixer("olmo_core.nn.attention.kda", "KimiDeltaAttention", None, ("cu_doc_lens",)),
)
"""Named classes that hand packed offsets to FLA: what ``isolate_seqlens`` hooks besides FLA's own."""

_HF_KDA_WHY = ("calls FLA's chunk_kda through transformers' kernel wrapper, which keeps only chunk_kda's own "
               "parameter names, so cu_seq_lens_q never reaches the kernel; its conv (transformers' torch "
               "fallback) refuses cu_seqlens")

LEAKING_MIXERS: tuple[LeakingMixer, ...] = (
    *(LeakingMixer(f"{_HF}.{folder}.modeling_{folder}", name, _HF_KDA_WHY) for folder, name in (
        ("kimi_linear", "KimiLinearDeltaAttention"), ("bailing_hybrid", "BailingHybridDeltaAttention"),
        ("glm5_next", "Glm5NextTextLinearAttention"))),
    LeakingMixer(f"{_HF}.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer",
                 "runs its Mamba2 (torch path, or mamba_ssm) over the packed row without document bounds"),
    LeakingMixer("olmo_core.nn.attention.recurrent", "NemotronMamba2Mixer",
                 "deletes its **kwargs, cu_doc_lens included, and runs a pure-torch SSD over the packed row"),
)
"""Named upstream classes known to drop packed offsets (FLA's own: :func:`fla_layer_mixer`)."""

FLA_LAYER_MODULES: tuple[str, ...] = ("fla.layers.", "fla.models.")
"""Where flash-linear-attention 0.6 defines its layers and models: the modules the FLA rule reads."""

_READS_CU_SEQLENS = re.compile(r"""kwargs\s*(?:\.get\(|\.pop\(|\[)\s*['"]cu_seqlens['"]""")
_FLA_DROPS_WHY = "takes **kwargs but its forward never reads cu_seqlens (no varlen path)"
_FLA_DROPS_OTHERWISE = "train it on unpacked batches (one document per row), or use an FLA layer that reads cu_seqlens"


def fla_layer_mixer(cls: type, sources: dict | None = None) -> UpstreamMixer | LeakingMixer | None:
    """The FLA rule: what a class of flash-linear-attention's ``fla.layers`` / ``fla.models`` does with offsets.

    Judged on the first class of ``cls``'s MRO under :data:`FLA_LAYER_MODULES` (``PreTrainedModel`` skipped): its
    ``forward`` names ``cu_seqlens`` or reads it from ``**kwargs``: an :class:`UpstreamMixer` with offsets
    ``("cu_seqlens",)``; an ``fla.layers`` class taking ``**kwargs`` that never reads it: a :class:`LeakingMixer`;
    else ``None``.

    Args:
        cls: the class to judge (``type(module)``).
        sources: a dict to memoise ``forward`` sources in, across calls of one caller (optional).
    """
    target = next((c for c in cls.__mro__ if c.__module__.startswith(FLA_LAYER_MODULES)), None)
    if target is None or not issubclass(target, nn.Module) or any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in target.__mro__
    ):
        return None
    forward = target.forward
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.name == "cu_seqlens" for p in params):
        return UpstreamMixer(target.__module__, target.__qualname__, None, ("cu_seqlens",))
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    memo = sources if sources is not None else {}
    if forward not in memo:
        try:
            memo[forward] = inspect.getsource(forward)
        except (OSError, TypeError):
            memo[forward] = ""
    if _READS_CU_SEQLENS.search(memo[forward]):
        return UpstreamMixer(target.__module__, target.__qualname__, None, ("cu_seqlens",))
    if target.__module__.startswith("fla.layers."):
        return LeakingMixer(target.__module__, target.__qualname__, _FLA_DROPS_WHY, _FLA_DROPS_OTHERWISE)
    return None


DROP_IN_NAMES: dict[str, str] = {
    **{f"{_HF}.{folder}.modeling_{folder}.{name}": drop_in for folder, name, drop_in in (
        ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"),
        ("qwen3_5", "Qwen3_5GatedDeltaNet", "Qwen3_5GatedDeltaNet"),
        ("qwen4_exp", "Qwen4ExpTextGatedDeltaNet", "Qwen3_8FlashNextGatedDeltaNet"),
        ("qwen3_next", "Qwen3NextGatedDeltaNet", "Qwen3NextGatedDeltaNet"),
        ("olmo_hybrid", "OlmoHybridGatedDeltaNet", "OlmoHybridGatedDeltaNet"),
        ("lara_mini", "LaraMiniGatedDeltaNet", "LaraMiniGatedDeltaNet"),
        ("nemotron_h", "NemotronHMamba2Mixer", "NemotronHMamba2Mixer"),
        ("kimi_linear", "KimiLinearDeltaAttention", "KimiLinearDeltaAttention"),
        ("glm5_next", "Glm5NextTextLinearAttention", "Glm5NextTextLinearAttention"),
        ("bailing_hybrid", "BailingHybridDeltaAttention", "BailingHybridDeltaAttention"),
    )},
    "olmo_core.nn.attention.recurrent.NemotronMamba2Mixer": "OlmoNemotronMamba2Mixer",
    "fla.layers.mamba2.Mamba2": "FlaMamba2",
}
"""``{replaced class ("module.Class"): the name of our drop-in in fla_ac_isolation.mixers}``: what
:func:`~fla_ac_isolation.swap_mixers` replaces (the families say how each is configured and tested)."""


def drop_in_name(entry: ForeignClass) -> str | None:
    """The name of the drop-in replacing ``entry``'s class (:data:`DROP_IN_NAMES`), or ``None``."""
    return DROP_IN_NAMES.get(entry.qualified)


def remedy(entry: LeakingMixer) -> str:
    """What to do about a class that drops its offsets: ``swap_mixers`` where a drop-in exists, else
    ``entry.otherwise``."""
    return _remedy(entry, entry.otherwise)


def leak_remedy(entry: UpstreamMixer) -> str | None:
    """What to do about ``entry.leak()`` (as :func:`remedy`); ``None`` without ``leaks_without``."""
    return None if entry.leaks_without is None else _remedy(entry, entry.leaks_without.otherwise)


def _remedy(entry: ForeignClass, otherwise: str) -> str:
    name = drop_in_name(entry)
    if name is None:
        return f"no drop-in here: {otherwise}"
    return f"use swap_mixers(model) (drop-in fla_ac_isolation.mixers.{name})"


def is_drop_in(cls: type) -> bool:
    """``cls`` is (or subclasses, as FSDP2's wrapper class does) a drop-in of :mod:`fla_ac_isolation.mixers`, which
    subclass the classes they replace (read by name: nothing is imported)."""
    return any(c.__module__ == "fla_ac_isolation.mixers" and "replaced" in vars(c) for c in cls.__mro__)


def foreign_mixer(module: nn.Module, sources: dict | None = None) -> tuple[UpstreamMixer | LeakingMixer, type] | None:
    """``(entry, matched class of its MRO)`` for ``module``: named classes first, then the FLA rule; ``None`` when
    not a known FLA-backed mixer (our own drop-ins included, though they subclass the classes they replace)."""
    if is_drop_in(type(module)):
        return None
    for entry in (*FLA_BACKED_MIXERS, *LEAKING_MIXERS):
        cls = entry.in_hierarchy(module)
        if cls is not None:
            return entry, cls
    entry = fla_layer_mixer(type(module), sources)
    if entry is None:
        return None
    return entry, next(c for c in type(module).__mro__ if c.__module__ == entry.module and c.__qualname__ == entry.name)


def named(qualified: str) -> UpstreamMixer | LeakingMixer:
    """The entry of :data:`FLA_BACKED_MIXERS` or :data:`LEAKING_MIXERS` for ``"module.Class"``.

    Raises:
        KeyError: no named entry has that qualified name.
    """
    found = next((e for e in (*FLA_BACKED_MIXERS, *LEAKING_MIXERS) if e.qualified == qualified), None)
    if found is None:
        raise KeyError(f"no named foreign class {qualified!r}")
    return found
