"""The CP layer benchmark (``benchmarks/bench_cp.py``): its pure parts in this process, and one CPU smoke launch.

The full CPU smoke (``python benchmarks/bench_cp.py --device cpu``: 2 gloo ranks, FLA's CP kernels in Triton's
interpreter, all 4 modes, each mode's probe, memory and timed step: 12 interpreted CP layer steps per rank)
costs 55-90 s of CPU time on the 2-core CI machine (measured, all processes: 81 s with its defaults, hidden
32 and T = 128; 56 s at T = 64; 86 s at hidden 64 and T = 128; 2-3.5 s per contiguous step and rank, zigzag
2-4x that, plus about 5 s of imports per rank). That is over the budget of one test in the suite (about
30 s of CPU), so CI launches it with ONE mode, contiguous, T = 64 (``--modes isolated --tokens 64 --docs
2``): 3 steps per rank, measured 26-29 s of CPU (18 s wall). It still covers the spawned launch, gloo, FLA's CP kernels under the
shims, the rows, table, targets and JSON. What the modes change (slowest-rank step times, paired ratios,
targets, per-rank columns) is tested here on fabricated per-rank results, the PNG with them, and the mode
order with a fake group through ``layer_step.measure`` itself.

``benchmarks/bench_cp.py`` (and its rows, ``benchmarks/cp_rows.py``) are modules of the ``benchmarks`` package
(run as ``python -m benchmarks.bench_cp``), imported here as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cp_rows, layer_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    import benchmarks.bench_cp

    return benchmarks.bench_cp


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _error(bench, capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc", "1"], "--nproc must be at least 2 (one rank has no rank cut for a document to cross), got 1"),
    (["--tokens", "130", "--layout", "zigzag"],
     "--tokens 130 must be a multiple of 2 * --nproc = 4 (the zigzag layout cuts the batch into 4 equal parts)"),
    (["--tokens", "126", "--nproc", "4"], "--tokens 126 must be a multiple of --nproc = 4 (the contiguous layout"),
    (["--tokens", "128", "129"], "--tokens 129 must be a multiple of --nproc = 2 (the contiguous layout"),
    (["--tokens", "130", "--layout", "contiguous", "zigzag"], "--tokens 130 must be a multiple of 2 * --nproc = 4"),
    (["--tokens", "2", "--docs", "3"], "--tokens 2 must be at least --docs = 3"),
    (["--tokens", "16", "--nproc", "4", "--layout", "zigzag"],
     "each CP interval of the zigzag layout holds 2 tokens (--tokens = 16 over 8 intervals), fewer than "
     "conv_kernel_size - 1 = 3"),
    (["--hidden", "30"], "--hidden must be a multiple of 4 and at least 16, got 30"),
    (["--iters", "0"], "--iters must be >= 1 and --warmup >= 0, got 0 and 0"),
    (["--warmup", "-1"], "--iters must be >= 1 and --warmup >= 0, got 1 and -1"),
    (["--docs", "0"], "--docs must be at least 1, got 0"),
])
def test_bad_arguments_are_parser_errors_naming_the_flag(bench, capsys, no_torchrun, argv, message):
    assert message in _error(bench, capsys, ["--device", "cpu", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without CUDA")
def test_cuda_without_cuda_is_a_parser_error(bench, capsys, no_torchrun):
    assert "--device cuda (the default) needs CUDA devices; use --device cpu" in _error(bench, capsys, [])


def test_fewer_gpus_than_ranks_is_a_parser_error(bench, capsys, monkeypatch, no_torchrun):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _error(bench, capsys, ["--nproc", "2"])
    assert "--nproc 2 needs 2 CUDA devices on this host (one GPU per rank), found 1" in err


def test_under_torchrun_nproc_must_be_its_world_and_cpu_needs_the_interpreter(bench, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "--nproc 3 differs from torchrun's world size 2" in _error(bench, capsys, ["--device", "cpu", "--nproc", "3"])
    assert bench.parse_args(["--device", "cpu"]).nproc == 2
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "needs TRITON_INTERPRET=1 exported before torchrun starts" in _error(bench, capsys, ["--device", "cpu"])


def test_defaults_per_device(bench, monkeypatch, no_torchrun):
    cpu = bench.parse_args(["--device", "cpu"])
    assert (cpu.nproc, cpu.tokens, cpu.hidden, cpu.docs, cpu.iters, cpu.warmup) == (2, [128], 32, 3, 1, 0)
    assert cpu.layout == ["contiguous"] and cpu.modes == ["no-ac", "shared", "isolated", "global-disable"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    gpu = bench.parse_args(["--modes", "isolated", "shared", "--layout", "zigzag", "contiguous", "zigzag"])
    assert (gpu.nproc, gpu.tokens, gpu.hidden, gpu.docs, gpu.iters, gpu.warmup) == (2, [65536, 262144], 2048, 8, 50, 3)
    assert gpu.modes == ["shared", "isolated"] and gpu.layout == ["zigzag", "contiguous"]


# ------------------------------------------------------------------------------------------- documents
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_cuts_are_where_fla_layout_changes_rank(layout, world):
    """Independent of rank_cuts' formula: the owner of every token from parallel.cp_token_index."""
    from fla_ac_isolation.parallel import CPConfig, cp_token_index

    tokens = 48 * world
    owner = torch.empty(tokens, dtype=torch.long)
    for rank in range(world):
        owner[cp_token_index(tokens, CPConfig(world_size=world, rank=rank, layout=layout))] = rank
    expected = [t for t in range(1, tokens) if owner[t] != owner[t - 1]]
    assert cp_rows.rank_cuts(tokens, world, layout) == expected
    assert len(expected) == world - 1 if layout == "contiguous" else 2 * (world - 1)


def test_crossing_documents_hold_tokens_on_both_sides_of_a_cut():
    assert cp_rows.crossing_documents([10, 0, 30, 88], [64]) == [3]
    assert cp_rows.crossing_documents([64, 64], [64]) == []  # a document boundary on the cut
    assert cp_rows.crossing_documents([20, 60, 48], [32, 96]) == [1, 2]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("tokens", [65536, 262144, 128])
def test_every_default_document_layout_has_a_document_crossing_a_rank(tokens, layout):
    docs = 3 if tokens == 128 else 8
    layouts = cp_rows.document_layouts(tokens, docs, 2, layout)
    assert len(layouts) == 3 and len({tuple(lens) for lens in layouts}) == 3  # three seeded layouts
    for lens in layouts:
        assert sum(lens) == tokens and len(lens) == docs and min(lens) >= 1
        assert cp_rows.crossing_documents(lens, cp_rows.rank_cuts(tokens, 2, layout))


def test_a_layout_without_a_crossing_document_is_refused_naming_docs(monkeypatch):
    monkeypatch.setattr(layer_step, "doc_lengths", lambda tokens, docs, seed: [tokens // 2, tokens // 2])
    with pytest.raises(ValueError, match=r"--docs 2: the document lengths of seed 0 for --tokens 128 put a document "
                                         r"boundary on every rank cut \[64\]"):
        cp_rows.document_layouts(128, 2, 2, "contiguous")


# ------------------------------------------------------------------------------------------ mode order
class _FakeGroup:
    """The interface layer_step.measure needs; records which (mode, iteration) ran, in order."""

    device = "cpu"

    def __init__(self):
        self.ran: list[tuple[str, int]] = []
        self.barriers = 0

    def prepare(self, mode, i, layer=None):
        return lambda: self.ran.append((mode, i))

    def synchronize(self):
        self.barriers += 1


def test_every_rank_runs_the_same_rotated_mode_order_from_the_iteration_index():
    """Two 'ranks' measuring the same arguments run the same sequence: warm-up and timed iterations rotated
    (iteration i starts at mode i % 4), probe and memory steps in mode order; a barrier before every timed step and around every probe."""
    modes = list(cp_rows.MODES)
    ranks = [_FakeGroup(), _FakeGroup()]
    results = [layer_step.measure(group, modes, 2, 5) for group in ranks]
    assert ranks[0].ran == ranks[1].ran
    ran = ranks[0].ran
    warm, probe, memory, timed = ran[:8], ran[8:12], ran[12:16], ran[16:]
    assert [m for m, _ in warm] == modes + modes[1:] + modes[:1]
    assert probe == [(m, 0) for m in modes] and memory == [(m, 1) for m in modes]
    for i in range(5):
        assert [m for m, _ in timed[4 * i: 4 * i + 4]] == modes[i % 4:] + modes[: i % 4]
        assert {it for _, it in timed[4 * i: 4 * i + 4]} == {i}
    assert ranks[0].barriers == 1 + 2 * 4 + 20  # after warm-up, around each probe, before each timed step
    times, memory_mib, probes = results[0]
    assert sorted(times) == sorted(modes) and all(len(t) == 5 for t in times.values())
    assert memory_mib == {m: (0.0, 0.0) for m in modes} and all(p[:2] == (0, {}) for p in probes.values())


# ------------------------------------------------------------------------------------------------ rows
def _rank_result(times: dict[str, list[float]], peaks: dict[str, float], sites: dict[str, dict[str, int]]) -> dict:
    return {
        "tokens": 65536, "layout": "contiguous", "docs": 8, "local_tokens": 32768, "lens": [], "rank_cuts": [32768],
        "crossing": [], "times": times, "memory": {m: [p, p / 2] for m, p in peaks.items()},
        "probes": {m: [sum(s.values()), s, 4] for m, s in sites.items()},
    }


CP_SITE = "fla/ops/cp/chunk_fwd.py:12"
INDEX_SITE = "fla/ops/utils/index.py:164"
RANK0 = _rank_result(
    {"no-ac": [8.0, 7.0, 8.0], "shared": [10.0, 9.0, 10.0], "isolated": [11.0, 10.0, 12.0],
     "global-disable": [12.0, 10.0, 10.5]},
    {"no-ac": 900.0, "shared": 500.0, "isolated": 500.5, "global-disable": 500.0},
    {"no-ac": {INDEX_SITE: 1}, "shared": {INDEX_SITE: 1}, "isolated": {}, "global-disable": {INDEX_SITE: 2}},
)
RANK1 = _rank_result(
    {"no-ac": [7.0, 8.0, 8.0], "shared": [9.0, 10.0, 10.0], "isolated": [10.0, 11.0, 10.0],
     "global-disable": [11.0, 10.5, 10.0]},
    {"no-ac": 901.0, "shared": 501.0, "isolated": 501.0, "global-disable": 501.0},
    {"no-ac": {}, "shared": {}, "isolated": {CP_SITE: 2, INDEX_SITE: 1}, "global-disable": {}},
)


@pytest.fixture
def rows():
    return cp_rows.build_rows([RANK0, RANK1], list(cp_rows.MODES))


def test_step_time_is_the_slowest_rank_per_iteration(rows):
    by_mode = {r.mode: r for r in rows}
    assert by_mode["shared"].step_ms == [10.0, 10.0, 10.0]
    assert by_mode["isolated"].step_ms == [11.0, 11.0, 12.0]
    assert by_mode["global-disable"].step_ms == [12.0, 10.5, 10.5]
    assert by_mode["no-ac"].step_ms == [8.0, 8.0, 8.0]
    for r in rows:
        assert r.median_ms == statistics.median(r.step_ms)
        assert r.p10_ms <= r.median_ms <= r.p90_ms
        assert r.times_ms == [RANK0["times"][r.mode], RANK1["times"][r.mode]]
        assert r.rank_median_ms == [statistics.median(RANK0["times"][r.mode]), statistics.median(RANK1["times"][r.mode])]
        assert (r.tokens, r.local_tokens, r.layout, r.world, r.docs) == (65536, 32768, "contiguous", 2, 8)


def test_paired_ratio_pairs_the_slowest_ranks_of_one_iteration(rows):
    by_mode = {r.mode: r for r in rows}
    shared = by_mode["shared"].step_ms
    for r in rows:
        assert r.paired_x_shared == pytest.approx(statistics.median(t / s for t, s in zip(r.step_ms, shared)))
        assert r.x_shared == pytest.approx(r.median_ms / by_mode["shared"].median_ms)
    assert by_mode["shared"].paired_x_shared == 1.0 and by_mode["no-ac"].paired_x_no_ac == 1.0
    assert by_mode["isolated"].paired_x_shared == pytest.approx(1.1)  # [1.1, 1.1, 1.2]
    assert by_mode["global-disable"].paired_x_shared == pytest.approx(1.05)  # [1.2, 1.05, 1.05]
    assert by_mode["isolated"].paired_x_no_ac == pytest.approx(11 / 8)


def test_per_rank_syncs_sites_and_the_cp_subset(rows):
    iso_row = next(r for r in rows if r.mode == "isolated")
    assert iso_row.syncs_per_step == [0, 3] and iso_row.cp_syncs_per_step == [0, 2]
    assert iso_row.sync_sites == [{}, {CP_SITE: 2, INDEX_SITE: 1}]
    assert iso_row.peak_mib == [500.5, 501.0] and iso_row.held_mib == [250.25, 250.5]
    assert iso_row.helper_computations_per_step == [4, 4]
    disable = next(r for r in rows if r.mode == "global-disable")
    assert disable.syncs_per_step == [2, 0] and disable.cp_syncs_per_step == [0, 0]


def test_targets_say_met_or_not_met(rows):
    lines = cp_rows.targets(rows)
    assert lines == [
        "T=65536 contiguous: isolated / shared (paired) = 1.100, target <= 1.01: NOT met",
        "T=65536 contiguous: isolated 1.100 vs global-disable 1.050 (paired x shared), target isolated <= "
        "global-disable: NOT met",
        "T=65536 contiguous: host syncs from fla/ops/cp/ in isolated, per rank [0, 2], target none: NOT met",
    ]
    fixed = {"isolated": {"paired_x_shared": 1.005, "cp_syncs_per_step": [0, 0]}}
    good = [dataclasses.replace(r, **fixed.get(r.mode, {})) for r in rows]
    assert [line.rsplit(": ", 1)[1] for line in cp_rows.targets(good)] == ["met", "met", "met"]
    assert cp_rows.targets([r for r in rows if r.mode != "isolated"]) == []


def test_table_json_and_png_from_rows(rows, tmp_path):
    args = cp_rows.argparse.Namespace(json=str(tmp_path / "cp.json"), png=str(tmp_path / "cp.png"), device="cuda",
                                    iters=3)
    groups = [{"tokens": 65536, "layout": "contiguous", "lens": [[1, 2]], "rank_cuts": [32768], "crossing": [[1]]}]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cp_rows.report(rows, groups, args, {"world": 2, "dtype": "bfloat16"})
    text = out.getvalue()
    assert "CP=2 gdn layer step" in text and "SMOKE" not in text
    assert "11.000 / 10.000" in text  # isolated: the two ranks' medians
    assert f"sync sites T=65536 contiguous isolated rank 1: {{'{CP_SITE}': 2, '{INDEX_SITE}': 1}}" in text
    assert "target T=65536 contiguous: host syncs from fla/ops/cp/ in isolated, per rank [0, 2]" in text
    data = json.loads((tmp_path / "cp.json").read_text())
    assert data["meta"] == {"world": 2, "dtype": "bfloat16"} and data["groups"] == groups
    assert [r["mode"] for r in data["rows"]] == list(cp_rows.MODES)
    assert data["rows"][2]["times_ms"] == [RANK0["times"]["isolated"], RANK1["times"]["isolated"]]
    assert set(data["rows"][0]) == set(cp_rows.CPRow.__dataclass_fields__)
    assert (tmp_path / "cp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -------------------------------------------------------------------------------------- the smoke launch
@pytest.mark.distributed
@pytest.mark.slow
def test_cpu_smoke_launch_of_two_gloo_ranks(tmp_path):
    """One mode: the script spawns 2 gloo ranks running FLA's CP kernels in the interpreter (see the module
    docstring for why one mode and T = 64)."""
    json_path = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_cp", "--device", "cpu", "--modes", "isolated", "--tokens", "64",
         "--docs", "2", "--json", str(json_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    data = json.loads(json_path.read_text())
    meta, (row,), (group,) = data["meta"], data["rows"], data["groups"]
    assert (meta["world"], meta["process_group"], meta["dtype"], meta["launcher"]) == (2, "gloo", "float32", "spawn")
    assert meta["kernels"] == "fla (Triton interpreter)" and meta["environment"]["NCCL_NVLS_ENABLE"] == "0"
    assert (row["mode"], row["tokens"], row["local_tokens"], row["layout"]) == ("isolated", 64, 32, "contiguous")
    assert len(row["times_ms"]) == 2 and all(len(t) == 1 and t[0] > 0 for t in row["times_ms"])
    assert row["step_ms"] == [max(t[0] for t in row["times_ms"])]
    assert row["syncs_per_step"] == [0, 0] and row["peak_mib"] == [0.0, 0.0]  # CUDA measurements, 0 on CPU
    assert all(n > 0 for n in row["helper_computations_per_step"])
    assert group["rank_cuts"] == [32] and all(group["crossing"])
    assert "CPU SMOKE TEST" in proc.stdout and "target T=64 contiguous: host syncs from fla/ops/cp/" in proc.stdout


def test_the_documented_gpu_command_and_defaults_are_the_scripts(bench, monkeypatch, no_torchrun):
    """docs/benchmarks.md's command parses on a 2-GPU host and its defaults line is DEFAULTS["cuda"]."""
    import re
    import shlex

    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index("## CP=2 layer step"):]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ").split("2>&1")[0]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "benchmarks.bench_cp"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = bench.parse_args(argv[3:])
    assert args.nproc == 2 and args.first_config and args.lift_hopper_guard and args.json and args.png
    defaults = bench.DEFAULTS["cuda"]
    line = (f"Defaults: `--tokens {' '.join(map(str, defaults['tokens']))} --layout contiguous --docs {defaults['docs']} "
            f"--hidden {defaults['hidden']} --iters {defaults['iters']} --warmup {defaults['warmup']}`")
    assert line in section
