"""How the launcher places modes in processes: where ranks are spawned (CUDA, or ranks that need environment
variables), one-rank modes share one process while they succeed; a mode that fails gets the next one a fresh
process; the unsafe modes run last; the results are those of one launch per mode, bit for bit.

Spawning is what the GPU runs pay for (about 20 s of imports per process on a fresh H200 machine); on a CPU
the same path is taken by giving the ranks an environment variable, which forces ``spawn``.
"""

import pytest

from fla_ac_isolation.harness.regression import RegressionSpec, run_regression

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SIZES = {"model": "qwen3_5_moe", "ep": 1, "steps": 1, "hidden_size": 64, "num_layers": 2, "num_experts": 4,
         "top_k": 2}
SPAWNED = (("FLA_AC_ISOLATION_TEST_SPAWN", "1"),)  # any variable: ranks that need one are spawned


def _run(**changes):
    started: list[tuple[str, int]] = []
    result = run_regression(RegressionSpec(**SIZES, **changes),
                            on_rank_start=lambda mode, rank, pid: started.append((mode, pid)))
    return result, started


def test_spawned_one_rank_modes_share_one_process_and_equal_one_launch_per_mode():
    shared_process, started = _run(env=SPAWNED)
    per_mode, _ = _run()
    assert list(shared_process.modes) == ["no-ac", "shared", "isolated", "global-disable"], "reported in spec order"
    assert [mode for mode, _ in started] == ["no-ac", "isolated", "global-disable", "shared"], "unsafe modes last"
    pids = {pid for _, pid in started}
    assert len(pids) == 1, started
    for name, mode in per_mode.modes.items():
        got = shared_process.modes[name]
        assert (got.error, got.losses, got.grad_norms, got.grad_diffs) == (
            mode.error, mode.losses, mode.grad_norms, mode.grad_diffs), name


def test_a_failing_one_rank_mode_gives_the_next_mode_a_fresh_process():
    result, started = _run(env=SPAWNED, fail_on=("isolated", 0, "injected"))
    assert result.modes["isolated"].error == "RuntimeError: injected"
    assert result.modes["global-disable"].error is None and result.modes["global-disable"].grad_diffs == [0.0]
    pid = dict(started)
    assert pid["no-ac"] == pid["isolated"] != pid["global-disable"] == pid["shared"]
