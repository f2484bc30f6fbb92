"""The user's code a command or a spec names: ``"module:callable"`` or ``"path/to/file.py:callable"``, loaded so
that each file runs once per process whatever mix of the two names it (:func:`load_callable`, :func:`load_module`),
and a module-level callable named so that a rank process loads the same one again (:func:`callable_target`).

A file run twice is two modules: ``reference_kernels()`` serves FLA's kernels by rebinding the names of the modules
in ``sys.modules``, and the model's own module, replaced there by the second run, would keep FLA's."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
import types
from typing import Any

from fla_ac_isolation.harness.failures import first_line

__all__ = ["FILE_MODULE_PREFIX", "callable_target", "importable", "is_file_target", "load_callable", "load_module"]

FILE_MODULE_PREFIX = "_fla_ac_isolation_check_"
"""The module name a file given by path runs under: this prefix, the file's stem (and a number when another file
of that stem holds the name)."""


def is_file_target(where: str) -> bool:
    """Whether the part before ``:`` names a file (``path/to/file.py``) rather than a module."""
    return where.endswith(".py") or "/" in where


def _file_of(module: Any) -> pathlib.Path | None:
    file = getattr(module, "__file__", None) if module is not None else None
    return pathlib.Path(os.path.realpath(file)) if isinstance(file, str) else None


def _loaded_from(path: pathlib.Path) -> types.ModuleType | None:
    """The module already loaded from the file ``path`` (resolved), under any name."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if (isinstance(module, types.ModuleType) and isinstance(file, str)
                and os.path.basename(file) == path.name and _file_of(module) == path):
            return module
    return None


def _free_name(path: pathlib.Path) -> str:
    name, n = f"{FILE_MODULE_PREFIX}{path.stem}", 1
    while name in sys.modules:  # another file of that stem (this one would have been found)
        n += 1
        name = f"{FILE_MODULE_PREFIX}{path.stem}_{n}"
    return name


def load_module(where: str) -> types.ModuleType:
    """The module of ``where``: a file (``path/to/file.py``, run as a module the first time only) or a module name
    (imported with the working directory first on ``sys.path``, as pytest and uvicorn put it; it stays there).
    A file already loaded under a module name, or a module name that resolves to a file already loaded by path, is
    that module (the name is then bound to it in ``sys.modules``).

    Raises:
        FileNotFoundError: no file ``where``.
        Exception: whatever importing the module raised.
    """
    if is_file_target(where):
        path = pathlib.Path(os.path.realpath(where))
        if not path.is_file():
            raise FileNotFoundError(where)
        found = _loaded_from(path)
        if found is not None:
            return found
        spec = importlib.util.spec_from_file_location(_free_name(path), path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while a class is created
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
        return module
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    if where not in sys.modules:
        spec = importlib.util.find_spec(where)
        origin = spec.origin if spec is not None and spec.has_location else None
        found = _loaded_from(pathlib.Path(os.path.realpath(origin))) if origin else None
        if found is not None:
            sys.modules[where] = found
            return found
    return importlib.import_module(where)


def _module_not_found_hint(err: BaseException, where: str) -> str:
    top = where.split(".")[0]
    if not isinstance(err, ModuleNotFoundError) or err.name is None or err.name.split(".")[0] != top:
        return ""
    return (f" (module:callable imports from the working directory {os.getcwd()} and sys.path: run from the "
            f"folder that holds {top}.py or the {top}/ package, or give path/to/file.py:callable)")


def _namespace_hint(module: Any, where: str, name: str) -> str:
    """``where`` imported a folder (a namespace package): say so, and name the file inside it to give."""
    folder = pathlib.Path(next(iter(module.__path__)))
    inside = folder / f"{where.rpartition('.')[2]}.py"
    give = f"{inside}:{name}" if inside.is_file() else f"path/to/file.py:{name}"
    return (f" ({where} is the folder {folder}, imported as a namespace package, not a module: run from inside it, "
            f"or give {give})")


def load_callable(target: str, argument: str, error: type[Exception] = ValueError) -> Any:
    """The callable of ``target`` (``"path/to/file.py:callable"`` or ``"module:callable"``), its module loaded by
    :func:`load_module`.

    Raises:
        error: naming ``argument`` and ``target``: no such file, the import fails (a ``ModuleNotFoundError`` of
            the module itself says where modules are looked up), no such attribute, or it is not callable.
    """
    where, _, name = target.partition(":")
    try:
        module = load_module(where)
    except FileNotFoundError:
        raise error(f"{argument} {target!r}: no file {where}") from None
    except Exception as err:
        raise error(f"{argument} {target!r}: importing {where} failed: {first_line(err)}"
                    f"{_module_not_found_hint(err, where)}") from err
    if not hasattr(module, name):
        folder = "" if getattr(module, "__file__", None) else _namespace_hint(module, where, name)
        raise error(f"{argument} {target!r}: {where} has no callable {name!r}{folder}")
    fn = getattr(module, name)
    if not callable(fn):
        shown = f"{where}:{name}" if is_file_target(where) else f"{where}.{name}"
        raise error(f"{argument} {target!r}: {shown} is not callable ({type(fn).__name__})")
    return fn


def importable(module_name: str) -> bool:
    """Whether a fresh process imports the module ``module_name`` (loaded here) from the same file through
    ``sys.path``: not for a file loaded by path under another name (by this module, or by the user's own
    ``importlib.util.spec_from_file_location``). A built-in module, and ``__main__`` (which ``multiprocessing``
    re-imports in its children), count as importable."""
    module = sys.modules.get(module_name)
    file = _file_of(module)
    if module is None or file is None or module_name == "__main__":
        return True
    relative = pathlib.Path(*module_name.split("."))
    package = file.name.split(".")[0] == "__init__"
    folder, stem = (relative, None) if package else (relative.parent, relative.name)
    for entry in sys.path:
        if os.path.realpath(pathlib.Path(entry or os.getcwd()) / folder) == str(file.parent) and (
                package or file.name.split(".")[0] == stem):
            return True
    return False


def callable_target(obj: Any) -> str:
    """How a rank process names ``obj`` (a class or function) to load it again: ``"module:qualname"``, or
    ``"path/to/file.py:qualname"`` when its module is a script's ``__main__`` or is not :func:`importable` by
    its name (a file loaded by path; the path relative to the working directory when under it). A lambda or a
    function defined inside another keeps its ``<lambda>`` / ``<locals>`` qualname: the caller refuses it."""
    name = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or type(obj).__name__
    file = _file_of(sys.modules.get(name))
    if file is None or (name != "__main__" and importable(name)):
        return f"{name}:{qualname}"
    cwd = os.path.realpath(os.getcwd())
    shown = os.path.relpath(file, cwd) if file.is_relative_to(cwd) else str(file)
    return f"{shown}:{qualname}"
