"""What the subcommands share: the rich console, escaping of foreign text, the policy and mode arguments."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fla_ac_isolation.extras import require

__all__ = ["add_policy_arguments", "console", "escape", "parse_modes"]


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


def parse_modes(value: str, allowed: tuple[str, ...], flag: str = "--modes") -> list[str]:
    """Split a comma-separated ``--modes`` value and check every entry against ``allowed``.

    Raises:
        ValueError: naming ``flag`` and the allowed modes, for an empty value or an unknown mode.
    """
    modes = [m.strip() for m in value.split(",") if m.strip()]
    if not modes or any(m not in allowed for m in modes):
        raise ValueError(f"{flag} must be a non-empty subset of {', '.join(allowed)}, got {value!r}")
    return modes


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ac full|selective``, ``--policy`` (choices: :data:`fla_ac_isolation.policies.POLICIES`) and ``--freq``."""
    from fla_ac_isolation.policies import POLICIES

    parser.add_argument("--ac", choices=("full", "selective"), default="selective", help="activation checkpointing")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="save-all-copies",
                        help="SAC policy (with --ac selective)")
    parser.add_argument("--freq", type=int, choices=(1, 2, 4), default=1, help="checkpoint every N-th block")
