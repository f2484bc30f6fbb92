"""``swap_mixers``: turn a model's supported mixers (transformers', OLMo-core's, flash-linear-attention's) into this
package's drop-ins, in place (``docs/swap.md``): each module's class becomes the drop-in subclassing it
(:mod:`fla_ac_isolation.mixers`), which keeps documents apart in its own forward; its tensors, submodules and
attributes stay as they are.

Only exact classes of :data:`SUPPORTED_MIXERS` are swapped (a subclass may change ``forward``). OLMo-core's
``GatedDeltaNet`` and ``KimiDeltaAttention`` are not: :func:`~fla_ac_isolation.isolate_seqlens` fixes them in place.
"""

from __future__ import annotations

import warnings

from torch import nn

from fla_ac_isolation.families import Family, UpstreamMixer, upstream_mixers
from fla_ac_isolation.ops.backend import check_backend
from fla_ac_isolation.packed_positions import install_packed_positions, remove_packed_positions

__all__ = ["SUPPORTED_MIXERS", "restore_mixers", "swap_mixers"]

SUPPORTED_MIXERS: tuple[UpstreamMixer, ...] = tuple(upstream for upstream, _ in upstream_mixers())
"""Upstream mixer classes :func:`swap_mixers` replaces (matched by module and class name), from the families."""


def _family_of(module: nn.Module) -> tuple[UpstreamMixer, Family] | None:
    return next(((u, f) for u, f in upstream_mixers() if u.matches(module)), None)


def _looked_for() -> str:
    return ", ".join(t.qualified for t in SUPPORTED_MIXERS)


def _check_swappable(path: str, mixer: nn.Module) -> None:
    """Refuse a mixer whose ``forward`` is replaced on the instance (accelerate's hooks, ``kernelize``: a class change
    would not reach it) or whose parameters are sharded (DTensor: our path does not know TP)."""
    if "forward" in vars(mixer):
        raise ValueError(
            f"swap_mixers cannot swap {path!r}: its forward is replaced on the instance ({vars(mixer)['forward']!r}, "
            "e.g. accelerate's device_map hooks or kernels' kernelize); call swap_mixers before dispatching or "
            "kernelizing the model")
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed: nothing can be sharded
        return
    sharded = [n for n, p in mixer.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"swap_mixers cannot swap {path!r}: its parameters are already distributed ({sharded[0]!r} is a "
            "DTensor); call swap_mixers before fully_shard / parallelize_module"
        )


def swap_mixers(model: nn.Module, backend: str = "auto", *, saveable: bool = False) -> list[str]:
    """Turn, in place, every supported mixer of ``model`` into this package's drop-in for its class.

    Each module's class becomes the drop-in (a subclass of its own class: :mod:`fla_ac_isolation.mixers`); its
    parameters, buffers, hooks and attributes stay the same objects (same ``state_dict()``, an existing optimizer
    still works). All are swapped, or on an error none. Swap before FSDP/TP/accelerate dispatch or ``kernelize``.

    Args:
        model: a module holding supported mixers (transformers models, an OLMo-core ``Transformer`` with
            ``NemotronMamba2Mixer`` blocks, FLA's ``Mamba2ForCausalLM``), on any device including ``meta``.
        backend: ``"auto"`` (FLA on CUDA tensors, the pure-torch reference elsewhere), ``"fla"`` or ``"reference"``.
        saveable: the drop-ins' ops as custom operators a SAC policy can save (``save_fla_ops``).

    Returns:
        The module paths swapped; ``[]`` with a ``UserWarning`` when only this package's mixers are found.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: a bad ``backend``; ``model`` is itself a mixer; no supported or swapped mixer found; a mixer
            whose forward is replaced on the instance or whose parameters are DTensors; the drop-in refuses the
            module's configuration (e.g. an activation other than SiLU).
        NotImplementedError: ``saveable=True`` for a drop-in without saveable operators (KDA).
        ImportError: the drop-in's library cannot be imported (it was imported to build the model: not expected).

    Usage: ``docs/swap.md``.
    """
    from fla_ac_isolation.mixers import DropIn, family_drop_in

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_backend(backend)
    found: list[tuple[str, nn.Module, type[DropIn]]] = []
    swapped_before: list[str] = []  # swapped earlier, or built from fla_ac_isolation.mixers directly
    for path, module in model.named_modules():
        if isinstance(module, DropIn):
            swapped_before.append(path)
            continue
        match = _family_of(module)
        if match is not None:
            if not path:
                raise ValueError("swap_mixers needs the model (or a module) containing the mixer, not the mixer itself")
            upstream, family = match
            _check_swappable(path, module)
            found.append((path, module, family_drop_in(family, upstream)))
    if not found:
        if swapped_before:
            warnings.warn(
                f"swap_mixers: nothing to swap; the {len(swapped_before)} mixer(s) of {type(model).__name__} are "
                f"already fla_ac_isolation's ({swapped_before[0]!r}, ...)",
                stacklevel=2,
            )
            return []
        raise ValueError(
            f"swap_mixers found no supported mixer in {type(model).__name__}; looked for {_looked_for()}"
        )
    done: list[nn.Module] = []
    try:
        for _, module, cls in found:
            cls.adopt(module, backend, saveable)
            done.append(module)
    except Exception:
        for module in done:
            module.release()
        raise
    install_packed_positions(model, [path for path, _, _ in found])
    return [path for path, _, _ in found]


def restore_mixers(model: nn.Module) -> list[str]:
    """Undo :func:`swap_mixers`: each drop-in becomes its replaced class again, in place (same tensors).

    Args:
        model: the module :func:`swap_mixers` was called on, or any module containing swapped mixers.

    Returns:
        The module paths restored; ``[]`` (with a ``UserWarning``) when ``model`` holds no swapped mixer.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``model`` is itself a swapped mixer (pass the module containing it).
    """
    from fla_ac_isolation.mixers import DropIn

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, DropIn):
        raise ValueError(
            "restore_mixers needs the model (or a module) containing the swapped mixer, not the swapped mixer itself"
        )
    restored = []
    for path, module in list(model.named_modules()):
        if isinstance(module, DropIn):
            module.release()
            restored.append(path)
    remove_packed_positions(model)
    if not restored:
        warnings.warn(
            f"restore_mixers: {type(model).__name__} holds no swapped mixer; nothing to restore", stacklevel=2
        )
    return restored
