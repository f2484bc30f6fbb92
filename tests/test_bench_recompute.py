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
    assert [(c["group"], c["status"]) for c in smoke["cells"]] == [("gdn", "ok"), ("stack", "ok")]
    rows = {(r["group"], r["mode"], r["graphed"]) for r in smoke["rows"]}
    assert rows == {("gdn", m, False) for m in bench_recompute.LAYER_MODES} | {
        ("stack", m, False) for m in bench_recompute.STACK_MODES}
    sac = next(r for r in smoke["rows"] if (r["group"], r["mode"]) == ("gdn", "sac"))
    assert sac["padded_vs_plain"] == {} and sac["x_no_ac"] > 0 and len(sac["times_ms"]) == 2
    assert smoke["meta"]["max_docs"] == 32 and smoke["meta"]["layouts_docs"] == [8, 5, 13, 16]


def test_a_cell_past_the_budget_is_skipped_and_said_so(tmp_path):
    path = tmp_path / "r.json"
    bench_recompute.main([*TINY, "--json", str(path), "--budget-s", "0"])
    cells = json.loads(path.read_text())["cells"]
    assert [c["status"] for c in cells] == ["skipped", "skipped"]
    assert "estimated > budget" in cells[0]["reason"]


def test_a_failing_mode_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(num_tokens, width=levers.SMALL_WIDTH):
        def policy(ctx, op, *args, **kwargs):
            raise RuntimeError("policy exploded")
        return policy

    monkeypatch.setattr(levers, "save_small_outputs", broken)
    path = tmp_path / "r.json"
    bench_recompute.main([*TINY, "--json", str(path), "--no-stack"])
    result = json.loads(path.read_text())
    cell = result["cells"][0]
    assert cell["status"] == "partial"
    assert set(cell["failures"]) == {"sac+save-small", "sac+save-core+small"}
    assert all("RuntimeError: policy exploded" in e for e in cell["failures"].values())
    assert {r["mode"] for r in result["rows"]} == {"no-ac", "sac", "sac+static", "sac+save-core", "sac+save-core+conv"}


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
