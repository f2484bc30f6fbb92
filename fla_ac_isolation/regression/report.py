"""Verdicts, the table, the JSON document and the loss plot of a regression run.

A mode's deviation from ``no-ac`` is the larger of the largest relative loss difference over the steps
and the largest gradient difference divided by the largest reference gradient (both over all steps,
ranks and parameters). A mode *matches* when it completed every step and its deviation is at most
``rtol`` (0 by default on the CPU reference backend in float32: bit for bit). The run passes (exit code
0) when ``no-ac`` completed and ``isolated`` and ``global-disable`` (those of them that ran) match;
``shared`` is the unsafe mode and never changes the exit code: the table says whether it reproduced the
fault (it failed or diverged). Under context parallelism the modes are also judged against the run
without CP (:mod:`.cp_report`), and the CP-only ``field`` mode is unsafe too.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from fla_ac_isolation.extras import require
from fla_ac_isolation.regression.cp_report import apply_cp1_verdicts, default_cp_rtol
from fla_ac_isolation.regression.spec import ModeResult, RegressionResult

__all__ = ["Verdict", "check_rtol", "default_rtol", "exit_code", "print_report", "verdicts", "write_json", "write_plot"]

#: modes whose mismatch fails the run
REQUIRED = ("isolated", "global-disable")
#: the unsafe modes: run to show the fault, never change the exit code
UNSAFE = ("shared", "field")


@dataclass(frozen=True)
class Verdict:
    """One mode's verdict.

    Attributes:
        mode: the mode.
        status: ``reference`` | ``matches`` | ``diverged`` | ``failed`` | ``no reference``.
        text: what the table prints (``matches``, ``DIVERGED by X``, ``FAILED: <first line>``).
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
    """0 (bit for bit) for float32 on CPU; 1e-2 relative otherwise (FLA kernels, low precision)."""
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
        ValueError: naming ``name`` (the CLI passes ``--rtol``) for a negative, infinite or NaN value
            or a non-number.
    """
    if rtol is None:
        return
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0 (relative tolerance), got {rtol!r}")


def verdicts(result: RegressionResult, rtol: float | None = None, cp_rtol: float | None = None) -> dict[str, Verdict]:
    """A :class:`Verdict` per mode of ``result`` (``rtol``, ``cp_rtol``: see the module docstring).

    Raises:
        ValueError: ``rtol`` or ``cp_rtol`` is negative, infinite or NaN.
    """
    check_rtol(rtol)
    check_rtol(cp_rtol, "cp_rtol")
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
        else:
            dev, what = _deviation(mode, ref)
            if dev <= rtol and len(mode.losses) == len(ref.losses):
                text = "matches (bit for bit)" if dev == 0 else f"matches (within {dev:.1e} <= rtol {rtol:g})"
                out[name] = Verdict(name, "matches", text, dev)
            else:
                out[name] = Verdict(name, "diverged", f"DIVERGED by {dev:.2e} ({what})", dev)
    if spec.cp > 1:
        apply_cp1_verdicts(out, result, default_cp_rtol(spec.device, spec.dtype) if cp_rtol is None else cp_rtol)
    return out


def exit_code(result: RegressionResult, rtol: float | None = None) -> int:
    """0 when ``no-ac`` ran and every required mode that ran matches it; 1 otherwise."""
    found = verdicts(result, rtol)
    if "no-ac" not in found or not found["no-ac"].ok:
        return 1
    return 0 if all(found[m].ok for m in REQUIRED if m in found) else 1


def fault_reproduced(result: RegressionResult, rtol: float | None = None, mode: str = "shared") -> bool | None:
    """Whether the unsafe ``mode`` (``shared``, or ``field`` under CP) failed or diverged.

    ``None`` (not judged) when it did not run, when ``no-ac`` did not complete (a failure of every mode
    says nothing about the fault) or when the mode was stopped by the timeout.
    """
    found = verdicts(result, rtol)
    verdict, reference = found.get(mode), found.get("no-ac")
    if verdict is None or verdict.status == "no reference" or reference is None or not reference.ok:
        return None
    if result.modes[mode].timed_out:
        return None
    return verdict.status in ("failed", "diverged")


# ------------------------------------------------------------------------------------------- table
def _fmt(x: float | None, spec: str = ".6g") -> str:
    return "-" if x is None else format(x, spec)


def print_report(result: RegressionResult, *, rtol: float | None = None, verbose: bool = False, console=None) -> None:
    """Print the header, the per-step table, the verdict summary and (``verbose``) FLA cache counts.

    Every foreign string (error messages of the ranks, notes) is escaped, so text such as gloo's
    ``[/pytorch/third_party/gloo/.../pair.cc:537]`` or ``[bold]`` prints as it is, never as rich markup.

    Raises:
        ValueError: ``rtol`` is negative or not a number (see :func:`verdicts`).
    """
    from rich.console import Console
    from rich.table import Table

    from fla_ac_isolation.cli.console import escape

    console = console or Console()
    spec = result.spec
    found = verdicts(result, rtol)
    ac = "full" if spec.ac == "full" else f"selective, policy {spec.policy}"
    title = (
        f"{spec.model}  {_parallelism(spec)}  AC {ac}, every {spec.freq} block(s)  backend={spec.backend}  "
        f"{spec.device}/{spec.dtype}  hidden={spec.hidden_size}  {spec.num_experts} experts top-{spec.top_k}"
    )
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    seconds = ", ".join(f"{name} {mode.seconds:.1f}" for name, mode in result.modes.items())
    caption = (
        "max |grad - ref|: largest gradient difference to no-ac over all ranks and parameters; idle experts: "
        f"most experts without any token in one MoE layer (all ranks). Seconds per mode: {seconds}."
    )
    table = Table(title=escape(title), title_justify="left", caption=escape(caption), caption_justify="left")
    _add_rows(table, result, found)
    console.print(table)
    _print_verdicts(result, found, rtol, console)
    if verbose:
        _print_cache(result, console)
        for name, mode in result.modes.items():
            if mode.traceback:
                rank = mode.failed_ranks[0] if mode.failed_ranks else "?"
                console.print(f"[red]{name}[/red] traceback (rank {rank}):")
                console.print(mode.traceback, markup=False, highlight=False)


def _print_verdicts(result: RegressionResult, found: dict[str, Verdict], rtol: float | None, console) -> None:
    """One line per required mode (PASS/FAIL) and one per unsafe mode (whether it reproduced the fault)."""
    from fla_ac_isolation.cli.console import escape

    for name in REQUIRED:
        if name in found:
            mark = "[green]PASS[/green]" if found[name].ok else "[red]FAIL[/red]"
            console.print(f"{name:>15}: {mark}  {escape(found[name].text)}")
    for name in UNSAFE:
        if name not in found:
            continue
        reproduced = fault_reproduced(result, rtol, name)
        what = {True: "[magenta]fault reproduced[/magenta]", False: "fault NOT reproduced under this policy",
                None: "not judged (no reference, or stopped by the timeout)"}[reproduced]
        label = escape(name + " (unsafe)")
        console.print(f"{label:>15}: {what}  {escape(found[name].text)}  (does not affect the exit code)")


def _add_rows(table, result: RegressionResult, found: dict[str, Verdict]) -> None:
    """One column per field, one row per mode and step (under CP also the difference to the run without CP)."""
    from fla_ac_isolation.cli.console import escape

    cp = result.spec.cp > 1
    columns = [("mode", "left"), ("step", "right"), ("loss", "right"), ("grad norm", "right"),
               ("max |grad - ref|", "right"), ("idle experts", "right"), ("verdict", "left")]
    if cp:
        columns.insert(5, ("max |grad - CP=1|", "right"))
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for name, mode in result.modes.items():
        verdict = found[name]
        text = escape(verdict.text)
        style = {"matches": "green", "reference": "cyan", "failed": "red", "diverged": "red"}.get(verdict.status, "")
        rows = max(len(mode.losses), 1)
        for i in range(rows):
            done = i < len(mode.losses)
            cells = [
                name if i == 0 else "",
                str(i) if done else "-",
                _fmt(mode.losses[i], ".8f") if done else "-",
                _fmt(mode.grad_norms[i], ".6g") if done else "-",
                _fmt(mode.grad_diffs[i], ".3e") if done and i < len(mode.grad_diffs) else "-",
                str(mode.idle_experts[i]) if done else "-",
                f"[{style}]{text}[/{style}]" if i == 0 and style else (text if i == 0 else ""),
            ]
            if cp:
                cells.insert(5, _fmt(mode.cp1_grad_diffs[i], ".3e") if done and i < len(mode.cp1_grad_diffs) else "-")
            table.add_row(*cells, end_section=i == rows - 1)


def _parallelism(spec) -> str:
    """``EP=2``; under context parallelism ``CP=2 (zigzag) x EP=2`` or ``CP=2 (contiguous), EP=1``."""
    if spec.cp == 1:
        return f"EP={spec.ep}"
    cp = f"CP={spec.cp} ({spec.cp_layout})"
    return f"{cp} x EP={spec.ep}" if spec.ep > 1 else f"{cp}, EP=1"


def _print_cache(result: RegressionResult, console) -> None:
    from rich.table import Table

    from fla_ac_isolation.cli.console import escape

    table = Table(title="FLA tensor-cache lookups per mode (summed over ranks and steps)", title_justify="left")
    for col in ("mode", "helper", "hit", "miss", "bypass"):
        table.add_column(col, justify="left" if col in ("mode", "helper") else "right")
    for name, mode in result.modes.items():
        helpers = sorted(mode.cache_by_helper.items())
        for i, (helper, counts) in enumerate(helpers):
            counted = (str(counts.get(k, 0)) for k in ("hit", "miss", "bypass"))
            table.add_row(name if i == 0 else "", escape(helper), *counted)
        table.add_row(
            name if not helpers else "", "[bold]total[/bold]",
            *(str(mode.cache.get(k, 0)) for k in ("hit", "miss", "bypass")), end_section=True,
        )
    console.print(table)


# --------------------------------------------------------------------------------------- artefacts
def to_document(result: RegressionResult, rtol: float | None = None) -> dict[str, Any]:
    """The JSON document: spec, per-mode results, verdicts, exit code, notes, versions."""
    doc = result.to_dict()
    doc["verdicts"] = {name: {**asdict(v), "ok": v.ok} for name, v in verdicts(result, rtol).items()}
    doc["fault_reproduced"] = fault_reproduced(result, rtol)
    if "field" in result.modes:
        doc["field_fault_reproduced"] = fault_reproduced(result, rtol, "field")
    doc["exit_code"] = exit_code(result, rtol)
    return doc


def write_json(result: RegressionResult, path: str, rtol: float | None = None) -> None:
    """Write :func:`to_document` to ``path`` (infinities as strings)."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as f:
        json.dump(clean(to_document(result, rtol)), f, indent=2)
        f.write("\n")


def write_plot(result: RegressionResult, path: str, rtol: float | None = None) -> None:
    """Write a PNG of the loss per step per mode; a failed mode ends with an ``x`` at its last step."""
    matplotlib = require("matplotlib", "cli", "the regression's --plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = verdicts(result, rtol)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = {"no-ac": ("black", "-", 3.0), "shared": ("tab:red", "--", 1.5),
              "isolated": ("tab:green", "-", 1.5), "global-disable": ("tab:blue", ":", 2.0)}
    for name, mode in result.modes.items():
        color, line, width = styles.get(name, ("gray", "-", 1.0))
        label = f"{name}: {found[name].text}"
        if len(label) > 70:
            label = label[:67] + "..."
        label = label.replace("$", r"\$")  # foreign text: a '$' would start matplotlib's mathtext
        steps = list(range(len(mode.losses)))
        if steps:
            ax.plot(steps, mode.losses, line, color=color, linewidth=width, marker="o", markersize=4, label=label)
        else:
            ax.plot([], [], line, color=color, label=label)
        if mode.error is not None and steps:
            ax.plot([steps[-1] + 0.5], [mode.losses[-1]], "x", color=color, markersize=10)
    spec = result.spec
    policy = f" ({spec.policy})" if spec.ac == "selective" else ""
    ax.set_title(f"{spec.model}, {_parallelism(spec)}, AC {spec.ac}{policy}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_xticks(range(spec.steps))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
