"""Verdicts never judge a match on missing data (constructed results: no processes).

* A required mode that ran fewer steps than ``no-ac`` and reported no error: ``incomplete`` (exit 1), never a
  match, and for the unsafe mode not "fault reproduced" (not judged).
* Under PP (and CP, the same rule), a mode without a gradient difference from the one-rank run at step 0:
  ``incomplete``, not a match on the loss alone.
"""

from __future__ import annotations

from fla_ac_isolation.harness.regression import report
from fla_ac_isolation.harness.regression.spec import ModeResult, RegressionResult, RegressionSpec

BASE = {"losses": [5.5, 5.6], "grad_norms": [6.6, 8.9], "grad_diffs": [0.0, 0.0], "ref_grad_max": [0.5, 0.5],
        "idle_experts": [0, 0]}
REF = {**BASE, "grad_diffs": [None, None], "ref_grad_max": [None, None]}
PP1 = {"pp1_grad_diffs": [1e-6, 2e-6], "pp1_ref_grad_max": [0.3, 0.3]}  # 3.3e-6 relative: within 2e-4


def _pp_result(**modes) -> RegressionResult:
    out = {"no-ac-pp1": ModeResult("no-ac-pp1", **REF), "no-ac": ModeResult("no-ac", **REF, **PP1)}
    for name, change in modes.items():
        out[name] = ModeResult(name, **{**BASE, **PP1, **change})
    return RegressionResult(RegressionSpec(pp=2, steps=2).validate(), out)


def test_a_required_mode_with_fewer_steps_and_no_error_is_incomplete_not_a_match():
    one_step = {"losses": [5.5], "grad_norms": [6.6], "grad_diffs": [0.0], "ref_grad_max": [0.5]}
    result = _pp_result(isolated=one_step, shared=one_step)
    found = report.verdicts(result)

    assert (found["isolated"].status, found["isolated"].text) == (
        "incomplete", "INCOMPLETE: ran 1 of 2 steps and reported no error")
    assert not found["isolated"].ok and report.exit_code(result) == 1
    assert report.fault_reproduced(result) is None  # the unsafe mode's missing step is no evidence either way
    assert found["no-ac"].text == "reference; vs PP=1 3.3e-06 <= 0.0002"  # the control: complete data is judged


def test_a_mode_without_its_pp1_gradient_difference_is_incomplete_not_matched_on_the_loss():
    for missing in ({"pp1_grad_diffs": []}, {"pp1_grad_diffs": [None, None]}):
        result = _pp_result(isolated=missing)
        found = report.verdicts(result)
        assert (found["isolated"].status, found["isolated"].text) == (
            "incomplete", "INCOMPLETE: no gradient difference from PP=1 at step 0 (cannot be judged against PP=1)")
        assert report.exit_code(result) == 1

    complete = report.verdicts(_pp_result(isolated={}))["isolated"]
    assert (complete.status, complete.text) == ("matches", "matches (bit for bit); vs PP=1 3.3e-06 <= 0.0002")


def test_under_cp_a_missing_cp1_gradient_difference_is_incomplete_too():
    cp1 = {"cp1_grad_diffs": [1e-6, 2e-6], "cp1_ref_grad_max": [0.3, 0.3]}
    out = {"no-ac-cp1": ModeResult("no-ac-cp1", **REF), "no-ac": ModeResult("no-ac", **REF, **cp1),
           "isolated": ModeResult("isolated", **BASE)}
    result = RegressionResult(RegressionSpec(cp=2, steps=2).validate(), out)
    found = report.verdicts(result)

    assert (found["isolated"].status, found["isolated"].text) == (
        "incomplete", "INCOMPLETE: no gradient difference from CP=1 at step 0 (cannot be judged against CP=1)")
    assert found["no-ac"].status == "reference" and report.exit_code(result) == 1
