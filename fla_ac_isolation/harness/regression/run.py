"""The entry point of the regression: :func:`run_regression`."""

from __future__ import annotations

from collections.abc import Callable

from fla_ac_isolation.harness.environment import versions
from fla_ac_isolation.harness.regression.data import cp_padding_note, pp_microbatch_note
from fla_ac_isolation.harness.regression.launch import run_spawned
from fla_ac_isolation.harness.regression.spec import RegressionResult, RegressionSpec
from fla_ac_isolation.harness.regression.torchrun import run_under_torchrun, under_torchrun

__all__ = ["run_regression"]


def run_regression(
    spec: RegressionSpec,
    *,
    on_step: Callable[[str, int], None] | None = None,
    on_rank_start: Callable[[str, int, int], None] | None = None,
) -> RegressionResult:
    """Run every mode of ``spec`` and return the results (a failing mode is recorded and the next one runs).

    Launches ``spec.world`` processes per mode, or, under ``torchrun``, uses the current processes (then every
    rank returns the same result).

    Args:
        spec: what to run (validated here).
        on_step: called as ``on_step(mode, step)`` after each completed step (rank 0).
        on_rank_start: spawned ranks only: called as ``on_rank_start(mode, rank, pid)`` once that rank's
            process group is up.

    Raises:
        ValueError: an invalid spec.
    """
    spec.validate()
    spawned = not under_torchrun()
    result = run_spawned(spec, on_step, on_rank_start) if spawned else run_under_torchrun(spec, on_step)
    result.environment = versions()
    if spec.cp > 1 and (note := cp_padding_note(spec.cp, spec.cp_layout)) is not None:
        result.notes.append(note)
    if spec.pp > 1:
        result.notes.append(pp_microbatch_note(spec.steps, spec.mesh.dp, spec.microbatches))
    return result
