"""The ``fla-ac-isolation`` command: ``doctor | regress | audit | check``, each subcommand in its own module.

* :mod:`~fla_ac_isolation.harness.cli.doctor` - versions, device, FLA cache state, SAC replay semantics;
* :mod:`~fla_ac_isolation.harness.cli.regress` - the EP regression (:mod:`fla_ac_isolation.harness.regression`),
  rendered by
  :mod:`~fla_ac_isolation.harness.cli.regress_render`;
* :mod:`~fla_ac_isolation.harness.cli.audit` - one step of a tiny model under :class:`~fla_ac_isolation.ReplayAudit`
  (:mod:`fla_ac_isolation.harness.audit_runner`);
* :mod:`~fla_ac_isolation.harness.cli.check` - one step of the user's own model (or a tiny transformers / FLA one) under
  the audit, its FLA-backed classes and the fix (:mod:`fla_ac_isolation.harness.check_runner`);
* :mod:`~fla_ac_isolation.harness.cli.console` - what they share: the console, the policy flags, foreign-text escaping.

Each subcommand module has ``HELP`` (its line in ``--help``), ``add_arguments(parser)`` and
``run(args) -> exit code``: it parses the flags into the Python API's spec (whose defaults and rules, with
their messages, are the command's), checks only what a command has (output paths) and renders the data the
API returns; this module only parses and dispatches. The command needs the ``cli`` extra (rich,
matplotlib); ``regress`` and the family models of ``audit`` also need ``ep`` (torchtitan). A missing extra
is reported with the ``pip install`` that brings it (exit code 2).
"""

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

