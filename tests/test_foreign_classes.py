"""Every FLA-backed class of other libraries that ``docs/foreign-classes.md`` lists, on the real package, on a CPU.

Per row: the class as shipped (fails, diverges, leaks across packed documents, or is latent: the audit sees the
divergence while the numbers still agree) and with our answer (``isolate_seqlens``: bit for bit against the
same model without AC, every checkpointed region aligned; or the LeakingMixerWarning naming what to do).
FLA's kernels are served by :func:`fla_ac_isolation.harness.reference_kernels.reference_kernels`; AC wraps every
decoder layer under SAC saving every ``_to_copy`` (FLA's int32 miss path casts with it). OLMo-core's and
torchtitan's rows are proved in ``test_isolate_olmo_core.py``, ``test_isolate_torchtitan.py`` and
``test_swap_olmo_core.py``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
import warnings

import pytest
import torch
from helpers import (
    INT_REPLAY,
    audited_step,
    deep_copy,
    fla_layer,
    glm5_next_kda_only,
    gradient_error,
    leak,
    olmo_hybrid,
)
from torch import nn

from fla_ac_isolation import isolate_seqlens, swap_mixers
from fla_ac_isolation.foreign_classes import ForeignClass, LeakingMixer, UpstreamMixer, drop_in_name, fla_layer_mixer
from fla_ac_isolation.harness.foreign_models import build_tiny
from fla_ac_isolation.harness.reference_kernels import reference_kernels
from fla_ac_isolation.harness.transformers_kernels import transformers_version
from fla_ac_isolation.isolate import LeakingMixerWarning
from fla_ac_isolation.policies import POLICIES

pytestmark = pytest.mark.usefixtures("single_thread", "served")

INT = f"RuntimeError: {INT_REPLAY}"
HISTC = "NotImplementedError: \"histogram_cpu\" not implemented for 'Int'"  # an FLA int32 tensor replayed into histc
# not FLA: torchtitan's policy saves topk, and transformers' MoE routers divide its output in place
MUTATED = "RuntimeError: Tensor cached during selective activation checkpoint has been mutated"
LATENT = "latent"  # loss and gradients equal no-AC bit for bit, the audit sees layer 0 diverge (fp32: no op consumes
#                    the shifted int32 cast)


@pytest.fixture(scope="module")
def served():
    with reference_kernels() as served:
        yield served


# ------------------------------------------------------------------------------------ isolate_seqlens rows
LARA_MINI = importlib.util.find_spec("transformers.models.lara_mini") is not None  # transformers >= 5.24
_ROWS = [  # tiny model, mixer class, shipped under save-all-copies in fp32, in bf16, under torchtitan's (measured)
    ("qwen3_5_text", "Qwen3_5GatedDeltaNet", LATENT, INT, LATENT),
    ("qwen3_5_moe_text", "Qwen3_5MoeGatedDeltaNet", HISTC, INT, MUTATED),
    ("qwen4_exp_text", "Qwen4ExpTextGatedDeltaNet", HISTC, INT, MUTATED),
    ("qwen3_next", "Qwen3NextGatedDeltaNet", HISTC, INT, MUTATED),
    ("olmo_hybrid", "OlmoHybridGatedDeltaNet", LATENT, INT, LATENT),
    ("lara_mini", "LaraMiniGatedDeltaNet", HISTC, INT, LATENT),
    ("gated_deltanet", "GatedDeltaNet", LATENT, INT, LATENT),  # flash-linear-attention's GatedDeltaNetForCausalLM
]
ISOLATED = [row for row in _ROWS if row[0] != "lara_mini" or LARA_MINI]
TRANSFORMERS_GDNS = [row[:2] for row in ISOLATED if row[0] != "gated_deltanet"]


def test_lara_mini_ships_from_transformers_5_24_and_its_rows_run_only_there():
    assert LARA_MINI is (transformers_version() >= (5, 24))
    assert ("lara_mini" in {row[0] for row in ISOLATED}) is LARA_MINI and len(TRANSFORMERS_GDNS) == 5 + LARA_MINI
# swap_mixers has a drop-in for their mixer (every transformers GDN from 0.5; 0.4 had none for the last three)
SWAPPABLE = ("qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text", "qwen3_next", "olmo_hybrid", "lara_mini")


def _outcome(step) -> str:
    return f"{type(step.error).__name__}: {str(step.error).splitlines()[0]}" if step.error is not None else LATENT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "mixer", "fp32", "bf16", "titan"), ISOLATED, ids=[row[1] for row in ISOLATED])
def test_shipped_diverges_and_isolate_seqlens_matches_no_ac_bit_for_bit(name, mixer, fp32, bf16, titan, dtype):
    base, _, framework = build_tiny(name)
    base = base.to(dtype)
    paths = [p for p, m in base.named_modules() if type(m).__name__ == mixer]
    no_ac = audited_step(deep_copy(base), framework, checkpointed=False)
    shipped = audited_step(deep_copy(base), framework, checkpointed=True)
    fixed_model = deep_copy(base)
    handle = isolate_seqlens(fixed_model)
    fixed = audited_step(fixed_model, framework, checkpointed=True)

    assert no_ac.error is None, no_ac.error
    expected = fp32 if dtype == torch.float32 else bf16
    assert _outcome(shipped) == expected
    assert shipped.divergent == ["model.layers.0"]  # the first FLA layer: miss in forward, hit in recompute
    helpers = {d.helper for d in shipped.audit.divergent[0].fla}  # FLA's cache: a miss in forward, a hit in recompute
    assert helpers and helpers <= {"prepare_chunk_indices", "prepare_chunk_offsets"}
    framework = "flash-linear-attention" if name == "gated_deltanet" else "transformers"
    swap = " (or swap_mixers(model), which replaces it with a drop-in)" if name in SWAPPABLE else ""
    offsets = "cu_seqlens" if name == "gated_deltanet" else "cu_seq_lens_q, cu_seq_lens_k"
    assert shipped.audit.divergent[0].message.splitlines()[-2] == (  # the audit's fix for a class one does not own
        f"Fix: {mixer} ({framework}) is code you do not own: call isolate_seqlens(model) once after building the "
        f"model{swap}; it gives every {mixer} call fresh {offsets}.")
    if expected == LATENT:
        assert torch.equal(shipped.loss, no_ac.loss) and gradient_error(shipped, no_ac) == 0.0

    assert len(paths) in (3, 4) and handle.paths == paths
    assert fixed.error is None, fixed.error
    assert fixed.audit.ok and len(fixed.audit.regions) == 4
    assert torch.equal(fixed.loss, no_ac.loss)
    assert gradient_error(fixed, no_ac) == 0.0
    assert handle.rewritten == 2 * len(paths)  # every mixer: its forward and its recompute


@pytest.mark.parametrize("policy", ["torchtitan", "save-d2h-copies"])
@pytest.mark.parametrize(("name", "mixer", "fp32", "bf16", "titan"), ISOLATED, ids=[row[1] for row in ISOLATED])
def test_shipped_under_torchtitans_policy_and_the_d2h_rule(name, mixer, fp32, bf16, titan, policy):
    """fp32. The D2H rule saves nothing on a CPU (no device-to-host copy): latent. torchtitan's saves no op of
    FLA's miss path: latent, but it saves ``topk``, which transformers' MoE routers then change in place."""
    base, _, framework = build_tiny(name)
    no_ac = audited_step(deep_copy(base), framework, checkpointed=False)
    shipped = audited_step(base, framework, checkpointed=True, policy=POLICIES[policy]())

    expected = titan if policy == "torchtitan" else LATENT
    assert _outcome(shipped) == expected
    if expected == LATENT:
        assert shipped.divergent == ["model.layers.0"]
        assert torch.equal(shipped.loss, no_ac.loss) and gradient_error(shipped, no_ac) == 0.0


@pytest.mark.slow
def test_flas_kda_model_diverges_shipped_and_isolate_seqlens_matches_no_ac_bit_for_bit():
    """FLA's KDAForCausalLM (chunk_kda served by FLA's naive per-token recurrence: ~1 s a step)."""
    base, _, framework = build_tiny("kda")
    base = base.to(torch.bfloat16)
    lens = (37, 23, 41)
    no_ac = audited_step(deep_copy(base), framework, checkpointed=False, lens=lens)
    shipped = audited_step(deep_copy(base), framework, checkpointed=True, lens=lens)
    fixed_model = deep_copy(base)
    handle = isolate_seqlens(fixed_model)
    fixed = audited_step(fixed_model, framework, checkpointed=True, lens=lens)

    assert _outcome(shipped) == INT and shipped.divergent == ["model.layers.0"]
    assert handle.paths == [f"model.layers.{i}.attn" for i in range(4)]
    assert fixed.audit.ok and len(fixed.audit.regions) == 4
    assert torch.equal(fixed.loss, no_ac.loss) and gradient_error(fixed, no_ac) == 0.0


@pytest.mark.parametrize(("name", "mixer"), TRANSFORMERS_GDNS, ids=[row[1] for row in TRANSFORMERS_GDNS])
def test_transformers_gdn_folders_leak_through_their_torch_conv_which_isolation_keeps_and_the_drop_in_ends(
        name, mixer):
    """Without the causal_conv1d package transformers runs its torch conv fallback, which is never told where
    documents end: 3 tokens of the previous document reach each document's first outputs. Every one of the six
    classes has a drop-in (issue 38), whose conv restarts at each document."""
    model, _, framework = build_tiny(name)
    shipped = leak(model.eval(), framework)
    isolate_seqlens(model)
    isolated = leak(model, framework)
    fresh, _, _ = build_tiny(name)
    swap_mixers(fresh)
    swapped = leak(fresh.eval(), framework)

    assert shipped[0] < 1e-5 and min(shipped[1:]) > 0.04, shipped  # measured 0.044 to 0.106
    assert isolated == shipped  # fresh offsets change nothing here: the conv never receives them
    assert max(swapped) < 1e-5, swapped  # float32 rounding of the chunked scans (measured <= 1.1e-7)


CONV_DROP_IN = {"qwen3_5_text": "Qwen3_5GatedDeltaNet", "qwen3_5_moe_text": "Qwen3_5MoeGatedDeltaNet",
                "qwen4_exp_text": "Qwen3_8FlashNextGatedDeltaNet", "qwen3_next": "Qwen3NextGatedDeltaNet",
                "olmo_hybrid": "OlmoHybridGatedDeltaNet", "lara_mini": "LaraMiniGatedDeltaNet"}


@pytest.mark.parametrize(("name", "mixer"), TRANSFORMERS_GDNS, ids=[row[1] for row in TRANSFORMERS_GDNS])
def test_isolate_seqlens_hooks_a_transformers_gdn_and_warns_its_conv_leaks_unless_causal_conv1d_imports(
        name, mixer, monkeypatch):
    model, _, _ = build_tiny(name)
    paths = [p for p, m in model.named_modules() if type(m).__name__ == mixer]
    drop_in = CONV_DROP_IN.get(name)
    remedy = (f"use swap_mixers(model) (drop-in fla_ac_isolation.mixers.{drop_in})" if drop_in else
              "no drop-in here: install causal_conv1d (CUDA) and pass seq_idx (DataCollatorWithFlattening("
              "return_seq_idx=True)), or expect documents to mix in the conv")

    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # not importable: transformers' torch conv
    with pytest.warns(LeakingMixerWarning) as warned:
        handle = isolate_seqlens(model)
    assert [str(w.message) for w in warned if w.category is LeakingMixerWarning] == [
        f"isolate_seqlens: {mixer} (transformers; {len(paths)} in the model: {', '.join(paths)}) hands FLA its "
        "offsets, but its short conv runs transformers' torch causal_conv1d_fn across document boundaries (the "
        f"causal_conv1d package cannot be imported here): documents are not kept apart: {remedy}"]
    assert handle.paths == paths  # hooked all the same: the AC fault is fixed, the conv leak is not
    handle.remove()

    monkeypatch.setitem(sys.modules, "causal_conv1d", types.ModuleType("causal_conv1d"))  # a stand-in imports
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = isolate_seqlens(model)
    assert not [w for w in caught if issubclass(w.category, LeakingMixerWarning)]
    assert handle.paths == paths


# ------------------------------------------------------------------------------------------ leaking rows
KDA_WHY = ("calls FLA's chunk_kda through transformers' kernel wrapper, which keeps only chunk_kda's own parameter "
           "names, so cu_seq_lens_q never reaches the kernel; its conv (transformers' torch fallback) refuses "
           "cu_seqlens: documents are not kept apart: ")
LEAKING = [  # tiny model, mixer class, what the model returns, smallest leak of documents 2 and 3 (measured)
    ("kimi_linear", "KimiLinearDeltaAttention", "logits", 0.19),  # measured 0.198, 0.314
    ("bailing_hybrid", "BailingHybridDeltaAttention", "logits", 0.7),  # measured 0.769, 0.732
    ("glm5_next", "Glm5NextTextLinearAttention", "last_hidden_state", None),
]


@pytest.mark.parametrize(("name", "mixer", "output", "floor"), LEAKING, ids=[row[1] for row in LEAKING])
def test_transformers_kda_leaks_across_documents_and_isolate_seqlens_names_it(name, mixer, output, floor, served):
    if name == "glm5_next":
        model, framework = glm5_next_kda_only(), "transformers"
    else:
        model, _, framework = build_tiny(name)
        model.eval()
    calls = len(served.calls)
    diffs = leak(model, framework, output=output)
    kda = [c for c in served.calls[calls:] if c.kernel == "chunk_kda"]

    assert kda and all(c.cu_seqlens is None for c in kda)  # the offsets never reach FLA
    assert diffs[0] < 1e-5  # the first document sees no other: rounding only
    assert min(diffs[1:]) > (floor if floor is not None else 0.5), diffs  # glm5: measured 0.86, 1.16
    paths = [p for p, m in model.named_modules() if type(m).__name__ == mixer]
    with pytest.warns(LeakingMixerWarning) as warned, pytest.raises(ValueError, match=(
            rf"isolate_seqlens found no FLA-backed mixer in {type(model).__name__}; its {len(paths)} mixer\(s\) "
            r"that drop the offsets")):
        isolate_seqlens(model)
    (message,) = [str(w.message) for w in warned if w.category is LeakingMixerWarning]
    shown = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
    head = f"isolate_seqlens: {mixer} (transformers; {len(paths)} in the model: {shown}) {KDA_WHY}"
    assert message.startswith(head)
    remedy = message[len(head):]
    cls = type(model.get_submodule(paths[0]))
    if drop_in_name(ForeignClass(cls.__module__, cls.__qualname__)) is None:
        assert remedy == "no drop-in here: train it on unpacked batches (one document per row) until a drop-in exists"
    else:  # once the KDA drop-in's family is registered (families.FAMILIES), swap_mixers is the answer
        assert remedy.startswith("use swap_mixers(model) (drop-in fla_ac_isolation.mixers.")
    with pytest.raises(ValueError, match=rf"'{re.escape(paths[0])}' \({mixer}\) calls FLA's chunk_kda .*isolating "
                                         r"its arguments cannot change that"):
        isolate_seqlens(model, modules=[paths[0]], arg_names=["cu_seq_lens_q"])  # the attempt


def test_nemotron_h_mamba2_leaks_isolate_seqlens_names_it_and_swap_mixers_fixes_it():
    model, _, framework = build_tiny("nemotron_h")
    paths = ["model.layers.0.mixer", "model.layers.2.mixer"]
    shipped = leak(model.eval(), framework)
    with pytest.warns(LeakingMixerWarning, match=re.escape(
            f"isolate_seqlens: NemotronHMamba2Mixer (transformers; 2 in the model: {', '.join(paths)}) runs its "
            "Mamba2 (torch path, or mamba_ssm) over the packed row without document bounds: documents are not kept "
            "apart: use swap_mixers(model) (drop-in fla_ac_isolation.mixers.NemotronHMamba2Mixer)")), \
            pytest.raises(ValueError, match="found no FLA-backed mixer in NemotronHForCausalLM"):
        isolate_seqlens(model)

    assert shipped[0] < 1e-5 and min(shipped[1:]) > 0.3, shipped  # measured 0.421, 0.458
    assert swap_mixers(model) == paths
    assert max(leak(model, framework)) < 1e-5
    model.train()
    no_ac = audited_step(deep_copy(model), framework, checkpointed=False)
    swapped = audited_step(model, framework, checkpointed=True)
    assert swapped.audit.ok and len(swapped.audit.regions) == 4
    assert torch.equal(swapped.loss, no_ac.loss) and gradient_error(swapped, no_ac) == 0.0


def test_olmo_cores_nemotron_mamba2_is_named_and_its_gated_deltanet_still_hooked():
    pytest.importorskip("olmo_core")
    model = olmo_hybrid(("mamba", "gdn"))
    with pytest.warns(LeakingMixerWarning, match=re.escape(
            "isolate_seqlens: NemotronMamba2Mixer (OLMo-core; 1 in the model: blocks.0.attention) deletes its "
            "**kwargs, cu_doc_lens included, and runs a pure-torch SSD over the packed row: documents are not kept "
            "apart: use swap_mixers(model) (drop-in fla_ac_isolation.mixers.OlmoNemotronMamba2Mixer)")):
        handle = isolate_seqlens(model)
    assert handle.paths == ["blocks.1.attention"]


FLA_DROPS = ["BasedLinearAttention", "ReBasedLinearAttention", "Mamba", "Mamba2", "LogLinearMamba2"]
FLA_DROP_INS = {"Mamba2": "FlaMamba2"}  # swap_mixers' drop-ins (tests/test_fla_mamba2_swap.py)


@pytest.mark.parametrize("name", FLA_DROPS)
def test_flas_layers_without_a_varlen_path_are_named_as_leaking(name):
    """Their kernels are Triton's only (no CPU run): the evidence is the class itself, a forward that takes
    ``**kwargs`` (so a packed ``cu_seqlens`` is accepted) and never reads ``cu_seqlens``."""
    layer = fla_layer(name)
    entry = fla_layer_mixer(type(layer))
    model = nn.ModuleDict({"mixer": layer})
    remedy = (f"use swap_mixers(model) (drop-in fla_ac_isolation.mixers.{FLA_DROP_INS[name]})" if name in FLA_DROP_INS
              else "no drop-in here: train it on unpacked batches (one document per row), or use an FLA layer that "
                   "reads cu_seqlens")
    with pytest.warns(LeakingMixerWarning, match=re.escape(
            f"isolate_seqlens: {name} (flash-linear-attention; 1 in the model: mixer) takes **kwargs but its forward "
            f"never reads cu_seqlens (no varlen path): documents are not kept apart: {remedy}")), \
            pytest.raises(ValueError, match="found no FLA-backed mixer in ModuleDict"):
        isolate_seqlens(model)
    assert isinstance(entry, LeakingMixer) and entry.qualified == f"{type(layer).__module__}.{name}"


# ------------------------------------------------------------------------------------------ the FLA rule
FLA_TAKES = {  # fla.layers.__all__ of flash-linear-attention 0.6 minus FLA_DROPS: 40 classes
    "ABCAttention", "Attention", "BitAttention", "Comba", "CyclicFlowAttention", "DeltaFormerAttention", "DeltaNet",
    "ForgettingAttention", "GatedDeltaNet", "GatedDeltaNet2", "GatedDeltaProduct", "GatedLinearAttention",
    "GatedSlotAttention", "HGRN2Attention", "HGRNAttention", "KimiDeltaAttention", "LightNetAttention",
    "LinearAttention", "Mamba3", "MesaNet", "MoBA", "MomAttention", "MomentumDeltaNet", "MultiScaleRetention",
    "MultiheadLatentAttention", "NativeSparseAttention", "PaTHAttention", "Parallax", "PrecondGatedDeltaNet",
    "PrecondKDA", "RWKV6Attention", "RWKV7Attention", "Raven", "RodimusAttention", "SlidingWindowSharedKeyAttention",
    "StickBreakingAttention", "WallAttention", "YOCOCrossAttention", "YOCOGatedRetention", "YOCOSharedKVBuilder",
}


# flash-linear-attention 0.5.2 lacks five of 0.6's layers, and its LinearAttention has no varlen path (drops
# cu_seqlens); read with the rule on 0.5.2
_NOT_IN_052 = {"CyclicFlowAttention", "MomentumDeltaNet", "PrecondGatedDeltaNet", "PrecondKDA", "StickBreakingAttention"}
_FLA_CENSUS = {  # release -> (classes fla.layers exports, those taking cu_seqlens, those dropping it)
    "0.6": (45, FLA_TAKES, set(FLA_DROPS)),
    "0.5": (40, FLA_TAKES - _NOT_IN_052 - {"LinearAttention"}, {*FLA_DROPS, "LinearAttention"}),
}


def test_the_fla_rule_finds_every_offsets_taking_class_and_every_dropping_one():
    """flash-linear-attention 0.6: 40 of the 45 classes ``fla.layers`` exports take ``cu_seqlens`` (37 from
    ``**kwargs``), 5 drop it (0.5.2: 34 of 40, 6); the rule also finds classes no export list names
    (``SimpleGatedLinearAttention``, RWKV's nested helpers, feed-forwards and blocks) and skips FLA's
    ``PreTrainedModel`` classes."""
    import importlib.metadata

    import fla.layers

    from fla_ac_isolation.harness.fla_seam.models import fla_layer_and_model_classes

    classes = fla_layer_and_model_classes()
    sources: dict = {}
    verdicts = {(c.__module__, c.__qualname__): fla_layer_mixer(c, sources) for c in classes}
    takes = {q for (m, q), v in verdicts.items() if isinstance(v, UpstreamMixer)}
    drops = {q for (m, q), v in verdicts.items() if isinstance(v, LeakingMixer)}
    exported = set(fla.layers.__all__)

    release = ".".join(importlib.metadata.version("flash-linear-attention").split(".")[:2])
    count, expected_takes, expected_drops = _FLA_CENSUS[release]
    assert len(exported) == count and len(FLA_TAKES) == 40
    assert drops == expected_drops
    assert takes & exported == expected_takes
    assert takes - exported == {"SimpleGatedLinearAttention", "LerpLinear", "DDLerpLinear", "YOCORotaryEmbedding",
                                "RWKV6FeedForward", "RWKV6Block", "RWKV7FeedForward", "RWKV7Block"}
    assert all(v.offsets == ("cu_seqlens",) for v in verdicts.values() if isinstance(v, UpstreamMixer))
    assert verdicts[("fla.models.gla.modeling_gla", "GLAModel")] is None  # a PreTrainedModel hands it on
    if release == "0.6":  # CAT is new in 0.6
        assert verdicts[("fla.models.cat.modeling_cat", "CATModel")] is None
    else:
        assert ("fla.models.cat.modeling_cat", "CATModel") not in verdicts


@pytest.mark.parametrize(("config", "layers"), [
    ("gla", ["model.layers.{}.attn"]),
    ("retnet", ["model.layers.{}.attn"]),
    ("rwkv7", ["model.layers.{}", "model.layers.{}.attn", "model.layers.{}.ffn"]),
], ids=["GLAForCausalLM", "RetNetForCausalLM", "RWKV7ForCausalLM"])
def test_isolate_seqlens_hooks_every_rule_matched_layer_and_hands_it_fresh_offsets(config, layers):
    """FLA models whose kernels are Triton's only (no CPU step): ``isolate_seqlens(model)`` hooks exactly the
    layers the rule matches, and each call of each receives a new ``cu_seqlens`` object equal to the caller's (a
    pre-hook registered after ours records it and stops the call before the first Triton kernel)."""
    model, batch, _ = build_tiny(config)
    handle = isolate_seqlens(model)
    expected = [p.format(i) for i in range(4) for p in layers]
    cu, hidden = batch["cu_seqlens"], torch.randn(1, int(batch["cu_seqlens"][-1]), 64)

    class StopForwardError(Exception):
        pass

    def spy(module, args, kwargs):
        raise StopForwardError(kwargs.get("cu_seqlens"))

    seen = []
    for path in expected:
        module = model.get_submodule(path)
        module.register_forward_pre_hook(spy, with_kwargs=True)
        for _ in range(2):
            with pytest.raises(StopForwardError) as stopped:
                module(hidden, cu_seqlens=cu)
            seen.append(stopped.value.args[0])

    assert handle.paths == expected
    assert all(t is not cu and torch.equal(t, cu) for t in seen)
    assert len({id(t) for t in seen}) == 2 * len(expected)  # a new object per call
    assert handle.rewritten == 2 * len(expected)
