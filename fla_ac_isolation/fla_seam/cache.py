"""FLA's identity-keyed ``fla.utils.tensor_cache`` (a public module): global switch,
queue size, hit/miss probe. Each of FLA's index helpers keeps its last ``FLA_TENSOR_CACHE_SIZE`` (default 4) calls
and returns a stored result when every argument ``is`` the stored one. The only module-level mutable state here.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "CacheEvent",
    "CacheProbe",
    "cache_enabled",
    "cache_size",
    "cached_helpers",
    "clear_tensor_cache",
    "probe_tensor_cache",
    "tensor_cache_disabled",
    "tensor_cache_size",
]

Outcome = Literal["hit", "miss", "bypass"]

# Modules whose helpers matter; importing them registers their tensor_cache wrappers.
_HELPER_MODULES = ("fla.ops.utils.index", "fla.ops.cp.context", "fla.modules.token_shift")


def _utils():
    import fla.utils

    return fla.utils


def cache_enabled() -> bool:
    """Whether FLA's tensor cache is in force (``fla.utils.FLA_DISABLE_TENSOR_CACHE`` is false)."""
    return not bool(getattr(_utils(), "FLA_DISABLE_TENSOR_CACHE", False))


@contextlib.contextmanager
def tensor_cache_disabled() -> Iterator[None]:
    """Disable FLA's tensor cache process-wide inside the block (``fla.utils.FLA_DISABLE_TENSOR_CACHE``): every
    index helper then recomputes on each call (on GPU, with its host syncs); the prior value is restored."""
    utils = _utils()
    prior = getattr(utils, "FLA_DISABLE_TENSOR_CACHE", False)
    utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        utils.FLA_DISABLE_TENSOR_CACHE = prior


# ------------------------------------------------------------------------------------ helper discovery
@dataclass(frozen=True)
class _Helper:
    name: str
    wrapper: Callable[..., Any]
    cached_cell: Any  # closure cell holding the deque
    fn_cell: Any  # closure cell holding the undecorated function


def _wrapper_code():
    from fla.utils import tensor_cache

    return tensor_cache(lambda: None).__code__


# module name -> (module object, the helpers found in it): each module is scanned once rather than on
# every probe and clear_tensor_cache(), which the regression harness calls every step
_scanned: dict[str, tuple[object, tuple[_Helper, ...]]] = {}


def _helpers_in(module: object, code) -> tuple[_Helper, ...]:
    found = []
    for obj in list(vars(module).values()):
        if getattr(obj, "__code__", None) is code:
            cells = dict(zip(code.co_freevars, obj.__closure__))
            found.append(_Helper(obj.__name__, obj, cells["cached"], cells["fn"]))
    return tuple(found)


def cached_helpers() -> list[_Helper]:
    """Every function wrapped by FLA's ``tensor_cache`` in the imported ``fla`` modules."""
    for name in _HELPER_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    code = _wrapper_code()
    found: dict[int, _Helper] = {}
    for mod_name, mod in sys.modules.copy().items():  # a snapshot; list(items()) costs ~50x more here
        if mod is None or not (mod_name == "fla" or mod_name.startswith("fla.")):
            continue
        seen = _scanned.get(mod_name)
        if seen is None or seen[0] is not mod:
            seen = (mod, _helpers_in(mod, code))
            if not getattr(getattr(mod, "__spec__", None), "_initializing", False):
                _scanned[mod_name] = seen  # a module still importing may gain helpers: rescan it later
        for helper in seen[1]:
            found.setdefault(id(helper.wrapper), helper)
    return sorted(found.values(), key=lambda h: h.name)


def cache_size() -> int:
    """Current capacity of FLA's per-helper queues (``FLA_TENSOR_CACHE_SIZE``, default 4)."""
    helpers = cached_helpers()
    if helpers:
        return helpers[0].cached_cell.cell_contents.maxlen
    return int(getattr(_utils(), "FLA_TENSOR_CACHE_SIZE", 4))


def clear_tensor_cache() -> None:
    """Empty every helper's queue (tests use it to start from a known state)."""
    for helper in cached_helpers():
        helper.cached_cell.cell_contents.clear()


@contextlib.contextmanager
def tensor_cache_size(size: int) -> Iterator[None]:
    """Give every imported FLA helper a fresh queue of ``size`` entries inside the block (``1`` provokes evictions).

    Raises:
        ValueError: ``size`` < 1.
        RuntimeError: called while :func:`probe_tensor_cache` is active.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if _probe_state.sinks:
        raise RuntimeError("tensor_cache_size() must be entered outside probe_tensor_cache()")
    helpers = cached_helpers()
    originals = [h.cached_cell.cell_contents for h in helpers]
    for h in helpers:
        h.cached_cell.cell_contents = deque(maxlen=size)
    try:
        yield
    finally:
        for h, original in zip(helpers, originals):
            h.cached_cell.cell_contents = original


# ------------------------------------------------------------------------------------------- probe
@dataclass(frozen=True)
class CacheEvent:
    """One call of an FLA cached helper: its name, whether it hit, missed or bypassed the cache, and its tensor
    ``arguments`` (held; recorded only under ``arguments=True``; not compared)."""

    helper: str
    outcome: Outcome
    arguments: tuple[Any, ...] = field(default=(), compare=False, repr=False)


@dataclass
class CacheProbe:
    """Events recorded by :func:`probe_tensor_cache`, in call order (a nested call after its outer call's)."""

    events: list[CacheEvent] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return sum(e.outcome == "hit" for e in self.events)

    @property
    def misses(self) -> int:
        return sum(e.outcome == "miss" for e in self.events)

    @property
    def bypasses(self) -> int:
        return sum(e.outcome == "bypass" for e in self.events)

    def by_helper(self) -> dict[str, dict[str, int]]:
        """``{helper: {"hit": n, "miss": n, "bypass": n}}`` for the helpers that were called."""
        out: dict[str, dict[str, int]] = {}
        for e in self.events:
            out.setdefault(e.helper, {"hit": 0, "miss": 0, "bypass": 0})[e.outcome] += 1
        return out

    def mark(self) -> int:
        """Position in :attr:`events`, to slice out what a later block recorded."""
        return len(self.events)


class _ProbeState:
    def __init__(self) -> None:
        self.sinks: list[list[CacheEvent]] = []  # the ``events`` lists of the active probes
        self.installed: list[tuple[_Helper, deque, Callable[..., Any]]] = []
        self.keeping = 0  # how many active probes record arguments

    def emit(self, helper: str, outcome: Outcome, args: tuple = (), kwargs: dict | None = None,
             ) -> list[tuple[list[CacheEvent], int]]:
        """Append an event to every active probe; return where it went, so it can be amended."""
        event = CacheEvent(helper, outcome, self.tensors(args, kwargs))
        where = []
        for sink in self.sinks:
            where.append((sink, len(sink)))
            sink.append(event)
        return where

    def amend(self, where: list[tuple[list[CacheEvent], int]], helper: str, outcome: Outcome, args: tuple = (),
              kwargs: dict | None = None) -> None:
        event = CacheEvent(helper, outcome, self.tensors(args, kwargs))
        for sink, pos in where:
            sink[pos] = event

    def tensors(self, args: tuple, kwargs: dict | None) -> tuple[Any, ...]:
        if not self.keeping:
            return ()
        values = (*args, *(kwargs or {}).values())
        return tuple(v for v in values if isinstance(v, torch.Tensor))


_probe_state = _ProbeState()


class _ProbingDeque(deque):
    """A helper's queue, swapped in while probing, that reports each lookup: running off its end is a miss."""

    def __init__(self, items, maxlen: int, name: str) -> None:
        super().__init__(items, maxlen)
        self._name = name

    def __iter__(self):
        # Recorded as a hit at lookup time (so nested helper calls come after it) ...
        _lookup_started(self._name)
        entry = None
        try:
            for entry in super().__iter__():
                yield entry
        except GeneratorExit:  # FLA's wrapper returned from inside its loop: a hit on the last entry yielded
            _lookup_hit(self._name, entry)
            raise
        # ... and amended when FLA's wrapper runs off the end: no entry matched, the helper will run.
        _lookup_missed(self._name)


# The bookkeeping below (and _ProbeState's emit/amend, called only from it) is torch.compiler.disable'd (dynamo
# tracing a deque subclass's __iter__ raises a NameError in fla.ops.utils.index on torch >= 2.14); the code dynamo
# may trace (the deque's lookup, the helper's wrapped function) hands it only the helper's name and the call's
# values: where an event went is kept here, never passed through traced code (dynamo would guard on those lists
# and recompile as they grow).
_open: list[list[tuple[list[CacheEvent], int]]] = []  # where each lookup in progress recorded its hit
_misses: dict[str, list[list[tuple[list[CacheEvent], int]]]] = {}  # per helper: misses awaiting their call


@torch.compiler.disable
def _lookup_started(name: str) -> None:
    _open.append(_probe_state.emit(name, "hit"))


@torch.compiler.disable
def _lookup_hit(name: str, entry: Any) -> None:
    where = _open.pop()
    if _probe_state.keeping and entry is not None:
        _probe_state.amend(where, name, "hit", entry[0], entry[1])


@torch.compiler.disable
def _lookup_missed(name: str) -> None:
    """Turn the lookup's recorded hit into a miss and leave where it went for the helper's wrapped function."""
    where = _open.pop()
    _probe_state.amend(where, name, "miss")
    _misses.setdefault(name, []).append(where)


@torch.compiler.disable
def _note_call(name: str, args: tuple, kwargs: dict) -> None:
    """Called by a helper's wrapped function: a call after a miss completes that miss (with its arguments), any
    other is a bypass."""
    pending = _misses.get(name)
    if pending:
        _probe_state.amend(pending.pop(), name, "miss", args, kwargs)
    else:
        _probe_state.emit(name, "bypass", args, kwargs)


def _install() -> None:
    for helper in cached_helpers():
        original = helper.cached_cell.cell_contents
        fn = helper.fn_cell.cell_contents
        probing = _ProbingDeque(original, original.maxlen, helper.name)

        def counting_fn(*args, _fn=fn, _name=helper.name, **kwargs):
            _note_call(_name, args, kwargs)
            return _fn(*args, **kwargs)

        helper.cached_cell.cell_contents = probing
        helper.fn_cell.cell_contents = counting_fn
        _probe_state.installed.append((helper, original, fn))


def _uninstall() -> None:
    for helper, original, fn in _probe_state.installed:
        probing = helper.cached_cell.cell_contents
        original.clear()
        original.extend(probing)
        helper.cached_cell.cell_contents = original
        helper.fn_cell.cell_contents = fn
    _probe_state.installed.clear()
    _open.clear()
    _misses.clear()


@contextlib.contextmanager
def probe_tensor_cache(arguments: bool = False) -> Iterator[CacheProbe]:
    """Record every FLA cached-helper call made inside the block as a hit, a miss or a bypass (cache disabled),
    without changing FLA's behaviour; probes nest, each seeing every event made while it is active.

    Args:
        arguments: also record each call's tensor arguments (:attr:`CacheEvent.arguments`), for every probe
            active meanwhile (the events keep those tensors alive).
    """
    probe = CacheProbe()
    if not _probe_state.sinks:
        _install()
    _probe_state.sinks.append(probe.events)
    _probe_state.keeping += bool(arguments)
    try:
        yield probe
    finally:
        _probe_state.keeping -= bool(arguments)
        # by identity: two probes' event lists may be equal
        _probe_state.sinks[:] = [s for s in _probe_state.sinks if s is not probe.events]
        if not _probe_state.sinks:
            _uninstall()
