"""Verdicts against the one-rank run without PP (:data:`~.spec.PP1_REFERENCE`), for ``pp > 1``: within
:func:`default_pp_rtol` (microbatching changes the summation order), by the rule of :mod:`.cp_report`."""

from __future__ import annotations

from fla_ac_isolation.harness.regression.cp_report import reference_deviation
from fla_ac_isolation.harness.regression.spec import ModeResult

__all__ = ["PP_RTOL_MEASURED", "default_pp_rtol", "pp1_deviation"]

PP_RTOL_MEASURED = 3.2e-5
"""The largest deviation of ``no-ac`` under PP from the run without PP measured on CPU in float32
(``docs/pipeline-parallel.md``)."""


def default_pp_rtol(device: str, dtype: str) -> float:
    """2e-4 for float32 on CPU (:data:`PP_RTOL_MEASURED`), 2e-2 otherwise."""
    return 2e-4 if device == "cpu" and dtype == "float32" else 2e-2


def pp1_deviation(mode: ModeResult, pp1: ModeResult) -> tuple[float, str]:
    """``(deviation, "loss" | "grad" | "nan" | "missing")`` of ``mode`` from the PP=1 reference."""
    return reference_deviation(mode.losses, pp1.losses, mode.pp1_ref_grad_max, mode.pp1_grad_diffs)
