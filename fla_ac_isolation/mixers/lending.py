"""Tensor lending between a drop-in mixer and the upstream module it replaced: slots pointed at tensors, not copies.

Used by :func:`~fla_ac_isolation.swap_mixers`; :func:`lent_to_original` lends the tensors back for upstream code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["keep_original", "lent_to_original", "original_of", "release_original", "share_tensors", "strip_tensors"]

# Attribute (in the replacement's __dict__, so not a registered submodule) holding the stripped original.
_ORIGINAL_ATTR = "_fla_ac_original"


def _slots(module: nn.Module) -> dict[str, tuple[nn.Module, str, str]]:
    """``{qualified name: (owning module, local name, kind)}`` for every tensor slot, ``None`` ones included."""
    slots: dict[str, tuple[nn.Module, str, str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for local in sub._parameters:
            slots[f"{prefix}.{local}" if prefix else local] = (sub, local, "param")
        for local in sub._buffers:
            kind = "buffer (non-persistent)" if local in sub._non_persistent_buffers_set else "buffer"
            slots[f"{prefix}.{local}" if prefix else local] = (sub, local, kind)
    return slots


def _table(owner: nn.Module, kind: str) -> dict[str, Any]:
    return owner._parameters if kind == "param" else owner._buffers


def share_tensors(src: nn.Module, dst: nn.Module, what: str) -> None:
    """Point every parameter/buffer slot of ``dst`` at the tensor object of the same name in ``src`` (no copy).

    Raises:
        RuntimeError: naming ``what``, when the modules' parameters and buffers differ in names, kinds or shapes.
    """
    src_slots, dst_slots = _slots(src), _slots(dst)
    if set(src_slots) != set(dst_slots):
        raise RuntimeError(
            f"{what}: {type(dst).__name__} does not declare the tensors of {type(src).__name__} "
            f"(missing {sorted(set(src_slots) - set(dst_slots))}, extra {sorted(set(dst_slots) - set(src_slots))}); "
            "a drop-in must keep upstream names"
        )
    for name, (owner, local, kind) in dst_slots.items():
        src_owner, src_local, src_kind = src_slots[name]
        if kind != src_kind:
            raise RuntimeError(f"{what}: {name!r} is a {src_kind} in {type(src).__name__} but a {kind} here")
        tensor = _table(src_owner, src_kind)[src_local]
        declared = _table(owner, kind)[local]
        if tensor is not None and declared is not None and tuple(declared.shape) != tuple(tensor.shape):
            raise RuntimeError(
                f"{what}: {name!r} has shape {tuple(tensor.shape)} in {type(src).__name__} but "
                f"{type(dst).__name__} expects {tuple(declared.shape)} (was it built from another config?)"
            )
        _table(owner, kind)[local] = tensor


def strip_tensors(module: nn.Module) -> None:
    """Drop the module's references to its tensors (the slots stay, holding ``None``, for a later share)."""
    for owner, local, kind in _slots(module).values():
        _table(owner, kind)[local] = None


def keep_original(replacement: nn.Module, original: nn.Module) -> None:
    """Keep ``original`` on ``replacement``, outside the module tree (neither saved, moved nor counted)."""
    vars(replacement)[_ORIGINAL_ATTR] = original


def original_of(module: nn.Module) -> nn.Module | None:
    """The upstream module kept on ``module`` by :func:`keep_original`, or ``None``."""
    return vars(module).get(_ORIGINAL_ATTR)


def release_original(replacement: nn.Module) -> nn.Module:
    """Remove and return the upstream module kept on ``replacement`` (``KeyError`` when none)."""
    return vars(replacement).pop(_ORIGINAL_ATTR)


@contextlib.contextmanager
def lent_to_original(module: nn.Module) -> Iterator[nn.Module]:
    """The upstream module a swapped mixer replaced, pointed at the mixer's tensors (writes stay) for the block;
    ``RuntimeError`` when ``module`` was not made by :func:`~fla_ac_isolation.swap_mixers`."""
    original = original_of(module)
    if original is None:
        raise RuntimeError(
            f"{type(module).__name__} was not made by swap_mixers: it holds no upstream module to lend its tensors to"
        )
    share_tensors(module, original, f"lent_to_original({type(module).__name__})")
    try:
        yield original
    finally:
        strip_tensors(original)
