"""The regression under context parallelism through its launcher: CP=2 x EP=2 over gloo in 2 processes, and
``RegressionSpec(cp=2)`` from Python (FLA's CP kernels under Triton's interpreter, as ``regress --cp 2``).

Nemotron-H: its Mamba2 runs head-parallel with the reference ops (no interpreter needed), its attention
gathers keys and values over the CP ranks, torchtitan's MoE shards its experts over the same ranks; the
launcher runs the one-rank reference without CP first and every mode compares with it. The Gated DeltaNet
families run FLA's CP kernels, under Triton's interpreter on a CPU: their regression
(``fla-ac-isolation regress --cp 2 [--ep 2]``, minutes) is run by hand and recorded in
``docs/regression.md``; CI checks the same per-rank loop on a smaller decoder in
``test_context_parallel_gloo.py``.

Stated tolerance: ``isolated`` equals ``no-ac`` (CP=2) bit for bit; ``no-ac`` equals the run without CP
within 1e-4 of the largest gradient at step 0 and 1e-6 of the loss at every step (measured 2e-6 and
1e-7; ``cp_report.default_cp_rtol``).
"""

import pytest

from fla_ac_isolation.harness.cli import regress_render
from fla_ac_isolation.harness.regression import RegressionSpec, report, run_regression

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def nemotron_h():
    spec = RegressionSpec(model="nemotron_h", cp=2, ep=2, cp_layout="zigzag", steps=2, modes=("shared", "isolated"))
    return run_regression(spec)


@pytest.fixture(scope="module")
def gdn_from_python():
    """``RegressionSpec(cp=2)`` from Python on a CPU, as ``fla-ac-isolation regress --cp 2`` runs it (the spec
    resolves the backend, the interpreter and the ranks' environment itself), on a smaller decoder (one GDN
    block and one attention block, one step, ``isolated`` only) to keep CI's minutes."""
    spec = RegressionSpec(cp=2, steps=1, num_layers=2, hidden_size=32, num_experts=4, top_k=2, modes=("isolated",))
    return run_regression(spec)


def test_cp_regression_runs_from_python_with_flas_cp_kernels_under_the_interpreter(gdn_from_python):
    spec = gdn_from_python.spec
    assert (spec.device, spec.backend, spec.kernels, spec.ep) == ("cpu", "fla", "interpreter", 1)
    cp1, no_ac, isolated = (gdn_from_python.modes[m] for m in ("no-ac-cp1", "no-ac", "isolated"))
    assert cp1.error is None and no_ac.error is None and isolated.error is None, (cp1.traceback, no_ac.traceback)
    assert isolated.losses == no_ac.losses and isolated.grad_diffs == [0.0], "bit for bit with CP=2 without AC"
    # against the one-rank run without CP: default_cp_rtol (1e-4 of the largest gradient, float32 on CPU)
    assert abs(no_ac.losses[0] - cp1.losses[0]) <= 1e-6 * abs(cp1.losses[0])
    assert no_ac.cp1_grad_diffs[0] <= 1e-4 * no_ac.cp1_ref_grad_max[0]
    assert report.verdicts(gdn_from_python)["isolated"].text.startswith("matches (bit for bit); vs CP=1 ")
    assert report.exit_code(gdn_from_python) == 0


def test_no_ac_under_cp_matches_the_run_without_cp(nemotron_h):
    cp1, no_ac = nemotron_h.modes["no-ac-cp1"], nemotron_h.modes["no-ac"]
    assert cp1.error is None and no_ac.error is None, (cp1.traceback, no_ac.traceback)
    assert len(cp1.losses) == len(no_ac.losses) == 2
    for a, b in zip(no_ac.losses, cp1.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert no_ac.cp1_grad_diffs[0] <= 1e-4 * no_ac.cp1_ref_grad_max[0]
    assert cp1.grad_diffs == [None, None], "the reference compares with nothing"


def test_isolated_under_cp_is_bit_exact_and_the_run_passes(nemotron_h):
    no_ac, isolated = nemotron_h.modes["no-ac"], nemotron_h.modes["isolated"]
    assert isolated.error is None, isolated.traceback
    assert isolated.losses == no_ac.losses and isolated.grad_diffs == [0.0, 0.0]
    assert isolated.cp1_grad_diffs == no_ac.cp1_grad_diffs
    found = report.verdicts(nemotron_h)
    assert found["isolated"].text.startswith("matches (bit for bit); vs CP=1 ")
    assert report.exit_code(nemotron_h) == 0


def test_shared_mode_matches_for_nemotron_h_in_float32(nemotron_h):
    """As without CP: the Mamba2 block holds no cast after FLA's helpers in float32, so the shared path
    runs other ops in its recompute but computes the same numbers (the GDN families fail: see
    test_context_parallel_gloo.py)."""
    assert report.verdicts(nemotron_h)["shared"].status == "matches"
    assert report.fault_reproduced(nemotron_h) is False


def test_report_names_the_parallelism_and_the_cp1_column(nemotron_h):
    from rich.console import Console

    console = Console(width=220, record=True)
    regress_render.print_report(nemotron_h, console=console)
    text = console.export_text()
    assert "nemotron_h  CP=2 (zigzag) x EP=2  AC selective" in text
    assert "max |grad - CP=1|" in text and "reference (one rank, no CP, no AC)" in text
    assert ("max |grad - CP=1|: the same to the one-rank run without CP (no-ac-cp1), per step; the verdict (vs CP=1) "
            "judges the gradients at step 0 only") in " ".join(text.split())


def test_a_padded_cp_batch_is_said_in_the_notes(monkeypatch):
    from fla_ac_isolation.harness.regression import run as regression_run
    from fla_ac_isolation.harness.regression.data import cp_batch, cp_padding_note
    from fla_ac_isolation.harness.regression.spec import RegressionResult

    # 128 tokens: 3 contiguous parts need 129 (one padding token), 3 zigzag parts (6 intervals) need 132
    padded = cp_batch(0, layout="contiguous", multiple=3)
    assert padded.seq_lens[-1] == 1 and padded.labels[0, -1].item() == -100 and padded.input_ids.shape[1] == 129
    assert cp_padding_note(3, "contiguous") == (
        "CP batch padded: 128/128 tokens do not split into 3 equal parts (contiguous, CP=3); each step appends one "
        "document of 1 token(s) whose labels are ignored (the CP=1 reference trains on the same padded batch)"
    )
    assert "split into 6 equal parts (zigzag, CP=3)" in cp_padding_note(3, "zigzag")
    assert "document of 4 token(s)" in cp_padding_note(3, "zigzag")
    assert cp_padding_note(2, "contiguous") is None and cp_padding_note(2, "zigzag") is None

    monkeypatch.setattr(regression_run, "run_spawned", lambda spec, *_: RegressionResult(spec=spec, modes={}))
    noted = run_regression(RegressionSpec(cp=3, ep=1, hidden_size=64, backend="fla"))
    assert noted.notes == [cp_padding_note(3, "contiguous")]
    assert run_regression(RegressionSpec(cp=2, hidden_size=64, backend="fla")).notes == []
