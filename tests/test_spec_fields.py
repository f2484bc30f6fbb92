"""The rules the audit's and the regression's specs share, and the ``--model`` of ``audit`` and ``regress``: one
definition each (``harness/spec_fields.py``, ``harness/cli/console.add_model_argument``), so both give the same
exact messages."""

import pytest

from fla_ac_isolation.harness.audit_runner import AuditSpec
from fla_ac_isolation.harness.cli import main
from fla_ac_isolation.harness.regression.spec import RegressionSpec
from fla_ac_isolation.policies import save_all_copies, torchtitan_selective

SPECS = [pytest.param(AuditSpec, id="audit"), pytest.param(RegressionSpec, id="regression")]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ac": "none"}, "ac must be 'full' or 'selective', got 'none'"),
        ({"policy": "save-everything"},
         "policy must be one of ['save-all-copies', 'save-d2h-copies', 'torchtitan'], 'module:callable' or "
         "'path/to/file.py:callable' naming your own SAC policy, or that function: (ctx, op, *args, **kwargs) -> "
         "CheckpointPolicy, as torch.utils.checkpoint.create_selective_checkpoint_contexts takes it, got "
         "'save-everything'"),
        ({"freq": 0}, "freq must be an int >= 1, got 0"),
        ({"num_layers": True}, "num_layers must be an int >= 1, got True"),
        ({"top_k": 1.5}, "top_k must be an int >= 1, got 1.5"),
        ({"backend": "triton"}, "backend must be one of ('auto', 'fla', 'reference'), got 'triton'"),
        ({"seed": "0"}, "seed must be an int, got '0'"),
        ({"seed": False}, "seed must be an int, got False"),
    ],
)
def test_both_specs_refuse_a_shared_field_with_one_message(spec, change, message):
    with pytest.raises(ValueError) as raised:
        spec(device="cpu", **change).validate()
    assert str(raised.value) == message


@pytest.mark.parametrize("spec", SPECS)
def test_full_ac_refuses_a_given_policy_and_selective_builds_a_fresh_one(spec):
    """A policy given with full AC would be ignored (full AC saves no op): refused, as check refuses it. Not given,
    it is the default policy under selective AC and nothing under full AC."""
    for policy in ("save-all-copies", "not-a-policy"):
        with pytest.raises(ValueError) as raised:
            spec(device="cpu", ac="full", policy=policy).validate()
        assert str(raised.value) == (
            f"policy {policy!r} was given with ac='full': full AC recomputes every op and saves none, so a SAC "
            "policy has nothing to choose: leave policy out, or give ac='selective' to apply it")
    full, selective = spec(device="cpu", ac="full").validate(), spec(device="cpu").validate()
    assert (full.policy, selective.policy, selective.policy_name) == (None, None, "save-all-copies")
    from fla_ac_isolation.harness.spec_fields import sac_policy

    assert sac_policy("full", None) is None and sac_policy("selective", None).__name__ == "save_all_copies"
    assert sac_policy("full", "save-all-copies") is None
    first, second = sac_policy("selective", "save-all-copies"), sac_policy("selective", "save-all-copies")
    assert first.__name__ == save_all_copies().__name__ == "save_all_copies" and first is not second
    pytest.importorskip("torchtitan")
    assert type(sac_policy("selective", "torchtitan")) is torchtitan_selective


@pytest.mark.parametrize(("command", "names"), [
    ("audit", "qwen3_5_moe, qwen3_8, nemotron_h, kimi_linear, fault-stack"),
    ("regress", "qwen3_5_moe, qwen3_8, nemotron_h, kimi_linear"),
])
def test_audit_and_regress_refuse_an_unknown_model_with_one_message(capsys, command, names):
    with pytest.raises(SystemExit) as exited:
        main([command, "--model", "llama"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.rstrip().endswith(f"argument --model: must be one of {names}, got 'llama'")


@pytest.mark.parametrize("spec", SPECS)
def test_both_specs_take_the_users_own_policy_from_a_file_or_as_the_function(spec):
    """One rule (``spec_fields.resolve_policy``, check's too): the file runs once; the regression keeps a
    function as the target its ranks load, the audit (one process) as it is."""
    from fla_ac_isolation.harness.spec_fields import sac_policy
    from fla_ac_isolation.harness.user_code import load_callable

    target = "examples/own_trainer.py:sac_policy"
    policy = load_callable(target, "policy")
    assert spec(device="cpu", policy=target).validate().policy_name == target
    assert sac_policy("selective", target) is policy
    by_function = spec(device="cpu", policy=policy).validate()
    assert by_function.policy_name == (target if spec is RegressionSpec else "sac_policy")
    assert sac_policy("selective", by_function.policy) is policy


def test_audit_runs_the_users_own_policy_from_a_file(capsys):
    target = "examples/own_trainer.py:sac_policy"
    assert main(["audit", "--model", "fault-stack", "--policy", target, "--modes", "isolated", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"== fault-stack | isolated | SAC policy {target} | freq 1: aligned"
