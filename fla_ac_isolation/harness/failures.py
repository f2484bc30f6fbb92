"""How a failure is reported in one line: ``"<ExceptionType>: <first line of its message>"``.

The regression, the audit command and the fault stack catch errors that the unsafe mode raises on
purpose (and any other) and report them next to their verdicts; they all use :func:`first_line`, so a
report, a JSON document and a test see the same text. The text is the error's own: whoever prints it
with markup (``rich``) must escape it (:func:`fla_ac_isolation.harness.cli.console.escape`).
"""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(err: BaseException) -> str:
    """``"<Type>: <first non-empty line of str(err)>"``, or ``"<Type>"`` for an empty message."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
