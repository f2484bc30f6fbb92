"""Verdicts against the one-rank run without CP (:data:`~.spec.CP1_REFERENCE`), for ``cp > 1``: within
:func:`default_cp_rtol`, on the losses of every step and the full gradients of step 0 only (after AdamW's first
update, near-zero components whose sign differs by rounding make later gradients differ by about ``lr``)."""

from __future__ import annotations

import math

from fla_ac_isolation.harness.regression.spec import ModeResult

__all__ = ["cp1_deviation", "default_cp_rtol", "reference_deviation"]


def default_cp_rtol(device: str, dtype: str) -> float:
    """1e-4 for float32 on CPU, 2e-2 otherwise."""
    return 1e-4 if device == "cpu" and dtype == "float32" else 2e-2


def cp1_deviation(mode: ModeResult, cp1: ModeResult) -> tuple[float, str]:
    """``(deviation, "loss" | "grad" | "nan" | "missing")`` of ``mode`` from the CP=1 reference."""
    return reference_deviation(mode.losses, cp1.losses, mode.cp1_ref_grad_max, mode.cp1_grad_diffs)


def reference_deviation(losses: list[float], reference_losses: list[float], reference_grad_max: list[float] | None,
                        grad_diffs: list[float] | None) -> tuple[float, str]:
    """``(deviation, "loss" | "grad" | "nan" | "missing")``: the larger of the largest relative loss difference and
    the step-0 gradient difference relative to the reference's largest gradient; ``(inf, "missing")`` without a
    step-0 gradient difference."""
    loss_dev = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference_losses)), default=0.0)
    scale, diff = (reference_grad_max or [None])[0], (grad_diffs or [None])[0]
    if diff is None:
        return math.inf, "missing"
    grad_dev = diff / scale if scale else diff
    if math.isnan(loss_dev) or math.isnan(grad_dev):
        return math.inf, "nan"
    return (loss_dev, "loss") if loss_dev >= grad_dev else (grad_dev, "grad")
