"""``benchmarks.bench_pp_one_gpu`` on a CPU: two local stages of the tiny decoder on ONE gloo rank under torch's
``ScheduleInterleaved1F1B``, 6 microbatches, FLA's cache shrunk to 1 entry per helper, reference backend.

What each outcome must be, and why (derived from the schedule, not copied from a run):

* ``in flight``: torch's interleaved 1F1B at world size 1 with 2 local stages runs one warm-up forward, then
  forwards and backwards alternately, so at most 2 (stage, microbatch) forwards wait for their backward
  (stage 0's and stage 1's of the same microbatch); LoopedBFS would hold all 2 x 6.
* ``isolated`` and ``global-disable`` equal ``no-ac`` bit for bit under every policy (fresh offsets per layer
  call; no cache at all), and ``no-ac`` equals its own repeat (the CPU reference backend is deterministic).
* ``shared`` under ``save-all-copies``: the first GDN layer of a stage call misses in its forward and hits in
  its recompute, which skips FLA's integer casts, and torch's SAC replays a saved int copy into autograd:
  ``Autograd not support dtype: Int`` whatever the cache size (as the EP regression sees it).
* ``shared`` under ``save-d2h-copies`` (saves nothing on a CPU): 2 in flight > 1 cache entry, so a later stage
  call evicts the entry a layer hit in its forward; the recompute misses and runs FLA's ops its forward did not,
  which torch 2.13's SAC looks up by (op, index) and does not find (torch wraps it in its stage backward error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")  # the tiny decoder's MoE

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--device", "cpu", "--schedules", "interleaved-1f1b", "--stages", "2", "--microbatches", "6",
         "--cache-size", "1", "--policies", "save-d2h-copies", "save-all-copies", "--layers", "4", "--hidden", "32",
         "--tokens", "32", "--iters", "1", "--warmup", "0"]

E_INT = "RuntimeError: Autograd not support dtype: Int"
E_EVICTED = ("RuntimeError: Failed to run stage backward: RuntimeError: aten.div.Tensor_mode encountered during "
             "backward but not found in storage. This can happen if the operations in the checkpointed region are "
             "nondeterministic or depend on global state that changed between forward and backward.")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp1") / "pp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.bench_pp_one_gpu", *SMOKE, "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_cell_has_its_derived_outcome(smoke):
    result, _ = smoke
    got = {(c["policy"], c["mode"]): c["outcome"] for c in result["cells"]}
    assert got == {
        ("-", "no-ac"): "reference", ("-", "no-ac (repeat)"): "exact",
        ("save-d2h-copies", "isolated"): "exact", ("save-d2h-copies", "global-disable"): "exact",
        ("save-d2h-copies", "shared"): E_EVICTED,
        ("save-all-copies", "isolated"): "exact", ("save-all-copies", "global-disable"): "exact",
        ("save-all-copies", "shared"): E_INT,
    }
    assert {(c["schedule"], c["stages"], c["in_flight"], c["dtype"]) for c in result["cells"]} == {
        ("interleaved-1f1b", 2, 2, "fp32")}
    assert result["meta"]["fla_cache_size"] == 1 and result["meta"]["world_size"] == 1


def test_timed_steps_are_recorded_and_syncs_only_on_cuda(smoke):
    result, stdout = smoke
    for cell in result["cells"]:
        if cell["error"] is None:
            assert len(cell["times_ms"]) == 1 and cell["median_ms"] == cell["times_ms"][0] > 0
        else:
            assert cell["times_ms"] == [] and cell["median_ms"] is None
        assert cell["syncs"] is None  # the recorder needs CUDA; a CPU run claims nothing
    assert result["sync_verdicts"] == []
    assert "CPU SMOKE TEST" in stdout and "interleaved-1f1b" in stdout


def test_bad_arguments_are_refused_naming_them(capsys):
    from benchmarks import bench_pp_one_gpu

    for argv, word in ((["--device", "cpu", "--cache-size", "0"], "--cache-size"),
                       (["--device", "cpu", "--stages", "9"], "--stages"),
                       (["--device", "cpu", "--microbatches", "0"], "--microbatches")):
        with pytest.raises(SystemExit):
            bench_pp_one_gpu.parse_args(argv)
        assert word in capsys.readouterr().err
