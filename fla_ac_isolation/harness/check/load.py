"""The model and batch of a :class:`~fla_ac_isolation.harness.check.spec.CheckSpec`, loaded on the spec's device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fla_ac_isolation.foreign_classes import FLA_BACKED_MIXERS
from fla_ac_isolation.harness.check.spec import CheckInputError, CheckSpec, load_callable
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.local_seqlens import PackedSeqlens
from fla_ac_isolation.packed_positions import packed_offsets_from_positions

__all__ = ["load_model", "offsets_keywords"]


def _holds_offsets(value: Any) -> bool:
    if isinstance(value, PackedSeqlens):  # the batch's LayerLocalSeqlens, built by the data loader
        return True
    if isinstance(value, torch.Tensor):
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        return value.dim() == 1 and integer
    return isinstance(value, tuple) and any(_holds_offsets(v) for v in value)  # torchtitan's VarlenMetadata


def offsets_keywords() -> str:
    """The keywords the known classes' models read packed offsets from, as one line."""
    known = {}
    for entry in FLA_BACKED_MIXERS:
        known.setdefault(entry.framework, entry.offsets[0])
    known.setdefault("flash-linear-attention's models", "cu_seqlens")  # what the FLA rule's classes read
    return ", ".join(f"{keyword} ({framework})" for framework, keyword in known.items())


def _packed_positions(batch: dict) -> bool:
    """Whether ``batch['position_ids']`` restart (a batch packed by positions alone), by the drop-ins' own rule."""
    try:
        return packed_offsets_from_positions(batch.get("position_ids")) is not None
    except ValueError:  # restarts in a batch of several rows: packed; the model's forward refuses it, naming why
        return True


def _require_offsets(batch: dict) -> None:
    """Refuse a batch without packed offsets: nothing can show in its step."""
    if any(_holds_offsets(v) for v in batch.values()) or _packed_positions(batch):
        return
    raise CheckInputError(
        f"the batch carries no packed offsets (no 1-D integer tensor, PackedSeqlens or restarting "
        f"position_ids among model(**batch)'s keywords: "
        f"{', '.join(batch) or 'none'}), so nothing can be checked: give one packed batch with its offsets under "
        f"the keyword the model reads: {offsets_keywords()}"
    )


def load_model(spec: CheckSpec) -> tuple[nn.Module, dict]:
    """``(model, batch)`` of ``spec`` (a fresh model on each call), on the spec's device.

    Raises:
        CheckInputError: the callable cannot be imported, raises, or returns something else than
            ``(nn.Module, dict)``; the batch holds no packed offsets (a 1-D integer tensor, a tuple holding
            one, a :class:`~fla_ac_isolation.PackedSeqlens`, or restarting ``position_ids``);
            a seqlens in it on another device type.
    """
    if spec.config is not None:
        from fla_ac_isolation.harness.foreign_models import build_tiny

        model, batch, _ = build_tiny(spec.config, seed=spec.seed)
    else:
        fn = spec.model if callable(spec.model) else load_callable(spec.model)
        try:
            got = fn()
        except Exception as err:
            raise CheckInputError(f"model {spec.model_name!r}: calling it failed: {first_line(err)}") from err
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], nn.Module)
                and isinstance(got[1], dict)):
            raise CheckInputError(f"model {spec.model_name!r} must return (nn.Module, dict of forward keyword "
                                  f"arguments), got {type(got).__name__}")
        model, batch = got
        _require_offsets(batch)
    device = torch.device(spec.device)
    for key, value in batch.items():
        if isinstance(value, PackedSeqlens) and value.device.type != device.type:
            raise CheckInputError(f"batch[{key!r}] is a {type(value).__name__} on {value.device}, the check runs on "
                                  f"{device}: build it from offsets on {device} (a seqlens is not moved)")
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return model.to(device).train(), batch


