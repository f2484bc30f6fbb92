"""What the subcommands share: the rich console, escaping of foreign text, the policy arguments, ``--modes``
splitting."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fla_ac_isolation.harness.extras import require

__all__ = ["add_policy_arguments", "console", "escape", "split_modes"]


def console(what: str) -> Any:
    """A ``rich`` console; wide (160 columns) when writing to a pipe or CI log, where rich assumes 80.

    Raises:
        MissingExtraError: rich is not installed (the ``cli`` extra).
    """
    rich_console = require("rich.console", "cli", what)
    return rich_console.Console() if sys.stdout.isatty() else rich_console.Console(width=160)


def escape(text: str) -> str:
    """``text`` with rich markup escaped, so foreign text (error messages, paths) prints as it is."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def split_modes(value: str) -> tuple[str, ...]:
    """The entries of a comma-separated ``--modes`` value, stripped (empty entries dropped); which modes a
    command takes is the Python API's rule, checked there."""
    return tuple(m.strip() for m in value.split(",") if m.strip())


def add_policy_arguments(parser: argparse.ArgumentParser, default: dict) -> None:
    """``--ac full|selective``, ``--policy`` (choices: :data:`fla_ac_isolation.policies.POLICIES`) and ``--freq``,
    with the ``ac``, ``policy`` and ``freq`` defaults of the command's spec (``default``)."""
    from fla_ac_isolation.policies import POLICIES

    parser.add_argument("--ac", choices=("full", "selective"), default=default["ac"], help="activation checkpointing")
    parser.add_argument("--policy", choices=sorted(POLICIES), default=default["policy"],
                        help="SAC policy (with --ac selective)")
    parser.add_argument("--freq", type=int, choices=(1, 2, 4), default=default["freq"],
                        help="checkpoint every N-th block")
