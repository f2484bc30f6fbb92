"""``fla-ac-isolation doctor``: the environment facts that decide whether and how the FLA cache fault can appear
(the report is :func:`fla_ac_isolation.environment.environment_report`; this module renders it)."""

from __future__ import annotations

import argparse

from fla_ac_isolation.cli.console import console, escape
from fla_ac_isolation.environment import environment_report

__all__ = ["HELP", "add_arguments", "run"]

HELP = "versions, device, FLA cache state, torch's SAC replay semantics and missing torch features"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``doctor`` subcommand takes no options."""
    parser.description = (
        "Print versions, device, FLA cache state, torch's SAC replay semantics and the features the installed "
        "torch lacks (fla_ac_isolation.environment)."
    )


def run(args: argparse.Namespace) -> int:
    """Print :func:`fla_ac_isolation.environment.environment_report` as a table; return 0."""
    out = console("fla-ac-isolation doctor")
    from rich.table import Table

    table = Table(title="fla-ac-isolation doctor", show_header=False)
    for key, value in environment_report().items():
        table.add_row(escape(key), escape(value))  # versions and device names are foreign text
    out.print(table)
    return 0
