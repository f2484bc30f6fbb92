"""``benchmarks/bench_own_trainer.py``'s CPU smoke path (``--device cpu``): one row per mode, the statistics of
its own times, JSON equal to the table, every AC mode's gradients equal to no AC's, and its FLA helper counts
equal to counts made here, independently, with the example's model on the same document layout."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest
from helpers import ROOT

from fla_ac_isolation.harness.user_code import load_module

MODES = ["no-ac", "fixed", "global-disable"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import benchmarks.bench_own_trainer as bench

    out = tmp_path_factory.mktemp("bench") / "own.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert bench.main(["--device", "cpu", "--iters", "3", "--out", str(out)]) == 0
    return json.loads(out.read_text()), stdout.getvalue().splitlines()


def _helper_computations(mode: str) -> int:
    """FLA index-helper computations of one step of the example's model in ``mode`` on the benchmark's probe
    layout (seed 2 of 3 documents in 192 tokens), counted here."""
    from benchmarks.layer_step import doc_lengths
    from fla_ac_isolation.fla_seam.cache import probe_tensor_cache
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    example = load_module(str(ROOT / "examples" / "own_trainer.py"))
    model = example.build(mode)
    batch = example.packed_batch(doc_lens=doc_lengths(192, 3, seed=2))
    with reference_kernels(), example.fla_cache_disabled(mode == "global-disable"), probe_tensor_cache() as probe:
        model(**batch).backward()
    return probe.misses + probe.bypasses


def test_one_row_per_mode_from_its_own_times_with_the_table_equal_to_the_json(run):
    data, lines = run
    rows = data["rows"]
    assert [r["mode"] for r in rows] == MODES and data["args"]["tokens"] == 192
    assert lines[0] == ("own trainer: 2 x (Gated DeltaNet + MoE), hidden 64, T = 192 (3 documents), float32, cpu "
                        "(smoke test, not a measurement)")
    for r, line in zip(rows, lines[2:5], strict=True):
        assert len(r["times_ms"]) == 3 and r["median_ms"] == statistics.median(r["times_ms"]) > 0
        assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert (r["peak_mib"], r["syncs"]) == (0.0, 0)  # a CPU reports none
        assert line.split() == [r["mode"], f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}", f"{r['p90_ms']:.2f}",
                                f"{r['x_global']:.3f}", f"{r['paired_x_global']:.3f}", "0", "0", str(r["helpers"]),
                                "0"]
    by_mode = {r["mode"]: r for r in rows}
    assert (by_mode["global-disable"]["x_global"], by_mode["global-disable"]["paired_x_global"]) == (1.0, 1.0)
    ratios = [a / b for a, b in zip(by_mode["fixed"]["times_ms"], by_mode["global-disable"]["times_ms"], strict=True)]
    assert by_mode["fixed"]["paired_x_global"] == statistics.median(ratios)


def test_every_mode_equals_no_ac_and_counts_the_helpers_it_ran(run):
    """Bit for bit (the global disable really disabled FLA's cache: the shipped model under this SAC fails
    otherwise); the fix computes FLA's helpers less often than the global disable."""
    by_mode = {r["mode"]: r for r in run[0]["rows"]}
    assert {mode: r["max_grad_diff"] for mode, r in by_mode.items()} == dict.fromkeys(MODES, 0.0)
    counted = {mode: _helper_computations(mode) for mode in MODES}
    assert {mode: r["helpers"] for mode, r in by_mode.items()} == counted
    assert counted["fixed"] < counted["global-disable"]
