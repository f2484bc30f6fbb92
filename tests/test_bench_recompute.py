"""``benchmarks.bench_recompute`` on a CPU: the smoke path of the script (reference backend, tiny shapes, no
graphs), its budget guard, its per-mode failure records, the lever policies and the chart."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from benchmarks import bench_recompute, levers, recompute_chart

TINY = ["--device", "cpu", "--hidden", "64", "--tokens", "128", "--stack-tokens", "128", "--iters", "2",
        "--warmup", "1", "--layers", "gdn"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "recompute.json"
    torch.set_num_threads(1)
    assert bench_recompute.main([*TINY, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_every_cell_runs_every_mode_eagerly_on_a_cpu(smoke):
    assert [(c["group"], c["phase"], c["status"]) for c in smoke["cells"]] == [
        ("gdn", "eager", "ok"), ("stack", "eager", "ok")]  # no graphs on a CPU
    rows = {(r["group"], r["mode"], r["graphed"]) for r in smoke["rows"]}
    assert rows == {("gdn", m, False) for m in bench_recompute.LAYER_MODES} | {
        ("stack", m, False) for m in bench_recompute.STACK_MODES}
    sac = next(r for r in smoke["rows"] if (r["group"], r["mode"]) == ("gdn", "sac"))
    assert sac["padded_vs_plain"] == {} and sac["x_no_ac"] > 0 and len(sac["times_ms"]) == 2
    assert smoke["meta"]["max_docs"] == 32 and smoke["meta"]["layouts_docs"] == [8, 5, 13, 16]


def test_a_cell_past_the_budget_is_skipped_and_said_so_and_a_run_of_skipped_cells_exits_1(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert bench_recompute.main([*TINY, "--json", str(path), "--budget-s", "0"]) == 1
    cells = json.loads(path.read_text())["cells"]
    assert [c["status"] for c in cells] == ["skipped", "skipped"]
    assert "estimated > budget" in cells[0]["reason"]
    assert capsys.readouterr().err == "bench_recompute: nothing ran: of 14 modes, 14 skipped\n"


def test_a_failing_mode_is_recorded_and_the_others_still_run_exit_0(tmp_path, monkeypatch, capsys):
    def broken(num_tokens, width=levers.SMALL_WIDTH):
        def policy(ctx, op, *args, **kwargs):
            raise RuntimeError("policy exploded")
        return policy

    monkeypatch.setattr(levers, "save_small_outputs", broken)
    path = tmp_path / "r.json"
    assert bench_recompute.main([*TINY, "--json", str(path), "--no-stack"]) == 0
    result = json.loads(path.read_text())
    cell = result["cells"][0]
    assert cell["status"] == "partial"
    assert set(cell["failures"]) == {"sac+save-small", "sac+save-core+small"}
    assert all("RuntimeError: policy exploded" in e for e in cell["failures"].values())
    assert {r["mode"] for r in result["rows"]} == {"no-ac", "sac", "sac+static", "sac+save-core", "sac+save-core+conv"}
    assert capsys.readouterr().out.splitlines()[-1] == (
        "bench_recompute: of 7 modes, 5 ran, 2 failed (exit code 0, the failures are listed above)")


def test_save_small_outputs_saves_small_floating_point_pointwise_ops_only():
    policy = levers.save_small_outputs(num_tokens=10, width=2)  # at most 20 elements
    small, big = torch.zeros(1, 10, 2), torch.zeros(1, 10, 3)
    aten = torch.ops.aten
    assert policy(None, aten.exp.default, small) == CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.mul.Tensor, small, small) == CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.mul.Tensor, small, big) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.mm.default, small[0], small[0].T) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.add.Tensor, small.long(), 1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.mean.dim, small, [-1]) == CheckpointPolicy.PREFER_RECOMPUTE


def test_the_chart_draws_the_smoke_results(smoke, tmp_path):
    path = tmp_path / "chart.png"
    recompute_chart.plot(smoke, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chart_of_a_run_that_measured_nothing_is_refused_exit_1(smoke, tmp_path, capsys):
    results, png = tmp_path / "r.json", tmp_path / "chart.png"
    results.write_text(json.dumps({**smoke, "rows": []}))
    assert recompute_chart.main([str(results), str(png)]) == 1
    assert capsys.readouterr().err == f"recompute_chart: nothing to draw: {results} holds no row (its run measured nothing)\n"
    assert not png.exists()


def test_the_graphed_phase_runs_on_a_cpu_stand_in_graph(monkeypatch):
    """The graphed phase's wiring (capture per mode against a graph of no-ac, refills of the static buffers,
    replays, the gradients read from the capture's tensors, the comparison with an eager step on a layout
    never captured) with ``helpers.CpuGraph`` in place of a CUDA graph. On a CPU a replay is an eager step,
    so it must equal the eager step bit for bit; the GPU tests check real graphs."""
    from helpers import cpu_capture

    from benchmarks import graph_step, recompute_cells

    monkeypatch.setattr(graph_step, "capture", cpu_capture)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    torch.set_num_threads(1)
    modes = ["no-ac", "sac", "sac+save-core"]
    group = recompute_cells.Group.build("mamba2", 128, modes, 64, "cpu", 32)
    failures: dict[str, str] = {}
    rows = recompute_cells.graphed_phase(group, modes, iters=2, deadline=float("inf"), failures=failures)
    assert failures == {}
    assert [(r.mode, r.graphed) for r in rows] == [("no-ac", True), ("sac", True), ("sac+save-core", True)]
    assert all(r.replay_vs_eager == {} and len(r.times_ms) >= 2 and r.x_no_ac > 0 for r in rows)


def test_cells_take_every_eager_number_before_any_graph_and_the_long_groups_last():
    import argparse

    args = argparse.Namespace(tokens=[32768, 131072], layers=["gdn", "mamba2"], stack=True, stack_tokens=32768,
                              device="cuda", no_graphs=False)
    order = [(kind, tokens, phase) for kind, tokens, _, phase in bench_recompute.cells(args)]
    assert order == [
        ("gdn", 32768, "eager"), ("mamba2", 32768, "eager"), ("stack", 32768, "eager"),
        ("gdn", 32768, "graphed"), ("mamba2", 32768, "graphed"), ("stack", 32768, "graphed"),
        ("gdn", 131072, "eager"), ("mamba2", 131072, "eager"),
        ("gdn", 131072, "graphed"), ("mamba2", 131072, "graphed"),
    ]
    assert all(key in bench_recompute.PLAN for key in order)


def test_a_graphed_cell_skips_the_modes_that_failed_eagerly(monkeypatch):
    import argparse

    from helpers import cpu_capture

    from benchmarks import graph_step

    monkeypatch.setattr(graph_step, "capture", cpu_capture)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = argparse.Namespace(hidden=64, device="cpu", max_docs=32, iters=2, warmup=1, tokens=[128])
    failures = {"sac+save-core": "RuntimeError: failed eagerly"}
    rows = bench_recompute.run_cell("gdn", 128, ["no-ac", "sac", "sac+save-core"], "graphed", args,
                                    float("inf"), failures)
    assert [(r.mode, r.graphed, r.replay_vs_eager) for r in rows] == [("no-ac", True, {}), ("sac", True, {})]
    assert failures == {"sac+save-core": "RuntimeError: failed eagerly"}
