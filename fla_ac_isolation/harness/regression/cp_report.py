"""Verdicts against the run without context parallelism, for a regression with ``cp > 1``.

Under CP every mode is judged twice (both by :func:`~.report.verdicts`, with the numbers of this module).
First as without CP: against ``no-ac`` of the same CP ranks, bit for bit on CPU in float32 (forward and
recompute run the same kernels on the same shards). Then against :data:`~.spec.CP1_REFERENCE` (one rank,
the whole batch, no AC): the same maths with another summation order (FLA's CP kernels merge per-rank
states; the attention and the reductions add in another order), so within a stated tolerance
:func:`default_cp_rtol`. The
deviation is the larger of the largest relative loss difference over all steps and the largest
difference of any parameter's full gradient (expert shards gathered) at step 0, relative to the largest
CP=1 gradient there.

Why gradients only at step 0: there both runs hold the same parameters. AdamW's first update is about
``lr * sign(grad)``, so a gradient component near zero whose sign differs by rounding (1e-7 apart) moves
by ``2 lr`` in one run only, and later gradients differ by about ``lr`` (measured on CPU, qwen3_5_moe,
CP=2: 6.9e-6 at step 0, 1.6e-3 at step 1 with ``lr = 1e-3``; with ``lr = 0`` every step stays within 7e-6).
The losses stay within 2e-7 relative and are judged at every step; the later gradient differences are
shown in the table and the JSON.
"""

from __future__ import annotations

import math

from fla_ac_isolation.harness.regression.spec import ModeResult

__all__ = ["cp1_deviation", "default_cp_rtol", "reference_deviation"]


def default_cp_rtol(device: str, dtype: str) -> float:
    """1e-4 for float32 on CPU (measured deviations: 2e-6 to 6e-6, docs/context-parallel.md), 2e-2 otherwise."""
    return 1e-4 if device == "cpu" and dtype == "float32" else 2e-2


def cp1_deviation(mode: ModeResult, cp1: ModeResult) -> tuple[float, str]:
    """``(deviation, "loss" | "grad" | "nan" | "missing")`` of ``mode`` from the CP=1 reference (see the module
    docstring); ``(inf, "missing")`` when ``mode`` has no gradient difference at step 0 (never judged on the loss
    alone)."""
    return reference_deviation(mode.losses, cp1.losses, mode.cp1_ref_grad_max, mode.cp1_grad_diffs)


def reference_deviation(losses: list[float], reference_losses: list[float], reference_grad_max: list[float] | None,
                        grad_diffs: list[float] | None) -> tuple[float, str]:
    """``(deviation, "loss" | "grad" | "nan" | "missing")``: the largest relative loss difference against
    ``reference_losses`` or the step-0 gradient difference relative to the reference's largest gradient,
    whichever is larger; ``(inf, "missing")`` without a step-0 gradient difference (never judged on the loss
    alone). The one rule of the CP=1 and PP=1 comparisons."""
    loss_dev = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference_losses)), default=0.0)
    scale, diff = (reference_grad_max or [None])[0], (grad_diffs or [None])[0]
    if diff is None:
        return math.inf, "missing"
    grad_dev = diff / scale if scale else diff
    if math.isnan(loss_dev) or math.isnan(grad_dev):
        return math.inf, "nan"
    return (loss_dev, "loss") if loss_dev >= grad_dev else (grad_dev, "grad")
