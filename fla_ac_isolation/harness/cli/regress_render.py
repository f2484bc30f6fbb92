"""How ``fla-ac-isolation regress`` shows a run (rich table, verdict lines, JSON file, loss plot); render only."""

from __future__ import annotations

import json
import math

from fla_ac_isolation.harness.cli.console import escape
from fla_ac_isolation.harness.extras import install_hint, missing_modules, require
from fla_ac_isolation.harness.regression.report import (
    REQUIRED,
    UNSAFE,
    Verdict,
    fault_reproduced,
    to_document,
    verdicts,
)
from fla_ac_isolation.harness.regression.spec import CP1_REFERENCE, PP1_REFERENCE, RegressionResult, RegressionSpec

__all__ = ["parallelism", "print_report", "write_json", "write_plot"]


def _fmt(x: float | None, spec: str = ".6g") -> str:
    return "-" if x is None else format(x, spec)


def print_report(result: RegressionResult, *, rtol: float | None = None, verbose: bool = False, console=None) -> None:
    """Print the header, the per-step table, the verdict summary and (``verbose``) FLA cache counts; foreign
    strings are escaped from rich markup.

    Raises:
        ValueError: ``rtol`` is negative or not a number.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    spec = result.spec
    found = verdicts(result, rtol)
    ac = "full" if spec.ac == "full" else f"selective, policy {spec.policy_name}"
    title = (
        f"{spec.model}  {parallelism(spec)}  AC {ac}, every {spec.freq} block(s)  backend={spec.backend}  "
        f"{spec.device}/{spec.dtype}  hidden={spec.hidden_size}  {spec.num_experts} experts top-{spec.top_k}"
    )
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    seconds = ", ".join(f"{name} {mode.seconds:.1f}" for name, mode in result.modes.items())
    under = " (under PP: no-ac under the same schedule)" if spec.pp > 1 else ""
    counted = " (under PP, padding and torch's shape-inference pass count as tokens)" if spec.pp > 1 else ""
    without = "PP" if spec.pp > 1 else ("CP" if spec.cp > 1 else None)
    judged = (
        f" max |grad - {without}=1|: the same to the one-rank run without {without} (no-ac-{without.lower()}1), per "
        f"step; the verdict (vs {without}=1) judges the gradients at step 0 only, relative to the largest "
        f"{without}=1 gradient, and the loss at every step: AdamW's first update amplifies rounding, so later "
        "steps can exceed the tolerance;"
        if without else "")
    caption = (
        f"max |grad - ref|: largest gradient difference to no-ac{under} over all ranks and parameters;{judged} idle "
        f"experts: most experts without any token in one MoE layer (all ranks){counted}.\nSeconds per mode: {seconds}."
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
    """One line per reference that failed (nothing is judged against it), per required mode (PASS/FAIL) and per
    unsafe mode (whether it reproduced the fault); then each module the failures say is missing, with its install."""
    for name in ("no-ac", CP1_REFERENCE, PP1_REFERENCE):
        if name in found and not found[name].ok:
            label = escape(name + " (reference)")
            console.print(f"{label:>15}: [red]FAIL[/red]  {escape(found[name].text)}  (nothing is judged against it)")
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
    for name in missing_modules("\n".join(mode.error or "" for mode in result.modes.values())):
        console.print(f"missing module {escape(name)}: {escape(install_hint(name))}")


def _add_rows(table, result: RegressionResult, found: dict[str, Verdict]) -> None:
    """One row per mode and step."""
    cp, pp = result.spec.cp > 1, result.spec.pp > 1
    columns = [("mode", "left"), ("step", "right"), ("loss", "right"), ("grad norm", "right"),
               ("max |grad - ref|", "right"), ("idle experts", "right"), ("verdict", "left")]
    if cp:
        columns.insert(5, ("max |grad - CP=1|", "right"))
    if pp:
        columns.insert(5, ("max |grad - PP=1|", "right"))
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for name, mode in result.modes.items():
        verdict = found[name]
        text = escape(verdict.text)
        style = {"matches": "green", "reference": "cyan", "failed": "red", "diverged": "red",
                 "incomplete": "red"}.get(verdict.status, "")
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
            if pp:
                cells.insert(5, _fmt(mode.pp1_grad_diffs[i], ".3e") if done and i < len(mode.pp1_grad_diffs) else "-")
            table.add_row(*cells, end_section=i == rows - 1)


def parallelism(spec: RegressionSpec) -> str:
    """The run's layout, e.g. ``EP=2``, ``CP=2 (zigzag) x EP=2`` or ``PP=2 (1f1b, 4 microbatches), EP=1``."""
    mesh = spec.mesh
    if mesh.pp > 1:
        pp = f"PP={mesh.pp} ({spec.schedule}, {spec.microbatches} microbatches)"
        return f"{pp} x EP={mesh.ep}" if mesh.ep > 1 else f"{pp}, EP=1"
    if mesh.cp == 1:
        return f"EP={mesh.ep}"
    cp = f"CP={mesh.cp} ({spec.cp_layout})"
    return f"{cp} x EP={mesh.ep}" if mesh.ep > 1 else f"{cp}, EP=1"


def _print_cache(result: RegressionResult, console) -> None:
    from rich.table import Table

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


def write_json(result: RegressionResult, path: str, rtol: float | None = None) -> None:
    """Write :func:`~fla_ac_isolation.harness.regression.report.to_document` to ``path`` (infinities as strings)."""

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
    policy = f" ({spec.policy_name})" if spec.ac == "selective" else ""
    ax.set_title(f"{spec.model}, {parallelism(spec)}, AC {spec.ac}{policy}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_xticks(range(spec.steps))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
