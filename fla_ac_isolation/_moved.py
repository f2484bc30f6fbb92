"""The 0.3 import paths of moved modules (:data:`MOVED`), kept as deprecated aliases: importing an old path warns
and gives the very module at its new path (submodules follow; ``python -m`` works too). The only library module
that names harness modules, imported only when an old path is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["MOVED", "MovedModuleFinder", "deprecation_message", "install_aliases", "new_path"]

PACKAGE = __name__.rpartition(".")[0]

# 0.3 path -> current path, both relative to the package
MOVED: dict[str, str] = {
    "audit_runner": "harness.audit_runner",
    "check_runner": "harness.check_runner",
    "cli": "harness.cli",
    "environment": "harness.environment",
    "extras": "harness.extras",
    "failures": "harness.failures",
    "fault_stack": "harness.fault_stack",
    "fla_seam.custom_ops": "ops.saveable",
    "fla_seam.interpreter": "harness.fla_seam.interpreter",
    "fla_seam.kernels": "ops",
    "fla_seam.models": "harness.fla_seam.models",
    "fla_seam.served_ops": "harness.fla_seam.served_ops",
    "fla_seam.serving": "harness.fla_seam.serving",
    "foreign_models": "harness.foreign_models",
    "modes": "harness.modes",
    "ops.reference_ops": "ops.saveable",
    "reference_kernels": "harness.reference_kernels",
    "regression": "harness.regression",
    "testing": "harness.testing",
}


def new_path(old: str) -> str | None:
    """The current absolute module path of the 0.3 module path ``old``, or ``None`` when ``old`` did not move."""
    prefix = PACKAGE + "."
    if not old.startswith(prefix):
        return None
    relative = old[len(prefix):]
    for before, after in MOVED.items():
        if relative == before or relative.startswith(before + "."):
            return f"{prefix}{after}{relative[len(before):]}"
    return None


def deprecation_message(old: str, new: str) -> str:
    """The warning an import of the deprecated path ``old`` emits (``new``: where the module lives now)."""
    return f"{old} is deprecated (its 0.3 path): the module moved to {new}; import {new} instead"


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path: the same module object, its own ``__spec__`` kept."""

    def __init__(self, new: str) -> None:
        self.new = new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(deprecation_message(spec.name, self.new), DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set the alias's spec on the shared module: put it back

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The new module's code (for ``python -m <old path>``)."""
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` (and their submodules) and nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_path(fullname)
        if new is None:
            return None
        target_spec = importlib.util.find_spec(new)
        if target_spec is None:
            return None
        is_package = target_spec.submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new), is_package=is_package)


def install_aliases() -> None:
    """Put one :class:`MovedModuleFinder` first on ``sys.meta_path`` (idempotent)."""
    if not any(type(finder).__name__ == "MovedModuleFinder" and type(finder).__module__ == __name__
               for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
