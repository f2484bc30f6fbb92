"""One classification per model: :func:`fla_ac_isolation.mixer_plan.classify` decides each module's status once,
and ``isolate_seqlens`` (its targets, its warnings, its handle) and ``check``'s survey read that plan."""

from __future__ import annotations

import warnings

import pytest
import torch
from fla.layers import GatedDeltaNet, Mamba2
from torch import nn

import fla_ac_isolation.harness.check.findings as check_findings
import fla_ac_isolation.harness.check.runner as check_runner
import fla_ac_isolation.isolate as isolate_module
import fla_ac_isolation.mixer_plan as mixer_plan
from fla_ac_isolation import isolate_seqlens
from fla_ac_isolation.foreign_classes import named
from fla_ac_isolation.isolate import LeakingMixerWarning
from fla_ac_isolation.mixer_plan import PlannedMixer, classify
from fla_ac_isolation.mixers import FlaMamba2

OLMO_GDN = "olmo_core.nn.attention.recurrent.GatedDeltaNet"
QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet"
KIMI = "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention"


def _stand_in(qualified: str) -> type[nn.Module]:
    """A module class with the registry's module and class name (the registry matches by name, never imports)."""
    module, _, name = qualified.rpartition(".")

    def forward(self, x, cu_doc_lens=None, **kwargs):
        return x

    return type(name, (nn.Module,), {"__module__": module, "__qualname__": name, "forward": forward})


def _model() -> nn.Module:
    torch.manual_seed(0)
    mamba = Mamba2(num_heads=8, head_dim=16, hidden_size=64, state_size=16, n_groups=2, chunk_size=16)
    blocks = nn.ModuleDict({
        "fla_gdn": GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16, expand_v=1, mode="chunk"),  # FLA rule
        "qwen": _stand_in(QWEN3_5)(),          # hands offsets to FLA; swap_mixers has a drop-in
        "olmo": _stand_in(OLMO_GDN)(),         # hands offsets to FLA; hooked below
        "kimi": _stand_in(KIMI)(),             # drops the offsets; a drop-in exists
        "mamba": mamba,                        # FLA's Mamba2: the FLA rule says it drops them; FlaMamba2 replaces it
        "ours": FlaMamba2(num_heads=8, head_dim=16, hidden_size=64, state_size=16, n_groups=2, chunk_size=16),  # ours
        "mlp": nn.Linear(4, 4),
    })
    return nn.ModuleDict({"blocks": blocks})


def _rows(plan: tuple[PlannedMixer, ...]) -> list[tuple[str, str, str, bool]]:
    return [(p.path, p.cls, p.status, p.swappable) for p in plan]


def test_each_module_is_classified_with_its_exact_status():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeakingMixerWarning)
        warnings.simplefilter("ignore", isolate_module.PartialIsolationWarning)
        isolate_seqlens(model, modules=["blocks.olmo"])  # one module hooked before the plan is taken

    plan = classify(model)

    assert _rows(plan) == [
        ("blocks.fla_gdn", "fla.layers.gated_deltanet.GatedDeltaNet", "exposed", False),
        ("blocks.qwen", QWEN3_5, "exposed", True),
        ("blocks.olmo", OLMO_GDN, "hooked", False),
        ("blocks.kimi", KIMI, "leaking", True),
        ("blocks.mamba", "fla.layers.mamba2.Mamba2", "leaking", True),
        ("blocks.ours", "fla_ac_isolation.mixers.FlaMamba2", "drop-in", False),
    ]
    assert [p.covered for p in plan] == [False, False, True, False, False, True]
    assert plan[1].entry is named(QWEN3_5)  # the registry's own entry, not a copy
    assert plan[2].module is model.get_submodule("blocks.olmo")
    assert plan[5].entry is None and plan[5].matched is FlaMamba2


def test_isolate_seqlens_classifies_once_and_its_handle_keeps_the_plan(monkeypatch):
    model = _model()
    before = classify(model)
    calls = {"classify": 0, "foreign_mixer": 0}
    real_classify, real_foreign = mixer_plan.classify, mixer_plan.foreign_mixer

    def counting_classify(m):
        calls["classify"] += 1
        return real_classify(m)

    def counting_foreign(module, sources=None):
        calls["foreign_mixer"] += 1
        return real_foreign(module, sources)

    monkeypatch.setattr(isolate_module, "classify", counting_classify)
    monkeypatch.setattr(mixer_plan, "foreign_mixer", counting_foreign)
    with pytest.warns(LeakingMixerWarning) as caught:
        handle = isolate_seqlens(model)

    once_each = [m for m in model.modules() if type(m) is not FlaMamba2]  # a drop-in is known without asking
    assert calls == {"classify": 1, "foreign_mixer": len(once_each)}
    assert handle.paths == ["blocks.fla_gdn", "blocks.qwen", "blocks.olmo"]  # the plan's exposed modules
    assert handle.plan == before  # taken before hooking: the statuses as found
    conv_leaks = named(QWEN3_5).leak() is not None  # its torch conv mixes documents without causal_conv1d
    assert sorted(str(w.message).split(" ")[1] for w in caught) == [
        "KimiLinearDeltaAttention", "Mamba2", *(["Qwen3_5GatedDeltaNet"] if conv_leaks else [])]
    assert [p.status for p in classify(model)] == ["hooked", "hooked", "hooked", "leaking", "leaking", "drop-in"]


def test_modules_given_are_judged_from_the_same_one_plan(monkeypatch):
    model = _model()
    count = []
    real = mixer_plan.classify
    monkeypatch.setattr(isolate_module, "classify", lambda m: count.append(1) or real(m))
    with pytest.warns(isolate_module.PartialIsolationWarning, match=r"left 2 FLA-backed mixer\(s\)"):
        handle = isolate_seqlens(model, modules=["blocks.qwen"])
    assert handle.paths == ["blocks.qwen"] and count == [1]
    with pytest.raises(ValueError, match=r"'blocks.kimi' \(KimiLinearDeltaAttention\) calls FLA's chunk_kda"):
        isolate_seqlens(model, modules=["blocks.kimi"])
    assert count == [1, 1]  # the refused call classified once too


def test_the_survey_reads_a_plan_it_is_given_and_classifies_only_without_one(monkeypatch):
    model = _model()
    plan = classify(model)
    count = []
    real = mixer_plan.classify
    monkeypatch.setattr(check_findings, "classify", lambda m: count.append(1) or real(m))

    given = check_findings.survey(model, plan)
    assert count == []
    assert check_findings.survey(model) == given and count == [1]
    assert [(f.name, f.status, f.paths) for f in given] == [
        ("GatedDeltaNet", "exposed", ("blocks.fla_gdn",)),
        ("Qwen3_5GatedDeltaNet", "exposed", ("blocks.qwen",)),
        ("GatedDeltaNet", "exposed", ("blocks.olmo",)),
        ("KimiLinearDeltaAttention", "leaking", ("blocks.kimi",)),
        ("Mamba2", "leaking", ("blocks.mamba",)),
        ("FlaMamba2", "covered", ("blocks.ours",)),
    ]


def test_run_check_classifies_the_model_once(monkeypatch):
    """``run_check`` surveys from one plan; with the fix not verified, nothing classifies again."""
    calls = []
    real = mixer_plan.classify
    monkeypatch.setattr(check_runner, "classify", lambda m: calls.append(type(m).__name__) or real(m))
    result = check_runner.run_check(check_runner.CheckSpec(config="gated_deltanet", verify_fix=False))
    assert calls == ["GatedDeltaNetForCausalLM"]
    assert [(m.name, m.status) for m in result.mixers] == [("GatedDeltaNet", "exposed")]


def test_classify_refuses_a_non_module():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got dict"):
        classify({})
