"""Verdicts of a regression run (data only; :mod:`fla_ac_isolation.harness.cli.regress_render` renders them).

A mode's deviation is the larger of its largest relative loss difference and its largest gradient difference over
the largest reference gradient. A mode matches when it completed and its deviation is at most ``rtol``. The run
passes when ``no-ac`` completed and every required mode that ran matches; unsafe modes never change the exit code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fla_ac_isolation.harness.modes import modes_with_role
from fla_ac_isolation.harness.regression.cp_report import cp1_deviation, default_cp_rtol
from fla_ac_isolation.harness.regression.pp_report import default_pp_rtol, pp1_deviation
from fla_ac_isolation.harness.regression.spec import CP1_REFERENCE, PP1_REFERENCE, ModeResult, RegressionResult

__all__ = [
    "REQUIRED",
    "UNSAFE",
    "Verdict",
    "check_rtol",
    "default_rtol",
    "exit_code",
    "fault_reproduced",
    "to_document",
    "verdicts",
]

REQUIRED: tuple[str, ...] = modes_with_role("required")
"""Modes whose mismatch fails the run (role ``required``)."""
UNSAFE: tuple[str, ...] = modes_with_role("unsafe")
"""The unsafe modes (role ``unsafe``): run to show the fault, never changing the exit code."""


@dataclass(frozen=True)
class Verdict:
    """One mode's verdict.

    Attributes:
        mode: the mode.
        status: ``reference`` | ``matches`` | ``diverged`` | ``failed`` | ``incomplete`` (data to judge it is
            missing) | ``no reference``.
        text: what the table prints (``matches``, ``DIVERGED by X``, ``FAILED: <first line>``, ``INCOMPLETE: ...``).
        deviation: relative deviation from ``no-ac`` (``None`` when not computable).
        ok: ``status`` is ``matches`` or ``reference``.
    """

    mode: str
    status: str
    text: str
    deviation: float | None

    @property
    def ok(self) -> bool:
        return self.status in ("matches", "reference")


def default_rtol(device: str, dtype: str) -> float:
    """0 (bit for bit) for float32 on CPU; 1e-2 relative otherwise."""
    return 0.0 if device == "cpu" and dtype == "float32" else 1e-2


def _deviation(mode: ModeResult, ref: ModeResult) -> tuple[float, str]:
    loss_dev = max(
        (abs(a - b) / max(abs(b), 1e-30) for a, b in zip(mode.losses, ref.losses)), default=0.0
    )
    ref_scale = max((g for g in mode.ref_grad_max if g is not None), default=0.0)
    diffs = [d for d in mode.grad_diffs if d is not None]
    grad_dev = (max(diffs) / ref_scale if ref_scale > 0 else max(diffs)) if diffs else 0.0
    if math.isnan(loss_dev) or math.isnan(grad_dev):
        return math.inf, "nan"
    return (loss_dev, "loss") if loss_dev >= grad_dev else (grad_dev, "grad")


def check_rtol(rtol: float | None, name: str = "rtol") -> None:
    """Accept ``None`` (the default tolerance) or a finite number >= 0.

    Raises:
        ValueError: naming ``name`` for a negative, infinite or NaN value or a non-number.
    """
    if rtol is None:
        return
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0 (relative tolerance), got {rtol!r}")


def verdicts(result: RegressionResult, rtol: float | None = None, cp_rtol: float | None = None,
             pp_rtol: float | None = None) -> dict[str, Verdict]:
    """A :class:`Verdict` per mode of ``result``.

    Raises:
        ValueError: ``rtol``, ``cp_rtol`` or ``pp_rtol`` is negative, infinite or NaN.
    """
    check_rtol(rtol)
    check_rtol(cp_rtol, "cp_rtol")
    check_rtol(pp_rtol, "pp_rtol")
    spec = result.spec
    rtol = default_rtol(spec.device, spec.dtype) if rtol is None else rtol
    ref = result.modes.get("no-ac")
    out: dict[str, Verdict] = {}
    for name, mode in result.modes.items():
        if mode.error is not None:
            out[name] = Verdict(name, "failed", f"FAILED: {mode.error}", None)
        elif name == "no-ac":
            out[name] = Verdict(name, "reference", "reference", 0.0)
        elif ref is None or ref.error is not None or len(ref.losses) < spec.steps:
            out[name] = Verdict(name, "no reference", "no reference (no-ac failed)", None)
        elif len(mode.losses) != len(ref.losses):
            out[name] = Verdict(name, "incomplete", f"INCOMPLETE: ran {len(mode.losses)} of {len(ref.losses)} "
                                                    "steps and reported no error", None)
        else:
            dev, what = _deviation(mode, ref)
            if dev <= rtol:
                text = "matches (bit for bit)" if dev == 0 else f"matches (within {dev:.1e} <= rtol {rtol:g})"
                out[name] = Verdict(name, "matches", text, dev)
            else:
                out[name] = Verdict(name, "diverged", f"DIVERGED by {dev:.2e} ({what})", dev)
    if spec.cp > 1:
        _apply_whole_verdicts(out, result, CP1_REFERENCE, "CP", cp1_deviation,
                              default_cp_rtol(spec.device, spec.dtype) if cp_rtol is None else cp_rtol)
    if spec.pp > 1:
        _apply_whole_verdicts(out, result, PP1_REFERENCE, "PP", pp1_deviation,
                              default_pp_rtol(spec.device, spec.dtype) if pp_rtol is None else pp_rtol)
    return out


def _apply_whole_verdicts(found: dict[str, Verdict], result: RegressionResult, reference: str, what: str,
                          deviation, rtol: float) -> None:
    """Judge the modes that matched against the one-rank run without ``what`` (CP or PP), in place."""
    whole = result.modes.get(reference)
    complete = whole is not None and whole.error is None and len(whole.losses) == result.spec.steps
    for name, verdict in list(found.items()):
        if name == reference:
            if whole.error is None:
                found[name] = Verdict(name, "reference", f"reference (one rank, no {what}, no AC)", 0.0)
            continue
        if verdict.status not in ("reference", "matches"):
            continue
        if not complete:
            found[name] = Verdict(name, "no reference", f"no reference ({reference} failed)", None)
            continue
        dev, kind = deviation(result.modes[name], whole)
        if kind == "missing":
            found[name] = Verdict(name, "incomplete", f"INCOMPLETE: no gradient difference from {what}=1 at step 0 "
                                                      f"(cannot be judged against {what}=1)", None)
        elif dev <= rtol:
            found[name] = Verdict(name, verdict.status, f"{verdict.text}; vs {what}=1 {dev:.1e} <= {rtol:g}",
                                  verdict.deviation)
        else:
            found[name] = Verdict(name, "diverged", f"DIVERGED from {what}=1 by {dev:.2e} ({kind})", dev)


def exit_code(result: RegressionResult, rtol: float | None = None) -> int:
    """0 when ``no-ac`` ran and every required mode that ran matches it; 1 otherwise."""
    found = verdicts(result, rtol)
    if "no-ac" not in found or not found["no-ac"].ok:
        return 1
    return 0 if all(found[m].ok for m in REQUIRED if m in found) else 1


def fault_reproduced(result: RegressionResult, rtol: float | None = None, mode: str = "shared") -> bool | None:
    """Whether the unsafe ``mode`` failed or diverged; ``None`` when not judged (it did not run or timed out, its
    data is incomplete, or ``no-ac`` did not complete)."""
    found = verdicts(result, rtol)
    verdict, reference = found.get(mode), found.get("no-ac")
    if verdict is None or verdict.status in ("no reference", "incomplete") or reference is None or not reference.ok:
        return None
    if result.modes[mode].timed_out:
        return None
    return verdict.status in ("failed", "diverged")


def to_document(result: RegressionResult, rtol: float | None = None) -> dict[str, Any]:
    """The run as one JSON-ready document (spec, results, verdicts, fault reproduced, exit code, notes, versions)."""
    doc = result.to_dict()
    doc["verdicts"] = {name: {**asdict(v), "ok": v.ok} for name, v in verdicts(result, rtol).items()}
    doc["fault_reproduced"] = fault_reproduced(result, rtol)
    if "field" in result.modes:
        doc["field_fault_reproduced"] = fault_reproduced(result, rtol, "field")
    doc["exit_code"] = exit_code(result, rtol)
    return doc
