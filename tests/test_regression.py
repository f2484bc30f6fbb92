"""The regression's pieces without launching ranks: data schedule, models, spec checks, verdicts, report, CLI."""

import argparse
import json

import pytest
import torch

from fla_ac_isolation.harness.cli import regress_render
from fla_ac_isolation.harness.regression import report
from fla_ac_isolation.harness.regression.data import global_batch, rank_batch
from fla_ac_isolation.harness.regression.spec import ModeResult, RegressionResult, RegressionSpec

# ------------------------------------------------------------------------------------------------ data


def test_rank_batches_are_deterministic_and_differ_between_ranks():
    a0, a1 = rank_batch(0, 0, 2), rank_batch(0, 1, 2)
    assert torch.equal(a0.input_ids, rank_batch(0, 0, 2).input_ids)
    assert a0.seq_lens != a1.seq_lens and a0.num_tokens != a1.num_tokens
    for b in (a0, a1):
        assert 0 in b.seq_lens, "every ordinary step packs a zero-length document"
        assert max(b.seq_lens) > 64, "and one document spanning several FLA chunks"
        assert sum(b.seq_lens) == b.num_tokens == b.labels.shape[1]


def test_sparse_step_routes_fewer_tokens_than_experts():
    tokens = sum(rank_batch(1, r, 2).num_tokens for r in range(2))
    assert tokens * 4 < 16, "step 1 leaves experts without tokens at top-4 of 16"


def test_labels_are_next_tokens_within_documents():
    b = rank_batch(0, 0, 2)
    ids, labels = b.input_ids[0], b.labels[0]
    start = 0
    for n in b.seq_lens:
        if n:
            assert torch.equal(labels[start:start + n - 1], ids[start + 1:start + n])
            assert labels[start + n - 1] == -100
        start += n
    assert int((labels != -100).sum()) == sum(max(n - 1, 0) for n in b.seq_lens)


def test_global_batch_packs_every_rank_in_order():
    g = global_batch(2, 2)
    parts = [rank_batch(2, r, 2) for r in range(2)]
    assert g.seq_lens == parts[0].seq_lens + parts[1].seq_lens
    assert torch.equal(g.input_ids, torch.cat([p.input_ids for p in parts], 1))
    assert g.num_targets_global == sum(int((p.labels != -100).sum()) for p in parts)


# ---------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_8", "nemotron_h"])
def test_tiny_family_trains_on_packed_batch_with_one_seqlens_for_all_layers(family):
    from fla_ac_isolation.harness.regression.expert_parallel import setup_torchtitan
    from fla_ac_isolation.harness.regression.model import ModelSize, build_model
    from fla_ac_isolation.seqlens import LayerLocalSeqlens

    setup_torchtitan("cpu")
    torch.manual_seed(0)
    model = build_model(family, ModelSize(hidden_size=64, num_experts=4, top_k=2), backend="reference")
    kinds = [b.kind for b in model.layers]
    expected = {"qwen3_5_moe": ["gdn+moe"] * 3 + ["attention+moe"], "qwen3_8": ["gdn+moe"] * 3 + ["attention+moe"],
                "nemotron_h": ["mamba2", "moe", "attention", "moe"]}[family]
    assert kinds == expected
    batch = rank_batch(0, 0, 2, vocab_size=256)
    seqlens = LayerLocalSeqlens.from_seq_lens(batch.seq_lens)
    seen = []
    orig = type(seqlens).local

    def spy(self):
        seen.append(self)
        return orig(self)

    type(seqlens).local = spy
    try:
        logits = model(batch.input_ids, seqlens)
    finally:
        type(seqlens).local = orig
    assert logits.shape == (1, batch.num_tokens, 256)
    assert seen and all(s is seqlens for s in seen), "every mixer receives the one model-level object"
    torch.nn.functional.cross_entropy(logits[0], batch.labels[0], ignore_index=-100).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_attention_is_causal_within_each_document_only():
    from fla_ac_isolation.harness.regression.model import AttentionLayout
    from fla_ac_isolation.seqlens import LayerLocalSeqlens

    layout = AttentionLayout.from_seqlens(LayerLocalSeqlens.from_seq_lens([2, 0, 3]), torch.device("cpu"))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(layout.mask, expected)
    assert layout.positions.tolist() == [0, 1, 0, 1, 2]


def test_unknown_family_is_refused():
    from fla_ac_isolation.harness.regression.model import build_model

    with pytest.raises(ValueError, match="model must be one of"):
        build_model("llama")


# ------------------------------------------------------------------------------------------------ spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "gpt"}, "model must be one of"),
        ({"ep": 0}, "ep must be an int >= 1"),
        ({"ac": "none"}, "ac must be 'full' or 'selective'"),
        ({"policy": "save-everything"}, "policy must be one of"),
        ({"num_experts": 15}, r"num_experts \(15\) must be a multiple of ep \(2\)"),
        ({"top_k": 32}, "top_k"),
        ({"modes": ("isolated", "bogus")}, "modes must be"),
        ({"backend": "triton"}, "backend must be"),
        ({"ep": 2, "device": "cuda"}, "CUDA devices") if not torch.cuda.is_available() else ({"ep": 64, "device": "cuda"}, "CUDA devices"),
    ],
)
def test_spec_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        RegressionSpec(**change).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults")
def test_spec_resolves_its_own_defaults():
    """Every default lives in the spec (the command passes its unset flags through): what ``regress`` and
    ``regress --cp 2`` run on a CPU, from Python."""
    spec = RegressionSpec()
    assert (spec.ep, spec.steps, spec.device, spec.dtype, spec.hidden_size) == (2, 3, "cpu", "float32", 128)
    assert (spec.backend, spec.kernels, spec.rank_env) == ("auto", "native", ())
    cp = RegressionSpec(cp=2)
    assert (cp.ep, cp.steps, cp.device, cp.dtype, cp.hidden_size) == (1, 2, "cpu", "float32", 64)
    assert (cp.backend, cp.kernels, cp.rank_env) == ("fla", "interpreter", (("TRITON_INTERPRET", "1"),))
    nemotron = RegressionSpec(model="nemotron_h", cp=2)  # head-parallel Mamba2: the reference ops, no interpreter
    assert (nemotron.backend, nemotron.kernels, nemotron.rank_env) == ("auto", "native", ())
    assert RegressionSpec(cp=2, backend="reference").kernels == "native"
    cuda = RegressionSpec(device="cuda")
    assert (cuda.dtype, cuda.hidden_size, cuda.kernels) == ("bfloat16", 512, "native")
    with pytest.raises(ValueError, match=r"^device 'cuda' needs 2 CUDA devices \(one per rank\), found 0$"):
        cuda.validate()


def test_rank_setup_is_a_module_level_function_and_kernels_a_known_choice():
    from fla_ac_isolation.harness.testing.gpu import gpu_test_harness

    spec = RegressionSpec(rank_setup=gpu_test_harness, device="cpu").validate()
    assert spec.to_dict()["rank_setup"] == "fla_ac_isolation.harness.testing.gpu:gpu_test_harness"
    assert json.loads(json.dumps(spec.to_dict()))["rank_setup"] == "fla_ac_isolation.harness.testing.gpu:gpu_test_harness"
    for bad in (lambda: None, "fla_ac_isolation.harness.testing.gpu:gpu_test_harness"):
        with pytest.raises(ValueError, match=r"^rank_setup must be a module-level function \(it is pickled into "
                                             r"every rank process\), got "):
            RegressionSpec(rank_setup=bad).validate()
    with pytest.raises(ValueError, match=r"^kernels must be 'auto' or one of \('native', 'interpreter'\), got 'gpu'$"):
        RegressionSpec(kernels="gpu").validate()
    with pytest.raises(ValueError, match=r"^kernels='interpreter' runs FLA's kernels under Triton's interpreter on a "
                                         r"CPU; device must be 'cpu', got 'cuda'$"):
        RegressionSpec(kernels="interpreter", device="cuda").validate()


def test_no_ac_always_runs_first():
    assert RegressionSpec(modes=("isolated", "shared")).ordered_modes == ("no-ac", "shared", "isolated")


def test_missing_torch_attribute_is_shimmed_and_said(monkeypatch):
    from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat

    monkeypatch.delattr(torch.compiler, "_is_non_strict_tracing", raising=False)
    notes = ensure_torch_compat()
    assert torch.compiler._is_non_strict_tracing() is False
    assert len(notes) == 1 and "_is_non_strict_tracing" in notes[0]
    assert ensure_torch_compat() == [], "nothing to do (and nothing said) once present"


# -------------------------------------------------------------------------------------- verdicts, report


def _result(**modes) -> RegressionResult:
    base = {"losses": [2.0, 1.5], "grad_norms": [1.0, 0.9], "grad_diffs": [0.0, 0.0], "ref_grad_max": [0.5, 0.5],
            "idle_experts": [0, 4]}
    out = {"no-ac": ModeResult("no-ac", **{**base, "grad_diffs": [None, None], "ref_grad_max": [None, None]})}
    for name, change in modes.items():
        out[name.replace("_", "-")] = ModeResult(name.replace("_", "-"), **{**base, **change})
    return RegressionResult(RegressionSpec(steps=2), out)


def test_exact_modes_match_and_pass():
    result = _result(shared={"error": "rank 0: RuntimeError: Autograd not support dtype: Int", "losses": []},
                     isolated={}, global_disable={})
    found = report.verdicts(result)
    assert found["isolated"].text == "matches (bit for bit)"
    assert found["shared"].text == "FAILED: rank 0: RuntimeError: Autograd not support dtype: Int"
    assert report.fault_reproduced(result) is True
    assert report.exit_code(result) == 0, "the unsafe mode never changes the exit code"


def test_a_diverged_isolated_mode_fails_the_run_and_says_by_how_much():
    result = _result(isolated={"grad_diffs": [0.0, 0.05]}, global_disable={})
    found = report.verdicts(result)
    assert found["isolated"].status == "diverged"
    assert found["isolated"].text == "DIVERGED by 1.00e-01 (grad)"
    assert report.exit_code(result) == 1
    assert report.verdicts(result, rtol=0.2)["isolated"].ok, "within an explicit tolerance it matches"


@pytest.mark.parametrize("diverging", ["isolated", "global-disable"])
@pytest.mark.parametrize("how", ["diverged", "failed"])
def test_each_required_mode_alone_decides_the_exit_code(diverging, how):
    """Only one required mode off (the other matches, shared fails as usual): exit code 1, whichever it is."""
    bad = {"grad_diffs": [0.0, 0.05]} if how == "diverged" else {"error": "rank 1: RuntimeError: boom", "losses": []}
    modes = {"shared": {"error": "rank 0: RuntimeError: Autograd not support dtype: Int", "losses": []},
             "isolated": {}, "global_disable": {}}
    modes[diverging.replace("-", "_")] = bad
    result = _result(**modes)
    found = report.verdicts(result)
    assert [name for name, v in found.items() if not v.ok] == ["shared", diverging]
    assert report.exit_code(result) == 1
    modes[diverging.replace("-", "_")] = {}
    assert report.exit_code(_result(**modes)) == 0, "the same run with that mode matching passes"


def test_a_failed_reference_fails_the_run():
    result = _result(isolated={})
    result.modes["no-ac"].error = "RuntimeError: boom"
    assert report.verdicts(result)["isolated"].status == "no reference"
    assert report.exit_code(result) == 1


def test_a_run_whose_every_mode_failed_exits_1_and_names_the_reference_and_the_missing_module():
    """As two ranks without ``tyro`` (torchtitan's dependency) report it: every mode, no-ac included, failed."""
    from rich.console import Console

    error = {"error": "rank 0: ModuleNotFoundError: No module named 'tyro'", "losses": []}
    result = _result(shared=error, isolated=error, global_disable=error)
    result.modes["no-ac"].error, result.modes["no-ac"].losses = error["error"], []
    assert report.exit_code(result) == 1
    console = Console(width=200, record=True)
    regress_render.print_report(result, console=console)
    lines = console.export_text().splitlines()
    assert lines[-5:] == [
        "no-ac (reference): FAIL  FAILED: rank 0: ModuleNotFoundError: No module named 'tyro'  (nothing is judged "
        "against it)",
        "       isolated: FAIL  FAILED: rank 0: ModuleNotFoundError: No module named 'tyro'",
        " global-disable: FAIL  FAILED: rank 0: ModuleNotFoundError: No module named 'tyro'",
        "shared (unsafe): not judged (no reference, or stopped by the timeout)  FAILED: rank 0: ModuleNotFoundError: "
        "No module named 'tyro'  (does not affect the exit code)",
        "missing module tyro: pip install tyro",
    ]


def test_shared_failing_with_every_mode_or_by_timeout_is_not_judged_as_the_fault():
    """A crash of no-ac too (e.g. a width the kernels refuse) or a timeout says nothing about the fault."""
    everything_fails = _result(shared={"error": "RuntimeError: strides should be multiple of 16 bytes", "losses": []},
                               isolated={})
    everything_fails.modes["no-ac"].error = "RuntimeError: strides should be multiple of 16 bytes"
    assert report.fault_reproduced(everything_fails) is None
    timed_out = _result(shared={"error": "timed out after 1 s", "timed_out": True, "losses": []}, isolated={})
    assert report.verdicts(timed_out)["shared"].status == "failed"
    assert report.fault_reproduced(timed_out) is None
    from rich.console import Console

    console = Console(width=200, record=True)
    regress_render.print_report(timed_out, console=console)
    assert "shared (unsafe): not judged (no reference, or stopped by the timeout)" in console.export_text()


def test_report_table_json_and_plot(tmp_path):
    from rich.console import Console

    result = _result(shared={"losses": [2.0, 1.7]}, isolated={}, global_disable={})
    console = Console(width=200, record=True)
    regress_render.print_report(result, console=console, verbose=True)
    text = console.export_text()
    assert "DIVERGED by 1.33e-01 (loss)" in text and "fault reproduced" in text
    assert "FLA tensor-cache lookups" in text
    regress_render.write_json(result, tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["exit_code"] == 0 and doc["fault_reproduced"] is True
    assert doc["modes"]["isolated"]["losses"] == [2.0, 1.5]
    regress_render.write_plot(result, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------------- CLI


def _parse(*argv):
    from fla_ac_isolation.harness.cli import regress as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli, parser.parse_args(list(argv))


def test_cli_defaults_are_the_readme_command():
    cli, args = _parse()
    spec = cli.spec_from_arguments(args)
    assert (spec.model, spec.ep, spec.steps) == ("qwen3_5_moe", 2, 3)
    if not torch.cuda.is_available():
        assert (spec.device, spec.dtype, spec.hidden_size) == ("cpu", "float32", 128)


def test_cli_invalid_arguments_exit_2(capsys):
    cli, args = _parse("--experts", "15")
    assert cli.run(args) == 2
    assert "num_experts (15) must be a multiple of ep (2)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # the Python API's rules and wording (RegressionSpec.validate, report.check_rtol): one owner per rule
        pytest.param(["--timeout", "0"], "timeout_s must be a finite number of seconds > 0, got 0.0", id="timeout-0"),
        pytest.param(["--timeout", "-5"], "timeout_s must be a finite number of seconds > 0, got -5.0",
                     id="timeout-neg"),
        pytest.param(["--timeout", "nan"], "timeout_s must be a finite number of seconds > 0, got nan",
                     id="timeout-nan"),
        pytest.param(["--rtol", "-0.1"], "rtol must be a finite number >= 0 (relative tolerance), got -0.1",
                     id="rtol-neg"),
        pytest.param(["--json", "{missing}/r.json"], "--json {missing}/r.json: the folder {missing} does not exist",
                     id="json-missing-folder"),
        pytest.param(["--plot", "{missing}/r.png"], "--plot {missing}/r.png: the folder {missing} does not exist",
                     id="plot-missing-folder"),
        pytest.param(["--json", "{tmp}"], "--json {tmp}: is a folder; give a file path", id="json-is-a-folder"),
        # /sys refuses new files even to root (permission bits would not tell)
        pytest.param(["--plot", "/sys/r.png"], "--plot /sys/r.png: the folder /sys is not writable", id="plot-unwritable"),
        # 0 is a value, not "unset" (it used to fall back to the default of 3 steps)
        pytest.param(["--steps", "0"], "steps must be an int >= 1, got 0", id="steps-0"),
        pytest.param(["--hidden-size", "0"], "hidden_size must be an int >= 1, got 0", id="hidden-0"),
        # a width the tiny decoders cannot split into heads (it used to crash every mode, no-ac included)
        pytest.param(["--hidden-size", "3"], "hidden_size must be a multiple of 32 (an even number of 16-channel "
                     "heads at this width), got 3", id="hidden-3"),
        pytest.param(["--hidden-size", "96"], "hidden_size must be a multiple of 64 (an even number of 32-channel "
                     "heads at this width), got 96", id="hidden-96"),
        # the rule between the degrees comes first: with 16 experts, ep 3 also does not divide them
        pytest.param(["--cp", "2", "--ep", "3"], "ep (3) must be 1 or equal cp (2): the EP ranks are borrowed from "
                     "the 2 CP ranks (one process per CP rank)", id="ep-vs-cp-before-experts"),
        pytest.param(["--modes", "isolated,field"], "modes must be a non-empty subset of ('no-ac', 'shared', "
                     "'isolated', 'global-disable') (field needs cp > 1), got ('isolated', 'field')",
                     id="field-without-cp"),
        # AdamW refused it only inside every rank, after every mode had started
        pytest.param(["--lr", "-1"], "lr must be a finite number >= 0 (AdamW learning rate), got -1.0", id="lr-neg"),
        pytest.param(["--lr", "nan"], "lr must be a finite number >= 0 (AdamW learning rate), got nan", id="lr-nan"),
    ],
)
def test_cli_bad_flags_exit_2_before_any_work(argv, message, tmp_path, monkeypatch, capsys):
    import time

    from fla_ac_isolation.harness.cli import main
    from fla_ac_isolation.harness.regression import run as regression_run

    def must_not_run(*args, **kwargs):
        raise AssertionError("run_regression was called: the flag was not checked before the run")

    monkeypatch.setattr(regression_run, "run_regression", must_not_run)
    fill = {"missing": str(tmp_path / "no-such-folder"), "tmp": str(tmp_path)}
    start = time.monotonic()
    code = main(["regress", *(a.format(**fill) for a in argv)])
    assert time.monotonic() - start < 1.0
    assert code == 2
    assert f"fla-ac-isolation regress: error: {message.format(**fill)}" in " ".join(capsys.readouterr().out.split())


def test_timeout_and_rtol_are_checked_in_the_python_api_too():
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds > 0, got 0"):
        RegressionSpec(timeout_s=0).validate()
    with pytest.raises(ValueError, match=r"rtol must be a finite number >= 0 \(relative tolerance\), got -1"):
        report.verdicts(_result(isolated={}), rtol=-1)
    with pytest.raises(ValueError, match=r"fail_on must be \(mode, rank\) or \(mode, rank, message\)"):
        RegressionSpec(fail_on=("isolated", 2)).validate()
