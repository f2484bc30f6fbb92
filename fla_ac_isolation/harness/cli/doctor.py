"""``fla-ac-isolation doctor``: renders :func:`~fla_ac_isolation.harness.environment.environment_report` and
:func:`~fla_ac_isolation.harness.environment.fla_backed_classes`."""

from __future__ import annotations

import argparse

from fla_ac_isolation.harness.cli.console import console, escape
from fla_ac_isolation.harness.environment import environment_report, fla_backed_classes

__all__ = ["HELP", "add_arguments", "run"]

HELP = ("versions, device, FLA cache state, torch's SAC replay semantics, whether the audit sees checkpoints, missing "
        "torch features and the installed FLA-backed classes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``doctor`` subcommand takes no options."""
    parser.description = (
        "Print versions, device, FLA cache state, torch's SAC replay semantics, whether ReplayAudit sees "
        "checkpoints on this torch (a self-probe of a few milliseconds) and the features the installed "
        "torch lacks, then the FLA-backed classes of the installed libraries (transformers, flash-linear-attention, "
        "torchtitan, OLMo-core) with their status: covered by isolate_seqlens, or leaking across packed documents "
        "(and whether swap_mixers has a drop-in) (fla_ac_isolation.harness.environment)."
    )


def run(args: argparse.Namespace) -> int:
    """Print the environment report as a table; return 0."""
    out = console("fla-ac-isolation doctor")
    from rich.table import Table

    table = Table(title="fla-ac-isolation doctor", show_header=False)
    for key, value in environment_report().items():
        table.add_row(escape(key), escape(value))  # versions and device names are foreign text
    out.print(table)
    classes = Table(title="FLA-backed classes of the installed libraries")
    for column in ("library", "class", "status"):
        classes.add_column(column)
    rows = fla_backed_classes()
    for row in rows:
        if row.installed:
            classes.add_row(escape(row.framework), escape(row.name), escape(row.status))
    missing = sorted({row.framework for row in rows if not row.installed})
    out.print(classes)
    if missing:
        out.print(f"not installed: {escape(', '.join(missing))}")
    return 0
