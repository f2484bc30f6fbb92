"""What a page shows a command printing must be what it prints: the ```text blocks of the docs, compared with
the output of the test that runs the same command.

A block is found by its first line: a command (``$ python examples/own_model.py``), or, for the output of a
python block on the page, its first printed line. Every printed line of the block, up to the next ``$ ...``
command, must appear in the printed output, in order (the output may hold more lines: warnings, progress). A line matches
when its words match and each number matches at the precision the page shows it: ``5.025542`` is checked to 6
decimals, ``1.1e-07`` to 2 significant digits, ``4`` exactly. A page whose numbers vary in their last digits
across CPUs prints fewer digits and says so; a test may instead check fewer (``significant=``), and the page
then says how many are checked. A number that is rounding noise (a difference between two summation orders)
is named by its label (``varies=``): the page gives the range seen and the test bounds it. Lines naming wall
times are left out by the caller (``skip=``). A page line ending in ``...`` (pytest's summary line cut to the
terminal's width) matches a printed line that starts with its text: pytest does not cut them when ``CI`` is set.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["assert_printed_as_on_page", "page_block"]

ROOT = Path(__file__).resolve().parents[1]

# a number not glued to a word on its left (int32, qwen3_5 and layers.0's "0" after a dot stay words)
_NUMBER = re.compile(r"(?<![A-Za-z_\d.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\d])")


def page_block(page: str | Path, first_line: str) -> list[str]:
    """The lines of the ```text block of ``page`` (relative to the repository) whose first line is ``first_line``.

    Raises:
        AssertionError: no such block, or more than one.
    """
    text = (ROOT / page).read_text()
    blocks = re.findall(r"^```text\n(.*?)^```", text, re.S | re.M)
    found = [b.splitlines() for b in blocks if b.splitlines() and b.splitlines()[0] == first_line]
    assert len(found) == 1, f"{page}: {len(found)} ```text blocks start with {first_line!r}"
    return found[0]


def _skeleton(line: str) -> str:
    return " ".join(_NUMBER.sub("#", line).split())


def _same_number(shown: str, printed: str, significant: int | None) -> bool:
    if significant is not None:
        try:
            return float(f"{float(shown):.{significant - 1}e}") == float(f"{float(printed):.{significant - 1}e}")
        except ValueError:
            return False
    if not re.search(r"[.e]", shown):
        return shown == printed
    value = float(printed)
    if "e" in shown:
        mantissa = shown.split("e")[0].lstrip("+-")
        digits = len(mantissa.replace(".", "")) - 1
        return float(f"{value:.{digits}e}") == float(shown)
    decimals = len(shown.split(".")[1])
    return f"{value:.{decimals}f}" == shown or float(f"{value:.{decimals}f}") == float(shown)


def _hide_varying(line: str, varies: tuple[str, ...]) -> str:
    for label in varies:
        line = re.sub(re.escape(label) + r"\s*" + _NUMBER.pattern, label + " (varies)", line)
    return line


def _matches(shown: str, printed: str, significant: int | None, varies: tuple[str, ...] = ()) -> bool:
    if shown.endswith("...") and not printed.endswith("...") and len(printed) > len(shown) - 3:
        # pytest cuts its short summary lines to the terminal's width with "..." (not where the environment
        # says it is CI): a page line cut so matches the printed line that starts with its text
        printed = printed[: len(shown) - 3] + "..."
    shown, printed = _hide_varying(shown, varies), _hide_varying(printed, varies)
    if _skeleton(shown) != _skeleton(printed):
        return False
    pairs = zip(_NUMBER.findall(shown), _NUMBER.findall(printed), strict=True)
    return all(_same_number(a, b, significant) for a, b in pairs)


def assert_printed_as_on_page(
    printed: str,
    page: str | Path,
    first_line: str,
    *,
    significant: int | None = None,
    skip: tuple[str, ...] = (),
    varies: tuple[str, ...] = (),
) -> None:
    """Every line of the page's block (after its first line, up to the next ``$ ...`` command line; blank lines
    and lines holding a ``skip`` text left out) is a line of ``printed``, in order, with equal numbers at the page's precision
    (or at ``significant`` digits). The number right after a ``varies`` label is not compared: rounding noise
    whose value differs between CPUs, which the page says (with the range seen) and the test bounds.

    Raises:
        AssertionError: naming the first page line not printed, with the printed line of the same words.
    """
    lines = [" ".join(line.split()) for line in printed.splitlines()]
    at = 0
    block = page_block(page, first_line)
    for shown in block[1:] if first_line.startswith("$ ") else block:
        if shown.startswith("$ "):  # the next command: its output is not this run's
            break
        if not shown.strip() or any(s in shown for s in skip):
            continue
        shown = " ".join(shown.split())
        hit = next((i for i in range(at, len(lines)) if _matches(shown, lines[i], significant, varies)), None)
        if hit is None:
            same_words = [line for line in lines if _skeleton(line) == _skeleton(shown)]
            raise AssertionError(
                f"{page} ({first_line}) shows\n  {shown}\nbut the run printed "
                + (f"\n  {same_words[0]}" if same_words else "no line with these words")
            )
        at = hit + 1
