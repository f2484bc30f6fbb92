"""Nothing that ran nothing exits 0: every benchmark script's exit code and what it prints when its cells failed
(``benchmarks/outcome.py``), and the names of missing modules with their install
(``fla_ac_isolation.harness.extras``).

The scripts run as on the H100 that lacked ``tyro`` (torchtitan's dependency; torchtitan imports it only in
``torchtitan.config``, which its activation checkpointing and MoE need): in a subprocess where importing ``tyro``
raises Python's own ``ModuleNotFoundError`` (:func:`helpers.run_without`), on the CPU smoke shapes.
"""

from __future__ import annotations

import pytest
from helpers import run_without

from benchmarks import bench_ep_step, bench_recompute, outcome
from fla_ac_isolation.harness.extras import install_hint, missing_modules
from fla_ac_isolation.harness.regression.spec import ModeResult, RegressionResult, RegressionSpec

NO_TYRO = "ModuleNotFoundError: No module named 'tyro'"
RECOMPUTE = ["--device", "cpu", "--hidden", "64", "--tokens", "128", "--stack-tokens", "128", "--iters", "2",
             "--warmup", "1", "--layers", "gdn"]


# ------------------------------------------------------------------------------------------- the outcome
def test_missing_modules_are_read_from_pythons_words_and_named_with_their_install():
    text = ("rank 0: ModuleNotFoundError: No module named 'tyro'\n"
            "ModuleNotFoundError: No module named 'torchtitan.models'\n"
            "ModuleNotFoundError: import of rich halted; None in sys.modules\n"
            "ModuleNotFoundError: No module named 'tyro'")
    assert missing_modules(text) == ["tyro", "torchtitan.models", "rich"]
    assert [install_hint(m) for m in missing_modules(text)] == [
        "pip install tyro", "pip install 'fla-ac-isolation[ep]'", "pip install 'fla-ac-isolation[cli]'"]
    assert install_hint("fla.ops") == "pip install fla-core"
    assert missing_modules("RuntimeError: Autograd not support dtype: Int") == []


def test_nothing_ran_exits_1_with_each_distinct_error_once_and_what_to_install(capsys):
    failed = [NO_TYRO] * 3 + ["RuntimeError: policy exploded\n  at line 2", "RuntimeError: policy exploded"]
    assert outcome.finish("bench_x", outcome.Outcome(0, failed, skipped=2, unit="modes")) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "bench_x: nothing ran: of 7 modes, 5 failed, 2 skipped:",
        f"  {NO_TYRO} (x3)",
        "  RuntimeError: policy exploded (x2)",
        "  missing module tyro: pip install tyro",
    ]


def test_a_run_where_something_ran_exits_0_and_counts_the_failures(capsys):
    assert outcome.finish("bench_x", outcome.Outcome(5, ["RuntimeError: boom"] * 2, unit="modes")) == 0
    assert capsys.readouterr().out == "bench_x: of 7 modes, 5 ran, 2 failed (exit code 0, the failures are listed above)\n"
    assert outcome.finish("bench_x", outcome.Outcome(4)) == 0
    assert capsys.readouterr().out == "", "a run where everything ran says nothing more"


def test_the_unsafe_modes_runs_are_not_counted_either_way():
    runs = [("no-ac", None), ("isolated", None), ("shared", "RuntimeError: Autograd not support dtype: Int")]
    assert outcome.by_mode(runs, "cells") == outcome.Outcome(2, [], unit="cells (unsafe modes not counted)")
    only_shared_ran = [("no-ac", NO_TYRO), ("isolated", NO_TYRO), ("shared", None)]
    assert outcome.by_mode(only_shared_ran, "modes").exit_code == 1, "shared alone running is not a run"


# ------------------------------------------------------------------------------------------- the scripts
def test_bench_recompute_without_tyro_fails_every_cell_and_exits_1_naming_tyro(tmp_path):
    proc = run_without(("tyro",), ["-m", "benchmarks.bench_recompute", *RECOMPUTE], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "cell gdn T=128 eager: failed" in proc.stdout and "cell stack T=128 eager: failed" in proc.stdout
    # 7 layer modes and 7 stack modes, each cell failed while building its modules (torchtitan's SAC policy)
    assert proc.stderr.splitlines()[-3:] == [
        "bench_recompute: nothing ran: of 14 modes, 14 failed:",
        f"  {NO_TYRO} (x14)",
        "  missing module tyro: pip install tyro",
    ]


def test_bench_isolation_stopped_by_a_missing_module_exits_1_naming_it(tmp_path):
    argv = ["-m", "benchmarks.bench_isolation", "--device", "cpu", "--layers", "gdn", "--hidden", "64", "--tokens",
            "64", "--docs", "2", "--iters", "2", "--warmup", "0"]
    proc = run_without(("tyro",), argv, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"bench_isolation: stopped: {NO_TYRO}", "  missing module tyro: pip install tyro"]


def test_bench_pp_one_gpu_stopped_by_a_missing_module_exits_1_naming_it(tmp_path):
    pytest.importorskip("torchtitan")  # its MoE; without tyro, setting torchtitan up fails before the first cell
    proc = run_without(("tyro",), ["-m", "benchmarks.bench_pp_one_gpu", "--device", "cpu"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"bench_pp_one_gpu: stopped: {NO_TYRO}",
                                        "  missing module tyro: pip install tyro"]


def test_bench_recompute_whose_every_mode_raises_exits_1(monkeypatch, capsys):
    from fla_ac_isolation.mixers import Qwen3_5MoeGatedDeltaNet

    def forward(self, *args, **kwargs):
        raise RuntimeError("forward exploded")

    monkeypatch.setattr(Qwen3_5MoeGatedDeltaNet, "forward", forward)
    assert bench_recompute.main([*RECOMPUTE, "--no-stack"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "bench_recompute: nothing ran: of 7 modes, 7 failed:",
        "  RuntimeError: forward exploded (x7)",
    ]


def test_bench_ep_step_whose_every_mode_failed_exits_1(monkeypatch, capsys):
    """The GPU-only script's outcome on a CPU: the regression's result as two H100 ranks without tyro returned it
    (every mode failed on rank 0's import), handed to its ``main``."""
    from fla_ac_isolation.harness import regression

    def every_mode_failed(spec):
        modes = {m: ModeResult(m, error=f"rank 0: {NO_TYRO}") for m in spec.ordered_modes}
        return RegressionResult(RegressionSpec(steps=spec.steps), modes)

    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr(regression, "run_regression", every_mode_failed)
    assert bench_ep_step.main([]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "bench_ep_step: nothing ran: of 3 modes (unsafe modes not counted), 3 failed:",
        f"  rank 0: {NO_TYRO} (x3)",
        "  missing module tyro: pip install tyro",
    ]


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_cp_whose_ranks_lack_tyro_exits_1_naming_it(tmp_path):
    """Two spawned gloo ranks (about 30 s of CPU): each fails building its modes; the parent names the module."""
    proc = run_without(("tyro",), ["-m", "benchmarks.bench_cp", "--device", "cpu", "--modes", "isolated", "--tokens",
                                   "64"], tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "bench_cp: stopped: a rank failed: " in lines and NO_TYRO in lines
    assert lines.index("  missing module tyro: pip install tyro") > lines.index(NO_TYRO), "after the rank's traceback"


def test_bench_pp_one_gpu_whose_every_step_raises_exits_1(monkeypatch, capsys):
    """Every cell's first step raises (in this process: one gloo rank of world size 1, made and destroyed by
    ``main``): ``no-ac`` fails, so each (schedule, stages) group stops after it, and nothing ran."""
    pytest.importorskip("torchtitan")
    from benchmarks import bench_pp_one_gpu

    def step(*args, **kwargs):
        raise RuntimeError("step exploded")

    monkeypatch.setattr(bench_pp_one_gpu, "_step", step)
    argv = ["--device", "cpu", "--schedules", "gpipe", "1f1b", "--policies", "full-ac", "--layers", "4", "--hidden",
            "32", "--tokens", "32", "--microbatches", "2", "--iters", "0", "--warmup", "0"]
    assert bench_pp_one_gpu.main(argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        "bench_pp_one_gpu: nothing ran: of 2 cells (unsafe modes not counted), 2 failed:",
        "  RuntimeError: step exploded (x2)",
    ]
