"""Verdicts against the run without pipeline parallelism, for a regression with ``pp > 1``.

Under PP every mode is judged twice (both by :func:`~.report.verdicts`, with the numbers of this module). First
against ``no-ac`` under the same schedule and microbatches: bit for bit on CPU in float32 (the stages run the
same ops on the same microbatches in the same order; the report measured it in every cell). Then against
:data:`~.spec.PP1_REFERENCE` (one rank, the whole batch of every data-parallel rank, no microbatches, no EP, no
AC): the same maths summed in another order, so within :func:`default_pp_rtol`. The difference comes from the
microbatching, not from the pipeline: ``no-ac`` under PP equals one process running the same padded
microbatches one after another bit for bit; what differs from the whole batch is the order in which the
microbatches' gradients accumulate, and torchtitan's MoE grouping its tokens per microbatch.

The deviation is the larger of the largest relative loss difference over all steps and the largest
difference of any parameter's full gradient (each stage's parameters by name, expert shards gathered) at step
0, relative to the largest PP=1 gradient there. Gradients at step 0 only, as under CP (:mod:`.cp_report`):
AdamW's first update moves a near-zero gradient component by about ``2 lr`` when its sign differs by rounding,
so later gradients differ by about ``lr``; they are shown in the table and the JSON.
"""

from __future__ import annotations

from fla_ac_isolation.harness.regression.cp_report import reference_deviation
from fla_ac_isolation.harness.regression.spec import ModeResult

__all__ = ["PP_RTOL_MEASURED", "default_pp_rtol", "pp1_deviation"]

PP_RTOL_MEASURED = 3.2e-5
"""The largest deviation of ``no-ac`` under PP from the run without PP measured on CPU in float32 (3.14e-5: the tiny
Qwen3.5-MoE with oneDNN off; GPipe, 1F1B and interleaved 1F1B at 2 to 8 microbatches, the three families, 1 to 4
intra-op threads, torch's default and AVX2 kernels, with and without EP: ``docs/pipeline-parallel.md``)."""


def default_pp_rtol(device: str, dtype: str) -> float:
    """2e-4 for float32 on CPU (6x the largest measured deviation, :data:`PP_RTOL_MEASURED`), 2e-2 otherwise."""
    return 2e-4 if device == "cpu" and dtype == "float32" else 2e-2


def pp1_deviation(mode: ModeResult, pp1: ModeResult) -> tuple[float, str]:
    """``(deviation, "loss" | "grad" | "nan" | "missing")`` of ``mode`` from the PP=1 reference (see the module
    docstring); ``(inf, "missing")`` when ``mode`` has no gradient difference at step 0 (never judged on the loss
    alone)."""
    return reference_deviation(mode.losses, pp1.losses, mode.pp1_ref_grad_max, mode.pp1_grad_diffs)
