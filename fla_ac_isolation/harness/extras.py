"""Optional dependencies (extras ``cli``, ``ep``, ``hf``, ``test``, ``docs``) and :class:`MissingExtraError`, which
names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is missing; the message names the ``pip install`` that brings it."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, or explain which extra brings it.

    Args:
        module: the module to import (``"rich.console"``, ``"torchtitan"``).
        extra: the extra that installs it (``"cli"``, ``"ep"``, ``"hf"``).
        what: what needs it, for the message.

    Raises:
        MissingExtraError: ``module``'s distribution is not installed (an import error inside an installed
            module is re-raised unchanged).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        top = module.split(".")[0]
        if err.name is None or err.name.split(".")[0] != top:
            raise
        raise MissingExtraError(
            f"{what} needs {top}, which is not installed: pip install 'fla-ac-isolation[{extra}]'", name=err.name
        ) from err
