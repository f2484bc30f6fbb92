"""``fla-ac-isolation check``: the user's own model (``--model module:callable``) or a tiny one (``--model NAME``), one
audited step under SAC, its FLA-backed classes, the fix verified on a fresh model; exit 0 / 1 / 2.

The two models of ``examples/check_model.py`` are the ones ``docs/check.md`` shows: what the page prints
is what the command prints."""

from __future__ import annotations

import json
import sys
import textwrap
import types

import pytest
from page_output import assert_printed_as_on_page

from fla_ac_isolation import swap_mixers
from fla_ac_isolation.harness.check import CheckInputError, CheckSpec, survey
from fla_ac_isolation.harness.cli import main
from fla_ac_isolation.harness.foreign_models import build_tiny
from fla_ac_isolation.harness.transformers_kernels import transformers_version

pytestmark = pytest.mark.usefixtures("single_thread")

PAGE = "docs/check.md"
EXAMPLE = "examples/check_model.py"
CONV_LEAK = ("           its short conv runs transformers' torch causal_conv1d_fn across document boundaries (the "
             "causal_conv1d package cannot be imported here): documents are not kept apart")
#: The op at which transformers' Qwen3-Next GDN's recompute leaves its forward (model.layers.0): 5.25's
#: forward runs ten more ops before FLA's call (torch.tensor_split of q, k, v, beta, g for cached decoding).
QWEN3_NEXT_DIVERGENT_OP = {(5, 23): 75, (5, 24): 75, (5, 25): 85}
CONV_FIX = ("  Qwen3NextGatedDeltaNet, to keep packed documents apart: use swap_mixers(model) (drop-in "
            "fla_ac_isolation.mixers.Qwen3NextGatedDeltaNet)")


@pytest.fixture
def no_causal_conv1d(monkeypatch):
    """``import causal_conv1d`` fails, as on this CPU machine (transformers' GDN conv: its torch fallback)."""
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)


@pytest.fixture
def causal_conv1d_stand_in(monkeypatch):
    """``import causal_conv1d`` succeeds (a stand-in module: the detection is what is tested, not the kernel)."""
    monkeypatch.setitem(sys.modules, "causal_conv1d", types.ModuleType("causal_conv1d"))


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("callable_name", "where", "verdict"), [
    ("qwen3_next", "model.layers.0.linear_attn",
     "verdict: DIVERGENT (exit 1), and packed documents mix in Qwen3NextGatedDeltaNet"),
    ("fla_gated_deltanet", "model.layers.0.attn.q_conv1d", "verdict: DIVERGENT (exit 1)"),
])
def test_check_on_the_pages_models_names_the_exposed_class_the_divergence_and_the_verified_fix(
        capsys, no_causal_conv1d, callable_name, where, verdict):
    code, out, _ = _check(capsys, "--model", f"{EXAMPLE}:{callable_name}")

    assert code == 1
    lines = out.splitlines()
    assert lines[-1] == verdict
    fixed_by = "swap_mixers" if callable_name == "qwen3_next" else "isolate_seqlens"  # a drop-in ends the conv leak
    assert f"with {fixed_by}(model): 4 of 4 checkpointed region(s) aligned" in lines
    assert "as given: 3 of 4 checkpointed region(s) aligned, 1 DIVERGENT" in lines
    divergent = next(line for line in lines if "divergent at op" in line)
    assert divergent.startswith("  model.layers.0  divergent at op #") and f" in {where}: recompute ran " in divergent
    assert (CONV_LEAK in lines) == (callable_name == "qwen3_next")
    assert (CONV_FIX in lines) == (callable_name == "qwen3_next")
    varies = ()
    if callable_name == "qwen3_next":  # the page shows 5.24's op number
        assert divergent.startswith(f"  model.layers.0  divergent at op #{QWEN3_NEXT_DIVERGENT_OP[transformers_version()]} ")
        varies = ("divergent at op #",)
    assert_printed_as_on_page(out, PAGE, f"$ fla-ac-isolation check --model {EXAMPLE}:{callable_name}", varies=varies)


def test_check_json_has_the_survey_both_steps_and_the_exit_code(capsys, causal_conv1d_stand_in):
    code, out, _ = _check(capsys, "--model", "qwen3_next", "--json")
    result = json.loads(out)

    assert code == 1 and result["exit_code"] == 1
    (mixer,) = result["mixers"]
    assert mixer["name"] == "Qwen3NextGatedDeltaNet" and mixer["status"] == "exposed"
    assert mixer["paths"] == [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert mixer["offsets"] == ["cu_seq_lens_q", "cu_seq_lens_k"]
    assert mixer["fix"] == "isolate_seqlens(model) (or swap_mixers(model): a drop-in replaces it)"
    assert mixer["why"] is None and mixer["leak_fix"] is None  # causal_conv1d imports: its conv keeps them apart
    assert result["as_given"]["aligned"] is False
    assert result["as_given"]["error"] == "NotImplementedError: \"histogram_cpu\" not implemented for 'Int'"
    first = result["as_given"]["regions"][0]
    assert first["label"] == "model.layers.0" and first["verdict"] == "divergent"
    assert first["where"] == "model.layers.0.linear_attn"
    assert first["fla_helpers"] == ["prepare_chunk_indices", "prepare_chunk_offsets"]
    assert result["fix_applied"] == ["isolate_seqlens(model)"] and result["fixed"]["aligned"] is True
    assert result["fixes"] == ["Qwen3NextGatedDeltaNet: isolate_seqlens(model) (or swap_mixers(model): a drop-in "
                               "replaces it)"]
    assert result["spec"]["device"] == "cpu" and result["spec"]["policy"] == "save-all-copies"


def test_a_gdn_whose_conv_leaks_and_that_has_a_drop_in_is_fixed_by_swap_mixers(capsys, no_causal_conv1d):
    code, out, _ = _check(capsys, "--model", "qwen3_5_text", "--json")
    result = json.loads(out)

    (mixer,) = result["mixers"]
    assert mixer["name"] == "Qwen3_5GatedDeltaNet" and mixer["status"] == "exposed"
    assert mixer["leak_fix"] == "use swap_mixers(model) (drop-in fla_ac_isolation.mixers.Qwen3_5GatedDeltaNet)"
    assert result["fix_applied"] == ["swap_mixers(model)"] and result["fixed"]["aligned"] is True
    assert code == 1 and result["exit_code"] == 1


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


ISOLATED = """
    import warnings
    from fla_ac_isolation import isolate_seqlens
    from fla_ac_isolation.harness.foreign_models import build_tiny

    def isolated():
        model, batch, _ = build_tiny("qwen3_next")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the conv's LeakingMixerWarning (tested in test_isolate_transformers)
            isolate_seqlens(model)
        return model, batch
"""
COVERED = ("  covered  Qwen3NextGatedDeltaNet (transformers) x3: model.layers.0.linear_attn, model.layers.1.linear_attn, "
           "model.layers.2.linear_attn; offsets cu_seq_lens_q, cu_seq_lens_k")


def test_an_isolated_qwen3_next_without_causal_conv1d_is_aligned_but_leaks_through_its_conv_exit_1(
        capsys, tmp_path, no_causal_conv1d):
    """The leak is real: documents 2 and 3 of this model differ from themselves alone by 0.04 and more after
    isolate_seqlens (test_foreign_classes.py::test_transformers_gdn_folders_leak_through_their_torch_conv_...)."""
    code, out, _ = _check(capsys, "--model", f"{_write(tmp_path, ISOLATED)}:isolated")

    lines = out.splitlines()
    assert code == 1
    assert lines[-1] == "verdict: LEAKING (exit 1): packed documents mix in Qwen3NextGatedDeltaNet"
    assert lines[lines.index(COVERED) + 1] == CONV_LEAK
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert lines[lines.index("Fix:") + 1:lines.index("Fix:") + 3] == [CONV_FIX, ""]
    assert not any(line.startswith("with ") for line in lines)  # aligned: no fix run


def test_an_isolated_qwen3_next_with_causal_conv1d_importable_is_covered_and_aligned_exit_0(
        capsys, tmp_path, causal_conv1d_stand_in):
    code, out, _ = _check(capsys, "--model", f"{_write(tmp_path, ISOLATED)}:isolated")

    lines = out.splitlines()
    assert code == 0 and lines[-1] == "verdict: OK (exit 0)"
    assert lines[lines.index(COVERED) + 1] == ""  # no leak line
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert "Fix:" not in lines and not any(line.startswith("with ") for line in lines)


def test_a_mixer_that_leaks_across_documents_fails_the_check_though_aligned(capsys):
    code, out, _ = _check(capsys, "--model", "nemotron_h")

    lines = out.splitlines()
    assert code == 1
    assert "  leaking  NemotronHMamba2Mixer (transformers) x2: model.layers.0.mixer, model.layers.2.mixer" in lines
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert "  NemotronHMamba2Mixer: use swap_mixers(model) (drop-in fla_ac_isolation.mixers.NemotronHMamba2Mixer)" \
        in lines
    assert lines[-1] == "verdict: LEAKING (exit 1): packed documents mix in NemotronHMamba2Mixer"


def test_the_survey_lists_a_swapped_models_drop_ins_not_their_sub_modules():
    model, _, _ = build_tiny("kimi_linear")
    swap_mixers(model)
    (found,) = survey(model)  # not the drop-in's LowRankForgetGate, SigmoidGatedRMSNorm

    assert (found.name, found.framework, found.status) == ("KimiLinearDeltaAttention", "fla_ac_isolation", "covered")
    assert found.paths == tuple(f"model.layers.{i}.self_attn" for i in range(3))


def test_the_users_own_divergent_code_is_pointed_at_layer_local_seqlens(capsys, tmp_path):
    """A model of no class this package knows, whose layers call FLA's helper on one shared offsets object."""
    path = _write(tmp_path, """
        import torch
        from torch import nn
        from fla_ac_isolation.fla_seam.layout import prepare_chunk_indices

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(8, 8)

            def forward(self, x, cu_seqlens):
                n = prepare_chunk_indices(cu_seqlens, 64).shape[0]  # FLA's cached helper, shared offsets
                return self.proj(x) * n

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(Layer() for _ in range(2))

            def forward(self, x, cu_seqlens):
                for layer in self.layers:
                    x = layer(x, cu_seqlens)
                return x.square().mean()

        def own():
            torch.manual_seed(0)
            return Model(), {"x": torch.randn(1, 100, 8), "cu_seqlens": torch.tensor([0, 70, 100], dtype=torch.int32)}
    """)
    code, out, _ = _check(capsys, "--model", f"{path}:own", "--policy", "save-all-copies")

    lines = out.splitlines()
    assert code == 1 and lines[2:4] == [
        "FLA-backed classes:",
        "  exposed  Layer (your code) x2: layers.0, layers.1; its calls handed FLA the same offsets objects (observed "
        "in the step)"]
    assert lines[lines.index("Fix:") + 1:] == [
        "  Layer: build a LayerLocalSeqlens once per model forward, hand it to every layer, and call "
        "seqlens.local() inside Layer's forward (inside its checkpointed region), giving FLA its tensors "
        "(docs/own-model.md)", "", "verdict: DIVERGENT (exit 1)"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "qwen4"], "--model must be a built-in tiny model (one of ['"),
    (["--model", "no_such_module:build"], "model 'no_such_module:build': importing no_such_module failed: "
                                          "ModuleNotFoundError: No module named 'no_such_module'"),
    (["--model", f"{EXAMPLE}:nothing"], f"model '{EXAMPLE}:nothing': {EXAMPLE} has no callable 'nothing'"),
    (["--model", "examples/nothing.py:build"], "model 'examples/nothing.py:build': no file examples/nothing.py"),
    (["--model", "build:"], "model must be 'module:callable', 'path/to/file.py:callable' or a callable returning "
                            "(model, batch), got 'build:'"),
], ids=["name", "module", "callable", "file", "form"])
def test_bad_input_exits_2_naming_what_is_wrong(capsys, argv, message):
    code, out, err = _check(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"fla-ac-isolation check: error: {message}")


CONTRACT = """
import torch
from torch import nn

from fla_ac_isolation.harness.foreign_models import build_tiny

OFFSETS = torch.tensor([0, 2, 3])  # two packed documents of 2 and 1 tokens


class Flat(nn.Module):  # a loss, but no layer list to checkpoint
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x, cu_seqlens):
        return self.proj(x).square().mean()


class Layered(nn.Module):  # a layer list, but no loss
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2)])

    def forward(self, x, cu_seqlens):
        return self.layers[0](x)


class Markup(Layered):
    def forward(self, x, cu_seqlens):
        raise ValueError("[bold red]not markup[/] [link]")


def returns_int():
    return 3


def raises():
    raise KeyError("no data")


def no_layers():
    return Flat(), {"x": torch.randn(3, 2), "cu_seqlens": OFFSETS}


def no_loss():
    return Layered(), {"x": torch.randn(3, 2), "cu_seqlens": OFFSETS}


def wrong_keyword():  # the forward raises TypeError before any layer runs
    return Layered(), {"x": torch.randn(3, 2), "cu_seq_lens": OFFSETS}


def markup():
    return Markup(), {"x": torch.randn(3, 2), "cu_seqlens": OFFSETS}


def unpacked():
    return Layered(), {"x": torch.randn(3, 2)}


def fla_wrong_keyword():  # FLA's models take unknown keywords silently: the batch runs as one sequence
    model, batch, _ = build_tiny("gated_deltanet")
    batch["cu_seq_lens"] = batch.pop("cu_seqlens")
    return model, batch


not_callable = 3
"""
KEYWORDS = ("cu_seq_lens_q (transformers), attention_masks (torchtitan), cu_doc_lens (OLMo-core), cu_seqlens "
            "(flash-linear-attention's models)")
NO_AC = "model(**batch) fails without activation checkpointing, so the model or the batch is wrong, not AC: "
CONTRACT_ERRORS = [
    ("returns_int", "model '{target}' must return (nn.Module, dict of forward keyword arguments), got int"),
    ("raises", "model '{target}': calling it failed: KeyError: 'no data'"),
    ("not_callable", "model '{target}': {target} is not callable (int)"),
    ("no_layers", "cannot checkpoint the model's layers: layers_or_model must be an nn.ModuleList/nn.Sequential/"
                  "nn.ModuleDict of layers or a model with a `layers` container, got Flat"),
    ("no_loss", "model(**batch) must return a scalar loss or an object with .loss (labels in the batch?), got Tensor"),
    ("wrong_keyword", NO_AC + "TypeError: Layered.forward() got an unexpected keyword argument 'cu_seq_lens'"),
    ("markup", NO_AC + "ValueError: [bold red]not markup[/] [link]"),  # foreign text, printed as it is
    ("unpacked", "the batch carries no packed offsets (no 1-D integer tensor, PackedSeqlens or restarting "
                 "position_ids among model(**batch)'s keywords: x), "
                 "so nothing can be checked: give one packed batch with its offsets under the keyword the model "
                 f"reads: {KEYWORDS}"),
    ("fla_wrong_keyword", "no packed offsets reached FLA: the model's FLA-backed layers (GatedDeltaNet) called none "
                          "of FLA's index helpers, so they ran the batch as one sequence and nothing can be checked; "
                          f"give the offsets under the keyword the model reads: {KEYWORDS}"),
]


@pytest.mark.parametrize(("name", "message"), CONTRACT_ERRORS, ids=[row[0] for row in CONTRACT_ERRORS])
def test_a_callable_or_batch_that_breaks_the_contract_exits_2_naming_what_is_wrong(capsys, tmp_path, name, message):
    target = f"{_write(tmp_path, CONTRACT)}:{name}"
    code, out, err = _check(capsys, "--model", target)

    assert code == 2 and out == ""
    assert err.splitlines()[0] == f"fla-ac-isolation check: error: {message.format(target=target)}"


def test_bad_input_with_json_prints_the_error_as_json_on_stdout_too(capsys, tmp_path):
    target = f"{_write(tmp_path, CONTRACT)}:wrong_keyword"
    code, out, err = _check(capsys, "--model", target, "--json")

    message = NO_AC + "TypeError: Layered.forward() got an unexpected keyword argument 'cu_seq_lens'"
    assert code == 2 and json.loads(out) == {"error": message, "exit_code": 2}
    assert err == f"fla-ac-isolation check: error: {message}\n"


def test_the_spec_refuses_neither_or_both_sources():
    with pytest.raises(CheckInputError, match=r"give exactly one of model \('module:callable'\) and config"):
        CheckSpec().validate()
    with pytest.raises(CheckInputError, match="give exactly one of"):
        CheckSpec(model="a:b", config="qwen3_next").validate()


def test_check_offers_no_freq_it_would_refuse(capsys):
    """check checkpoints every layer: --freq is not an option of it (its --help offered 1, 2, 4 and refused 2)."""
    with pytest.raises(SystemExit) as caught:
        main(["check", "--model", "qwen3_next", "--freq", "2"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "fla-ac-isolation: error: unrecognized arguments: --freq 2")
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "--freq" not in capsys.readouterr().out


def test_a_family_name_means_that_family_in_check_as_in_audit(capsys):
    """``--model qwen3_5_moe`` (audit's and regress's family name) runs that family's tiny transformers model;
    a name only check runs is refused by audit naming check."""
    from fla_ac_isolation.harness.foreign_models import family_model_type

    assert [family_model_type(n) for n in ("qwen3_5_moe", "qwen3_8", "nemotron_h", "kimi_linear", "qwen3_next")] == [
        "qwen3_5_moe_text", "qwen4_exp_text", "nemotron_h", "kimi_linear", None]
    code, out, _ = _check(capsys, "--model", "qwen3_5_moe", "--no-verify-fix")
    lines = out.splitlines()
    assert lines[0] == ("fla-ac-isolation check: Qwen3_5MoeForCausalLM (--model qwen3_5_moe) | SAC policy "
                        "save-all-copies | cpu (FLA served by reference_kernels)")
    assert lines[3].startswith("  exposed  Qwen3_5MoeGatedDeltaNet (transformers) x3") and code == 1
    with pytest.raises(SystemExit) as caught:
        main(["audit", "--model", "qwen3_next"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "fla-ac-isolation audit: error: argument --model: audit runs the built-in tiny models only (qwen3_5_moe, "
        "qwen3_8, nemotron_h, kimi_linear, fault-stack); 'qwen3_next' is a tiny transformers / "
        "flash-linear-attention model that check runs: fla-ac-isolation check --model qwen3_next")


POSITIONS_ONLY = """
    from fla_ac_isolation import swap_mixers
    from fla_ac_isolation.harness.foreign_models import build_tiny

    def _positions_only(swap):
        model, batch, _ = build_tiny("qwen3_5_moe")
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            del batch[key]  # DataCollatorWithFlattening()'s default: restarting position_ids alone
        if swap:
            swap_mixers(model)
        return model, batch

    def swapped():
        return _positions_only(True)

    def shipped():
        return _positions_only(False)
"""


def test_a_batch_packed_by_position_ids_alone_is_checked_and_the_shipped_class_reads_no_offsets_from_it(
        capsys, tmp_path):
    """swap.md's position_ids packing: check judges it (was refused as 'no packed offsets'). The drop-ins derive
    the offsets from the positions (aligned, exit 0); the shipped class runs the batch as one sequence, so no
    offsets reach FLA and check says it cannot judge (exit 2)."""
    target = _write(tmp_path, POSITIONS_ONLY)
    code, out, _ = _check(capsys, "--model", f"{target}:swapped")
    assert code == 0 and out.splitlines()[-1] == "verdict: OK (exit 0)"
    assert "as given: 4 of 4 checkpointed region(s) aligned" in out.splitlines()
    code, out, err = _check(capsys, "--model", f"{target}:shipped")
    assert (code, out) == (2, "")
    assert err.splitlines()[0].startswith("fla-ac-isolation check: error: no packed offsets reached FLA: the model's "
                                          "FLA-backed layers (Qwen3_5MoeGatedDeltaNet) called none of FLA's index "
                                          "helpers")
