"""Why ``import fla`` fails on this install, known from the installed metadata before FLA is imported, and a finder
that makes ``import fla`` say so (:func:`explain_import`, run when :mod:`fla_ac_isolation.fla_seam` is imported).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys

from fla_ac_isolation.fla_seam.versions import fla_version

__all__ = ["explain_import", "import_problem"]


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def import_problem() -> str | None:
    """Why ``import fla`` fails on this install, from the installed metadata alone (imports nothing); else ``None``.

    The one case known: fla-core < 0.6 with Triton >= 3.9 (``ValueError: key contains names that are not kernel
    arguments: BT``).
    """
    fla = fla_version()
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
    if fla is None or _version_tuple(fla) >= (0, 6) or _version_tuple(triton) < (3, 9):
        return None
    return (f"fla-core {fla} does not import with triton {triton} (FLA's autotune keys name BT, which Triton >= 3.9 "
            f"refuses); install 'triton>=3.6,<3.9' (pip install 'fla-ac-isolation[fla052]' pins both) or "
            f"upgrade to 'fla-core>=0.6,<0.7'")


class _ExplainedLoader(importlib.abc.Loader):
    """FLA's own loader, with the failure :func:`import_problem` predicts re-raised as an ``ImportError``."""

    def __init__(self, loader: importlib.abc.Loader, problem: str) -> None:
        self._loader, self._problem = loader, problem

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        except ValueError as e:
            raise ImportError(self._problem) from e


class _ExplainedFinder(importlib.abc.MetaPathFinder):
    def __init__(self, problem: str) -> None:
        self._problem = problem

    def find_spec(self, fullname, path, target=None):
        if fullname != "fla":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ExplainedLoader(spec.loader, self._problem)
        return spec


@functools.cache
def explain_import() -> None:
    """Where :func:`import_problem` knows ``import fla`` fails, make it raise ``ImportError(import_problem())``
    (chained to FLA's error) by a finder for the top-level ``fla``, installed only if ``fla`` is not imported yet."""
    problem = import_problem()
    if problem is not None and "fla" not in sys.modules:
        sys.meta_path.insert(0, _ExplainedFinder(problem))
