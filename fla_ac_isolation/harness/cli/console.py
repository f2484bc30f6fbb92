"""What the subcommands share: the rich console, escaping, the ``--model`` and policy arguments, ``--modes``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fla_ac_isolation.harness.extras import require

__all__ = ["FULL_AC_POLICY", "add_model_argument", "add_policy_arguments", "console", "escape", "given_policy",
           "split_modes"]

FULL_AC_POLICY = ("--policy {policy} was given with --ac full: full AC recomputes every op and saves none, so a SAC "
                  "policy has nothing to choose: drop --policy, or use --ac selective to apply it")


def console(what: str) -> Any:
    """A ``rich`` console; 160 columns wide when writing to a pipe.

    Raises:
        MissingExtraError: rich is not installed (the ``cli`` extra).
    """
    rich_console = require("rich.console", "cli", what)
    return rich_console.Console() if sys.stdout.isatty() else rich_console.Console(width=160)


def escape(text: str) -> str:
    """``text`` with rich markup escaped, so foreign text prints as it is."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def split_modes(value: str) -> tuple[str, ...]:
    """The stripped, non-empty entries of a comma-separated ``--modes`` value."""
    return tuple(m.strip() for m in value.split(",") if m.strip())


def add_policy_arguments(parser: argparse.ArgumentParser, default: dict) -> None:
    """``--ac``, ``--policy`` (a name, or the user's own as ``module:callable`` / ``file.py:callable``) and, where
    ``default`` has one, ``--freq``, with the defaults of ``default``. ``--policy`` has no parsed default (the
    specs' ``None``, :data:`~fla_ac_isolation.harness.spec_fields.DEFAULT_POLICY` under ``--ac selective``): read
    it with :func:`given_policy`, which refuses it with ``--ac full``."""
    from fla_ac_isolation.harness.spec_fields import DEFAULT_POLICY
    from fla_ac_isolation.policies import POLICIES

    parser.add_argument("--ac", choices=("full", "selective"), default=default["ac"], help="activation checkpointing")
    shared = (f"(default: {DEFAULT_POLICY}); refused with --ac full, which recomputes every op and saves none")
    parser.add_argument("--policy", default=argparse.SUPPRESS, metavar="{" + ",".join(sorted(POLICIES)) + "} or "
                        "module:callable", help="SAC policy of --ac selective: a name, or your own policy "
                        "function (ctx, op, *args, **kwargs) -> CheckpointPolicy as module:callable or "
                        f"path/to/file.py:callable {shared}")
    if "freq" in default:
        parser.add_argument("--freq", type=int, choices=(1, 2, 4), default=default["freq"],
                            help="checkpoint every N-th block")


def given_policy(args: argparse.Namespace, error: type[ValueError] = ValueError) -> str | None:
    """The ``--policy`` of parsed ``args``; ``None`` when it was not given (the command's default policy applies
    under ``--ac selective``).

    Raises:
        error: ``--policy`` was given with ``--ac full`` (:data:`FULL_AC_POLICY`): full AC saves no op, so the
            policy would be ignored.
    """
    policy = getattr(args, "policy", None)
    if policy is not None and args.ac == "full":
        raise error(FULL_AC_POLICY.format(policy=policy))
    return policy


def add_model_argument(parser: argparse.ArgumentParser, names: tuple[str, ...], command: str, default: str,
                       what: str) -> None:
    """``--model``: one of ``names`` (built-in only; a ``module:callable`` is refused, naming ``check``)."""

    def model(value: str) -> str:
        if ":" in value:
            raise argparse.ArgumentTypeError(
                f"{command} runs the built-in tiny models only ({', '.join(names)}), got {value!r}: to run your "
                f"own model, use: fla-ac-isolation check --model {value}")
        if value not in names:
            from fla_ac_isolation.harness.foreign_models import tiny_names

            if value in tiny_names():
                raise argparse.ArgumentTypeError(
                    f"{command} runs the built-in tiny models only ({', '.join(names)}); {value!r} is a tiny "
                    f"transformers / flash-linear-attention model that check runs: fla-ac-isolation check --model "
                    f"{value}")
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {value!r}")
        return value

    parser.add_argument("--model", type=model, default=default, metavar="{" + ",".join(names) + "}",
                        help=f"the model to run: {what} (your own model: check --model module:callable)")
