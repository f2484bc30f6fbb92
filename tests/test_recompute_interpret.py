"""FLA's real kernels under Triton's interpreter: Mamba2's SSD without host syncs, and padded static metadata.

The cases live in ``tests/interpret_recompute_cases.py`` and run in a subprocess (``TRITON_INTERPRET`` must be set
before FLA's kernels are decorated). Every claim here is bit for bit: the same FLA kernels with the same inputs.
"""

import pytest
from helpers import run_interpreter_cases

pytestmark = pytest.mark.slow

TIMEOUT_S = 4 * 120  # a hang guard for the subprocess, not a speed target (those live in benchmarks/)


@pytest.fixture(scope="module")
def results():
    return run_interpreter_cases("interpret_recompute_cases.py", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(
    "case", ["simple_gla_given_schedule", "simple_gla_padded_schedule", "simple_gla_operator", "simple_gla_batch_rows"]
)
def test_sync_free_simple_gla_equals_flas_chunk_simple_gla_bit_for_bit(results, case):
    assert results[case] == [True] * 5  # output, dq, dk, dv, dg


@pytest.mark.parametrize("name", ["qwen3_5_moe", "nemotron_h"])
def test_an_isolated_checkpointed_layer_step_runs_no_op_that_syncs_on_cuda(results, name):
    assert results[f"syncs_{name}_isolated"] == []


def test_without_the_schedule_the_mamba2_step_syncs_where_flas_index_helper_does(results):
    """Shared device offsets (no host copy, no schedule): FLA builds the schedule with a device
    ``repeat_interleave`` in the forward (a miss) and the recompute hits its cache; without AC the same one."""
    site = ["repeat_interleave", "fla/ops/utils/index.py:128"]
    assert results["syncs_nemotron_h_shared"] == [site]
    assert results["syncs_nemotron_h_no-ac"] == [site]


def test_flas_own_chunk_simple_gla_reads_its_state_count_on_the_host(results):
    """The path the SSD left: FLA's entry point reads ``split_offsets[-1]`` on the host in the forward, in the
    backward's rebuild of the states and in the state gradients (``chunk_h.py``)."""
    assert results["syncs_fla_chunk_simple_gla"] == [
        ["repeat_interleave", "fla/ops/utils/index.py:128"],
        ["_local_scalar_dense", "fla/ops/common/chunk_h.py:335"],
        ["_local_scalar_dense", "fla/ops/common/chunk_h.py:335"],
        ["_local_scalar_dense", "fla/ops/common/chunk_h.py:399"],
    ]


@pytest.mark.parametrize("name", ["qwen3_5_moe", "nemotron_h"])
@pytest.mark.parametrize("layout", ["one doc", "the bound"])
def test_padded_static_metadata_gives_a_checkpointed_mixer_the_same_numbers(results, name, layout):
    assert results[f"padded_{name}_{layout}"] == []  # output, input and every parameter gradient equal

