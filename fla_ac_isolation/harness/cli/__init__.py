"""The ``fla-ac-isolation`` command: ``doctor | regress | audit | check``, one module each with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> exit code``. Needs the ``cli`` extra (``regress`` and the family models
of ``audit`` also ``ep``); a missing extra is reported with its ``pip install`` (exit code 2)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fla_ac_isolation import __version__
from fla_ac_isolation.harness.cli import audit, check, doctor, regress
from fla_ac_isolation.harness.extras import MissingExtraError

__all__ = ["main"]

_SUBCOMMANDS = {"doctor": doctor, "regress": regress, "audit": audit, "check": check}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser = argparse.ArgumentParser(
        prog="fla-ac-isolation",
        description="Make FLA layers safe under activation checkpointing: check, regress, audit.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    args = parser.parse_args(argv)
    try:
        return int(_SUBCOMMANDS[args.command].run(args) or 0)
    except MissingExtraError as err:
        print(f"fla-ac-isolation {args.command}: error: {err}", file=sys.stderr)
        return 2

