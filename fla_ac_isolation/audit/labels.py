"""How the audit names a region (its module path, else ``region #i (ClassName)``; a region tag in front:
``stage 1 / mb 0: layers.2``) and the module running at a divergent op.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["RegionNamer", "clean_path", "module_of", "running_modules"]


def module_of(fn: Any) -> nn.Module | None:
    """The module a checkpointed callable runs: itself, a bound method's owner, a partial's target."""
    for _ in range(8):
        if isinstance(fn, nn.Module):
            return fn
        if isinstance(fn, functools.partial):
            if fn.args and isinstance(fn.args[0], nn.Module):  # partial(forward, module) (transformers)
                return fn.args[0]
            fn = fn.func
        elif hasattr(fn, "__self__"):
            fn = fn.__self__
        else:
            return None
    return None


def running_modules() -> list[nn.Module]:
    """Modules whose ``forward`` is on the Python stack right now, innermost first."""
    frame = sys._getframe(1)
    found: list[nn.Module] = []
    while frame is not None:
        obj = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames[:1] else None
        if isinstance(obj, nn.Module) and (not found or found[-1] is not obj):
            found.append(obj)
        frame = frame.f_back
    return found


def clean_path(path: str) -> str:
    parts = [p for p in path.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod", "")]
    return ".".join(parts)


class RegionNamer:
    """Module paths inside a root module (cached per root) and the region tag (``tag() -> str | None``)."""

    def __init__(self, model: nn.Module | None, tag: Callable[[], str | None] | None = None) -> None:
        self._model_ref = weakref.ref(model) if model is not None else None
        self._paths: dict[int, tuple[weakref.ref, dict[int, str]]] = {}
        self._tag = tag
        self._untagged: dict[str, str] = {}  # tagged label -> the label without its tag

    def tagged(self, label: str) -> str:
        """``"<tag>: <label>"``, or ``label`` without a tag; ``TypeError`` when the tag is not a str or ``None``."""
        tag = self._tag() if self._tag is not None else None
        if tag is None:
            return label
        if not isinstance(tag, str):
            raise TypeError(f"region_tag must return a str or None, got {type(tag).__name__}")
        full = f"{tag}: {label}"
        self._untagged[full] = label
        return full

    def label_for(self, fn: Any, index: int) -> str:
        """Path of the checkpointed (else the calling) module inside ``model`` or the outermost running module."""
        number = f"region #{index}"
        running = running_modules()
        module = module_of(fn)
        if module is None:
            module = running[0] if running else None
        if module is None:
            return number
        root = self._model_ref() if self._model_ref is not None else None
        if root is None:
            root = running[-1] if running else None
        path = self._path_in(root, module) if root is not None else None
        return path or f"{number} ({type(module).__name__})"

    def where(self, label: str) -> str | None:
        """Path of the innermost running module (inside a recompute) that belongs to the model, for messages:
        a module called without being registered in it (transformers' ``kernels`` function modules) is skipped."""
        running = running_modules()
        if not running:
            return None
        root = self._model_ref() if self._model_ref is not None else None
        if root is not None:
            path = next((p for p in (self._path_in(root, m) for m in running) if p), None)
            if path:
                return path
        label = self._untagged.get(label, label)  # the module path, without the region tag
        sub = next((s for s in (self._path_in(running[-1], m) for m in running[:-1]) if s), None)
        return f"{label}.{sub}" if sub else label

    def _path_in(self, root: nn.Module, module: nn.Module) -> str | None:
        cached = self._paths.get(id(root))
        if cached is None or cached[0]() is not root:
            names = {}
            for name, m in root.named_modules(remove_duplicate=False):
                names.setdefault(id(m), clean_path(name))
            cached = (weakref.ref(root), names)
            self._paths[id(root)] = cached
        return cached[1].get(id(module))
