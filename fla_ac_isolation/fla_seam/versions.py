"""Version facts about the installed FLA: its version and the range this package is tested with."""

from __future__ import annotations

import importlib.metadata
import re

__all__ = ["fla_version", "tested_range"]


def tested_range() -> str:
    """The fla-core range this package requires (read from its installed metadata), or ``"unknown (...)"``."""
    try:
        requirements = importlib.metadata.requires("fla-ac-isolation") or []
    except importlib.metadata.PackageNotFoundError:
        return "unknown (fla-ac-isolation is not installed)"
    for requirement in requirements:
        match = re.fullmatch(r"fla-core\s*([^;]*?)\s*(;.*)?", requirement.strip())
        if match:
            return match.group(1) or "any"
    return "unknown (no fla-core requirement in fla-ac-isolation's metadata)"


def fla_version() -> str | None:
    """Version of the installed ``fla-core`` (or ``flash-linear-attention``) distribution, or ``None``."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
