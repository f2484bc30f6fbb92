"""FLA's real kernels as the saveable custom operators, on CPU under ``TRITON_INTERPRET=1``.

The cases run in a subprocess (``tests/interpret_saveable_cases.py``; the variable must be set before FLA's
kernels are decorated). One 2-layer stack (GDN, Mamba2; ``backend="fla"``) in bfloat16 covers the three
operators as the mixers call them.
"""


import pytest
from helpers import run_interpreter_cases

TIMEOUT_S = 4 * 60  # a hang guard for the subprocess, not a speed target (those live in benchmarks/)


@pytest.fixture(scope="module")
def results():
    return run_interpreter_cases("interpret_saveable_cases.py", timeout_s=TIMEOUT_S)


def test_saveable_stack_equals_the_default_path_bit_for_bit(results):
    """Without AC, ``saveable=True`` gives the loss and every gradient of FLA's public functions exactly."""
    assert results["parity"] is True


def test_every_fla_operator_matches_its_fake_kernel(results):
    assert results["fake"] == {name: True for name in (
        "causal_conv1d", "causal_conv1d_backward", "gated_delta_rule", "gated_delta_rule_backward", "simple_gla",
        "simple_gla_backward")}


def test_a_saved_core_runs_no_fla_kernel_in_the_recompute(results):
    """Core ops saved, conv not: the recompute reruns only the two convs (one launch each); no kernel of the
    gated delta rule or simple GLA and no FLA cache lookup; gradients bit-equal to no AC."""
    sac = results["sac"]
    assert sac["bit_equal"] is True
    assert sac["recompute_calls"] == {"causal_conv1d": 2}
    assert sac["recompute_launches"] == {"causal_conv1d_fwd_kernel": 2}
    assert sac["recompute_lookups"] == 0


def test_dynamo_traces_the_fla_gdn_mixer_without_a_graph_break(results):
    """FLA's public functions are ``torch.compiler.disable`` d (the default path breaks there); the operators
    are traced as single nodes."""
    assert results["compile"] == {"graphs": 1, "breaks": 0}

