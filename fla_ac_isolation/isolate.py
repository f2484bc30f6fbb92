"""``isolate_seqlens(model)``: fresh packed offsets inside every call of the FLA-backed mixers of a model
we do not own (OLMo-core, transformers, torchtitan, or a fork of one of them).

Those models hand one ``cu_seqlens`` object to every FLA-backed layer, so a checkpointed layer can miss FLA's
identity-keyed index cache in its forward and hit it in its recompute (docs: "The fault in one picture"). A
forward pre-hook on each such mixer (:class:`~fla_ac_isolation.offsets_hook.OffsetsHook`) replaces its offsets
arguments by fresh copies inside the mixer's call, in the forward and again in the recompute; which mixers, which
arguments and what is refused or warned about: :func:`isolate_seqlens`. The model keeps its modules, weights and
kernels.

Cost per hooked call: one copy of the ``[N + 1]`` offsets (plus, with host offsets, of the host offsets and
the ``[NT, 2]`` schedule), and one graph break per mixer call under ``torch.compile``. With host offsets, one
device-to-host copy of the offsets per batch (per new offsets object), where the kernel would otherwise make
one per cache miss.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from fla_ac_isolation.families import leak_remedy, remedy
from fla_ac_isolation.foreign_classes import FLA_BACKED_MIXERS, FLA_LAYER_MODULES, LeakingMixer, UpstreamMixer
from fla_ac_isolation.mixer_plan import DROP_IN, EXPOSED, HOOKED, PlannedMixer, classify
from fla_ac_isolation.offsets_hook import HOOK_ATTRIBUTE, CallCounter, HostOffsets, OffsetsHook, is_isolated

__all__ = ["IsolationHandle", "LeakingMixerWarning", "PartialIsolationWarning", "is_isolated", "isolate_seqlens"]

_MARK = HOOK_ATTRIBUTE


class PartialIsolationWarning(UserWarning):
    """``modules=`` left FLA-backed mixers of the model unhooked: the fault moves to the next such layer."""


class LeakingMixerWarning(UserWarning):
    """The model holds mixers whose packed documents are not kept apart: classes known to drop the offsets, or
    classes that leak without a package missing here (transformers' Gated DeltaNets without ``causal_conv1d``:
    their conv). A correctness bug of the upstream class that no isolation fixes; the message names the class,
    how it leaks and what to do."""


class IsolationHandle:
    """What :func:`isolate_seqlens` returns: the hooked module paths, the calls rewritten, and :meth:`remove`.

    Also a context manager: ``with isolate_seqlens(model): ...`` removes the hooks on exit.

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
        """Mixer calls whose offsets this handle's hooks replaced by fresh copies (a checkpointed mixer counts
        once in its forward and once in its recompute; an unpacked call, without offsets, does not count)."""
        return self._counter.rewritten

    def remove(self) -> None:
        """Remove this call's hooks (the modules receive the model's shared offsets again). Idempotent."""
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
    """One :class:`LeakingMixerWarning` per class of the plan whose packed documents leak: those known to drop
    the offsets (their paths are returned) and those that leak without a package missing here
    (:meth:`~fla_ac_isolation.foreign_classes.UpstreamMixer.leak`, asked once per class)."""
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
    """Refuse an ``arg_names`` entry that ``module.forward`` cannot receive (the hook would never see it).

    A forward taking ``**kwargs``, or without a signature, may receive any name: nothing is checked.
    """
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

    Hooks (``register_forward_pre_hook(..., with_kwargs=True)``) go on the mixer modules themselves, so the
    order relative to activation checkpointing (any wrapper: torch's ``checkpoint_wrapper``, OLMo-core's
    ``apply_activation_checkpointing``, transformers' ``gradient_checkpointing_enable``, torchtitan's AC),
    ``torch.compile`` (``module.compile()``, ``torch.compile(model)``) and FSDP2 (``fully_shard``) does not
    matter. The offsets arguments are replaced per call by copies with equal values that no dispatch mode
    sees (:func:`~fla_ac_isolation.local_seqlens.fresh_copy`), so a layer's forward and its recompute both
    start with an FLA cache miss.

    Which classes are hooked, through which arguments, and which are only warned about: the table of
    ``docs/foreign-classes.md``, rendered from :mod:`fla_ac_isolation.foreign_classes` (classes named one by
    one, and a rule over flash-linear-attention's own layers). The model is classified once
    (:func:`~fla_ac_isolation.mixer_plan.classify`); the handle keeps that plan (:attr:`IsolationHandle.plan`).
    Host offsets (``cu_seqlens_cpu``) and FLA's chunk schedule (``chunk_indices``) are added only where the
    foreign forward passes FLA's own keywords through to the kernel (transformers); elsewhere FLA computes them
    itself on each (fresh) call.

    Mixers known to drop the offsets are not hooked: a :class:`LeakingMixerWarning` per class names them, why,
    and what to do (``swap_mixers`` where this package has a drop-in). Hooked classes that leak without a
    package missing here (transformers' Gated DeltaNets without ``causal_conv1d``: their short conv runs across
    document boundaries; :attr:`~fla_ac_isolation.foreign_classes.UpstreamMixer.leaks_without`) are hooked and
    warned about too.

    A hook never passes a packed call silently: when none of its arguments arrives but the call carries
    offsets-like keywords (a 1-D integer tensor under a name starting with ``cu_``, e.g. ``cu_seq_lens_q``),
    the shared offsets would reach FLA untouched, so the call raises. A call without any (an unpacked batch)
    passes untouched.

    Args:
        model: the model (any ``nn.Module``); it is changed in place (hooks only).
        modules: hook these modules instead of the known classes: module objects inside ``model`` or paths
            (``"blocks.0.attention"``). A module of a known class keeps its registry arguments unless
            ``arg_names`` is given. When known FLA-backed mixers of ``model`` stay unhooked, a
            :class:`PartialIsolationWarning` is emitted: their shared offsets move the fault to them.
        arg_names: the forward arguments (keyword or positional) that carry the offsets: 1-D integer
            tensors (``[N + 1]`` ``cu_seqlens``, int32/int64) or NamedTuples holding them. Needed for
            modules of unknown classes; overrides the registry's names (and adds no FLA keywords) otherwise.

    Returns:
        An :class:`IsolationHandle` (``.paths``, ``.rewritten``: calls whose offsets were replaced, ``.remove()``,
        a context manager). A module hooked by an earlier call is skipped (idempotent): a second call returns an
        empty handle and warns.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``modules`` is not a list of modules/paths;
            ``arg_names`` is not a list of strings. At call time (from the mixer's forward): a named argument
            holds neither an integer offsets tensor nor a NamedTuple holding one.
        ValueError: nothing to isolate (the message lists the classes and arguments looked for, and the
            leaking mixers found); a path of ``modules`` is not in ``model``, a module of it is not a submodule,
            is of an unknown class without ``arg_names``, or is known to drop offsets (isolating it changes
            nothing); empty ``modules`` or ``arg_names``; a name of ``arg_names`` is not an argument of a
            chosen module's forward (one without ``**kwargs``). At call time: none of the hook's arguments
            arrived but offsets-like keywords did (the message names both, and the fix); transformers' offsets
            are not valid (not starting at 0, decreasing; the checks of :class:`~fla_ac_isolation.LayerLocalSeqlens`).

    Example::

        model = olmo_core_config.build(init_device="meta")
        model.apply_activation_checkpointing(TransformerActivationCheckpointingMode.selected_ops)
        handle = isolate_seqlens(model)   # handle.paths == ['blocks.0._checkpoint_wrapped_module.attention', ...]
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
