"""The model families this package covers, once: our mixer, the upstream classes it replaces, their configs,
and what is known of every FLA-backed mixer of other libraries (which :func:`~fla_ac_isolation.isolate_seqlens`
hooks, which leak across packed documents).

Every part that lists families or upstream classes, or needs a fact about one, reads this registry:
:func:`~fla_ac_isolation.swap_mixers`, :func:`~fla_ac_isolation.isolate_seqlens`, ``fla-ac-isolation check`` and
``doctor``, the audit's fix line, the regression and the audit (``--model`` choices; each family's tiny decoder
is built from :attr:`Family.tiny`), the benchmarks (:func:`layer_fields`) and the tests.

:data:`FAMILIES` (``qwen3_5_moe``, ``qwen3_8``, ``nemotron_h``, ``kimi_linear``): our drop-in per family and the
upstream classes it replaces (:attr:`Family.upstream`). Foreign FLA-backed mixers (:func:`foreign_mixer`
answers for any module):

* :data:`FLA_BACKED_MIXERS`: the classes that hand packed offsets to FLA, named one by one: transformers
  5.24's six Gated DeltaNets, torchtitan 0.3's Qwen3.5 ``GatedDeltaNet``, OLMo-core 3.0's ``GatedDeltaNet``
  and ``KimiDeltaAttention``. transformers' six also leak without ``causal_conv1d``
  (:attr:`UpstreamMixer.leaks_without`, :class:`PackageLeak`): their short conv then runs across documents;
* flash-linear-attention's own layers and models (``fla.layers``, ``fla.models``) by a rule over the class
  (:func:`fla_layer_mixer`);
* :data:`LEAKING_MIXERS`: classes known to drop the offsets (isolation cannot fix that): transformers' three
  KDA classes and Nemotron-H's Mamba2, OLMo-core's ``NemotronMamba2Mixer``; FLA's own by the same rule.

Nothing here imports transformers, OLMo-core, torchtitan, FLA or the mixers; :meth:`Family.mixer_class`,
:meth:`Family.config_class`, :meth:`ForeignClass.resolve` and :meth:`PackageLeak.applies` import on demand.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "FLA_BACKED_MIXERS",
    "FLA_LAYER_MODULES",
    "LAYERS",
    "LEAKING_MIXERS",
    "Family",
    "ForeignClass",
    "LeakingMixer",
    "PackageLeak",
    "TinyRecipe",
    "UpstreamMixer",
    "drop_in_for",
    "family_for_layer",
    "fla_layer_mixer",
    "foreign_mixer",
    "layer_fields",
    "upstream_mixers",
]

LAYERS: tuple[str, ...] = ("gdn", "mamba2")
"""The kinds of FLA-backed mixer a family's layers run: Gated DeltaNet, or Mamba2 (FLA's simple GLA as its SSD)."""


def layer_fields(layer: str, hidden: int) -> dict[str, int]:
    """Config fields of a ``layer`` mixer (``gdn`` | ``mamba2``) at model width ``hidden`` (``D``): the shapes
    the benchmarks run (transformers' field names, read by our mixers).

    GDN: head dims ``K = V = min(128, D // 4)``, ``D // K`` key and value heads (hidden 2048: 16 heads of 128).
    Mamba2: head dim ``P = min(64, D // 4)``, ``H = 2 * D // P`` heads (expand 2), ``G = min(8, H)`` groups, state
    ``N = min(128, D)`` (hidden 2048: 64 heads of 64, 8 groups, state 128). Hidden 64: GDN 4x16, Mamba2 8x16.

    Raises:
        ValueError: ``hidden`` does not split into whole heads (the message names ``--hidden``, the
            benchmarks' flag), or ``layer`` is not one of :data:`LAYERS`.
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
        """The class of ``module``'s MRO that is this class, or ``None`` (FSDP2's ``fully_shard`` swaps a module's
        class for a dynamic subclass, ``FSDPGatedDeltaNet``; both run this class's code unless forward changes)."""
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
    """A class handing FLA its offsets still mixes packed documents unless ``package`` imports: without it, part
    of its forward runs a fallback blind to document bounds (isolation keeps offsets fresh, cannot change that).

    Attributes:
        package: the import name (``"causal_conv1d"``); why: what runs instead, in a clause;
        otherwise: what to do where :func:`~fla_ac_isolation.swap_mixers` has no drop-in.
    """

    package: str
    why: str
    otherwise: str

    def applies(self) -> bool:
        """``package`` cannot be imported here (tried as the class's library tries it: not installed or broken)."""
        try:
            importlib.import_module(self.package)
        except Exception:
            return True
        return False


@dataclass(frozen=True)
class UpstreamMixer(ForeignClass):
    """A mixer class of another library: one of our mixers replaces it, or it is isolated in place.

    Attributes:
        config: the config class its model is built from, ``"module.Class"``; ``None`` when the module
            carries its own configuration as attributes (OLMo-core), which the replacement reads.
        offsets: the arguments of its ``forward`` (keyword or positional) carrying packed offsets to FLA: integer
            ``[N + 1]`` tensors or NamedTuples holding them (torchtitan's ``VarlenMetadata``); empty: no FLA call
            with offsets (nothing for ``isolate_seqlens`` to do).
        fla_keywords: FLA keywords (``cu_seqlens_cpu``, ``chunk_indices``) its ``forward`` hands on to FLA's
            kernel, so ``isolate_seqlens`` may add them.
        replacement: our class replacing it (in :mod:`fla_ac_isolation.mixers`) when not the family's own
            mixer (another interface around the same maths).
        leaks_without: the package whose absence makes it mix packed documents (:class:`PackageLeak`), or ``None``.
    """

    config: str | None = None
    offsets: tuple[str, ...] = ()
    fla_keywords: tuple[str, ...] = ()
    replacement: str | None = None
    leaks_without: PackageLeak | None = None

    def leak(self) -> str | None:
        """How its packed documents mix in this environment (:attr:`leaks_without` applies), else ``None``."""
        return self.leaks_without.why if self.leaks_without is not None and self.leaks_without.applies() else None

    def leak_remedy(self) -> str | None:
        """What to do about :meth:`leak` (as :meth:`LeakingMixer.remedy`); ``None`` without :attr:`leaks_without`."""
        return None if self.leaks_without is None else _remedy(self, self.leaks_without.otherwise)

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
    """A mixer class of another library that drops packed offsets: its packed documents leak into each other. No
    isolation fixes that; :func:`~fla_ac_isolation.swap_mixers` does where a drop-in exists (:func:`drop_in_for`).

    Attributes:
        why: how the offsets are lost, in a clause (``"runs its Mamba2 over the packed row ..."``).
        otherwise: what to do where ``swap_mixers`` has no drop-in for it.
    """

    why: str = ""
    otherwise: str = "train it on unpacked batches (one document per row)"

    def remedy(self) -> str:
        """What to do: ``swap_mixers(model)`` naming the drop-in where :func:`drop_in_for` has one, else
        :attr:`otherwise`."""
        return _remedy(self, self.otherwise)


def _remedy(entry: ForeignClass, otherwise: str) -> str:
    found = drop_in_for(entry)
    if found is None:
        return f"no drop-in here: {otherwise}"
    upstream, family = found
    return f"use swap_mixers(model) (drop-in fla_ac_isolation.mixers.{upstream.replacement or family.mixer})"


@dataclass(frozen=True)
class TinyRecipe:
    """What the regression's tiny decoder of a family is (the harness's ``regression/model.py`` builds it
    from the family's config class, :meth:`Family.config_class`, at the regression's sizes).

    Attributes:
        layout: the decoder's blocks and its config's field names. ``"qwen"``: per 4 layers, three mixer blocks
            then one gated attention block (output gate, qk-norm, partial RoPE), each followed by a routed MoE
            with a shared expert (softmax router), listed in ``layer_types``. ``"nemotron_h"``: one mixer per
            block, Mamba2 / MoE / attention (no RoPE) / MoE (sigmoid router), listed in ``layers_block_type``.
        attention_type: the config's name of the attention layers (``"full_attention"``; Qwen3.8's
            ``"indexed_attention"``, which the tiny decoder runs as plain gated attention).
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
        mixer: our drop-in's class name in :mod:`fla_ac_isolation.mixers`.
        upstream: the classes our mixer replaces, first the family's own (whose ``config`` class configures
            our mixer too).
        layer: the kind of FLA-backed mixer, one of :data:`LAYERS` (its widths: :func:`layer_fields`).
        fla_cp: under context parallelism its mixers run FLA's CP kernels (the Gated DeltaNet families); ``False``
            for Nemotron-H (head-parallel Mamba2: FLA 0.6 has no CP for simple GLA) and Kimi-Linear.
        tiny: how the regression builds its tiny decoder.
    """

    name: str
    title: str
    mixer: str
    upstream: tuple[UpstreamMixer, ...]
    layer: str
    fla_cp: bool
    tiny: TinyRecipe

    def mixer_class(self, upstream: UpstreamMixer | None = None) -> type[nn.Module]:
        """Our drop-in's class, or the one replacing ``upstream`` (imports :mod:`fla_ac_isolation.mixers`)."""
        name = upstream.replacement if upstream is not None and upstream.replacement else self.mixer
        return getattr(importlib.import_module("fla_ac_isolation.mixers"), name)

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
    """A transformers 5.24 Gated DeltaNet: ``cu_seqlens=kwargs.pop("cu_seq_lens_q")`` to FLA, the rest of its
    ``**kwargs`` through transformers' kernel wrapper (host offsets, chunk schedule); its conv needs causal_conv1d."""
    return UpstreamMixer(f"{_HF}.{folder}.modeling_{folder}", name, f"{_HF}.{folder}.configuration_{folder}.{config}",
                         _HF_OFFSETS, _HF_FLA_KEYWORDS, leaks_without=_HF_CONV_LEAK)


_QWEN3_5_MOE_GDN = _hf_gdn("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeTextConfig")
_QWEN3_5_GDN = _hf_gdn("qwen3_5", "Qwen3_5GatedDeltaNet", "Qwen3_5TextConfig")
_QWEN3_8_GDN = _hf_gdn("qwen4_exp", "Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextConfig")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeGatedDeltaNet",
            (_QWEN3_5_MOE_GDN, _QWEN3_5_GDN),
            layer="gdn", fla_cp=True, tiny=TinyRecipe("qwen"),
        ),
        Family(
            "qwen3_8", "Qwen3.8-Flash-Next", "Qwen3_8FlashNextGatedDeltaNet",
            (_QWEN3_8_GDN,),
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

FLA_BACKED_MIXERS: tuple[UpstreamMixer, ...] = (
    _QWEN3_5_MOE_GDN,
    _QWEN3_5_GDN,
    _QWEN3_8_GDN,
    _hf_gdn("qwen3_next", "Qwen3NextGatedDeltaNet", "Qwen3NextConfig"),
    _hf_gdn("olmo_hybrid", "OlmoHybridGatedDeltaNet", "OlmoHybridConfig"),
    _hf_gdn("lara_mini", "LaraMiniGatedDeltaNet", "LaraMiniConfig"),
    # torchtitan 0.3: one VarlenMetadata (cu_seq_q, cu_seq_k, ...), positional; no host offsets or chunk schedule
    UpstreamMixer("torchtitan.models.qwen3_5.model", "GatedDeltaNet", None, ("attention_masks",)),
    # OLMo-core 3.0: one cu_doc_lens per batch, a keyword, to every block; FLA gets cu_seqlens only
    UpstreamMixer("olmo_core.nn.attention.recurrent", "GatedDeltaNet", None, ("cu_doc_lens",)),
    UpstreamMixer("olmo_core.nn.attention.kda", "KimiDeltaAttention", None, ("cu_doc_lens",)),
)
"""Classes named one by one that hand packed offsets to FLA: what ``isolate_seqlens`` hooks besides FLA's own."""

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
"""Upstream classes, named one by one, known to drop packed offsets (FLA's own: :func:`fla_layer_mixer`)."""

FLA_LAYER_MODULES: tuple[str, ...] = ("fla.layers.", "fla.models.")
"""Where flash-linear-attention 0.6 defines its layers and models: the modules the FLA rule reads."""

_READS_CU_SEQLENS = re.compile(r"""kwargs\s*(?:\.get\(|\.pop\(|\[)\s*['"]cu_seqlens['"]""")
_FLA_DROPS_WHY = "takes **kwargs but its forward never reads cu_seqlens (no varlen path)"
_FLA_DROPS_OTHERWISE = "train it on unpacked batches (one document per row), or use an FLA layer that reads cu_seqlens"


def fla_layer_mixer(cls: type, sources: dict | None = None) -> UpstreamMixer | LeakingMixer | None:
    """The FLA rule: what a class of flash-linear-attention's ``fla.layers`` / ``fla.models`` does with offsets.

    FLA's models hand one ``cu_seqlens`` (``[N + 1]`` int32/int64) through ``**kwargs`` to every block and
    layer. The rule, over the first class of ``cls``'s hierarchy defined under :data:`FLA_LAYER_MODULES` (so
    FSDP2's renamed classes and subclasses are judged by FLA's class), skipping ``PreTrainedModel`` classes:

    * its ``forward`` names a ``cu_seqlens`` parameter, or takes ``**kwargs`` and its source reads ``cu_seqlens``
      out of them: an :class:`UpstreamMixer` with offsets ``("cu_seqlens",)`` (48 classes in 0.6: 40 of the 45
      ``fla.layers`` exports, and 8 more: ``SimpleGatedLinearAttention``, RWKV6/7's helpers, feed-forwards, blocks);
    * a class of ``fla.layers`` whose ``forward`` takes ``**kwargs`` and never reads ``cu_seqlens``: a
      :class:`LeakingMixer` (0.6: ``BasedLinearAttention``, ``ReBasedLinearAttention``, ``Mamba``, ``Mamba2``,
      ``LogLinearMamba2``); anything else: ``None``.

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


def foreign_mixer(module: nn.Module, sources: dict | None = None) -> tuple[UpstreamMixer | LeakingMixer, type] | None:
    """What this registry knows of ``module``'s class, and the class of its hierarchy that matched.

    Named classes first (:data:`FLA_BACKED_MIXERS`, then :data:`LEAKING_MIXERS`, matched along the class
    hierarchy), then the FLA rule (:func:`fla_layer_mixer`; ``sources`` as there). ``None``: not an
    FLA-backed mixer this package knows (our own drop-ins included: they isolate themselves).
    """
    for entry in (*FLA_BACKED_MIXERS, *LEAKING_MIXERS):
        cls = entry.in_hierarchy(module)
        if cls is not None:
            return entry, cls
    entry = fla_layer_mixer(type(module), sources)
    if entry is None:
        return None
    return entry, next(c for c in type(module).__mro__ if c.__module__ == entry.module and c.__qualname__ == entry.name)


def drop_in_for(entry: ForeignClass) -> tuple[UpstreamMixer, Family] | None:
    """The family whose drop-in :func:`~fla_ac_isolation.swap_mixers` puts in place of ``entry``'s class
    (with the registry's :class:`UpstreamMixer` for it), or ``None``."""
    return next(((u, f) for u, f in upstream_mixers() if u.qualified == entry.qualified), None)


def upstream_mixers() -> list[tuple[UpstreamMixer, Family]]:
    """Every upstream class with the family whose mixer replaces it, in registry order."""
    return [(upstream, family) for family in FAMILIES.values() for upstream in family.upstream]


def family_for_layer(layer: str) -> Family:
    """The first family (registry order) whose mixer is a ``layer`` (:data:`LAYERS`): the benchmarks' layer.

    Raises:
        ValueError: ``layer`` is not one of :data:`LAYERS`.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    return next(family for family in FAMILIES.values() if family.layer == layer)
