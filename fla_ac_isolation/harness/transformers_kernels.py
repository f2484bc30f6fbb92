"""How transformers binds FLA's entry points into its modeling modules, per release: the one module of this
package that knows it (the serving of FLA's kernels on a CPU and the tests read it from here).

A modeling module's kernel-or-torch functions (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``,
``causal_conv1d_fn``, ...) are decorated by transformers' ``use_kernel_func_from_hub_with_fallback(name,
package)``, which picks an implementation once, at import: FLA's when ``import fla`` works, else the torch one.

* **Without the ``kernels`` package** (transformers 5.23 and 5.24 where it is not installed) the module attribute
  is a ``functools.wraps`` wrapper: ``__wrapped__`` is the torch function and the closure cell
  ``implementation`` holds FLA's. It calls FLA on every device.
* **With ``kernels``** (a dependency from transformers 5.25) the attribute is a ``kernels`` function module (an
  ``nn.Module`` with ``kernel_layer_name``, the hub name above) around that wrapper; ``kernels.kernelize`` with a
  mapping replaces its ``forward``, per device and mode: transformers' documented way to choose an implementation.
  From 5.25 the wrapper also runs the torch function for inputs on a device FLA does not list (the CPU among
  them), and refuses packed inputs there (``can't keep packed sequences apart ...``).

:func:`serve_on_cpu` therefore serves a function module through ``kernelize`` and a plain wrapper through its
closure cell; :func:`torch_fallback` runs the modeling module as transformers does without FLA.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "FLA_HUB_FUNCTIONS",
    "PACKED_REFUSAL",
    "HubFunction",
    "hub_name",
    "implementation_cell",
    "kernelized_serving",
    "served_in_wrapper",
    "torch_fallback",
    "torch_function",
    "transformers_version",
]

FLA_HUB_FUNCTIONS: dict[str, str] = {
    "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule",
    "chunk_kda": "fla.ops.kda",
    "fused_recurrent_kda": "fla.ops.kda",
}
"""transformers' hub names of FLA's entry points, with the FLA module each resolves to."""

PACKED_REFUSAL = "can't keep packed sequences apart without `flash-linear-attention`"
"""The start of transformers' (>= 5.24) refusal of packed inputs on its torch path."""


def transformers_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed transformers, ``None`` when it is not installed."""
    try:
        from importlib.metadata import version

        major, minor = version("transformers").split(".")[:2]
    except Exception:
        return None
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def hub_name(obj: Any) -> str | None:
    """The hub name of a ``kernels`` function module (``"chunk_gated_delta_rule"``), else ``None``."""
    if isinstance(obj, nn.Module) and not isinstance(obj, type):
        name = getattr(type(obj), "kernel_layer_name", None)
        return name if isinstance(name, str) else None
    return None


def implementation_cell(wrapper: Any) -> Any | None:
    """The closure cell ``implementation`` of a plain transformers wrapper (``functools.wraps``, no ``kernels``),
    else ``None``."""
    if not isinstance(wrapper, types.FunctionType) or not hasattr(wrapper, "__wrapped__") or not wrapper.__closure__:
        return None
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__))
    return cells.get("implementation")


# ---------------------------------------------------------------------------------- what a call is served by
def _with_states_on_torch(stand_in: Callable | None, torch_fn: Callable) -> Callable:
    """``stand_in``, except that a call with recurrent states (``initial_state``, ``output_final_state``: cached
    decoding) runs transformers' torch implementation, which takes them (the stand-ins compute training calls);
    ``stand_in=None``: always the torch implementation. The torch implementation gets the keywords it takes."""
    params = inspect.signature(torch_fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def on_torch(*args: Any, **kwargs: Any) -> Any:
        return torch_fn(*args, **(kwargs if takes_all else {k: v for k, v in kwargs.items() if k in params}))

    if stand_in is None:
        return on_torch

    @functools.wraps(stand_in)
    def served(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            return on_torch(*args, **kwargs)
        return stand_in(*args, **kwargs)

    return served


_IN_WRAPPERS: dict[tuple[int, int], tuple[Any, Callable]] = {}  # one object per (stand-in, wrapper): blocks agree


def served_in_wrapper(stand_in: Callable | None, wrapper: Any) -> Callable:
    """What a plain transformers wrapper's ``implementation`` cell holds inside the serving block: see
    :func:`_with_states_on_torch` (the wrapper's ``__wrapped__`` is its torch implementation); the same object
    in every block."""
    key = (id(stand_in), id(wrapper))
    found = _IN_WRAPPERS.get(key)
    if found is None or found[0] is not wrapper:
        found = (wrapper, _with_states_on_torch(stand_in, inspect.unwrap(wrapper)))
        _IN_WRAPPERS[key] = found
    return found[1]


# ------------------------------------------------------------------------------------------- kernelize
@dataclass(frozen=True)
class HubFunction:
    """A served function module: where it was found and what it ran before (restored on exit)."""

    place: str
    module: nn.Module


def _applicable(fla_function: Callable) -> frozenset[str]:
    """The parameter names of FLA's ``fla_function``: the keywords transformers' wrapper hands on to it (a
    ``**kwargs`` of FLA's takes none of the others)."""
    return frozenset(inspect.signature(fla_function).parameters)


@dataclass(frozen=True)
class _StandInRepository:
    """A ``kernels`` repository (anything with ``load()``) whose layer calls ``stand_in`` with the keywords FLA's
    own function takes, as transformers' wrapper hands them to FLA on a GPU (calls with recurrent states, or every
    call when ``stand_in`` is ``None``: the function's torch implementation)."""

    name: str
    stand_in: Callable | None
    fla_function: Callable
    func_class: type

    def load(self) -> type[nn.Module]:
        keep = _applicable(self.fla_function)
        torch_fn = torch_function(self.func_class())
        stand_in = _with_states_on_torch(self.stand_in, torch_fn)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return stand_in(*args, **{k: v for k, v in kwargs.items() if k in keep})

        # kernels checks the replacement's forward against the function module's (count and kinds of arguments)
        forward.__signature__ = inspect.signature(self.func_class.forward)  # type: ignore[attr-defined]
        layer = type(f"Served_{self.name}", (nn.Module,), {"forward": forward, "can_torch_compile": True})
        layer.__module__ = __name__
        return layer


@contextlib.contextmanager
def _quiet_kernels() -> Iterator[None]:
    """kernels logs a warning for every layer it restores to its own forward: quiet during our calls."""
    loggers = [logging.getLogger(n) for n in ("kernels", "kernels._internals.layer.layer")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _kernelize(modules: list[nn.Module], mapping: dict) -> None:
    from kernels import Mode, kernelize, use_kernel_mapping

    holder = nn.ModuleList(modules)  # registers them as children of a throwaway list; they are not changed
    with _quiet_kernels(), use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(holder, mode=Mode.TRAINING, device="cpu", use_fallback=True)


class _KernelizedServing:
    """The function modules served so far, and the scan that finds new ones (modeling modules imported late)."""

    def __init__(self, stand_ins: dict[str, Callable], places: list[str]) -> None:
        self.stand_ins = {k: v for k, v in stand_ins.items() if k in FLA_HUB_FUNCTIONS}
        self.places = places
        self.served: dict[int, HubFunction] = {}
        self.seen: set[str] = set()

    def scan(self) -> None:
        """Serve the function modules of every transformers modeling module not scanned yet."""
        for name, module in list(sys.modules.items()):
            if name in self.seen or not name.startswith("transformers.models.") or not isinstance(
                    module, types.ModuleType):
                continue
            self.seen.add(name)
            for attr, value in list(vars(module).items()):
                hub = hub_name(value)
                if hub in self.stand_ins and id(value) not in self.served:
                    self._serve(HubFunction(f"kernelized {name}.{attr}", value), hub)

    def _serve(self, found: HubFunction, hub: str) -> None:
        fla_function = getattr(importlib.import_module(FLA_HUB_FUNCTIONS[hub]), hub)
        repo = _StandInRepository(hub, self.stand_ins[hub], fla_function, type(found.module))
        _kernelize([found.module], {hub: {"cpu": repo}})
        self.served[id(found.module)] = found
        self.places.append(found.place)

    def restore(self) -> None:
        if self.served:
            _kernelize([s.module for s in self.served.values()], {})  # no mapping: each runs its own forward
        self.served.clear()


@contextlib.contextmanager
def kernelized_serving(stand_ins: dict[str, Callable], places: list[str]) -> Iterator[list[HubFunction]]:
    """Inside the block every ``kernels`` function module of a transformers modeling module whose hub name is in
    ``stand_ins`` runs its stand-in (through ``kernelize``, device ``cpu``), with the keywords FLA's function of
    that name takes; on exit each gets its own ``forward`` back. Modeling modules imported inside the block are
    served before the next module call (a global forward pre-hook looks for them when ``sys.modules`` grew).
    Appends ``"kernelized module.attr"`` to ``places``; yields the served list (grows). A no-op without
    ``kernels``.

    Args:
        stand_ins: ``{hub name: callable with FLA's signature, or None for the function's torch implementation}``;
            names outside :data:`FLA_HUB_FUNCTIONS` are ignored.
    """
    if importlib.util.find_spec("kernels") is None:
        yield []
        return
    from torch.nn.modules.module import register_module_forward_pre_hook

    serving = _KernelizedServing(stand_ins, places)
    serving.scan()
    modules_seen = [len(sys.modules)]

    def rescan(module: nn.Module, args: Any) -> None:
        if len(sys.modules) != modules_seen[0]:
            modules_seen[0] = len(sys.modules)
            serving.scan()

    handle = register_module_forward_pre_hook(rescan)
    try:
        yield list(serving.served.values())
    finally:
        handle.remove()
        serving.restore()


# --------------------------------------------------------------------------------------- torch fallback
@contextlib.contextmanager
def torch_fallback(modeling: types.ModuleType, names: dict[str, str]) -> Iterator[None]:
    """Inside the block ``modeling``'s functions ``names`` (``{attribute: hub name}``) behave as transformers
    built them without FLA: the torch implementation, refusing packed inputs.

    transformers >= 5.25 does so by itself for CPU tensors (FLA does not list the CPU), so nothing changes there;
    before, each wrapper is rebuilt with ``import fla`` failing.
    """
    version = transformers_version()
    if version is None or version >= (5, 25):
        yield
        return
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    saved = {attr: getattr(modeling, attr) for attr in names if hasattr(modeling, attr)}
    hidden = sys.modules.get("fla")
    sys.modules["fla"] = None  # type: ignore[assignment]  # `import fla` raises while transformers resolves it
    try:
        for attr, fn in saved.items():
            setattr(modeling, attr, use_kernel_func_from_hub_with_fallback(names[attr], "fla")(inspect.unwrap(fn)))
    finally:
        if hidden is None:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = hidden
    try:
        yield
    finally:
        for attr, fn in saved.items():
            setattr(modeling, attr, fn)


def torch_function(obj: Any) -> Callable | None:
    """The torch implementation behind a transformers kernel-or-torch function: a plain wrapper's
    ``__wrapped__``; for a ``kernels`` function module, the wrapper it calls, unwrapped. ``None`` otherwise."""
    if hub_name(obj) is not None:
        cells = inspect.getclosurevars(type(obj).forward).nonlocals
        obj = cells.get("func")
    if isinstance(obj, types.FunctionType) and hasattr(obj, "__wrapped__"):
        return inspect.unwrap(obj)
    return None
