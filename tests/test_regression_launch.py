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


_UNGUARDED = """
from fla_ac_isolation.harness.regression import RegressionSpec, run_regression

result = run_regression(RegressionSpec(device="cpu", ep=1, steps=1, hidden_size=64, num_layers=1, num_experts=4,
                                       top_k=2, modes=("no-ac",)))
print(result.modes["no-ac"].error)
"""


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """The rank process re-imports the script (forkserver and spawn do) and its top-level run_regression meets
    multiprocessing's bootstrapping RuntimeError: the launcher names the guard. The script's own run passes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fla_ac_isolation.harness.regression.launch import UNGUARDED_MAIN

    (tmp_path / "unguarded.py").write_text(_UNGUARDED)
    root = str(Path(__file__).resolve().parents[1])  # this tree's package, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "unguarded.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = ("launcher: RuntimeError: the regression was started while a process was importing the main module: the "
            "rank processes re-import it (the spawn and forkserver start methods do), so guard your script's entry "
            'with `if __name__ == "__main__":`')
    assert f"launcher: {UNGUARDED_MAIN}" == line
    assert proc.stdout.splitlines() == [line, "None"]  # the rank's re-import, then the script's own run
