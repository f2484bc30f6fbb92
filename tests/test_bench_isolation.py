"""The isolation benchmark's CPU smoke path: rows, paired ratios, helper counts, JSON and PNG.

``benchmarks/bench_isolation.py`` is a module of the ``benchmarks`` package (run as ``python -m
benchmarks.bench_isolation``), imported here as such. One run of both layers with tiny shapes on the reference backend is shared by the tests (module fixture); the FLA
helper computations it reports are checked against counts made here, independently, with the conftest
mixers under the same SAC policy.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import statistics

import pytest
import torch
from helpers import FAMILIES, HIDDEN

from benchmarks import layer_step, saved_outputs
from fla_ac_isolation.harness.layer_widths import LAYERS, family_for_layer, layer_fields

TOKENS, DOCS, ITERS = 192, 3, 3  # several 64-token chunks per document
LAYER_FAMILY = {layer: family_for_layer(layer).name for layer in LAYERS}  # the benchmark's layer of each kind
SAVEABLE_MODES = {"isolated+save-core": ("gated_delta_rule", "ssd"),
                  "isolated+save-core+conv": ("gated_delta_rule", "ssd", "causal_conv1d")}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny CPU ops run faster on one torch thread (as the benchmark's CPU path does); restored after."""
    prior = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prior)


@pytest.fixture(scope="module")
def bench():
    import benchmarks.bench_isolation

    return benchmarks.bench_isolation


@pytest.fixture(scope="module")
def modes(bench):
    """Every mode."""
    return list(bench.MODES)


@pytest.fixture(scope="module")
def run(bench, modes, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = bench.main([
            "--device", "cpu", "--layers", "gdn", "mamba2", "--hidden", str(HIDDEN), "--tokens", str(TOKENS),
            "--docs", str(DOCS), "--iters", str(ITERS), "--warmup", "1", "--modes", *modes,
            "--json", str(json_path), "--png", str(png_path), "--profile",
        ])
    assert rc == 0
    return json.loads(json_path.read_text()), png_path, stdout.getvalue()


def _helper_computations(bench, kind: str, mode: str) -> int:
    """FLA helper computations (misses + bypasses) of one SAC step of ``mode``, counted independently.

    Only the document layout is the benchmark's (that of its probe step, seed 0): which helpers run can
    depend on it. Mixer, checkpointing, seqlens and counting are this test's own.
    """
    from torch.utils.checkpoint import checkpoint

    from fla_ac_isolation.fla_seam.cache import probe_tensor_cache, tensor_cache_disabled
    from fla_ac_isolation.harness.modes import SharedSeqlens
    from fla_ac_isolation.policies import any_of, sac_context_fn, save_fla_ops, torchtitan_selective
    from fla_ac_isolation.seqlens import LayerLocalSeqlens

    saved = SAVEABLE_MODES.get(mode)
    mixer = FAMILIES[LAYER_FAMILY[kind]].build(backend="reference", saveable=saved is not None)
    lens = layer_step.doc_lengths(TOKENS, DOCS, seed=0)
    host = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seqlens = {
        "isolated": lambda: LayerLocalSeqlens(host.clone()),
        "isolated+cpu": lambda: LayerLocalSeqlens(host.clone(), cu_seqlens_cpu=host),
        "isolated-no-indices": lambda: LayerLocalSeqlens(host.clone(), chunk_indices=False),
        "isolated+save-core": lambda: LayerLocalSeqlens(host.clone()),
        "isolated+save-core+conv": lambda: LayerLocalSeqlens(host.clone()),
    }.get(mode, lambda: SharedSeqlens(host.clone()))()
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    policy = torchtitan_selective() if saved is None else any_of(save_fla_ops(saved), torchtitan_selective())
    context = sac_context_fn(policy)
    cache = tensor_cache_disabled() if mode == "global-disable" else contextlib.nullcontext()
    with cache, probe_tensor_cache() as probe:
        if mode == "no-ac":
            out = mixer(x, seqlens)
        else:
            out = checkpoint(mixer, x, seqlens, use_reentrant=False, context_fn=context)
        out.sum().backward()
    return probe.misses + probe.bypasses


def _rows(run):
    return run[0]["rows"]


def test_every_mode_has_one_row_per_group_with_positive_times(run, modes):
    rows = _rows(run)
    for layer in ("gdn", "mamba2"):
        got = [r["mode"] for r in rows if r["layer"] == layer and r["tokens"] == TOKENS]
        assert got == modes
    for r in rows:
        assert r["median_ms"] > 0 and 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert len(r["times_ms"]) == ITERS and all(t > 0 for t in r["times_ms"])
        assert r["median_ms"] == statistics.median(r["times_ms"])
        assert r["syncs_per_step"] == 0 and r["sync_sites"] == {} and r["peak_mib"] == 0.0  # CPU reports 0


def test_paired_ratio_is_per_iteration_median_and_exactly_one_for_shared(run):
    rows = _rows(run)
    for r in rows:
        shared = next(s for s in rows if (s["layer"], s["tokens"], s["mode"]) == (r["layer"], r["tokens"], "shared"))
        expected = statistics.median(t / s for t, s in zip(r["times_ms"], shared["times_ms"]))
        assert r["paired_x_shared"] == pytest.approx(expected, rel=1e-12)
        assert r["x_shared"] == pytest.approx(r["median_ms"] / shared["median_ms"], rel=1e-12)
        if r["mode"] == "shared":
            assert r["paired_x_shared"] == 1.0 and r["x_shared"] == 1.0


def test_helper_computations_match_an_independent_count(run, bench, modes):
    rows = _rows(run)
    for layer in ("gdn", "mamba2"):
        got = {r["mode"]: r["helper_computations_per_step"] for r in rows if r["layer"] == layer}
        expected = {mode: _helper_computations(bench, layer, mode) for mode in modes}
        assert got == expected, layer
        assert got["global-disable"] > got["shared"]
        assert got["isolated+cpu"] == got["isolated"]
        assert got["no-ac"] == got["shared"]  # one forward; the shared recompute only hits
        # the precomputed schedule removes the schedule computations of both layers; the Mamba2 layer, whose
        # SSD takes the chunk offsets too, then computes none at all (the GDN's prepare_chunk_offsets remains)
        assert got["isolated-no-indices"] > got["isolated"]
        if layer == "gdn":
            assert got["isolated"] >= got["shared"]
        else:
            assert got["isolated"] == 0


def test_paired_ratio_to_no_ac_is_per_iteration_median_and_exactly_one_for_no_ac(run):
    rows = _rows(run)
    for r in rows:
        floor = next(s for s in rows if (s["layer"], s["tokens"], s["mode"]) == (r["layer"], r["tokens"], "no-ac"))
        expected = statistics.median(t / s for t, s in zip(r["times_ms"], floor["times_ms"]))
        assert r["paired_x_no_ac"] == pytest.approx(expected, rel=1e-12)
        if r["mode"] == "no-ac":
            assert r["paired_x_no_ac"] == 1.0 and r["x_no_ac"] == 1.0


def test_saved_outputs_column_is_the_saved_operators_outputs(run, bench):
    """The saveable modes report the MiB their saved operators keep (from the fake kernels at the group's
    shapes), the other modes 0; held memory is a CUDA measurement, 0 on CPU."""
    for r in _rows(run):
        ops = SAVEABLE_MODES.get(r["mode"], ())
        assert r["saved_outputs_mib"] == saved_outputs.saved_mib(r["layer"], TOKENS, HIDDEN, ops)
        assert (r["saved_outputs_mib"] > 0) == bool(ops) and r["held_mib"] == 0.0
        if r["mode"] == "isolated+save-core+conv":
            core = next(s for s in _rows(run) if (s["layer"], s["mode"]) == (r["layer"], "isolated+save-core"))
            assert r["saved_outputs_mib"] > core["saved_outputs_mib"]


def test_profile_shows_the_saved_core_missing_from_the_recompute(run, modes):
    """One profiled step per checkpointed mode; on CPU the breakdown lists every operator of the recompute
    (self times). The reference GDN core's triangular solve and the SSD's cumulative sums run in the
    isolated recompute; in the saveable modes the saved operator's dispatch returns SAC's stored output, so
    none of its inner operators runs, and the conv's inner ops run only when the conv is not saved."""
    profiles = {(p["layer"], p["mode"]): p for p in run[0]["profile"]}
    assert sorted(profiles) == sorted((layer, mode) for layer in ("gdn", "mamba2") for mode in modes if mode != "no-ac")
    for p in profiles.values():
        assert p["ranges"] == 1 and p["method"] == "cpu operators" and p["wall_ms"] >= p["kernel_ms"] > 0
        assert p["launches"] == sum(k["calls"] for k in p["kernels"])

    def calls(layer, mode, name):
        return sum(k["calls"] for k in profiles[(layer, mode)]["kernels"] if k["name"] == name)

    assert calls("gdn", "isolated", "aten::linalg_solve_triangular") > 0
    assert calls("mamba2", "isolated", "aten::cumsum") > 0
    for mode in SAVEABLE_MODES:
        assert calls("gdn", mode, "aten::linalg_solve_triangular") == 0
        assert calls("mamba2", mode, "aten::cumsum") == 0
        assert calls("gdn", mode, "fla_ac_isolation::gated_delta_rule_reference") == 1  # the cached dispatch
    conv_ops = {mode: calls("gdn", mode, "aten::conv1d") for mode in SAVEABLE_MODES}
    assert conv_ops == {"isolated+save-core": calls("gdn", "isolated", "aten::conv1d"), "isolated+save-core+conv": 0}
    assert "gdn T=192 isolated+save-core: recompute" in run[2]


def test_json_and_png_are_written_with_the_printed_rows(run, bench):
    data, png, stdout = run
    printed = re.findall(r"^(\w+) T=(\d+) ([\w+-]+): ([\d.]+) ms, .* (\d+) helper computations$", stdout, re.M)
    assert [(r["layer"], str(r["tokens"]), r["mode"], f"{r['median_ms']:.3f}", str(r["helper_computations_per_step"]))
            for r in data["rows"]] == printed
    assert "CPU SMOKE TEST" in stdout
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["meta"]["device"] == "cpu" and data["meta"]["backend"] == "reference"
    assert set(data["rows"][0]) == set(bench.Row.__dataclass_fields__)


def test_rotation_puts_every_mode_first_once_per_cycle(bench):
    modes = list(bench.MODES)
    orders = [layer_step.rotated(modes, i) for i in range(len(modes))]
    assert [o[0] for o in orders] == modes
    assert all(sorted(o) == sorted(modes) for o in orders)
    assert layer_step.rotated(modes, len(modes)) == modes


def test_default_shapes_are_the_h200_layers():
    gdn, mamba2 = layer_fields("gdn", 2048), layer_fields("mamba2", 2048)
    assert (gdn["linear_num_key_heads"], gdn["linear_key_head_dim"]) == (16, 128)
    assert (mamba2["mamba_num_heads"], mamba2["mamba_head_dim"], mamba2["n_groups"], mamba2["ssm_state_size"]) == (
        64, 64, 8, 128)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without CUDA")
def test_cuda_device_without_cuda_is_a_parser_error(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--iters", "2"])
    assert "needs a CUDA device" in capsys.readouterr().err
