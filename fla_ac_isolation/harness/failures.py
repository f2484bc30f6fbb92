"""How a failure is reported in one line, the same in every report; it is raw text (escape it for rich)."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(err: BaseException) -> str:
    """``"<Type>: <first non-empty line of str(err)>"``, or ``"<Type>"`` for an empty message."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
