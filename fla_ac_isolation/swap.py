"""``swap_mixers``: replace a transformers (or OLMo-core) model's mixers, in place, by this package's drop-ins
(:mod:`fla_ac_isolation.mixers`), which isolate the offsets in their own forward (``docs/swap.md``).

Only exact classes of :data:`SUPPORTED_MIXERS` are swapped (a subclass may change ``forward``). OLMo-core's
``GatedDeltaNet`` and ``KimiDeltaAttention`` are not: :func:`~fla_ac_isolation.isolate_seqlens` fixes them in place.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from fla_ac_isolation.families import Family, UpstreamMixer, upstream_mixers
from fla_ac_isolation.mixers.lending import (
    keep_original,
    original_of,
    release_original,
    share_tensors,
    strip_tensors,
)
from fla_ac_isolation.ops.backend import check_backend

__all__ = ["SUPPORTED_MIXERS", "restore_mixers", "swap_mixers"]

SUPPORTED_MIXERS: tuple[UpstreamMixer, ...] = tuple(upstream for upstream, _ in upstream_mixers())
"""Upstream mixer classes :func:`swap_mixers` replaces (matched by module and class name), from the families."""


def _family_of(module: nn.Module) -> tuple[UpstreamMixer, Family] | None:
    return next(((u, f) for u, f in upstream_mixers() if u.matches(module)), None)


def _looked_for() -> str:
    return ", ".join(t.qualified for t in SUPPORTED_MIXERS)


# ------------------------------------------------------------------------------------------ discovery
def _config_for(model: nn.Module, path: str, mixer: nn.Module, config: Any) -> Any:
    """The (text) config a mixer was built from: ``config``, the mixer's own, or its nearest ancestor's."""
    found = config if config is not None else getattr(mixer, "config", None)
    if found is None:
        parts = path.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = model.get_submodule(".".join(parts[:depth]))
            found = getattr(ancestor, "config", None)
            if found is not None:
                break
    if found is None:
        raise ValueError(
            f"swap_mixers found no config for {path!r} ({type(mixer).__name__}): neither it nor a module above it "
            "has a `config`; pass swap_mixers(model, config=...) (the model's text config)"
        )
    get_text_config = getattr(found, "get_text_config", None)
    return get_text_config(decoder=True) if callable(get_text_config) else found


def _check_swappable(path: str, mixer: nn.Module) -> None:
    """Refuse mixers that FSDP2, TP or accelerate already hold by reference (hooks) or have sharded (DTensor)."""
    for name, sub in mixer.named_modules():
        hooked = [
            attr
            for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
            if getattr(sub, attr, None)
        ]
        if hasattr(sub, "_hf_hook"):
            hooked.append("_hf_hook (accelerate)")
        if hooked:
            where = f"{path}.{name}" if name else path
            raise ValueError(
                f"swap_mixers cannot swap {path!r}: {where!r} carries module hooks ({', '.join(hooked)}); "
                "call swap_mixers before wrapping or dispatching the model (FSDP, accelerate device_map, ...)"
            )
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


def _install(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, module)


def _build(family: Family, upstream: UpstreamMixer, original: nn.Module, config: Any, backend: str,
           path: str) -> nn.Module:
    cls = family.mixer_class(upstream)
    if upstream.config is None:  # configured by its attributes (OLMo-core): the replacement reads them
        config = cls.config_from(original)
    layer_idx = getattr(original, "layer_idx", None)
    with torch.device("meta"):
        new = cls(config, layer_idx, backend=backend)
    share_tensors(original, new, f"swap_mixers({path!r})")
    new.train(original.training)
    return new


# ---------------------------------------------------------------------------------------------- API
def swap_mixers(model: nn.Module, backend: str = "auto", *, config: Any = None) -> list[str]:
    """Replace, in place, every supported transformers mixer of ``model`` with this package's drop-in.

    The replacement shares the existing parameter and buffer objects (nothing copied or re-initialised, same
    ``state_dict()`` keys, an existing optimizer still works). All mixers are swapped, or on an error none.
    Swap after init and before FSDP/TP/PEFT/accelerate dispatch.

    Args:
        model: a module holding supported mixers (transformers models, an OLMo-core ``Transformer`` with
            ``NemotronMamba2Mixer`` blocks, FLA's ``Mamba2ForCausalLM``), on any device including ``meta``.
        backend: ``"auto"`` (FLA on CUDA tensors, the pure-torch reference elsewhere), ``"fla"`` or ``"reference"``.
        config: the text config the mixers were built from; when ``None``, found on the mixer or the nearest module
            above it (unused for OLMo-core's and FLA's Mamba2).

    Returns:
        The module paths swapped; ``[]`` with a ``UserWarning`` when only this package's mixers are found.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: a bad ``backend``; ``model`` is itself a mixer; no supported or swapped mixer found; a mixer
            carries module hooks or DTensor parameters; no ``config`` found; the replacement refuses the config (a
            missing field or an unsupported value, ``layer_types`` shorter than a mixer's ``layer_idx``).
        RuntimeError: the replacement does not declare the original's parameters and buffers (names, kinds,
            shapes), e.g. ``config`` belongs to another model.

    Example::

        model = Qwen3_5MoeForCausalLM(config)
        swap_mixers(model)              # ['model.layers.0.linear_attn', ...]
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": sac_context_fn(save_all_copies())})
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_backend(backend)
    ours = tuple({family.mixer_class(upstream) for upstream, family in upstream_mixers()})
    found: list[tuple[str, nn.Module, Family, UpstreamMixer]] = []
    swapped_before: list[str] = []  # swapped earlier, or built from fla_ac_isolation.mixers directly
    for path, module in model.named_modules():
        if original_of(module) is not None or isinstance(module, ours):
            swapped_before.append(path)
            continue
        match = _family_of(module)
        if match is not None:
            if not path:
                raise ValueError("swap_mixers needs the model (or a module) containing the mixer, not the mixer itself")
            found.append((path, module, match[1], match[0]))
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

    replacements = []
    for path, original, family, upstream in found:  # build all first: an error leaves the model untouched
        _check_swappable(path, original)
        found_config = None if upstream.config is None else _config_for(model, path, original, config)
        new = _build(family, upstream, original, found_config, backend, path)
        replacements.append((path, original, new))
    for path, original, new in replacements:
        strip_tensors(original)
        keep_original(new, original)
        _install(model, path, new)
    return [path for path, _, _ in replacements]


def restore_mixers(model: nn.Module) -> list[str]:
    """Undo :func:`swap_mixers`: put the original mixers back on the tensors the swapped ones hold now (no copy).

    Args:
        model: the module :func:`swap_mixers` was called on, or any module containing swapped mixers.

    Returns:
        The module paths restored; ``[]`` (with a ``UserWarning``) when ``model`` holds no swapped mixer.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``model`` is itself a swapped mixer (pass the module containing it).
        RuntimeError: a swapped mixer's parameter/buffer names or kinds no longer match the original's; the
            mixers before it (``named_modules()`` order) are restored already.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if original_of(model) is not None:
        raise ValueError(
            "restore_mixers needs the model (or a module) containing the swapped mixer, not the swapped mixer itself"
        )
    restored = []
    for path, module in list(model.named_modules()):
        original = original_of(module)
        if original is None:
            continue
        share_tensors(module, original, f"restore_mixers({path!r})")
        original.train(module.training)
        release_original(module)
        _install(model, path, original)
        restored.append(path)
    if not restored:
        warnings.warn(
            f"restore_mixers: {type(model).__name__} holds no swapped mixer; nothing to restore", stacklevel=2
        )
    return restored
