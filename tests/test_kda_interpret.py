"""FLA's real ``chunk_kda`` and causal conv, run on CPU under ``TRITON_INTERPRET=1``, match the KDA reference backend.

The cases live in ``tests/interpret_kda_cases.py`` and run in a subprocess (``TRITON_INTERPRET`` must be set before
FLA's kernels are decorated), with the shims of ``fla_ac_isolation.harness.fla_seam.interpreter``. Measured on 2 CPU cores:
max error / max(1, |reference|) <= 4.1e-7 for the op (output and gradients) and <= 1.9e-6 for the Kimi-Linear
mixer (its decay gradients ``A_log``, ``dt_bias``; float32 chunk sums in FLA against a token recurrence); bound
1e-5, as ``tests/test_ops_interpret.py``. The cases took 24 s on 2 cores, 55 s with the machine loaded
about 2.7 times over (load average 5.5): the budget, 90 s, catches a blow-up, not a busy neighbour.
"""

import pytest
from helpers import run_interpreter_cases

pytestmark = pytest.mark.slow

TOL = 1e-5
TIMEOUT_S = 4 * 90  # a hang guard for the subprocess, not a speed target (those live in benchmarks/)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_cases("interpret_kda_cases.py", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("case", ["chunk_kda_gva", "kimi_linear_mixer"])
def test_flas_chunk_kda_under_interpreter_matches_the_reference(interpreter_results, case):
    result = interpreter_results[case]
    assert result["output"] <= TOL, result
    for name, err in result["grads"].items():
        assert err <= TOL, (name, err)


def test_the_reference_makes_the_same_index_lookups_as_flas_chunk_kda(interpreter_results):
    """Forward, fresh offsets: FLA's chunk_kda and the reference miss the same cached helpers in the same order."""
    lookups = interpreter_results["chunk_kda_gva"]["lookups"]
    assert lookups["fla"] == lookups["reference"] == [
        ["prepare_chunk_indices", "miss"], ["prepare_lens", "miss"], ["prepare_chunk_offsets", "miss"],
        ["prepare_lens", "miss"],
    ]

