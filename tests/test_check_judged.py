"""What ``check`` judges, in one place (``run_check``; the CLI and the pytest plugin render it):

* a model that checkpoints itself and whose forward fails (``isolate_seqlens``' hook refusing a misspelt
  ``cu_seq_lens=``) is a step that failed, exit 2 with the hook's error: no region verdict, no ``Fix:`` line;
  the unsafe path (the same misspelling without ``isolate_seqlens``) is exit 2 too, told that no offsets reached
  FLA;
* a step that saw nothing it could judge (no FLA-backed class and no call of FLA's index helpers) is refused by
  ``run_check`` itself, for the CLI too;
* "covered by observation" reads which offsets objects FLA's cached helpers received (the cache probe), which
  FLA's CUDA kernels call as the CPU's served ones do: not the CPU-served kernels' own record;
* the fix step reads the survey's plan (one classification per ``run_check``), not a second one.

The model is ``examples/own_decoder.py`` (FLA's ``GatedDeltaNet`` and ``KimiDeltaAttention`` with an MLP)."""

from __future__ import annotations

import json

import pytest
import torch
from page_output import assert_printed_as_on_page
from torch import nn

import fla_ac_isolation.harness.check.runner as check_runner
import fla_ac_isolation.harness.check.step as check_step
from fla_ac_isolation import mixer_plan
from fla_ac_isolation.harness.check import CheckInputError, CheckSpec, run_check
from fla_ac_isolation.harness.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

EXAMPLE = "examples/own_decoder.py"
HOOK_ERROR = ("ValueError: isolate_seqlens: layers.0.mixer (GatedDeltaNet) is hooked to refresh ['cu_seqlens'], but "
              "this call passed none of them and passed the offsets-like keyword(s) ['cu_seq_lens']: GatedDeltaNet "
              "hands FLA its offsets only from ['cu_seqlens'], so FLA would never see these and would run the packed "
              "documents as one sequence (they mix); fix the call: pass the offsets as cu_seqlens=...")
FORWARD_FAILED = ("model(**batch) fails in its forward, before any recompute (the model checkpoints itself; its "
                  "forward runs the ops it runs without AC), so the model or the batch is wrong, not AC: ")
NO_OFFSETS = ("no packed offsets reached FLA: the model's FLA-backed layers (GatedDeltaNet, KimiDeltaAttention) "
              "called none of FLA's index helpers, so they ran the batch as one sequence and nothing can be "
              "checked; give the offsets under the keyword the model reads: cu_seq_lens_q (transformers), "
              "attention_masks (torchtitan), cu_doc_lens (OLMo-core), cu_seqlens (flash-linear-attention's models)")
MISSPELT_CALL = ("no packed offsets reached FLA: the model's FLA-backed layers (GatedDeltaNet, KimiDeltaAttention) "
                 "called none of FLA's index helpers, so they ran the batch as one sequence and nothing can be "
                 "checked; the model's call of layers.0.mixer (GatedDeltaNet) (and 3 more layer(s): "
                 "KimiDeltaAttention x2, GatedDeltaNet x1) passed the offsets as cu_seq_lens=, a keyword GatedDeltaNet does not read: fix the call: pass them as "
                 "cu_seqlens=")
NOTHING_JUDGED = ("nothing was judged: the step found no FLA-backed class and its checkpointed regions called none "
                  "of FLA's index helpers, so no packed offsets reached FLA and nothing of the fault could show; "
                  "check a model whose layers call FLA, with its offsets under the keyword it reads")


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ a step that failed is not a verdict
def test_an_isolated_model_whose_call_misspells_the_keyword_is_a_failed_step_exit_2_with_the_hooks_error(capsys):
    code, out, err = _check(capsys, "--model", f"{EXAMPLE}:misspelt_isolated")
    assert (code, out) == (2, "")  # no report: no class list, no "aligned", no verdict, no Fix: line
    assert err == f"fla-ac-isolation check: error: {FORWARD_FAILED}{HOOK_ERROR}\n"
    assert_printed_as_on_page(err, "docs/check.md", f"$ fla-ac-isolation check --model {EXAMPLE}:misspelt_isolated")

    code, out, _ = _check(capsys, "--model", f"{EXAMPLE}:misspelt_isolated", "--json")
    assert code == 2 and json.loads(out) == {"error": FORWARD_FAILED + HOOK_ERROR, "exit_code": 2}

    with pytest.raises(CheckInputError) as raised:
        run_check(CheckSpec(model=f"{EXAMPLE}:misspelt_isolated"))
    assert str(raised.value) == FORWARD_FAILED + HOOK_ERROR
    assert isinstance(raised.value.__cause__, ValueError)


def test_the_same_misspelling_without_isolate_seqlens_is_told_which_call_to_fix_exit_2(capsys):
    """The unsafe path: FLA's layers take ``cu_seq_lens=`` silently and run the batch as one sequence. The batch
    says ``cu_seqlens``, so the advice names the model's call, the keyword it gave and the one FLA reads (the
    batch-keyword advice, :data:`NO_OFFSETS`, would send the user to a batch that is right)."""
    code, out, err = _check(capsys, "--model", f"{EXAMPLE}:misspelt")
    assert (code, out) == (2, "")
    assert err == f"fla-ac-isolation check: error: {MISSPELT_CALL}\n"
    with pytest.raises(CheckInputError) as raised:
        run_check(CheckSpec(model=f"{EXAMPLE}:misspelt"))
    assert str(raised.value) == MISSPELT_CALL


def test_following_the_misspelling_advice_fixes_the_model():
    """Doing what the advice says (the block calls its mixer with ``cu_seqlens=``) is the example's ``own_ckpt``
    model (``Block`` instead of ``MisspeltBlock``, nothing else differs): the check then judges the step (the shared
    offsets' divergence, exit 1), and with isolate_seqlens it passes (exit 0)."""
    judged = run_check(CheckSpec(model=f"{EXAMPLE}:own_ckpt", verify_fix=False))
    assert judged.exit_code == 1 and judged.as_given.divergent
    assert run_check(CheckSpec(model=f"{EXAMPLE}:isolated", verify_fix=False)).exit_code == 0


def test_without_the_forward_rule_the_failed_step_was_reported_as_a_divergence(monkeypatch):
    """What the rule prevents: the failed forward passed on to the audited step gives a DIVERGENT exit 1 over one
    region never recomputed, with a Fix: line pointing at LayerLocalSeqlens."""
    from fla_ac_isolation.harness.cli.check import render

    dry = check_runner.dry_run

    def lenient(model, batch, spec):
        try:
            return dry(model, batch, spec)
        except CheckInputError:
            return True, None  # the old rule: a model that checkpoints itself goes on to the step

    monkeypatch.setattr(check_runner, "dry_run", lenient)
    result = run_check(CheckSpec(model=f"{EXAMPLE}:misspelt_isolated"))
    lines = render(result).splitlines()
    assert result.as_given.error == HOOK_ERROR and result.exit_code == 1
    assert [r.verdict for r in result.as_given.regions] == ["not recomputed"]
    assert "Fix:" not in lines  # a fix of own code is offered for a divergence only (none diverged)
    assert lines[-1] == "verdict: FAILED under AC (exit 1)"


# ---------------------------------------------------------------------- nothing judged: run_check refuses
MLP = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, hidden, cu_seqlens):
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return hidden.pow(2).mean()


def mlp():
    return MLP(), {"hidden": torch.randn(1, 6, 8), "cu_seqlens": torch.tensor([0, 2, 6], dtype=torch.int32)}
"""


@pytest.fixture
def mlp_target(tmp_path):
    path = tmp_path / "fla_free.py"
    path.write_text(MLP)
    return f"{path}:mlp"


def test_a_model_without_fla_is_refused_by_run_check_and_the_cli_exit_2(capsys, monkeypatch, mlp_target):
    with pytest.raises(CheckInputError) as raised:
        run_check(CheckSpec(model=mlp_target))
    assert str(raised.value) == NOTHING_JUDGED
    code, out, err = _check(capsys, "--model", mlp_target)
    assert (code, out, err) == (2, "", f"fla-ac-isolation check: error: {NOTHING_JUDGED}\n")

    # the unsafe path, without the rule: both regions aligned, passed blind
    monkeypatch.setattr(check_runner, "_require_judged", lambda step, mixers: None)
    result = run_check(CheckSpec(model=mlp_target))
    assert result.exit_code == 0 and result.mixers == [] and result.as_given.fla_helper_calls == 0
    assert [r.verdict for r in result.as_given.regions] == ["aligned", "aligned"]


def test_the_plugin_renders_run_checks_refusal_and_keeps_no_rule_of_its_own(mlp_target):
    import fla_ac_isolation.harness.pytest_plugin as plugin

    with pytest.raises(pytest.fail.Exception) as failed:
        plugin.assert_ac_safe(mlp_target)
    assert str(failed.value) == f"fla-ac-isolation check refused the model: {NOTHING_JUDGED}"
    assert not hasattr(plugin, "_judged")


# ------------------------------------------------------------- every region divergent is judged, not blind
class _SharedHelperLayer(nn.Module):
    """Calls FLA's cached helper on the offsets it is handed (the batch's one tensor: shared)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, cu_seqlens):
        from fla.ops.utils.index import prepare_chunk_indices

        return self.proj(x * prepare_chunk_indices(cu_seqlens, 64).shape[0])  # the recompute reaches the helper


class _OneLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_SharedHelperLayer()])

    def forward(self, x, cu_seqlens):
        return self.layers[0](x, cu_seqlens).square().mean()


def _one_layer():
    torch.manual_seed(0)
    return _OneLayer(), {"x": torch.randn(1, 100, 8), "cu_seqlens": torch.tensor([0, 70, 100], dtype=torch.int32)}


def test_a_step_whose_every_region_diverged_is_judged_divergent_exit_1_not_blind():
    """One layer on the batch's offsets: its forward misses FLA's cache, its recompute hits, so its only region
    diverges. Nothing was unseen: the audit is not blind (no region aligned is not "nothing judged"), and the
    check exits 1 DIVERGENT, not 2."""
    from fla_ac_isolation.audit import ReplayAudit
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
    from fla_ac_isolation.harness.cli.check import render
    from fla_ac_isolation.policies import checkpoint_layers, save_all_copies

    model, batch = _one_layer()
    checkpoint_layers(model, "selective", save_all_copies())
    clear_tensor_cache()
    with ReplayAudit(model, on_divergence="record") as audit:
        model(**batch).backward()
    assert [r.verdict for r in audit.regions] == ["divergent"]
    assert (audit.verdict, audit.why_blind) == ("divergent", None)

    result = run_check(CheckSpec(model=_one_layer, policy="save-all-copies", verify_fix=False))
    assert result.as_given.blind is None and result.exit_code == 1
    lines = render(result).splitlines()
    assert lines[5] == "as given: 0 of 1 checkpointed region(s) aligned, 1 DIVERGENT"
    assert lines[-1] == "verdict: DIVERGENT (exit 1)"


# ------------------------------------------------------------- covered: observed from FLA's cache, any device
class Helpers(nn.Module):
    """Calls FLA's cached index helpers with the offsets it is handed (as FLA's CUDA kernels do), no kernel."""

    def forward(self, hidden, cu_seqlens):
        from fla.ops.utils.index import prepare_chunk_indices

        prepare_chunk_indices(cu_seqlens, 4)
        return hidden * 2


def _observed(fresh_per_call: bool) -> tuple[str, ...]:
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache, probe_tensor_cache

    model = nn.ModuleDict({"a": Helpers(), "b": Helpers()})
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    clear_tensor_cache()
    with probe_tensor_cache(arguments=True) as probe:
        seen = check_step._OffsetsSeen(model, ["a", "b"], probe, {"cu_seqlens": cu})
        hidden = torch.zeros(1, 8)
        for name in ("a", "b", "a"):  # a's second call: as its recompute
            hidden = model[name](hidden, cu.clone() if fresh_per_call else cu)
        seen.remove()
    return seen.fresh()


def test_fresh_offsets_are_observed_from_flas_cached_helpers_without_the_cpu_served_kernels():
    """No ``reference_kernels()`` here: what is read is what FLA's helpers were given, which FLA's own (CUDA)
    kernels call; the batch's shared tensor in every call is not fresh."""
    assert _observed(fresh_per_call=True) == ("a", "b")
    assert _observed(fresh_per_call=False) == ()


def test_a_model_whose_blocks_call_local_is_covered_and_the_shared_one_stays_exposed():
    local = run_check(CheckSpec(model=f"{EXAMPLE}:local", verify_fix=False))
    assert [(m.name, m.status, m.observed) for m in local.mixers] == [
        ("GatedDeltaNet", "covered", "fresh offsets"), ("KimiDeltaAttention", "covered", "fresh offsets")]
    assert local.as_given.fresh_offsets == tuple(f"layers.{i}.mixer" for i in range(4)) and local.exit_code == 0
    shared = run_check(CheckSpec(model=f"{EXAMPLE}:plain", verify_fix=False))
    assert [(m.status, m.observed) for m in shared.mixers] == [("exposed", None), ("exposed", None)]
    assert shared.as_given.fresh_offsets == ()


@pytest.mark.gpu
def test_on_cuda_a_model_whose_blocks_call_local_is_covered_by_what_flas_kernels_were_handed(hopper_guard_lifted):
    """FLA's own Triton kernels (no served stand-ins): the same observation as on a CPU."""
    local = run_check(CheckSpec(model=f"{EXAMPLE}:local", device="cuda", verify_fix=False, first_config=True))
    assert [(m.name, m.status, m.observed) for m in local.mixers] == [
        ("GatedDeltaNet", "covered", "fresh offsets"), ("KimiDeltaAttention", "covered", "fresh offsets")]
    assert local.exit_code == 0 and local.fixes == []
    shared = run_check(CheckSpec(model=f"{EXAMPLE}:plain", device="cuda", verify_fix=False, first_config=True))
    assert [m.status for m in shared.mixers] == ["exposed", "exposed"] and shared.as_given.fresh_offsets == ()


# ---------------------------------------------------------------------------- the fix reads the one plan
@pytest.mark.parametrize(("spec", "applied"), [
    (CheckSpec(model=f"{EXAMPLE}:plain"), ("isolate_seqlens(model)",)),
    (CheckSpec(config="qwen3_5_moe_text"), ("swap_mixers(model)",)),  # every exposed mixer swapped: no hook
], ids=["isolate", "swap"])
def test_run_check_with_the_fix_verified_classifies_once(monkeypatch, spec, applied):
    calls = []
    real = mixer_plan.classify
    monkeypatch.setattr(check_runner, "classify", lambda m: calls.append(type(m).__name__) or real(m))
    result = run_check(spec)
    assert len(calls) == 1 and result.fix_applied == applied
    assert result.fixed is not None and result.fixed.aligned and not result.as_given.aligned


@pytest.mark.gpu
def test_on_cuda_check_autocast_names_the_weight_cast_cache_and_passes_sac_context_fn(hopper_guard_lifted):
    """FLA's own kernels under ``torch.autocast("cuda", bfloat16)``: torch's SAC contexts diverge at a cast the
    weight-cast cache skipped (the audit sees it before any misreplayed tensor reaches a kernel); our context_fn
    aligns every region."""
    from fla_ac_isolation.harness.check.fix import AUTOCAST_CHECK_FIX

    raw = run_check(CheckSpec(model=f"{EXAMPLE}:isolated", device="cuda", autocast="bf16", first_config=True))
    divergent = [r for r in raw.as_given.regions if r.verdict == "divergent"]
    assert divergent and all(r.autocast_cast for r in divergent)
    assert raw.exit_code == 1 and raw.fixes == [AUTOCAST_CHECK_FIX]
    fixed = run_check(CheckSpec(model=f"{EXAMPLE}:isolated_sac", device="cuda", autocast="bf16", first_config=True))
    assert [r.verdict for r in fixed.as_given.regions] == ["aligned"] * 4
    assert fixed.exit_code == 0 and fixed.fixes == []


def test_misspelt_keyword_advice_needs_a_keyword_the_class_reads():
    """A watched class with no offsets keyword of its own (a leaking class: nothing to name) gets no misspelt
    advice, where an exposed one is told its keyword (the rule reads the class's first offsets keyword)."""
    from fla_ac_isolation.harness.check.findings import CheckStep, MixerFinding

    def finding(offsets):
        return MixerFinding("m.Mixer", "Mixer", "a library", "exposed", ("layers.0.mixer",), offsets)

    step = CheckStep((), offsets_keywords=(("layers.0.mixer", ("cu_seq_lens",)),))
    assert check_runner._misspelt(step, [finding(())]) is None
    assert check_runner._misspelt(step, [finding(("cu_seqlens",))]) == (
        "the model's call of layers.0.mixer (Mixer) passed the offsets as cu_seq_lens=, a keyword Mixer does not "
        "read: fix the call: pass them as cu_seqlens=")
