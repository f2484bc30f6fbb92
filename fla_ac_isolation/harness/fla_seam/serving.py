"""FLA's Triton entry points served by the stand-ins of :mod:`~.served_ops` inside a block, wherever foreign code
looked them up (module attributes found by identity, closure cells of transformers' kernel wrappers, and
transformers' ``kernels`` function modules through ``kernelize``:
:mod:`~fla_ac_isolation.harness.transformers_kernels`), in the modules imported before the block and in those
imported inside it (an import hook on ``sys.meta_path`` serves each as it finishes loading, FLA's own modules
executed anew included): foreign models, and your own code calling FLA's ops, on a CPU. On exit FLA's entry points come
back behind a guard that raises on CPU-only tensors, so run the backward of a region checkpointed inside the
block inside it too. FLA's other kernels (GLA, ...) and fused losses (use ``fuse_cross_entropy=False``) are not
served."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fla_ac_isolation.fla_seam import features
from fla_ac_isolation.harness import transformers_kernels
from fla_ac_isolation.harness.fla_seam import served_ops
from fla_ac_isolation.harness.fla_seam.served_ops import KernelCall, ServedKernels, recording

__all__ = ["KernelCall", "ServedKernels", "reference_kernels"]


_GUARDED = "fla_entry_point"  # the attribute of a guard holding FLA's entry point
_GUARDS: dict[int, tuple[Any, Any]] = {}  # {id(FLA's entry point): (it, its guard)}, each guard made once
_OPEN: list[_Serving] = []  # the blocks open now, outermost first


def _cpu_only(args: tuple, kwargs: dict) -> bool:
    devices = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    return devices == {"cpu"}


def _outside_message(name: str) -> str:
    if torch._C._current_graph_task_id() != -1:  # inside a backward: a checkpointed region's recompute
        return (f"FLA's {name} was called on CPU tensors outside reference_kernels(): a region checkpointed "
                f"inside reference_kernels() recomputes in backward; run backward inside the "
                f"`with reference_kernels():` block")
    return (f"FLA's {name} was called on CPU tensors outside reference_kernels(): FLA's Triton kernels cannot "
            f"run on a CPU; call it inside a `with reference_kernels():` block (or on CUDA tensors)")


def _guarded(fla: Any, name: str | None = None) -> Any:
    """FLA's entry point ``fla`` behind the guard (one per entry point; ``fla`` itself for a guard), named ``name``.

    Raises:
        RuntimeError: (from the guard) every tensor argument is a CPU tensor, before FLA runs any op.
    """
    fla = getattr(fla, _GUARDED, fla)
    found = _GUARDS.get(id(fla))
    if found is not None and found[0] is fla:
        return found[1]
    name = name or fla.__qualname__

    @functools.wraps(fla)
    def guard(*args: Any, **kwargs: Any) -> Any:
        if _cpu_only(args, kwargs):
            raise RuntimeError(_outside_message(name))
        return fla(*args, **kwargs)

    setattr(guard, _GUARDED, fla)
    _GUARDS[id(fla)] = (fla, guard)
    return guard


def _entry_points() -> list[tuple[Any, Any]]:
    """``[(FLA's entry point as its package binds it now (behind the guard after a block), stand-in)]``."""
    from fla.modules.activations import swiglu, swiglu_linear
    causal_conv1d = features.module("conv").causal_conv1d
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
    from fla.ops.kda.chunk import chunk_kda

    pairs = ((chunk_gated_delta_rule, served_ops.chunk_gated_delta_rule), (causal_conv1d, served_ops.causal_conv1d),
             (chunk_kda, served_ops.chunk_kda), (swiglu, served_ops.swiglu),
             (swiglu_linear, served_ops.swiglu_linear))
    return list(pairs)


def _defined_in(fla: Any, name: str) -> tuple[str, str]:
    """``(module, attribute)`` where FLA defines ``fla`` (``swiglu`` is a ``Function``'s bound ``apply``)."""
    return getattr(fla, "__self__", fla).__module__, name


def _targets(entry_points: list[tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """``{id(FLA function or its guard): (that object, stand-in)}``."""
    found = ((f, s) for fla, s in entry_points for f in (getattr(fla, _GUARDED, fla), fla, _guarded(fla, s.__name__)))
    return {id(f): (f, s) for f, s in found}


@functools.cache
def _recurrent() -> dict[int, Any]:
    """``{id(FLA's recurrent entry point): it}``: served in transformers' wrappers by their torch implementation."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda import fused_recurrent_kda

    return {id(f): f for f in (fused_recurrent_gated_delta_rule, fused_recurrent_kda)}


def _forwards() -> list[tuple[type, Any]]:
    """``[(FLA class, stand-in forward)]``."""
    from fla.modules import FusedRMSNormGated, RMSNorm

    return [(RMSNorm, served_ops.rms_norm_forward), (FusedRMSNormGated, served_ops.rms_norm_gated_forward)]


def _module_dicts() -> Iterator[tuple[str, dict]]:
    """Every module's namespace but this seam's own."""
    ours = (sys.modules[__name__], served_ops)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if isinstance(module, types.ModuleType) and module not in ours:
                yield name, vars(module)


def _cells(value: Any) -> tuple:
    """The closure cells of a ``functools.wraps`` wrapper, else ``()`` (also for a guard of this module)."""
    if (isinstance(value, types.FunctionType) and value.__closure__ and hasattr(value, "__wrapped__")
            and not hasattr(value, _GUARDED)):
        return value.__closure__
    return ()


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


class _Patches:
    """Replaced bindings, undone in reverse order."""

    def __init__(self) -> None:
        self.undo: list[tuple[str, Any, Any, Any]] = []

    def scan(self, targets: dict[int, tuple[Any, Any]], places: list[str]) -> None:
        for name, namespace in _module_dicts():
            self.scan_namespace(name, namespace, targets, places)

    def scan_namespace(self, name: str, namespace: dict, targets: dict[int, tuple[Any, Any]],
                       places: list[str]) -> None:
        for attr, value in list(namespace.items()):
            hit = targets.get(id(value))
            if hit is not None and hit[0] is value:
                self.undo.append(("dict", namespace, attr, _guarded(value)))
                namespace[attr] = hit[1]
                places.append(f"{name}.{attr}")
            for cell in _cells(value):  # a transformers wrapper: its torch implementation for states
                content = _cell_contents(cell)
                hit = targets.get(id(content))
                if hit is not None and hit[0] is content:
                    self.undo.append(("cell", cell, None, _guarded(content)))
                    cell.cell_contents = transformers_kernels.served_in_wrapper(hit[1], value)
                    places.append(f"closure of {name}.{attr}")
                elif content is not None and _recurrent().get(id(content)) is content:
                    self.undo.append(("cell", cell, None, content))
                    cell.cell_contents = transformers_kernels.served_in_wrapper(None, value)
                    places.append(f"closure of {name}.{attr} (its torch implementation)")

    def serve_forward(self, cls: type, forward: Any, places: list[str]) -> None:
        old = cls.__dict__["forward"]  # a stand-in already in a nested block
        guard = _guarded(old, f"{cls.__qualname__}.forward")
        self.undo.append(("attr", cls, "forward", old if old is forward else guard))
        cls.forward = forward
        places.append(f"{cls.__module__}.{cls.__qualname__}.forward")

    def restore(self) -> None:
        for kind, holder, key, old in reversed(self.undo):
            if kind == "dict":
                holder[key] = old
            elif kind == "cell":
                holder.cell_contents = old
            else:
                setattr(holder, key, old)
        self.undo.clear()


def _adapter_bindings(adapters: dict[int, Any]) -> set[tuple[int, Any]]:
    """``(id(holder), key)`` of every binding holding an adapter now."""
    found = set()
    for _, namespace in _module_dicts():
        for attr, value in list(namespace.items()):
            if id(value) in adapters:
                found.add((id(namespace), attr))
            found.update((id(cell), None) for cell in _cells(value) if id(_cell_contents(cell)) in adapters)
    return found


def _point_back_at_fla(adapters: dict[int, Any], keep: set[tuple[int, Any]]) -> None:
    """Bindings made inside the block that hold an adapter: back to FLA's function (behind its guard)."""
    for _, namespace in _module_dicts():
        for attr, value in list(namespace.items()):
            if id(value) in adapters and (id(namespace), attr) not in keep:
                namespace[attr] = adapters[id(value)]
            for cell in _cells(value):
                content = _cell_contents(cell)
                if id(content) in adapters and (id(cell), None) not in keep:
                    cell.cell_contents = adapters[id(content)]


class _ServedLoader(importlib.abc.Loader):
    """A module's own loader, then ``loaded(module)``; the module keeps its own loader (``__loader__``)."""

    def __init__(self, loader: Any, loaded: Any) -> None:
        self.loader = loader
        self.loaded = loaded

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.loader.exec_module(module)
        self.loaded(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the module's own loader's
        if name == "loader":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.loader, name)


class _ServingFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while a block is open: the spec the finders after it give, with a loader that
    serves the module once it is executed."""

    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        finders = sys.meta_path
        after = next((i + 1 for i, f in enumerate(finders) if f is self), len(finders))
        for finder in finders[after:]:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ServedLoader(spec.loader, self.loaded)
                return spec
        return None


class _Serving:
    """One block: what it serves, what it replaced, and the modules it serves as they are imported."""

    def __init__(self) -> None:
        entry_points = _entry_points()
        self.targets = _targets(entry_points)
        self.adapters = {id(stand_in): _guarded(fla) for fla, stand_in in entry_points}  # stand-in -> FLA's guard
        self.keep = _adapter_bindings(self.adapters)  # a user's own import of a stand-in stays as it is
        # where FLA defines what is served: a module executed anew inside the block defines new objects
        self.defined = {_defined_in(getattr(fla, _GUARDED, fla), s.__name__): s for fla, s in entry_points}
        self.classes = {(cls.__module__, cls.__qualname__): forward for cls, forward in _forwards()}
        self.served = ServedKernels()
        self.patches = _Patches()
        self.finder = _ServingFinder(self.loaded)

    def start(self) -> None:
        self.patches.scan(self.targets, self.served.places)
        for cls, forward in _forwards():
            self.patches.serve_forward(cls, forward, self.served.places)
        sys.meta_path.insert(0, self.finder)

    def loaded(self, module: types.ModuleType) -> None:
        """Serve a module imported inside the block; one of FLA's defining its entry points or classes anew
        (its old ``sys.modules`` entry was removed) has its new objects served too."""
        name, namespace = module.__name__, vars(module)
        for (where, attr), stand_in in self.defined.items():
            fla = namespace.get(attr) if where == name else None
            if fla is not None and id(fla) not in self.targets and fla is not stand_in:
                self.targets.update(_targets([(fla, stand_in)]))
                self.adapters[id(stand_in)] = _guarded(fla)  # on exit, what the package binds now
        for (where, qualname), forward in self.classes.items():
            cls = namespace.get(qualname) if where == name else None
            if isinstance(cls, type) and cls.__dict__.get("forward") is not forward:
                self.patches.serve_forward(cls, forward, self.served.places)
        self.patches.scan_namespace(name, namespace, self.targets, self.served.places)

    def stop(self, outermost: bool) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self.finder]
        self.patches.restore()
        if outermost:  # a nested block leaves what was bound inside it served until the outer one ends
            _point_back_at_fla(self.adapters, self.keep)


@contextlib.contextmanager
def reference_kernels() -> Iterator[ServedKernels]:
    """Serve FLA's gated delta rule, causal conv, KDA, SwiGLU and RMS norms with reference stand-ins in the block.

    Runs code that calls FLA (transformers, FLA's models, OLMo-core, your own model calling ``fla.ops``) on a
    CPU: ``with reference_kernels(): loss = model(**batch).loss``. What is imported inside the block is served
    too (``from fla.ops.gated_delta_rule import chunk_gated_delta_rule`` in a forward). Blocks nest (the
    innermost records the calls). Not thread-safe: it rebinds module attributes and hooks imports.

    Yields:
        :class:`ServedKernels`: the places patched and every kernel call with the offsets objects it received.

    Raises:
        ImportError: fla-core is not installed.
        NotImplementedError: (from a stand-in) an argument the references do not cover: initial or final
            states, ``cp_context``, KDA's ``use_graph``.
    """
    serving = _Serving()
    _OPEN.append(serving)
    try:
        serving.start()
        hub = {"chunk_gated_delta_rule": served_ops.chunk_gated_delta_rule, "chunk_kda": served_ops.chunk_kda,
               "fused_recurrent_gated_delta_rule": None, "fused_recurrent_kda": None}  # None: the torch one
        with transformers_kernels.kernelized_serving(hub, serving.served.places), recording(serving.served):
            try:
                yield serving.served
            except ValueError as err:
                if transformers_kernels.PACKED_REFUSAL in str(err):
                    err.add_note("reference_kernels() served no transformers kernel function for this call: "
                                 "transformers ran its torch path, which refuses packed inputs")
                raise
    finally:
        _OPEN[:] = [s for s in _OPEN if s is not serving]
        serving.stop(outermost=not _OPEN)
