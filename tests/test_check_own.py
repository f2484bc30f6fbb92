"""``check`` your way (issue 30): the user's own SAC policy, a model that checkpoints itself, offsets made fresh by
the user's own ``LayerLocalSeqlens``, what a divergence means under full AC, ``module:callable`` from the working
directory, one meaning of ``--model``, the autotune notice, and a backward inside ``torch.autocast``.

The model is ``examples/own_decoder.py``: the trial's decoder (FLA's ``GatedDeltaNet`` and ``KimiDeltaAttention``
with an MLP, one ``cu_seqlens`` for every layer, its own policy saving every ``_to_copy`` and ``mm``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
import torch
from page_output import assert_printed_as_on_page

from fla_ac_isolation.harness.check import CheckInputError, CheckSpec, autotune_notice, resolve_policy
from fla_ac_isolation.harness.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

EXAMPLE = "examples/own_decoder.py"
POLICY_EXPECTED = ("one of ['save-all-copies', 'save-d2h-copies', 'torchtitan'], 'module:callable' or "
                   "'path/to/file.py:callable' naming your own SAC policy, or that function: (ctx, op, *args, "
                   "**kwargs) -> CheckpointPolicy, as torch.utils.checkpoint.create_selective_checkpoint_contexts "
                   "takes it")
DIVERGENT_0 = ("  layers.0  divergent at op #6 in layers.0.mixer.q_conv1d: recompute ran aten.slice.Tensor -> "
               "[1, 70, 64] float32 cpu, forward ran aten.slice.Tensor -> [3] int32 cpu (FLA cache: "
               "prepare_chunk_indices, prepare_chunk_offsets)")
# the KDA layer diverges too: FLA's chunk_kda asks prepare_chunk_indices by keyword, a cache entry apart from the
# convs' positional ones (the CPU serving asks as the kernel does; see tests/test_reference_kernels.py)
DIVERGENT_1 = ("  layers.1  divergent at op #116 in layers.1.mixer: recompute ran aten.slice.Tensor -> [1, 70, 4, 16] "
               "float32 cpu, forward ran aten.add.Tensor -> [3] int32 cpu (FLA cache: prepare_chunk_indices)")
AS_GIVEN = "as given: 2 of 4 checkpointed region(s) aligned, 2 DIVERGENT"
EXPOSED = ["  exposed  GatedDeltaNet (flash-linear-attention) x2: layers.0.mixer, layers.2.mixer; offsets cu_seqlens",
           "  exposed  KimiDeltaAttention (flash-linear-attention) x2: layers.1.mixer, layers.3.mixer; offsets "
           "cu_seqlens"]
FIXES = ["  GatedDeltaNet: isolate_seqlens(model)", "  KimiDeltaAttention: isolate_seqlens(model)"]


def _check(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _example():
    spec = importlib.util.spec_from_file_location("_own_decoder", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ item 1: own policy
def test_check_runs_the_users_own_policy_from_a_file_and_finds_the_shared_offsets(capsys):
    code, lines, err = _check(capsys, "--model", f"{EXAMPLE}:plain", "--policy", f"{EXAMPLE}:my_policy")

    assert lines[0] == (f"fla-ac-isolation check: Decoder (--model {EXAMPLE}:plain) | SAC policy "
                        f"{EXAMPLE}:my_policy | cpu (FLA served by reference_kernels)")
    assert lines[3:5] == EXPOSED
    assert AS_GIVEN in lines and DIVERGENT_0 in lines and DIVERGENT_1 in lines
    assert "with isolate_seqlens(model): 4 of 4 checkpointed region(s) aligned" in lines
    assert lines[lines.index("Fix:") + 1:lines.index("Fix:") + 3] == FIXES
    assert code == 1 and lines[-1] == "verdict: DIVERGENT (exit 1)" and err == ""


def test_the_spec_takes_the_policy_function_itself_and_the_step_runs_it():
    from fla_ac_isolation.harness.check import run_check

    policy = _example().my_policy
    asked = []

    def counting(ctx, op, *args, **kwargs):
        asked.append((ctx.is_recompute, op))
        return policy(ctx, op, *args, **kwargs)

    assert resolve_policy(policy) is policy
    assert CheckSpec(model="a:b", policy=policy).validate().policy_name == "my_policy"
    result = run_check(CheckSpec(model=f"{EXAMPLE}:plain", policy=counting, verify_fix=False))
    forward = {op for recompute, op in asked if not recompute}  # torch >= 2.13 asks in forwards only (replay by
    assert torch.ops.aten.native_layer_norm.default in forward  # index); torch 2.11 asks again in recomputes
    assert result.to_dict()["spec"]["policy"].endswith("counting") and result.exit_code == 1


def _not_a_policy():  # a constructor (takes no ctx, op), as save_all_copies uncalled
    return None


@pytest.mark.parametrize(("policy", "message"), [
    ("bogus", f"policy must be {POLICY_EXPECTED}, got 'bogus'"),
    (3, f"policy must be {POLICY_EXPECTED}, got int"),
    (f"{EXAMPLE}:nothing", f"policy '{EXAMPLE}:nothing': {EXAMPLE} has no callable 'nothing'"),
    (f"{EXAMPLE}:SAVE", f"policy '{EXAMPLE}:SAVE': {EXAMPLE}:SAVE is not callable (set)"),
    (_not_a_policy, "policy _not_a_policy: policy must be a SAC policy function (ctx, op, *args, **kwargs), but "
                    "_not_a_policy does not take (ctx, op); did you mean _not_a_policy() (policy constructors "
                    "return the policy)?"),
], ids=["name", "type", "attribute", "not-callable", "constructor"])
def test_a_bad_policy_is_refused_naming_policy_and_what_it_must_be(policy, message):
    with pytest.raises(CheckInputError) as err:
        CheckSpec(model="a:b", policy=policy).validate()
    assert str(err.value) == message


def test_the_spec_takes_the_model_factory_itself_and_names_it_by_module_and_qualname():
    """``CheckSpec(model=fn)`` as the pytest plugin takes it: the same verdict as its ``file.py:callable``."""
    from fla_ac_isolation.harness.check import run_check
    from fla_ac_isolation.harness.cli.check import render

    example = _example()
    by_function = run_check(CheckSpec(model=example.plain, policy=example.my_policy, verify_fix=False))
    by_name = run_check(CheckSpec(model=f"{EXAMPLE}:plain", policy=example.my_policy, verify_fix=False))
    assert by_function.exit_code == by_name.exit_code == 1
    assert [(r.label, r.verdict, r.first_diff) for r in by_function.as_given.regions] == [
        (r.label, r.verdict, r.first_diff) for r in by_name.as_given.regions]
    assert render(by_function).splitlines()[0] == (
        "fla-ac-isolation check: Decoder (--model _own_decoder:plain) | SAC policy my_policy | cpu (FLA served by "
        "reference_kernels)")
    assert by_function.to_dict()["spec"]["model"] == "_own_decoder:plain"
    with pytest.raises(CheckInputError) as caught:
        CheckSpec(model=42).validate()
    assert str(caught.value) == ("model must be 'module:callable', 'path/to/file.py:callable' or a callable returning "
                                 "(model, batch), got 42")


def test_a_bad_policy_flag_exits_2(capsys):
    code, lines, err = _check(capsys, "--model", f"{EXAMPLE}:plain", "--policy", "bogus")
    assert code == 2 and lines == []
    assert err == f"fla-ac-isolation check: error: policy must be {POLICY_EXPECTED}, got 'bogus'\n"


FULL_AC_POLICY_FLAG = ("--policy {} was given with --ac full: full AC recomputes every op and saves none, so a SAC "
                       "policy has nothing to choose: drop --policy, or use --ac selective to apply it")
FULL_AC_POLICY_SPEC = ("policy {} was given with ac='full': full AC recomputes every op and saves none, so a SAC "
                       "policy has nothing to choose: leave policy out, or give ac='selective' to apply it")


@pytest.mark.parametrize("policy", ["save-all-copies", f"{EXAMPLE}:my_policy", "bogus"])
def test_a_policy_flag_with_full_ac_exits_2_before_anything_runs(capsys, policy):
    """Full AC saves no op: a --policy given with it would be ignored, so it is refused (the default is not)."""
    code, lines, err = _check(capsys, "--model", f"{EXAMPLE}:plain", "--ac", "full", "--policy", policy)
    assert code == 2 and lines == []
    assert err == f"fla-ac-isolation check: error: {FULL_AC_POLICY_FLAG.format(policy)}\n"
    code, lines, err = _check(capsys, "--model", f"{EXAMPLE}:plain", "--ac", "full", "--policy", policy, "--json")
    assert code == 2 and json.loads("\n".join(lines)) == {"error": FULL_AC_POLICY_FLAG.format(policy), "exit_code": 2}


def test_the_spec_refuses_a_policy_with_full_ac_and_names_the_default_policy_when_none_is_given():
    from fla_ac_isolation.harness.check.spec import DEFAULT_POLICY
    from fla_ac_isolation.policies import save_all_copies

    with pytest.raises(CheckInputError) as raised:
        CheckSpec(model="a:b", ac="full", policy="save-all-copies").validate()
    assert str(raised.value) == FULL_AC_POLICY_SPEC.format("'save-all-copies'")
    with pytest.raises(CheckInputError) as raised:
        CheckSpec(model="a:b", ac="full", policy=_example().my_policy).validate()
    assert str(raised.value) == FULL_AC_POLICY_SPEC.format("my_policy")
    assert CheckSpec().policy is None and DEFAULT_POLICY == "save-all-copies"
    for ac in ("full", "selective"):  # not given: the report still names the default, as before
        spec = CheckSpec(model="a:b", ac=ac).validate()
        assert spec.policy is None and spec.policy_name == "save-all-copies"
    assert resolve_policy(None).__name__ == save_all_copies().__name__ == "save_all_copies"


# ------------------------------------------------------------------------- item 2: a model that checkpoints itself
def test_a_model_that_checkpoints_itself_is_audited_as_it_is_and_the_report_says_so(capsys):
    code, lines, _ = _check(capsys, "--model", f"{EXAMPLE}:own_ckpt")

    assert lines[0].endswith("| its own checkpointing | cpu (FLA served by reference_kernels)")
    assert lines[2] == ("the model checkpoints itself: audited as it is (its own policy; --ac and --policy not "
                        "applied)")
    # wrapped once (not 8 regions with layers.0 twice): the model's own four checkpoints
    assert AS_GIVEN in lines and DIVERGENT_0 in lines and DIVERGENT_1 in lines
    start = lines.index(AS_GIVEN)
    assert [line.split()[0] for line in lines[start + 1:start + 5]] == [f"layers.{i}" for i in range(4)]
    assert "with isolate_seqlens(model): 4 of 4 checkpointed region(s) aligned" in lines
    assert code == 1 and lines[-1] == "verdict: DIVERGENT (exit 1)"


# ------------------------------------------------------------- item 3: fresh offsets observed: covered, no Fix line
def test_a_model_whose_blocks_call_layer_local_seqlens_is_covered_by_what_the_step_saw(capsys):
    code, lines, _ = _check(capsys, "--model", f"{EXAMPLE}:local")

    observed = "; every call handed FLA offsets of its own (observed in the step)"
    assert lines[5:7] == [line.replace("exposed  ", "covered  ") + observed for line in EXPOSED]
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert "Fix:" not in lines and not any(line.startswith("with ") for line in lines)
    assert code == 0 and lines[-1] == "verdict: OK (exit 0)"


PARTIAL_MODELS = """
import importlib.util
import torch
from torch.utils.checkpoint import checkpoint

spec = importlib.util.spec_from_file_location("_own_decoder_partial", {example!r})
od = importlib.util.module_from_spec(spec)
spec.loader.exec_module(od)


class Partial(od.Decoder):  # checkpoints its even blocks only
    def forward(self, input_ids, labels, cu_seqlens):
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = (checkpoint(layer, x, cu_seqlens, use_reentrant=False, context_fn=self.context_fn) if i % 2 == 0
                 else layer(x, cu_seqlens))
        return torch.nn.functional.cross_entropy(self.head(x)[0, :-1], labels[0, 1:])


def partial():
    torch.manual_seed(0)
    return Partial(ckpt=True), od._batch()


def nested():  # the user's checkpoint_layers around blocks the model checkpoints itself
    from fla_ac_isolation.policies import checkpoint_layers

    model, batch = od.own_ckpt()
    checkpoint_layers(model, "selective", od.my_policy)
    return model, batch
"""


def test_a_model_checkpointing_some_layers_itself_is_told_which_are_not_audited(capsys, tmp_path):
    import os

    (tmp_path / "partial_models.py").write_text(PARTIAL_MODELS.format(example=os.path.abspath(EXAMPLE)))
    code, lines, _ = _check(capsys, "--model", f"{tmp_path}/partial_models.py:partial", "--no-verify-fix")
    assert lines[2:4] == [
        "the model checkpoints itself: audited as it is (its own policy; --ac and --policy not applied)",
        "  not checkpointed by the model: layers.1, layers.3 (they run without AC: not audited)"]
    assert "as given: 1 of 2 checkpointed region(s) aligned, 1 DIVERGENT" in lines and code == 1
    assert not any(line.startswith("checkpointed twice") for line in lines)

    code, lines, _ = _check(capsys, "--model", f"{tmp_path}/partial_models.py:nested", "--no-verify-fix")
    # the model's own checkpoint (outer) runs the layer checkpoint_layers wrapped (inner): both are layers.N
    assert lines[4] == ("checkpointed twice (a checkpoint inside a checkpoint): outer layers.0 holds inner layers.0, "
                        "outer layers.1 holds inner layers.1, outer layers.2 holds inner layers.2, outer layers.3 "
                        "holds inner layers.3; each level is audited and recomputes (below, the outer region is "
                        "listed first)")
    start = lines.index("as given: 6 of 8 checkpointed region(s) aligned, 2 DIVERGENT")
    assert [line.split()[:2] for line in lines[start + 1:start + 5]] == [
        ["layers.0", "aligned"], ["layers.0", "divergent"], ["layers.1", "aligned"], ["layers.1", "divergent"]]
    assert not any(line.startswith("  not checkpointed") for line in lines) and code == 1


# ------------------------------------------------- your own code calling FLA's ops (issue 37: the seed's users)
OWN_FLA_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

from fla_ac_isolation import LayerLocalSeqlens

D, H = 32, 2


class Mixer(nn.Module):  # calls FLA's own ops, imported where it calls them
    def __init__(self):
        super().__init__()
        self.qkv, self.gates, self.out = nn.Linear(D, 3 * D), nn.Linear(D, 2 * H), nn.Linear(D, D)

    def forward(self, hidden, local):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k, v = self.qkv(hidden).view(1, -1, 3, H, D // H).unbind(2)
        a, b = self.gates(hidden).chunk(2, dim=-1)
        o, _ = chunk_gated_delta_rule(q, k, v, F.logsigmoid(a), b.sigmoid(), cu_seqlens=local.cu_seqlens,
                                      cu_seqlens_cpu=local.cu_seqlens_cpu, use_qk_l2norm_in_kernel=True)
        return self.out(o.flatten(-2))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer()

    def forward(self, hidden, seqlens):
        local = seqlens.local() if isinstance(seqlens, LayerLocalSeqlens) else seqlens  # inside, or handed in
        return hidden + self.mixer(hidden, local)


class Model(nn.Module):
    def __init__(self, local_once):
        super().__init__()
        self.local_once = local_once
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, hidden, cu_seqlens):
        seqlens = LayerLocalSeqlens(cu_seqlens, num_tokens=hidden.shape[1])
        if self.local_once:
            seqlens = seqlens.local()  # once in the model's forward, handed to every layer
        for layer in self.layers:
            hidden = layer(hidden, seqlens)
        return hidden.pow(2).mean()


def _build(local_once):
    torch.manual_seed(0)
    return Model(local_once), {"hidden": torch.randn(1, 100, D), "cu_seqlens": torch.tensor([0, 30, 100])}


def isolated():
    return _build(False)


class LoaderModel(Model):  # the data loader builds the seqlens; the model hands it to its layers
    def forward(self, hidden, seqlens):
        for layer in self.layers:
            hidden = layer(hidden, seqlens)
        return hidden.pow(2).mean()


def _from_loader(local_in_loader):
    torch.manual_seed(0)
    seqlens = LayerLocalSeqlens(torch.tensor([0, 30, 100]), num_tokens=100)
    return LoaderModel(False), {"hidden": torch.randn(1, 100, D),
                                "seqlens": seqlens.local() if local_in_loader else seqlens}


def seqlens_in_batch():
    return _from_loader(False)


def local_in_batch():
    return _from_loader(True)


def local_once():
    return _build(True)
'''


def _own_fla_model(tmp_path) -> str:
    (tmp_path / "own_fla.py").write_text(OWN_FLA_MODEL)
    return f"{tmp_path}/own_fla.py"


def test_a_model_of_your_own_calling_flas_op_with_local_inside_each_layer_is_reported_covered(capsys, tmp_path):
    """Its mixer imports FLA's gated delta rule inside its forward; every call (forward and recompute of each
    layer) handed FLA's helpers offsets of its own: covered, seen in the step (it was "FLA-backed classes: none this
    package knows"). The unsafe path: ``.local()`` once, outside the layers (next test)."""
    code, lines, _ = _check(capsys, "--model", f"{_own_fla_model(tmp_path)}:isolated")
    assert lines[2:4] == [
        "FLA-backed classes:",
        "  covered  Mixer (your code) x2: layers.0.mixer, layers.1.mixer; every call handed FLA offsets of its own "
        "(observed in the step)"]
    assert lines[5:8] == ["as given: 2 of 2 checkpointed region(s) aligned", "  layers.0  aligned", "  layers.1  aligned"]
    assert "Fix:" not in lines and code == 0 and lines[-1] == "verdict: OK (exit 0)"


def test_a_batch_carrying_the_loaders_layer_local_seqlens_is_checked_and_its_local_in_the_loader_is_divergent(
        capsys, tmp_path):
    """The batch may carry the seqlens itself (built by the data loader): checked as packed, not refused as a batch
    without offsets. The unsafe path: the loader calls ``.local()`` and every layer gets that one call's offsets."""
    model = _own_fla_model(tmp_path)
    code, lines, _ = _check(capsys, "--model", f"{model}:seqlens_in_batch")
    assert lines[5:8] == ["as given: 2 of 2 checkpointed region(s) aligned", "  layers.0  aligned", "  layers.1  aligned"]
    assert code == 0 and lines[-1] == "verdict: OK (exit 0)"
    code, lines, _ = _check(capsys, "--model", f"{model}:local_in_batch")
    assert "as given: 1 of 2 checkpointed region(s) aligned, 1 DIVERGENT" in lines
    assert code == 1 and lines[-1] == "verdict: DIVERGENT (exit 1)"


def test_local_called_once_in_the_models_forward_is_named_in_the_fix(capsys, tmp_path):
    """One ``.local()`` in the model's forward, its ``LocalSeqlens`` handed to every checkpointed layer: each
    layer's forward and recompute give FLA the same objects (the fault). The report says which layers were handed
    it and that ``.local()`` must run inside each layer."""
    from fla_ac_isolation.harness.check import run_check

    model = _own_fla_model(tmp_path)
    code, lines, _ = _check(capsys, "--model", f"{model}:local_once")
    assert lines[2:4] == [
        "FLA-backed classes:",
        "  exposed  Mixer (your code) x2: layers.0.mixer, layers.1.mixer; its calls handed FLA the same offsets "
        "objects (observed in the step)"]
    assert "as given: 1 of 2 checkpointed region(s) aligned, 1 DIVERGENT" in lines
    assert lines[lines.index("Fix:") + 1:] == [
        "  Mixer: call seqlens.local() inside each layer's forward (inside its checkpointed region), not once "
        "outside: layers.0, layers.1 were handed the LocalSeqlens of one .local() call made outside them, so their "
        "forward and recompute gave FLA the same offsets objects (docs/own-model.md)",
        "", "verdict: DIVERGENT (exit 1)"]
    assert code == 1
    result = run_check(CheckSpec(model=f"{model}:local_once", verify_fix=False))
    assert result.as_given.handed_local == ("layers.0", "layers.1")
    assert [(c.path, c.fresh) for c in result.as_given.own_callers] == [("layers.0.mixer", False),
                                                                         ("layers.1.mixer", False)]
    isolated = run_check(CheckSpec(model=f"{model}:isolated", verify_fix=False)).as_given
    assert isolated.handed_local == () and all(c.fresh for c in isolated.own_callers)


def test_the_fix_for_divergent_own_code_with_no_caller_seen_names_local_inside_each_layer():
    """The fallback line (a region diverged, no class to blame): it says where ``.local()`` must run; with
    regions handed a ``LocalSeqlens`` it names them."""
    from fla_ac_isolation.harness.check.findings import CheckStep, RegionVerdict
    from fla_ac_isolation.harness.check.fix import fixes

    step = CheckStep((RegionVerdict("layers.0", "divergent", 3),))
    assert fixes([], step) == [
        "your own FLA-calling code: build a LayerLocalSeqlens once per model forward, hand it to every layer, and "
        "call seqlens.local() inside each layer's forward (inside its checkpointed region), giving FLA its tensors "
        "(docs/own-model.md)"]
    handed = CheckStep(step.regions, handed_local=("layers.0",))
    assert fixes([], handed) == [
        "your own FLA-calling code: call seqlens.local() inside each layer's forward (inside its checkpointed "
        "region), not once outside: layers.0 was handed the LocalSeqlens of one .local() call made outside it, so "
        "its forward and recompute gave FLA the same offsets objects (docs/own-model.md)"]


class _Checkpointed(torch.nn.Module):
    """Runs its children in order, each in a checkpoint of its own (a leaf runs a Linear, checkpointed too)."""

    def __init__(self, *children: torch.nn.Module) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(children or [torch.nn.Linear(4, 4)])

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for part in self.parts:
            x = checkpoint(part, x, use_reentrant=False)
        return x


def test_each_checkpoint_inside_a_checkpoint_names_its_outer_region_in_the_data_and_the_report():
    from fla_ac_isolation import ReplayAudit
    from fla_ac_isolation.harness.check import CheckResult, CheckStep, RegionVerdict
    from fla_ac_isolation.harness.check.findings import Nesting
    from fla_ac_isolation.harness.cli.check import render

    model = _Checkpointed(_Checkpointed(_Checkpointed(), _Checkpointed(_Checkpointed())))
    with ReplayAudit(model) as audit:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    # in forward order; the last two ran again inside the recompute of parts.0, which holds them
    assert [(r.index, r.label, r.outer) for r in audit.regions] == [
        (0, "parts.0", None), (1, "parts.0.parts.0", 0), (2, "parts.0.parts.0.parts.0", 1), (3, "parts.0.parts.1", 0),
        (4, "parts.0.parts.1.parts.0", 3), (5, "parts.0.parts.1.parts.0.parts.0", 4), (6, "parts.0.parts.0", 0),
        (7, "parts.0.parts.0.parts.0", 6)]

    step = CheckStep(tuple(RegionVerdict(r.label, r.verdict, outer=r.outer) for r in audit.regions))
    result = CheckResult(CheckSpec(model="a:b", device="cpu"), "M", [], step)
    assert result.twice == (Nesting("parts.0", ("parts.0.parts.0", "parts.0.parts.1")),
                            Nesting("parts.0.parts.0", ("parts.0.parts.0.parts.0",)),
                            Nesting("parts.0.parts.1", ("parts.0.parts.1.parts.0",)),
                            Nesting("parts.0.parts.1.parts.0", ("parts.0.parts.1.parts.0.parts.0",)))
    assert render(result).splitlines()[2] == (
        "checkpointed twice (a checkpoint inside a checkpoint): outer parts.0 holds inner parts.0.parts.0 and "
        "parts.0.parts.1, outer parts.0.parts.0 holds inner parts.0.parts.0.parts.0, outer parts.0.parts.1 holds "
        "inner parts.0.parts.1.parts.0, outer parts.0.parts.1.parts.0 holds inner parts.0.parts.1.parts.0.parts.0; "
        "each level is audited and recomputes (below, the outer region is listed first)")
    # one layer checkpointed twice, one checkpoint after the other, is not a checkpoint inside a checkpoint
    result.as_given = CheckStep((RegionVerdict("layers.0", "aligned"), RegionVerdict("layers.0", "aligned")))
    assert result.twice == () and not any(line.startswith("checkpointed twice") for line in render(result).splitlines())


# ------------------------------------------------------------------------------ item 4: full AC, judged by grads
def test_full_ac_says_the_gradients_are_right_and_what_sac_would_do_exit_0(capsys):
    code, lines, _ = _check(capsys, "--model", f"{EXAMPLE}:plain", "--ac", "full")

    assert lines[3:5] == EXPOSED and DIVERGENT_0 in lines
    assert ("under full AC nothing is replayed by index: torch recomputes every op and keeps only what the "
            "recompute returns, so a recompute that runs other ops still gives these gradients: bit-equal to the "
            "step without AC (compared). Under SAC (--ac selective) the same recompute would hand the ops after #6 in "
            "layers.0, #116 in layers.1 other ops' saved outputs (wrong gradients, or an error): fix it before you use SAC") in lines
    assert lines[lines.index("Fix (before you use SAC):") + 1:][:2] == FIXES
    assert code == 0
    assert lines[-1] == ("verdict: OK under full AC (exit 0): the gradients are right, but SAC would misalign "
                         "(see above)")


def test_the_same_model_under_sac_is_divergent_exit_1_and_full_ac_gradients_were_compared(monkeypatch):
    """The full-AC exit 0 rests on the gradients compared: with a no-AC reference that differs (a gradient
    nudged by 1e-6), the same divergence is exit 1."""
    import fla_ac_isolation.harness.check.runner as check_runner

    dry = check_runner.dry_run

    def nudged(model, batch, spec):
        own, grads = dry(model, batch, spec)
        first = next(iter(grads))
        grads[first] = grads[first] + 1e-6
        return own, grads

    monkeypatch.setattr(check_runner, "dry_run", nudged)
    result = check_runner.run_check(CheckSpec(model=f"{EXAMPLE}:plain", ac="full", verify_fix=False))
    assert result.as_given.grad_diff == pytest.approx(1e-6, rel=1e-3)
    assert not result.harmless_under_full_ac and result.exit_code == 1


# --------------------------------------------------------------------------- item 5: module:callable from the cwd
def test_module_callable_resolves_from_the_working_directory(capsys, tmp_path, monkeypatch):
    shutil.copy(EXAMPLE, tmp_path / "trial_decoder.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "trial_decoder", raising=False)
    with pytest.raises(CheckInputError, match="no callable 'nothing'"):  # imported: only the attribute is missing
        CheckSpec(model="a:b", policy="trial_decoder:nothing").validate()
    assert sys.path[0] == str(tmp_path)


def test_a_module_not_found_is_told_where_modules_are_looked_up(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, lines, err = _check(capsys, "--model", "absent_decoder:plain")
    assert code == 2 and lines == []
    assert err == (f"fla-ac-isolation check: error: model 'absent_decoder:plain': importing absent_decoder failed: "
                   f"ModuleNotFoundError: No module named 'absent_decoder' (module:callable imports from the working "
                   f"directory {tmp_path} and sys.path: run from the folder that holds absent_decoder.py or the "
                   f"absent_decoder/ package, or give path/to/file.py:callable)\n")


def test_a_folder_imported_as_a_namespace_package_is_named_with_the_file_inside_it(capsys, tmp_path, monkeypatch):
    """``mymodel:plain`` run from the folder above ``mymodel/mymodel.py`` imports the folder (a namespace package):
    the error says so and names the file to give, where it said only "has no callable"."""
    (tmp_path / "trial_ns").mkdir()
    shutil.copy(EXAMPLE, tmp_path / "trial_ns" / "trial_ns.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "trial_ns", raising=False)
    code, lines, err = _check(capsys, "--model", "trial_ns:plain")
    assert code == 2 and lines == []
    assert err == (f"fla-ac-isolation check: error: model 'trial_ns:plain': trial_ns has no callable 'plain' "
                   f"(trial_ns is the folder {tmp_path / 'trial_ns'}, imported as a namespace package, not a module: "
                   f"run from inside it, or give {tmp_path / 'trial_ns' / 'trial_ns.py'}:plain)\n")


# ---------------------------------------------------------------------------- item 6: one meaning of --model
def test_config_is_gone_model_takes_the_tiny_models_names(capsys):
    """0.4's deprecated ``--config NAME`` is removed in 0.5 (argparse refuses it); ``--model NAME`` names a tiny one."""
    with pytest.raises(SystemExit) as exited:
        main(["check", "--config", "qwen4"])
    assert exited.value.code == 2
    assert "error: the following arguments are required: --model" in capsys.readouterr().err
    code, lines, err = _check(capsys, "--model", "qwen4")
    assert code == 2 and lines == []
    assert err.startswith("fla-ac-isolation check: error: --model must be a built-in tiny model (one of [")


@pytest.mark.parametrize("command", ["audit", "regress"])
def test_audit_and_regress_refuse_a_users_model_naming_check(capsys, command):
    with pytest.raises(SystemExit) as exited:
        main([command, "--model", f"{EXAMPLE}:plain"])
    _, err = capsys.readouterr()
    assert exited.value.code == 2
    assert f"argument --model: {command} runs the built-in tiny models only (" in err
    assert err.rstrip().endswith(f"got '{EXAMPLE}:plain': to run your own model, use: fla-ac-isolation check "
                                 f"--model {EXAMPLE}:plain")


# --------------------------------------------------------------------------------- item 9: the autotune notice
def test_the_autotune_notice_is_given_on_cuda_only_and_names_the_shortcut():
    assert autotune_notice("cpu", False) is None and autotune_notice("cpu", True) is None
    assert autotune_notice("cuda", False) == (
        "FLA compiles and autotunes its Triton kernels on first use: the first step can take minutes with no output "
        "(rerun with --first-config, or CheckSpec(first_config=True), to keep each autotuner's first config: "
        "seconds, untuned kernels, the same verdict)")
    assert autotune_notice("cuda", True).startswith("FLA's Triton autotuners keep their first config (--first-config)")
    with pytest.raises(CheckInputError, match="first_config must be a bool, got 1"):
        CheckSpec(model="a:b", first_config=1).validate()


# ------------------------------------------------------------------------------- item 8b: backward in autocast
def _autocast_step(model, batch):
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    with reference_kernels(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch)
        loss.backward()  # inside the autocast block, as the trial did
    return loss.detach(), [p.grad for p in model.parameters()]


def test_a_backward_inside_autocast_is_bit_exact_to_no_ac_with_sac_context_fn_and_fails_with_torchs_alone():
    """torch.autocast's weight-cast cache: the forward casts each weight (``_to_copy``), the recompute (run inside
    the same autocast block) hits the cache and skips it, so a policy saving ``_to_copy`` replays shifted outputs
    (a [T, D] cast lands where the [1, T, D] one was). ``sac_context_fn`` turns the cache off inside regions."""
    from fla_ac_isolation import isolate_seqlens
    from fla_ac_isolation.policies import checkpoint_layers

    example = _example()
    loss0, grads0 = _autocast_step(*example.plain())

    model, batch = example.plain()
    isolate_seqlens(model)
    checkpoint_layers(model, "selective", example.my_policy)  # our context_fn, the user's policy
    loss1, grads1 = _autocast_step(model, batch)
    assert torch.equal(loss0, loss1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))

    model, batch = example.isolated()  # the user's own checkpoint(context_fn=create_selective_checkpoint_contexts)
    with pytest.raises(ValueError) as caught:
        _autocast_step(model, batch)
    assert str(caught.value) == AUTOCAST_ERROR


AUTOCAST_ERROR = (
    "x must have batch size 1 when cu_seqlens is given (packed input), got shape (134, 64); this ran in a backward "
    "under torch.autocast with its weight-cast cache on: if the layer is checkpointed with a SAC policy that saves "
    "aten._to_copy (torch's create_selective_checkpoint_contexts), the recompute skipped a weight cast its forward "
    "ran and SAC handed this op another op's saved tensor (torch issue #193338): checkpoint with "
    "fla_ac_isolation.policies.sac_context_fn(policy), call backward() outside the autocast block, or use "
    "torch.autocast(..., cache_enabled=False)"
)
AUTOCAST_DIVERGENT = ("  layers.3  divergent at op #2 in layers.3.mixer.q_proj: recompute ran aten.t.default -> "
                      "[64, 64] bfloat16 cpu, forward ran aten._to_copy.default -> [1, 134, 64] bfloat16 cpu")


def test_the_reference_ops_name_the_autocast_cache_only_in_a_backward_under_autocast_with_its_cache():
    """The hint is added where its three conditions hold, and nowhere else (the shape check's message is kept)."""
    from fla_ac_isolation.op_inputs import check_packed

    x, offsets = torch.zeros(2, 3), torch.tensor([0, 3], dtype=torch.int32)
    plain = "x must have batch size 1 when cu_seqlens is given (packed input), got shape (2, 3)"
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            for cache in (True, False):
                with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
                    with pytest.raises(ValueError) as caught:
                        check_packed("x", x, offsets)
                    seen.append(str(caught.value))
            with pytest.raises(ValueError) as caught:  # no autocast
                check_packed("x", x, offsets)
            seen.append(str(caught.value))
            return g

    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError) as caught:  # not in a backward
        check_packed("x", x, offsets)
    assert str(caught.value) == plain
    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [plain + AUTOCAST_ERROR.split("(134, 64)", 1)[1], plain, plain]


def test_check_autocast_names_the_weight_cast_cache_and_the_checkpointings_fix_exit_1(capsys):
    """``--autocast bf16``: the model's own checkpoint with torch's SAC contexts diverges at the cast the cache
    skipped; the fix named is the checkpointing's, not FLA's (its classes are covered)."""
    from fla_ac_isolation.harness.check.fix import AUTOCAST_CHECK_FIX

    code, lines, _ = _check(capsys, "--model", f"{EXAMPLE}:isolated", "--autocast", "bf16")
    assert lines[0] == (f"fla-ac-isolation check: Decoder (--model {EXAMPLE}:isolated) | its own checkpointing | "
                        f"cpu (FLA served by reference_kernels) | autocast bf16")
    assert [line.split()[0] for line in lines if line.startswith("  covered")] == ["covered", "covered"]
    assert "as given: 0 of 4 checkpointed region(s) aligned, 1 DIVERGENT, 3 not recomputed" in lines  # unjudged
    assert AUTOCAST_DIVERGENT in lines
    assert f"  the step failed: ValueError: {AUTOCAST_ERROR}" in lines
    fix = lines.index("Fix:")
    assert lines[fix + 1:fix + 3] == [f"  {AUTOCAST_CHECK_FIX}", ""]
    assert (code, lines[-1]) == (1, "verdict: DIVERGENT (exit 1)")
    assert_printed_as_on_page("\n".join(lines), "docs/check.md",
                              f"$ fla-ac-isolation check --model {EXAMPLE}:isolated --autocast bf16")


def test_check_autocast_passes_the_same_model_checkpointed_with_sac_context_fn_exit_0(capsys):
    code, lines, _ = _check(capsys, "--model", f"{EXAMPLE}:isolated_sac", "--autocast", "bf16")
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert "Fix:" not in lines
    assert (code, lines[-1]) == (0, "verdict: OK (exit 0)")


def test_the_audit_names_the_autocast_cache_and_not_with_the_cache_off():
    """The unsafe path (torch's contexts, cache on) diverges with the cause named; ``cache_enabled=False`` (the
    same model, the same contexts) aligns every region and the step is bit-exact to no AC."""
    from fla_ac_isolation import ReplayAudit
    from fla_ac_isolation.audit.explain import AUTOCAST_FIX
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    example = _example()
    results = {}
    for cache in (True, False):
        model, batch = example.isolated()
        with (reference_kernels(), ReplayAudit(model, on_divergence="record") as audit,
              torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)):
            loss = model(**batch)
            try:
                loss.backward()
                error = None
            except ValueError as err:
                error = str(err)
        results[cache] = audit.regions, error, loss.detach(), [p.grad for p in model.parameters()]
    regions, error, _, _ = results[True]
    assert [(r.label, r.verdict, r.autocast_cast) for r in regions] == [
        ("layers.0", "not recomputed", False), ("layers.1", "not recomputed", False),
        ("layers.2", "not recomputed", False), ("layers.3", "divergent", True)]
    assert regions[3].message.splitlines()[1:3] == [
        "torch.autocast's weight-cast cache was on in this recompute and the divergent op is a cast "
        "(aten._to_copy): a weight the forward cast was still in that cache when the backward, run inside the "
        "same autocast block, recomputed the region, so the recompute skipped the cast (torch issue #193338; any "
        "checkpointed layer, FLA or not).", AUTOCAST_FIX]
    assert error == AUTOCAST_ERROR
    regions, error, loss, grads = results[False]
    assert [r.verdict for r in regions] == ["aligned"] * 4 and error is None
    model, batch = example.plain()
    from fla_ac_isolation.harness.reference_kernels import reference_kernels as served

    with served(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        loss0 = model(**batch)
        loss0.backward()
    assert torch.equal(loss, loss0.detach())
    assert all(torch.equal(a, b) for a, b in zip(grads, [p.grad for p in model.parameters()], strict=True))


@pytest.mark.parametrize("autocast", ["bf32", "bfloat16", True])
def test_a_bad_autocast_is_refused_naming_autocast(autocast):
    with pytest.raises(CheckInputError) as caught:
        CheckSpec(model="a:b", autocast=autocast).validate()
    assert str(caught.value) == f"autocast must be one of ['bf16', 'fp16'] or None, got {autocast!r}"
