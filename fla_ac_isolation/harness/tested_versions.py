"""The newest release of each upstream that CI has passed with, for ``doctor`` to say when an installed one is
newer. Updated with each release of this package (``docs/versions.md`` holds the whole matrix)."""

from __future__ import annotations

import re

__all__ = ["CI_PASSED", "newer_than_tested", "release"]

CI_PASSED: dict[str, str] = {
    "torch": "2.15.0",
    "triton": "3.9.0",
    "fla-core": "0.6.0",
    "flash-linear-attention": "0.6.0",
    "transformers": "5.25.0",
    "torchtitan": "0.3.0",
    "ai2-olmo-core": "3.0.0",
}
"""``{distribution: version}``: the newest release of each that one of CI's jobs passed with."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers of ``version`` (``"2.13.0+cpu"`` -> ``(2, 13, 0)``; a pre-release counts as its release).

    Raises:
        ValueError: ``version`` does not start with a number.
    """
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        raise ValueError(f"version must start with a release number (e.g. '2.13.0'), got {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def newer_than_tested(installed: dict[str, str]) -> dict[str, str]:
    """``{distribution: tested version}`` for each of ``installed`` (``{distribution: version}``) newer than
    :data:`CI_PASSED` holds; distributions the table does not hold are left out."""
    return {name: CI_PASSED[name] for name, version in installed.items()
            if name in CI_PASSED and release(version) > release(CI_PASSED[name])}
