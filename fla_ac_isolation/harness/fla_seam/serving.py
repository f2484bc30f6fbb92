"""FLA's Triton entry points served by the stand-ins of :mod:`~.served_ops` inside a block, wherever foreign code
looked them up (module attributes found by identity, closure cells of transformers' kernel wrappers, and
transformers' ``kernels`` function modules through ``kernelize``:
:mod:`~fla_ac_isolation.harness.transformers_kernels`): foreign models on a CPU. On exit FLA's entry points come
back behind a guard that raises on CPU-only tensors, so run the backward of a region checkpointed inside the
block inside it too. FLA's other kernels (GLA, ...) and fused losses (use ``fuse_cross_entropy=False``) are not
served."""

from __future__ import annotations

import contextlib
import functools
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


def _targets() -> dict[int, tuple[Any, Any]]:
    """``{id(FLA function or its guard): (that object, stand-in)}``."""
    from fla.modules.activations import swiglu, swiglu_linear
    causal_conv1d = features.module("conv").causal_conv1d
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
    from fla.ops.kda.chunk import chunk_kda

    pairs = ((chunk_gated_delta_rule, served_ops.chunk_gated_delta_rule), (causal_conv1d, served_ops.causal_conv1d),
             (chunk_kda, served_ops.chunk_kda), (swiglu, served_ops.swiglu),
             (swiglu_linear, served_ops.swiglu_linear))
    found = ((f, s) for fla, s in pairs for f in (getattr(fla, _GUARDED, fla), fla, _guarded(fla, s.__name__)))
    return {id(f): (f, s) for f, s in found}


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
        recurrent = _recurrent()
        for name, namespace in _module_dicts():
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
                    elif recurrent.get(id(content)) is content:
                        self.undo.append(("cell", cell, None, content))
                        cell.cell_contents = transformers_kernels.served_in_wrapper(None, value)
                        places.append(f"closure of {name}.{attr} (its torch implementation)")

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


@contextlib.contextmanager
def reference_kernels() -> Iterator[ServedKernels]:
    """Serve FLA's gated delta rule, causal conv, KDA, SwiGLU and RMS norms with reference stand-ins in the block.

    Runs a model that calls FLA (transformers, FLA's models, OLMo-core) on a CPU:
    ``with reference_kernels(): loss = model(**batch).loss``. Blocks nest (the innermost records the calls). Not
    thread-safe: it rebinds module attributes.

    Yields:
        :class:`ServedKernels`: the places patched and every kernel call with the offsets objects it received.

    Raises:
        ImportError: fla-core is not installed.
        NotImplementedError: (from a stand-in) an argument the references do not cover: initial or final
            states, ``cp_context``, KDA's ``use_graph``.
    """
    targets = _targets()
    adapters = {id(adapter): _guarded(fla) for fla, adapter in targets.values()}
    keep = _adapter_bindings(adapters)  # a user's own import of a stand-in stays as it is
    served = ServedKernels()
    patches = _Patches()
    try:
        patches.scan(targets, served.places)
        for cls, forward in _forwards():
            old = cls.__dict__["forward"]  # a stand-in already in a nested block
            guard = _guarded(old, f"{cls.__qualname__}.forward")
            patches.undo.append(("attr", cls, "forward", old if old is forward else guard))
            cls.forward = forward
            served.places.append(f"{cls.__module__}.{cls.__qualname__}.forward")
        hub = {"chunk_gated_delta_rule": served_ops.chunk_gated_delta_rule, "chunk_kda": served_ops.chunk_kda,
               "fused_recurrent_gated_delta_rule": None, "fused_recurrent_kda": None}  # None: the torch one
        with transformers_kernels.kernelized_serving(hub, served.places), recording(served):
            try:
                yield served
            except ValueError as err:
                if transformers_kernels.PACKED_REFUSAL in str(err):
                    err.add_note("reference_kernels() served no transformers kernel function for this call: "
                                 "transformers ran its torch path, which refuses packed inputs")
                raise
    finally:
        patches.restore()
        _point_back_at_fla(adapters, keep)
