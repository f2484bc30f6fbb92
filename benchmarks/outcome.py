"""Whether a benchmark ran anything: its failures counted, what was missing named, its exit code (every script).

A script that records failures and goes on hands :func:`finish` what ran and one error line per failed cell (or
mode); a ``main`` whose first error ends the run is wrapped in :func:`stops_on_missing_module`. Exit codes of every
script (:data:`EPILOG`, in each ``--help``): 0 when something ran; the failures, if any, are counted under the table
(a failed mode is a result, as the unsafe path's is); 1 when nothing ran (every cell or mode failed or was skipped)
or a missing module stopped the run: the distinct error lines are printed with the ``pip install`` of each
missing module (:func:`fla_ac_isolation.harness.extras.install_hint`); 2 for invalid arguments (argparse).
"""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fla_ac_isolation.harness.extras import install_hint, missing_modules
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.modes import modes_with_role

__all__ = ["EPILOG", "Outcome", "by_mode", "finish", "stopped", "stops_on_missing_module"]

EPILOG = ("exit codes: 0 something ran (failed cells or modes, if any, are counted under the table); 1 nothing ran "
          "(every cell or mode failed or was skipped) or a missing module stopped the run: the distinct errors and "
          "the pip install of each missing module are printed; 2 invalid arguments")


@dataclass(frozen=True)
class Outcome:
    """What one run of a script did, in ``unit`` (``"cells"``, ``"modes"``): ``ran`` of them gave a result,
    ``failed`` holds one error text per failed one (repeats allowed; its first line is shown), ``skipped`` were not
    started."""

    ran: int
    failed: Sequence[str] = ()
    skipped: int = 0
    unit: str = "cells"

    @property
    def exit_code(self) -> int:
        """0 when anything ran, else 1."""
        return 0 if self.ran else 1

    def lines(self, script: str) -> list[str]:
        """What to print: nothing when everything ran; the counts when some failed or were skipped; otherwise that
        nothing ran, each distinct error's first line once (with its count) and what to install."""
        if self.ran and not self.failed and not self.skipped:
            return []
        total = self.ran + len(self.failed) + self.skipped
        if not total:
            return [f"{script}: nothing ran: no {self.unit} to run"]
        counted = ", ".join(f"{n} {what}" for n, what in ((self.ran, "ran"), (len(self.failed), "failed"),
                                                          (self.skipped, "skipped")) if n)
        if self.ran:
            listed = ", the failures are listed above" if self.failed else ""
            return [f"{script}: of {total} {self.unit}, {counted} (exit code 0{listed})"]
        head = f"{script}: nothing ran: of {total} {self.unit}, {counted}"
        counts = collections.Counter(_first_line(text) for text in self.failed)
        errors = [f"  {line}" + (f" (x{n})" if n > 1 else "") for line, n in counts.items()]
        return [head + (":" if counts else ""), *errors, *_missing_lines("\n".join(self.failed))]


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


def by_mode(runs: Iterable[tuple[str, str | None]], unit: str) -> Outcome:
    """The :class:`Outcome` of ``(mode, error or None)`` per run; the runs of an unsafe mode (``shared``, role
    ``unsafe`` in :mod:`fla_ac_isolation.harness.modes`) are not counted: their failure is the fault shown."""
    unsafe = modes_with_role("unsafe")
    errors = [error for mode, error in runs if mode not in unsafe]
    return Outcome(errors.count(None), [e for e in errors if e is not None], unit=f"{unit} (unsafe modes not counted)")


def _missing_lines(text: str) -> list[str]:
    """One line per module that ``text`` says is missing, with the ``pip install`` that brings it."""
    return [f"  missing module {name}: {install_hint(name)}" for name in missing_modules(text)]


def finish(script: str, outcome: Outcome) -> int:
    """Print ``outcome``'s lines (nothing ran: to stderr) and return its exit code."""
    for line in outcome.lines(script):
        print(line, file=sys.stderr if outcome.exit_code else sys.stdout, flush=True)
    return outcome.exit_code


def stopped(script: str, error: str) -> int:
    """Say that ``error`` (its text: one line, or another process's traceback) stopped the run, naming each missing
    module and its install; return 1."""
    print(f"{script}: stopped: {error}", file=sys.stderr)
    for line in _missing_lines(error):
        print(line, file=sys.stderr)
    sys.stderr.flush()
    return 1


def stops_on_missing_module(script: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a script's ``main(argv=None) -> int``: a ``ModuleNotFoundError`` out of it is reported by
    :func:`stopped` (exit code 1) instead of a traceback; any other error propagates as before."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None) -> int:
            try:
                return main(argv)
            except ModuleNotFoundError as err:
                return stopped(script, first_line(err))

        return run

    return wrap
