"""``isolate_seqlens(model)``: fresh packed offsets inside every call of the FLA-backed mixers of a model we do not
own (OLMo-core, transformers, torchtitan, forks), by a forward pre-hook per mixer; modules and weights are kept.

Cost per hooked call: a copy of the ``[N + 1]`` offsets, and one graph break under ``torch.compile``.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from fla_ac_isolation.foreign_classes import (
    FLA_BACKED_MIXERS,
    FLA_LAYER_MODULES,
    LeakingMixer,
    UpstreamMixer,
    leak_remedy,
    remedy,
)
from fla_ac_isolation.mixer_plan import DROP_IN, EXPOSED, HOOKED, PlannedMixer, classify
from fla_ac_isolation.offsets_hook import HOOK_ATTRIBUTE, CallCounter, HostOffsets, OffsetsHook, is_isolated

__all__ = ["IsolationHandle", "LeakingMixerWarning", "PartialIsolationWarning", "is_isolated", "isolate_seqlens"]

_MARK = HOOK_ATTRIBUTE


class PartialIsolationWarning(UserWarning):
    """``modules=`` left FLA-backed mixers of the model unhooked: the fault moves to the next such layer."""


class LeakingMixerWarning(UserWarning):
    """The model holds mixers whose packed documents are not kept apart (an upstream bug no isolation fixes); the
    message names the class, how it leaks and what to do."""


class IsolationHandle:
    """What :func:`isolate_seqlens` returns; a context manager that removes the hooks on exit.

    Attributes:
        paths: module paths (in ``model``) hooked by this call, in ``named_modules()`` order.
        plan: the model as :func:`~fla_ac_isolation.mixer_plan.classify` found it before this call hooked it.
    """

    def __init__(self, plan: tuple[PlannedMixer, ...] = ()) -> None:
        self.paths: list[str] = []
        self.plan = plan
        self._hooks: list[tuple[weakref.ref, Any]] = []
        self._counter = CallCounter()

    @property
    def rewritten(self) -> int:
        """Mixer calls whose offsets the hooks replaced (forward and recompute count once each; unpacked calls not)."""
        return self._counter.rewritten

    def remove(self) -> None:
        """Remove this call's hooks (idempotent)."""
        for ref, hook in self._hooks:
            hook.remove()
            module = ref()
            if module is not None and vars(module).get(_MARK) is hook:
                del vars(module)[_MARK]
        self._hooks.clear()

    def __enter__(self) -> IsolationHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        shown = ", ".join(self.paths[:3]) + (", ..." if len(self.paths) > 3 else "")
        return f"IsolationHandle({len(self._hooks)} hooked, {self.rewritten} calls rewritten: {shown})"


# ------------------------------------------------------------------------------------------------- API
def _looked_for() -> str:
    named = "; ".join(f"{u.qualified}({', '.join(u.offsets)})" for u in FLA_BACKED_MIXERS)
    return f"{named}; and flash-linear-attention's layers ({', '.join(FLA_LAYER_MODULES)}) reading cu_seqlens"


def _check_arguments(model: Any, modules: Any, arg_names: Any) -> tuple[list | None, tuple[str, ...] | None]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = None
    if arg_names is not None:
        if not isinstance(arg_names, (list, tuple)) or not all(isinstance(n, str) for n in arg_names):
            raise TypeError(f"arg_names must be a list of argument names (str), got {arg_names!r}")
        names = tuple(arg_names)
        if not names:
            raise ValueError("arg_names must name at least one argument")
    chosen = None
    if modules is not None:
        if isinstance(modules, (str, nn.Module)) or not isinstance(modules, Iterable):
            raise TypeError(f"modules must be a list of modules or module paths, got {type(modules).__name__}")
        chosen = list(modules)
        if not chosen:
            raise ValueError("modules must name at least one module (or be None: the known FLA-backed mixers)")
    return chosen, names


def _resolve(model: nn.Module, chosen: list) -> list[tuple[str, nn.Module]]:
    paths = {id(m): p for p, m in model.named_modules()}
    out = []
    for i, entry in enumerate(chosen):
        if isinstance(entry, str):
            try:
                module = model.get_submodule(entry)
            except AttributeError as err:
                raise ValueError(f"modules[{i}] = {entry!r} is not a submodule path of the model: {err}") from None
            out.append((entry, module))
        elif isinstance(entry, nn.Module):
            if id(entry) not in paths:
                raise ValueError(f"modules[{i}] ({type(entry).__name__}) is not a submodule of the model")
            out.append((paths[id(entry)], entry))
        else:
            raise TypeError(f"modules[{i}] must be an nn.Module or a module path (str), got {type(entry).__name__}")
    return out


def _hookable(planned: PlannedMixer | None) -> bool:
    return planned is not None and planned.status in (EXPOSED, HOOKED)


def _targets(model: nn.Module, plan: tuple[PlannedMixer, ...], chosen: list | None,
             arg_names: tuple[str, ...] | None) -> list[tuple[str, nn.Module, tuple, tuple, PlannedMixer | None]]:
    """``[(path, module, names, fla_keywords, its plan entry or None)]`` to hook."""
    if chosen is None:
        found = [p for p in plan if _hookable(p)]
        for p in found if arg_names is not None else ():
            _check_accepted(p.path, p.module, arg_names)
        return [(p.path, p.module, arg_names or p.entry.offsets, () if arg_names else p.entry.fla_keywords, p)
                for p in found]
    by_module = {id(p.module): p for p in plan}
    targets = []
    for path, module in _resolve(model, chosen):
        planned = by_module.get(id(module))
        if planned is not None and isinstance(planned.entry, LeakingMixer):
            raise ValueError(
                f"isolate_seqlens: {path!r} ({type(module).__name__}) {planned.entry.why}: documents are not kept "
                f"apart, and isolating its arguments cannot change that; {remedy(planned.entry)}"
            )
        known = planned if _hookable(planned) else None
        if arg_names is None and known is None:
            raise ValueError(
                f"isolate_seqlens: {path!r} ({type(module).__name__}) is not a known FLA-backed mixer; pass "
                "arg_names=[...] naming the forward arguments that carry its offsets"
            )
        if arg_names is not None:
            _check_accepted(path, module, arg_names)
        names = arg_names or known.entry.offsets
        targets.append((path, module, names, () if arg_names else known.entry.fla_keywords, known))
    return targets


def _warn_leaking(plan: tuple[PlannedMixer, ...]) -> list[str]:
    """One :class:`LeakingMixerWarning` per leaking class of the plan; returns the paths of those that drop offsets."""
    by_class: dict[str, tuple[UpstreamMixer | LeakingMixer, list[str]]] = {}
    for p in plan:
        if isinstance(p.entry, LeakingMixer) or (isinstance(p.entry, UpstreamMixer) and p.entry.leaks_without):
            by_class.setdefault(p.entry.qualified, (p.entry, []))[1].append(p.path)
    dropping = []
    for entry, paths in by_class.values():
        shown = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
        where = f"{entry.name} ({entry.framework}; {len(paths)} in the model: {shown})"
        if isinstance(entry, LeakingMixer):
            dropping += paths
            text = f"{where} {entry.why}: documents are not kept apart: {remedy(entry)}"
        elif (why := entry.leak()) is not None:
            text = (f"{where} hands FLA its offsets, but {why}: documents are not kept apart: "
                    f"{leak_remedy(entry)}")
        else:
            continue
        warnings.warn(f"isolate_seqlens: {text}", LeakingMixerWarning, stacklevel=3)
    return dropping


def _check_accepted(path: str, module: nn.Module, arg_names: tuple[str, ...]) -> None:
    """Refuse an ``arg_names`` entry that ``module.forward`` cannot receive (unchecked with ``**kwargs``)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind is not p.VAR_POSITIONAL]
    missing = [n for n in arg_names if n not in accepted]
    if missing:
        raise ValueError(
            f"isolate_seqlens: arg_names {missing} are not arguments of the forward of {path!r} "
            f"({type(module).__name__}), which takes {accepted}; the offsets would never be refreshed"
        )


def _warn_if_forward_overridden(path: str, module: nn.Module, known: PlannedMixer | None) -> None:
    if known is None:
        return
    upstream, cls = known.entry, known.matched
    if type(module).forward is not cls.forward:
        warnings.warn(
            f"isolate_seqlens: {path!r} ({type(module).__name__}) subclasses {upstream.qualified} and overrides "
            f"forward; its offsets are refreshed by the names {list(upstream.offsets)}: check that they still "
            "reach FLA that way (or pass modules= and arg_names=)",
            stacklevel=3,
        )


def _nothing_found(model: nn.Module, plan: tuple[PlannedMixer, ...], leaking: list[str]) -> None:
    """Raise (nothing to isolate) or warn (everything is isolated already)."""
    already = [p for p, m in model.named_modules() if is_isolated(m)]
    if already:
        warnings.warn(
            f"isolate_seqlens: nothing new to isolate; the {len(already)} FLA-backed mixer(s) of "
            f"{type(model).__name__} are hooked already ({already[0]!r}, ...)",
            stacklevel=3,
        )
        return
    own = [p.path for p in plan if p.status == DROP_IN]
    hint = (f"; its {len(own)} fla_ac_isolation mixer(s) ({own[0]!r}, ...) take fresh offsets themselves"
            if own else "")
    if leaking:
        hint += (f"; its {len(leaking)} mixer(s) that drop the offsets ({leaking[0]!r}, ...: see the "
                 "LeakingMixerWarning) have nothing to isolate")
    raise ValueError(
        f"isolate_seqlens found no FLA-backed mixer in {type(model).__name__}{hint}; looked for {_looked_for()}; "
        "pass modules=[...] and arg_names=[...] for other FLA-backed modules"
    )


def isolate_seqlens(
    model: nn.Module,
    *,
    modules: Iterable[nn.Module | str] | None = None,
    arg_names: Sequence[str] | None = None,
) -> IsolationHandle:
    """Make every call of each FLA-backed mixer of ``model`` take fresh packed offsets, inside its own call.

    The hooks sit on the mixers, so their order relative to AC wrappers, ``torch.compile`` and FSDP2 does not
    matter. Which classes are hooked: ``docs/foreign-classes.md``. Classes that leak documents (not hooked if they
    drop the offsets) get a :class:`LeakingMixerWarning`. A hooked call carrying offsets-like keywords (``cu_*``)
    but none of the hook's arguments raises; a call without any (unpacked) passes untouched.

    Args:
        model: the model, changed in place (hooks only).
        modules: hook these modules (objects inside ``model`` or paths such as ``"blocks.0.attention"``) instead of
            the known classes; known FLA-backed mixers left unhooked give a :class:`PartialIsolationWarning`.
        arg_names: the forward arguments (keyword or positional) that carry the offsets: ``[N + 1]`` int32/int64
            tensors or NamedTuples holding them. Needed for unknown classes; overrides the registry's names.

    Returns:
        An :class:`IsolationHandle`. Modules hooked by an earlier call are skipped: a second call warns and returns
        an empty handle.

    Raises:
        TypeError: ``model`` not an ``nn.Module``, ``modules``/``arg_names`` of the wrong type; at call time, a
            named argument holding no integer offsets tensor.
        ValueError: nothing to isolate; a ``modules`` entry not in ``model``, of an unknown class without
            ``arg_names``, or known to drop offsets; empty ``modules``/``arg_names``; an ``arg_names`` entry the
            forward does not take. At call time: offsets-like keywords but none of the hook's arguments; invalid
            transformers offsets.

    Usage: ``docs/olmo-core.md``, ``docs/torchtitan.md``.
    """
    chosen, names = _check_arguments(model, modules, arg_names)
    plan = classify(model)  # every module classified once; warnings, targets and the handle read this plan
    targets = _targets(model, plan, chosen, names)
    leaking = _warn_leaking(plan)
    handle = IsolationHandle(plan)
    host = HostOffsets()
    for path, module, offsets, fla_keywords, known in targets:
        if _MARK in vars(module):  # hooked already, by this call (a module listed twice) or an earlier one
            continue
        _warn_if_forward_overridden(path, module, known)
        registry = known.entry.offsets if known is not None else ()
        hook = module.register_forward_pre_hook(
            OffsetsHook(path or type(module).__name__, module, tuple(offsets), tuple(fla_keywords), host,
                        handle._counter, registry),
            with_kwargs=True,
        )
        vars(module)[_MARK] = hook
        handle.paths.append(path)
        handle._hooks.append((weakref.ref(module), hook))
    if not handle.paths:
        _nothing_found(model, plan, leaking)
    elif chosen is not None:
        missed = [p.path for p in plan if _hookable(p) and not is_isolated(p.module)]
        if missed:
            warnings.warn(
                f"isolate_seqlens: modules= left {len(missed)} FLA-backed mixer(s) of the model unhooked "
                f"({', '.join(missed[:3])}{', ...' if len(missed) > 3 else ''}); they still share the model's "
                "offsets, so the fault moves to the first of them (isolate every FLA-backed layer)",
                PartialIsolationWarning,
                stacklevel=2,
            )
    return handle
