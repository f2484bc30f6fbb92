"""FLA's real Triton kernels, run on CPU under ``TRITON_INTERPRET=1``, match the reference backend.

The cases live in ``tests/interpret_cases.py`` and run in a subprocess: ``TRITON_INTERPRET`` must be set
before FLA's kernels are decorated, i.e. before this test session imported FLA. The interpreter needs the
shims of ``fla_ac_isolation.harness.fla_seam.interpreter`` (first autotune config only; loop variables with a
no-op ``.to()``).
"""


import pytest
from helpers import run_interpreter_cases

TOL = 1e-5  # max |fla - reference| / max(1, max |reference|), float32, output and every gradient
TIMEOUT_S = 4 * 60  # a hang guard for the subprocess, not a speed target (those live in benchmarks/)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_cases("interpret_cases.py", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(
    "case",
    [
        "causal_conv1d", "gated_delta_rule_gva", "ssd_on_simple_gla", "qwen3_5_moe_mixer", "nemotron_h_mixer",
        "causal_conv1d_given_chunk_indices", "gated_delta_rule_given_chunk_indices",
    ],
)
def test_fla_kernels_under_interpreter_match_reference(interpreter_results, case):
    result = interpreter_results[case]
    assert result["output"] <= TOL, result
    for name, err in result["grads"].items():
        assert err <= TOL, (name, err)


def test_a_schedule_for_another_chunk_size_is_misread_by_the_kernel(interpreter_results):
    """Why LayerLocalSeqlens fixes the chunk size to FLA's and ops.fla checks FLA's conv chunk size:
    the kernel trusts ``chunk_indices`` and leaves tokens unwritten given a 128-token schedule."""
    result = interpreter_results["causal_conv1d_wrong_chunk_size"]
    assert not result["output"] <= 1e-2, result  # NaN (never-written rows) or a large error

