"""``fla-ac-isolation audit``: one step per mode, each region's verdict printed, exit code from the safe modes."""

import pytest
from helpers import run_without
from page_output import assert_printed_as_on_page

from fla_ac_isolation.harness.cli import main


def test_audit_cli_fault_stack_flags_shared_and_passes_isolated(capsys):
    code = main(["audit", "--model", "fault-stack", "--ac", "full", "--modes", "shared,isolated,global-disable"])
    out = capsys.readouterr().out
    assert code == 0
    assert "== fault-stack | shared | full AC | freq 1: 1 divergent region(s)" in out
    assert "== fault-stack | isolated | full AC | freq 1: aligned" in out
    assert "== fault-stack | global-disable | full AC | freq 1: aligned" in out
    assert "layers.0  54       24       DIVERGENT at op #0  1/3               2/0" in out
    assert "FLA prepare_position_ids, prepare_chunk_indices missed in forward and hit in recompute." in out


def test_audit_cli_rejects_bad_modes(capsys):
    assert main(["audit", "--model", "fault-stack", "--modes", "no-ac"]) == 2
    assert ("fla-ac-isolation audit: error: modes must be a non-empty subset of ('shared', 'isolated', "
            "'global-disable'), got ('no-ac',)") in capsys.readouterr().err


@pytest.mark.slow
def test_audit_cli_regression_family_names_the_mixer(capsys):
    pytest.importorskip("torchtitan")
    code = main(["audit", "--model", "qwen3_5_moe"])  # the command docs/audit.md shows (about 7 s of CPU)
    out = capsys.readouterr().out
    assert code == 0
    assert_printed_as_on_page(out, "docs/audit.md", "$ fla-ac-isolation audit --model qwen3_5_moe")
    assert "== qwen3_5_moe | shared | SAC policy save-all-copies | freq 1: 1 divergent region(s)" in out
    assert "recompute op #24 (in layers.0.mixer)" in out
    assert "FLA prepare_chunk_indices, prepare_chunk_offsets missed in forward and hit in recompute." in out
    assert "== qwen3_5_moe | isolated | SAC policy save-all-copies | freq 1: aligned" in out


@pytest.mark.parametrize(("failing", "expected_code"), [("isolated", 1), ("shared", 0)])
def test_audit_cli_a_mode_that_raises_is_reported_and_the_others_still_print(failing, expected_code, monkeypatch,
                                                                            capsys):
    import fla_ac_isolation.harness.fault_stack as fault_stack

    real = fault_stack.run_stack
    text = "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed [bold]"

    def run_stack(mode, *args, **kwargs):
        if mode == failing:
            raise RuntimeError(text.removeprefix("RuntimeError: "))
        return real(mode, *args, **kwargs)

    monkeypatch.setattr(fault_stack, "run_stack", run_stack)
    code = main(["audit", "--model", "fault-stack", "--ac", "full", "--modes", "shared,isolated,global-disable"])
    out = capsys.readouterr().out
    assert code == expected_code
    assert f"== fault-stack | {failing} | full AC | freq 1: FAILED: {text}" in out
    assert "== fault-stack | global-disable | full AC | freq 1: aligned" in out
    other = "isolated" if failing == "shared" else "shared"
    verdict = "aligned" if other == "isolated" else "1 divergent region(s)"
    assert f"== fault-stack | {other} | full AC | freq 1: {verdict}" in out


def test_an_audit_of_the_unsafe_mode_alone_judged_nothing_and_exits_2(capsys):
    code = main(["audit", "--model", "fault-stack", "--ac", "full", "--modes", "shared", "--quiet"])
    captured = capsys.readouterr()
    assert code == 2
    assert "== fault-stack | shared | full AC | freq 1: 1 divergent region(s)" in captured.out, "still audited"
    assert captured.err == ("fla-ac-isolation audit: could not judge: only unsafe modes ran (shared), and they never "
                            "decide\n")


def test_a_family_audit_without_tyro_judged_nothing_and_exits_2_naming_it(tmp_path):
    """As on the H100 that lacked ``tyro`` (torchtitan's dependency): every mode fails before its step."""
    pytest.importorskip("torchtitan")
    proc = run_without(("tyro",), ["-m", "fla_ac_isolation.harness.cli", "audit", "--model", "qwen3_5_moe"], tmp_path)
    missing = "ModuleNotFoundError: No module named 'tyro'"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"== qwen3_5_moe | shared | SAC policy save-all-copies | freq 1: FAILED: {missing}" in proc.stdout
    assert f"== qwen3_5_moe | isolated | SAC policy save-all-copies | freq 1: FAILED: {missing}" in proc.stdout
    assert proc.stderr.splitlines() == [
        f"fla-ac-isolation audit: could not judge: no mode that decides ran a checkpointed region: isolated: FAILED: "
        f"{missing}",
        "  missing module tyro: pip install tyro",
    ]


def test_the_audit_runs_from_python_and_returns_data():
    """The audit is library code (audit_runner): a spec in, region reports and the outcome out; nothing printed."""
    from fla_ac_isolation.harness.audit_runner import AuditSpec, run_audit

    seen = []
    result = run_audit(AuditSpec(model="fault-stack", ac="full"), on_run=seen.append)
    shared, isolated = result.runs
    assert seen == result.runs and [r.mode for r in result.runs] == ["shared", "isolated"]
    assert [region.label for region in shared.audit.divergent] == ["layers.0"]
    assert not shared.aligned and not shared.decides, "the unsafe mode (its role) never decides the outcome"
    assert isolated.aligned and isolated.decides and isolated.audit.regions
    assert result.exit_code == 0


@pytest.mark.parametrize(
    ("argv", "field", "message"),
    [
        (["--modes", ""], {"modes": ()},
         "modes must be a non-empty subset of ('shared', 'isolated', 'global-disable'), got ()"),
        (["--layers", "0"], {"num_layers": 0}, "num_layers must be an int >= 1, got 0"),
        (["--hidden-size", "-1"], {"hidden_size": -1}, "hidden_size must be an int >= 1, got -1"),
    ],
)
def test_audit_cli_shows_the_python_apis_message(argv, field, message, capsys):
    from fla_ac_isolation.harness.audit_runner import AuditSpec

    assert main(["audit", "--model", "fault-stack", *argv]) == 2
    assert f"fla-ac-isolation audit: error: {message}" in capsys.readouterr().err
    with pytest.raises(ValueError) as info:  # the same rule, the same words, from Python
        AuditSpec(model="fault-stack", **field).validate()
    assert str(info.value) == message
