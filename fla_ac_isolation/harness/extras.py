"""Optional dependencies (extras ``cli``, ``ep``, ``hf``, ``test``, ``docs``) and :class:`MissingExtraError`, which
names the extra to install; what a failure's text says is missing (:func:`missing_modules`) and the ``pip install``
that brings it (:func:`install_hint`)."""

from __future__ import annotations

import importlib
import re
from types import ModuleType

__all__ = ["MissingExtraError", "install_hint", "missing_modules", "require"]

_EXTRA_OF = {"rich": "cli", "matplotlib": "cli", "torchtitan": "ep", "spmd_types": "ep", "transformers": "hf"}
"""Top-level module -> the extra of pyproject.toml that installs it (transformers: ``hf``, the smaller of two)."""
_DISTRIBUTION_OF = {"fla": "fla-core"}
"""Top-level modules whose distribution has another name (those this package depends on)."""
_MISSING = re.compile(r"No module named '([^']+)'|import of (\S+) halted")
"""Python's words for a module that is not installed, or blocked (``sys.modules[name] = None``)."""


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


def install_hint(module: str) -> str:
    """The ``pip install`` that brings ``module`` (its top-level package): this package's extra for an optional
    dependency (``torchtitan`` -> ``pip install 'fla-ac-isolation[ep]'``), else the distribution of the module's
    name (``tyro`` -> ``pip install tyro``; a module whose distribution is named otherwise is not known here)."""
    top = module.split(".")[0]
    if top in _EXTRA_OF:
        return f"pip install 'fla-ac-isolation[{_EXTRA_OF[top]}]'"
    return f"pip install {_DISTRIBUTION_OF.get(top, top)}"


def missing_modules(text: str) -> list[str]:
    """The modules that ``text`` (an error's text, a traceback, another process's report) says are not installed
    (Python's ``No module named 'x'``, or ``import of x halted`` for a blocked one), in order, each once."""
    found = (a or b for a, b in _MISSING.findall(text))
    return list(dict.fromkeys(found))
