"""Command line: ``fla-ac-isolation doctor | regress | audit``.

Each subcommand lives in the module that owns its work; this file only parses arguments and dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]

# subcommand name -> (module, function that adds its arguments, function that runs it)
_SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "doctor": ("fla_ac_isolation.cli", "_doctor_args", "_doctor"),
    "regress": ("fla_ac_isolation.regression.cli", "add_arguments", "run"),
    "audit": ("fla_ac_isolation.audit_cli", "add_arguments", "run"),
}


def _doctor_args(parser: argparse.ArgumentParser) -> None:
    parser.description = "Print versions, device, FLA cache state and torch's SAC replay semantics."


def _doctor(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from fla_ac_isolation.doctor import environment_report

    table = Table(title="fla-ac-isolation doctor", show_header=False)
    for key, value in environment_report().items():
        table.add_row(key, value)
    Console().print(table)
    return 0


def _resolve(module: str, name: str) -> Callable:
    import importlib

    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fla-ac-isolation",
        description="Make FLA layers safe under activation checkpointing: check, regress, audit.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    available = {}
    for name, (module, add_args, run) in _SUBCOMMANDS.items():
        try:
            adder = _resolve(module, add_args)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # subcommand not part of this build yet
        adder(sub.add_parser(name))
        available[name] = (module, run)
    args = parser.parse_args(argv)
    module, run = available[args.command]
    return int(_resolve(module, run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
