"""FLA's Triton entry points served by reference stand-ins inside a block: foreign models on a CPU.

FLA's Triton kernels cannot run on a CPU, and foreign code (transformers, flash-linear-attention's own
``fla.layers`` / ``fla.models``, OLMo-core, torchtitan) calls them wherever it looked them up. Inside
:func:`reference_kernels` those lookups are pointed at the stand-ins of :mod:`~.served_ops` (same signatures,
pure torch, FLA's own cached index helpers asked as the kernels ask them, so FLA's cache hits and misses, and
the AC fault, are as with the kernels):

* functions: ``chunk_gated_delta_rule`` (FLA's in-kernel gate included), ``causal_conv1d``, ``chunk_kda``,
  ``swiglu``, ``swiglu_linear``;
* ``forward`` of the classes ``fla.modules.RMSNorm`` and ``fla.modules.FusedRMSNormGated``, so instances built
  earlier follow.

Where foreign code finds FLA (fla-core 0.6, flash-linear-attention 0.6, OLMo-core 3.0, transformers 5.24,
torchtitan 0.3):

* module attributes bound to FLA's function objects: FLA's own modules and its alias modules
  (``fla.modules.convolution`` and ``fla.modules.conv`` are synthesised modules whose attributes are separate
  bindings), ``fla.layers.*`` (bound at import), torchtitan's ``_fla_chunk_gated_delta_rule`` (bound at
  import), and the package attributes OLMo-core imports inside its dispatch functions. All are found by
  identity over ``sys.modules``.
* closure cells: transformers' ``use_kernel_func_from_hub_with_fallback`` captures FLA's function in the
  closure of the wrapper it binds (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``); the cell
  is rewritten, so every binding of that wrapper sees the stand-in. (The wrapper passes on only FLA's named
  parameters, computed from FLA's signature at import: the stand-ins accept all of them.)

On exit everything is put back, in reverse order, and a module imported inside the block that bound a
stand-in is pointed back at FLA (bindings that held a stand-in before the block are left alone). What is put
back is FLA's entry point behind a guard (made once per entry point, so repeated blocks never stack them; its
``__wrapped__`` and ``fla_entry_point`` are FLA's object): called with a tensor on any other device than the CPU
it calls FLA unchanged; called with CPU tensors only, where FLA's Triton kernels cannot run, it raises a
``RuntimeError`` naming the entry point before FLA runs any op. That is the trap of a region checkpointed inside
the block whose backward runs after it: its recompute calls FLA's own entry point, which failed with Triton's
``0 active drivers`` (full AC) or, under SAC, with torch's ``aten.empty_like.default encountered during backward
but not found in storage``; the guard's message says to run the backward inside the block.
Not served (they raise on a CPU as before): FLA's other kernels (GLA, RetNet, ... : run those on CUDA), its
fused cross-entropy losses (build FLA models with ``fuse_cross_entropy=False`` on a CPU), recurrent states.
"""

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
from fla_ac_isolation.harness.fla_seam import served_ops
from fla_ac_isolation.harness.fla_seam.served_ops import KernelCall, ServedKernels, recording

__all__ = ["KernelCall", "ServedKernels", "reference_kernels"]


_GUARDED = "fla_entry_point"  # the attribute of a guard holding FLA's entry point
_GUARDS: dict[int, tuple[Any, Any]] = {}  # {id(FLA's entry point): (it, its guard)}, each guard made once


def _cpu_only(args: tuple, kwargs: dict) -> bool:
    """Tensors among the arguments, all of them on the CPU."""
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
    """FLA's entry point ``fla`` (a function, or a class's ``forward``) behind the guard that
    :func:`reference_kernels` puts back on exit: the same guard object for every call, ``fla`` itself for a
    guard. ``name`` (default: ``fla.__qualname__``) is the one the guard's error gives.

    The guard calls ``fla`` unchanged unless its tensor arguments are all on the CPU.

    Raises:
        RuntimeError: (from the guard) every tensor argument is a CPU tensor, before FLA runs any op. Inside
            a backward the message names the recompute of a region checkpointed inside ``reference_kernels()``.
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


def _forwards() -> list[tuple[type, Any]]:
    """``[(FLA class, stand-in forward)]``."""
    from fla.modules import FusedRMSNormGated, RMSNorm

    return [(RMSNorm, served_ops.rms_norm_forward), (FusedRMSNormGated, served_ops.rms_norm_gated_forward)]


def _module_dicts() -> Iterator[tuple[str, dict]]:
    """Every module's namespace but this seam's own (deprecated module attributes warn when touched: silenced)."""
    ours = (sys.modules[__name__], served_ops)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if isinstance(module, types.ModuleType) and module not in ours:
                yield name, vars(module)


def _cells(value: Any) -> tuple:
    """The closure cells of a ``functools.wraps`` wrapper (transformers' kernel wrappers), else ``()`` (also for
    a guard of this module: its cell holds FLA's entry point and stays so)."""
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
            for attr, value in list(namespace.items()):
                hit = targets.get(id(value))
                if hit is not None and hit[0] is value:
                    self.undo.append(("dict", namespace, attr, _guarded(value)))
                    namespace[attr] = hit[1]
                    places.append(f"{name}.{attr}")
                for cell in _cells(value):
                    content = _cell_contents(cell)
                    hit = targets.get(id(content))
                    if hit is not None and hit[0] is content:
                        self.undo.append(("cell", cell, None, _guarded(content)))
                        cell.cell_contents = hit[1]
                        places.append(f"closure of {name}.{attr}")

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
    """``(id(holder), key)`` of every binding (module attribute or closure cell) holding an adapter now."""
    found = set()
    for _, namespace in _module_dicts():
        for attr, value in list(namespace.items()):
            if id(value) in adapters:
                found.add((id(namespace), attr))
            found.update((id(cell), None) for cell in _cells(value) if id(_cell_contents(cell)) in adapters)
    return found


def _point_back_at_fla(adapters: dict[int, Any], keep: set[tuple[int, Any]]) -> None:
    """Bindings made inside the block (modules imported there) that hold an adapter: back to FLA's function (behind
    its guard: ``adapters`` maps a stand-in to it)."""
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

    Use it to run a model that calls FLA (transformers' Qwen3.5 / Qwen3-Next / OLMo-hybrid / Kimi-Linear
    ..., FLA's ``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM``, OLMo-core's hybrids) on a CPU, e.g. under
    :class:`~fla_ac_isolation.ReplayAudit`: ``with reference_kernels(): loss = model(**batch).loss``.
    Blocks nest (the innermost records the calls). Not thread-safe: it rebinds module attributes.

    Yields:
        :class:`ServedKernels`: the places patched and, filled as the block runs, every kernel call with the
        offsets objects it received (``cu_seqlens``, ``cu_seqlens_cpu``, ``chunk_indices``).

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
        with recording(served):
            yield served
    finally:
        patches.restore()
        _point_back_at_fla(adapters, keep)
