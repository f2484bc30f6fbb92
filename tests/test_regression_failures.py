"""`fla-ac-isolation regress` when ranks die or raise: the report survives, verbatim, with the right exit code.

Two runs of the command (EP=2 over gloo, one step, a tiny Qwen3.5-MoE), each with ``no-ac`` and one more mode:

* a rank of ``isolated`` is killed with SIGKILL by this test, by its pid, once every rank's process group is up:
  the table and the JSON document name the mode, the rank and how it died; ``isolated`` failing fails the
  run (exit code 1);
* a rank of ``shared`` raises an error whose text holds rich markup look-alikes (``[bold]``, gloo's
  ``[/pytorch/third_party/gloo/.../pair.cc:537]`` and ``[../pair.cc:537]``) and a ``$`` (matplotlib's
  mathtext): the table, the JSON document and the plot show it as it is; ``shared`` never changes the exit
  code (0).

Both leave no worker process behind: every pid reported to ``on_rank_start`` is gone afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest

from fla_ac_isolation.harness.cli import main
from fla_ac_isolation.harness.regression import run as regression_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2  # EP=2, the command's default
SIZES = ["--steps", "1", "--hidden-size", "32", "--layers", "1", "--experts", "4", "--top-k", "2", "--no-progress"]
FOREIGN = "peer said [bold]no[/bold] at [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] and [../pair.cc:537] for $x^$"


def _flat(text: str) -> str:
    """``text`` with every run of whitespace made one space (rich wraps long lines at the console width)."""
    return " ".join(text.split())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def instrumented(monkeypatch):
    """Route the command's run_regression through a wrapper: record every rank's pid, kill or inject on demand."""
    real = regression_run.run_regression
    seen: dict[str, dict[int, int]] = {}
    plan: dict = {"kill": None, "fail_on": None}

    def on_rank_start(mode: str, rank: int, pid: int) -> None:
        seen.setdefault(mode, {})[rank] = pid
        # kill once EVERY rank of the mode is up: killing rank 1 as soon as it reports could stop rank 0
        # inside its own process-group set-up, before it reports (seen on a loaded 2-core machine)
        if plan["kill"] is not None and plan["kill"][0] == mode and len(seen[mode]) == WORLD:
            os.kill(seen[mode][plan["kill"][1]], signal.SIGKILL)

    def wrapped(spec, **kwargs):
        if plan["fail_on"] is not None:
            spec = dataclasses.replace(spec, fail_on=plan["fail_on"])
        return real(spec, on_rank_start=on_rank_start, **kwargs)

    monkeypatch.setattr(regression_run, "run_regression", wrapped)
    return plan, seen


def test_a_rank_killed_during_isolated_fails_the_run_and_the_report_says_so(instrumented, tmp_path, capsys):
    plan, seen = instrumented
    plan["kill"] = ("isolated", 1)
    out = tmp_path / "r.json"
    code = main(["regress", *SIZES, "--modes", "isolated", "--json", str(out)])
    text = _flat(capsys.readouterr().out)

    assert code == 1, text
    assert "isolated: FAIL FAILED: rank 1: process died (killed by SIGKILL)" in text
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == 1
    assert doc["modes"]["isolated"]["error"] == "rank 1: process died (killed by SIGKILL)"
    assert doc["modes"]["isolated"]["failed_ranks"][0] == 1, "the killed rank is the cause; its peer's error follows"
    assert doc["verdicts"]["no-ac"]["status"] == "reference" and doc["modes"]["no-ac"]["losses"]
    assert sorted(seen) == ["isolated", "no-ac"] and all(sorted(r) == [0, 1] for r in seen.values())
    assert all(_gone(pid) for ranks in seen.values() for pid in ranks.values()), seen


def test_an_error_text_with_brackets_is_reported_verbatim_and_shared_keeps_exit_code_0(instrumented, tmp_path, capsys):
    plan, seen = instrumented
    plan["fail_on"] = ("shared", 1, FOREIGN)
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["regress", *SIZES, "--modes", "shared", "--json", str(out), "--plot", str(plot)])
    text = _flat(capsys.readouterr().out)

    assert code == 0, text
    expected = f"rank 1: RuntimeError: {FOREIGN}"
    assert _flat(f"shared (unsafe): fault reproduced FAILED: {expected} (does not affect the exit code)") in text
    doc = json.loads(out.read_text())
    assert doc["modes"]["shared"]["error"] == expected
    assert doc["verdicts"]["shared"]["text"] == f"FAILED: {expected}"
    assert doc["exit_code"] == 0 and doc["fault_reproduced"] is True
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {out}" in text and f"wrote {plot}" in text
    assert all(_gone(pid) for ranks in seen.values() for pid in ranks.values()), seen
