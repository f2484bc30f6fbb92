"""``fla-ac-isolation check``: the user's own model (``--model module:callable``) or a tiny one (``--config``), one
audited step under SAC, its FLA-backed classes, the fix verified on a fresh model; exit 0 / 1 / 2.

The two models of ``examples/check_model.py`` are the ones ``docs/foreign-classes.md`` shows: what the page prints
is what the command prints."""

from __future__ import annotations

import json
import textwrap

import pytest
from page_output import assert_printed_as_on_page

from fla_ac_isolation.check_runner import CheckInputError, CheckSpec
from fla_ac_isolation.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

PAGE = "docs/foreign-classes.md"
EXAMPLE = "examples/check_model.py"


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("callable_name", ["qwen3_next", "fla_gated_deltanet"])
def test_check_on_the_pages_models_names_the_exposed_class_the_divergence_and_the_verified_fix(capsys,
                                                                                                callable_name):
    code, out, _ = _check(capsys, "--model", f"{EXAMPLE}:{callable_name}")

    assert code == 1
    lines = out.splitlines()
    assert lines[-1] == "verdict: DIVERGENT (exit 1)"
    assert "with isolate_seqlens(model): 4 of 4 checkpointed region(s) aligned" in lines
    assert "as given: 3 of 4 checkpointed region(s) aligned, 1 DIVERGENT" in lines
    assert next(line for line in lines if "divergent at op" in line).startswith("  model.layers.0  divergent at op #")
    assert_printed_as_on_page(out, PAGE, f"$ fla-ac-isolation check --model {EXAMPLE}:{callable_name}")


def test_check_json_has_the_survey_both_steps_and_the_exit_code(capsys):
    code, out, _ = _check(capsys, "--config", "qwen3_next", "--json")
    result = json.loads(out)

    assert code == 1 and result["exit_code"] == 1
    (mixer,) = result["mixers"]
    assert mixer["name"] == "Qwen3NextGatedDeltaNet" and mixer["status"] == "exposed"
    assert mixer["paths"] == [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert mixer["offsets"] == ["cu_seq_lens_q", "cu_seq_lens_k"] and mixer["fix"] == "isolate_seqlens(model)"
    assert result["as_given"]["aligned"] is False
    assert result["as_given"]["error"] == "NotImplementedError: \"histogram_cpu\" not implemented for 'Int'"
    first = result["as_given"]["regions"][0]
    assert first["label"] == "model.layers.0" and first["verdict"] == "divergent"
    assert first["fla_helpers"] == ["prepare_chunk_indices", "prepare_chunk_offsets"]
    assert result["fix_applied"] == ["isolate_seqlens(model)"] and result["fixed"]["aligned"] is True
    assert result["fixes"] == ["Qwen3NextGatedDeltaNet: isolate_seqlens(model)"]
    assert result["spec"]["device"] == "cpu" and result["spec"]["policy"] == "save-all-copies"


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_model_isolated_already_is_covered_and_aligned_exit_0(capsys, tmp_path):
    path = _write(tmp_path, """
        from fla_ac_isolation import isolate_seqlens
        from fla_ac_isolation.foreign_models import build_tiny

        def isolated():
            model, batch, _ = build_tiny("qwen3_next")
            isolate_seqlens(model)
            return model, batch
    """)
    code, out, _ = _check(capsys, "--model", f"{path}:isolated")

    lines = out.splitlines()
    assert code == 0 and lines[-1] == "verdict: OK (exit 0)"
    assert "  covered  Qwen3NextGatedDeltaNet (transformers) x3: model.layers.0.linear_attn, model.layers.1." \
           "linear_attn, model.layers.2.linear_attn; offsets cu_seq_lens_q, cu_seq_lens_k" in lines
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert "Fix:" not in lines and not any(line.startswith("with ") for line in lines)


def test_a_mixer_that_leaks_across_documents_fails_the_check_though_aligned(capsys):
    code, out, _ = _check(capsys, "--config", "nemotron_h")

    lines = out.splitlines()
    assert code == 1 and lines[-1] == "verdict: LEAKING (exit 1)"
    assert "  leaking  NemotronHMamba2Mixer (transformers) x2: model.layers.0.mixer, model.layers.2.mixer" in lines
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert "  NemotronHMamba2Mixer: use swap_mixers(model) (drop-in fla_ac_isolation.mixers.NemotronHMamba2Mixer)" \
        in lines


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
    assert code == 1 and "FLA-backed classes: none this package knows" in lines
    assert lines[lines.index("Fix:") + 1] == (
        "  your own FLA-calling code: build a LayerLocalSeqlens once per forward and hand each layer "
        "seqlens.local() inside its forward (docs/own-model.md)")


@pytest.mark.parametrize(("argv", "message"), [
    (["--config", "qwen4"], "config must be one of ["),
    (["--model", "no_such_module:build"], "model 'no_such_module:build': importing no_such_module failed: "
                                          "ModuleNotFoundError: No module named 'no_such_module'"),
    (["--model", f"{EXAMPLE}:nothing"], f"model '{EXAMPLE}:nothing': {EXAMPLE} has no callable 'nothing'"),
    (["--model", "examples/nothing.py:build"], "model 'examples/nothing.py:build': no file examples/nothing.py"),
    (["--model", "build"], "model must be 'module:callable' or 'path/to/file.py:callable', got 'build'"),
    (["--config", "qwen3_next", "--freq", "2"], "check checkpoints every layer: --freq must be 1"),
], ids=["config", "module", "callable", "file", "form", "freq"])
def test_bad_input_exits_2_naming_what_is_wrong(capsys, argv, message):
    code, out, err = _check(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"fla-ac-isolation check: error: {message}")


@pytest.mark.parametrize(("body", "message"), [
    ("def build():\n    return 3\n", "must return (nn.Module, dict of forward keyword arguments), got int"),
    ("def build():\n    raise KeyError('no data')\n", "calling it failed: KeyError: 'no data'"),
    ("from torch import nn\ndef build():\n    return nn.Linear(2, 2), {}\n",
     "cannot checkpoint the model's layers: layers_or_model must be an nn.ModuleList"),
    ("import torch\nfrom torch import nn\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.layers = nn.ModuleList([nn.Linear(2, 2)])\n    def forward(self, x):\n        return self.layers[0](x)\n"
     "def build():\n    return M(), {'x': torch.randn(3, 2)}\n",
     "model(**batch) must return a scalar loss or an object with .loss (labels in the batch?), got Tensor"),
], ids=["returns-int", "raises", "no-layers", "no-loss"])
def test_a_callable_that_breaks_the_contract_exits_2(capsys, tmp_path, body, message):
    path = tmp_path / "bad_model.py"
    path.write_text(body)
    code, _, err = _check(capsys, "--model", f"{path}:build")
    assert code == 2
    assert message in err.splitlines()[0]


def test_the_spec_refuses_neither_or_both_sources():
    with pytest.raises(CheckInputError, match=r"give exactly one of model \('module:callable'\) and config"):
        CheckSpec().validate()
    with pytest.raises(CheckInputError, match="give exactly one of"):
        CheckSpec(model="a:b", config="qwen3_next").validate()
