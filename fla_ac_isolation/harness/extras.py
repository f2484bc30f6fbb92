"""Optional dependencies and the error that names the extra to install.

``pip install fla-ac-isolation`` brings torch and fla-core: enough for
:class:`~fla_ac_isolation.LayerLocalSeqlens`, the SAC policies, :class:`~fla_ac_isolation.ReplayAudit`, the
ops and the mixers. The rest comes with extras:

* ``cli`` - rich and matplotlib: the ``fla-ac-isolation`` command's tables, progress bars and plots;
* ``ep`` - torchtitan (and transformers, for the model configs): the EP regression, ``regress`` and
  ``audit --model <family>``, :class:`~fla_ac_isolation.policies.torchtitan_selective`;
* ``hf`` - transformers, for :func:`~fla_ac_isolation.swap_mixers` on transformers models;
* ``test`` and ``docs`` - what the project's tests and documentation site need.

:func:`require` imports an optional module or raises :class:`MissingExtraError` naming the extra.
"""

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
        extra: the extra of this package that installs it (``"cli"``, ``"ep"``, ``"hf"``).
        what: what needs it, for the message (``"fla-ac-isolation regress"``).

    Raises:
        MissingExtraError: ``module``'s distribution is not installed. An import error raised *inside*
            an installed module is re-raised unchanged.
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
