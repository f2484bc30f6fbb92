"""Applying a SAC policy: :func:`sac_context_fn` (a checkpoint ``context_fn``) and :func:`checkpoint_layers`
(checkpoint every ``freq``-th layer); both re-exported by :mod:`fla_ac_isolation.policies`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["Policy", "check_policy", "checkpoint_layers", "find_layers", "sac_context_fn"]

Policy = Callable[..., CheckpointPolicy]
"""A SAC policy: ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``."""


def check_policy(policy: Any) -> None:
    """Reject what is not a policy function, e.g. the factory ``save_all_copies`` instead of its result.

    Raises:
        TypeError: ``policy`` is not callable, or does not take ``(ctx, op)``.
    """
    import inspect

    if not callable(policy):
        raise TypeError(f"policy must be a SAC policy function (ctx, op, *args, **kwargs), got {policy!r}")
    try:
        inspect.signature(policy).bind(None, None)
    except TypeError:
        name = getattr(policy, "__name__", repr(policy))
        raise TypeError(
            f"policy must be a SAC policy function (ctx, op, *args, **kwargs), but {name} does not take "
            f"(ctx, op); did you mean {name}() (policy constructors return the policy)?"
        ) from None
    except ValueError:  # builtins without a signature: let torch call them
        pass


def sac_context_fn(policy: Policy) -> Callable[[], tuple]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (or transformers'
    ``gradient_checkpointing_kwargs``).

    A policy with ``fresh()`` is renewed per checkpointed call. Inside each eager region ``torch.autocast``'s
    weight-cast cache is off, so a backward inside an autocast block recomputes the casts its forward ran (with
    torch's contexts alone SAC misaligns the saved ``_to_copy`` ops).

    Raises:
        TypeError: ``policy`` does not take ``(ctx, op, ...)``, e.g. ``save_all_copies`` given uncalled.
    """

    check_policy(policy)

    def context_fn():
        p = policy.fresh() if hasattr(policy, "fresh") else policy
        forward, recompute = create_selective_checkpoint_contexts(p)
        if torch.compiler.is_compiling():  # compiled regions take torch's modes as they are
            return forward, recompute
        return _without_autocast_cache(forward), _without_autocast_cache(recompute)

    return context_fn


class _without_autocast_cache:  # noqa: N801 - used like a function
    """``mode`` entered with ``torch.autocast``'s weight-cast cache off (re-enterable; torch issue #193338)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.enabled: list[bool] = []

    def __enter__(self) -> Any:
        self.enabled.append(torch.is_autocast_cache_enabled())
        torch.set_autocast_cache_enabled(False)
        try:
            return self.mode.__enter__()
        except BaseException:
            torch.set_autocast_cache_enabled(self.enabled.pop())
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.mode.__exit__(*exc)
        finally:
            torch.set_autocast_cache_enabled(self.enabled.pop())

    def __getattr__(self, name: str) -> Any:  # torch's mode's own state (e.g. SAC's ``storage``)
        if name in ("mode", "enabled"):
            raise AttributeError(name)
        return getattr(self.mode, name)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_layers(layers_or_model: nn.Module) -> nn.Module:
    """The layer container :func:`checkpoint_layers` wraps; ``ValueError`` when there is none."""
    if isinstance(layers_or_model, _CONTAINERS):
        return layers_or_model
    for path in ("layers", "model.layers", "backbone.layers", "model.language_model.layers", "blocks"):
        obj: Any = layers_or_model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, _CONTAINERS):
            return obj
    for _, module in layers_or_model.named_modules():
        if isinstance(module, nn.ModuleList):
            return module
    raise ValueError(
        "layers_or_model must be an nn.ModuleList/nn.Sequential/nn.ModuleDict of layers or a model with a "
        f"`layers` container, got {type(layers_or_model).__name__}"
    )


def checkpoint_layers(
    layers_or_model: nn.Module,
    mode: Literal["full", "selective"] = "full",
    policy: Policy | None = None,
    freq: int = 1,
    *,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
) -> nn.Module:
    """Wrap every ``freq``-th layer (indices 0, freq, 2*freq, ...) in a non-reentrant checkpoint.

    Uses torch's ``checkpoint_wrapper`` (``state_dict()`` keys unchanged); layers already wrapped are left alone.

    Args:
        layers_or_model: an ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict`` of layers (in insertion order),
            or a model holding one (``layers``, ``model.layers``, ``backbone.layers``, ``blocks``, or the first
            ModuleList).
        mode: ``"full"`` recomputes everything; ``"selective"`` saves what ``policy`` says.
        policy: SAC policy (required for ``"selective"``, forbidden for ``"full"``).

    Returns:
        The layer container (modified in place).

    Raises:
        ValueError: unknown ``mode``, ``freq`` < 1, ``policy`` missing or superfluous, no layers found.
        TypeError: ``policy`` is not a policy function (e.g. the constructor ``save_all_copies`` itself).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    if mode not in ("full", "selective"):
        raise ValueError(f"mode must be 'full' or 'selective', got {mode!r}")
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ValueError(f"freq must be an int >= 1, got {freq!r}")
    if mode == "selective" and policy is None:
        raise ValueError("mode='selective' needs a policy, e.g. policies.save_device_to_host_copies()")
    if mode == "full" and policy is not None:
        raise ValueError("mode='full' takes no policy; use mode='selective' to apply one")
    layers = find_layers(layers_or_model)
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else list(range(len(layers)))
    kwargs: dict[str, Any] = {"preserve_rng_state": preserve_rng_state, "early_stop": early_stop}
    if mode == "selective":
        kwargs["context_fn"] = sac_context_fn(policy)
    for i, key in enumerate(keys):
        layer = layers[key]
        if i % freq or isinstance(layer, CheckpointWrapper):
            continue
        layers[key] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
    return layers

