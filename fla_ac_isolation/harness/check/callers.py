"""Which of the model's own modules called FLA's cached index helpers in ``check``'s audited step, with which
offsets objects (a forward and each recompute are separate calls), and which modules were handed a
:class:`~fla_ac_isolation.local_seqlens.LocalSeqlens` (``.local()`` run outside them): what ``check`` says of code
that calls FLA itself (a class of no registry).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fla_ac_isolation.audit.labels import clean_path
from fla_ac_isolation.harness.check.findings import OwnCaller
from fla_ac_isolation.local_seqlens import LocalSeqlens

__all__ = ["FlaCallers", "fresh_paths"]

_NOT_OWN = ("torch", "fla", "fla_ac_isolation")  # packages whose modules are never the user's own FLA caller


def fresh_paths(seen: dict[tuple[str, int], list[tuple[Any, ...]]], shared: set[int]) -> tuple[str, ...]:
    """The paths of ``seen`` (``{(path, n-th call): [the tensors of each helper call]}``) each call of which handed
    FLA's helpers, in every helper call, a tensor no other call handed them and that is not among ``shared`` (ids
    of the batch's tensors): no entry another call made can be hit (FLA's cache compares every argument by
    identity). A path one of whose calls made no helper call is left out: nothing to judge."""
    owner: dict[int, set[tuple[str, int] | None]] = {i: {None} for i in shared}
    for key, calls in seen.items():
        for arguments in calls:
            for t in arguments:
                owner.setdefault(id(t), set()).add(key)
    out = []
    for path in dict.fromkeys(p for p, _ in seen):
        keys = [k for k in seen if k[0] == path]
        if all(seen[k] and all(any(owner[id(t)] == {k} for t in arguments) for arguments in seen[k]) for k in keys):
            out.append(path)
    return tuple(out)


def _own(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] not in _NOT_OWN


class FlaCallers:
    """Hooks on every module of ``model`` for one step: each FLA helper call (from ``probe``, recorded with its
    arguments) is attributed to the call of the innermost running module of the user's own (a class of no package
    in ``_NOT_OWN``), unless a module of ``skip`` (the paths ``check``'s survey judges) is running; and each module
    call handed a ``LocalSeqlens`` among its arguments is noted."""

    def __init__(self, model: nn.Module, probe: Any, skip: tuple[str, ...]) -> None:
        self.probe = probe
        self.skip = set(skip)
        self.cursor = probe.mark()
        self.stack: list[tuple[nn.Module, str, tuple[str, int]]] = []
        self.calls: dict[str, int] = {}
        self.seen: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
        self.classes: dict[str, str] = {}
        self.handed_local: dict[str, None] = {}  # paths of the module calls handed a LocalSeqlens, in call order
        self.handles = []
        for name, module in model.named_modules():
            path = clean_path(name)
            self.handles.append(module.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, always_call=True))

    def _flush(self) -> None:
        """Attribute the helper calls recorded since the last module call began or ended."""
        events = self.probe.events[self.cursor:]
        self.cursor = self.probe.mark()
        if not events or any(path in self.skip for _, path, _ in self.stack):
            return
        owner = next(((m, key) for m, _, key in reversed(self.stack) if _own(m)), None)
        if owner is not None:
            module, key = owner
            self.classes[key[0]] = f"{type(module).__module__}.{type(module).__qualname__}"
            self.seen.setdefault(key, []).extend(e.arguments for e in events)

    def _pre(self, path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._flush()
            n = self.calls.get(path, 0)
            self.calls[path] = n + 1
            self.stack.append((module, path, (path, n)))
            if any(isinstance(a, LocalSeqlens) for a in (*args, *kwargs.values())):
                self.handed_local[path] = None
        return hook

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._flush()
        if self.stack and self.stack[-1][0] is module:
            self.stack.pop()

    def own(self, shared: set[int]) -> tuple[OwnCaller, ...]:
        """The model's own FLA callers, in the order they first called FLA (``shared``: the batch's tensor ids)."""
        fresh = set(fresh_paths(self.seen, shared))
        return tuple(OwnCaller(p, self.classes[p], p in fresh) for p in dict.fromkeys(p for p, _ in self.seen))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
