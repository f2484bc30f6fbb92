"""``isolate_seqlens(model)``: fresh packed offsets inside every call of the FLA-backed mixers of a model
we do not own (OLMo-core, transformers, torchtitan, or a fork of one of them).

Those models build one ``cu_seqlens`` object per batch and hand it to every FLA-backed layer, so a
checkpointed layer can miss FLA's identity-keyed index cache in its forward and hit it in its recompute
(docs: "The fault in one picture"). :func:`isolate_seqlens` puts the :meth:`~fla_ac_isolation.
LayerLocalSeqlens.local` step in front of each such mixer's own call: a forward pre-hook (with kwargs) on the
mixer replaces every offsets argument by a fresh copy with the same values. The hook runs inside the
mixer's call, so inside whatever region checkpoints it (the block, or the mixer itself), in the forward and
again in the recompute; the copy (:func:`~fla_ac_isolation.local_seqlens.fresh_copy`) is invisible to
dispatch modes (SAC, the audit) and to ``torch.compile``. The model keeps its modules, weights and kernels.

Which mixers and arguments: what :func:`~fla_ac_isolation.families.foreign_mixer` knows (the classes
named in :data:`~fla_ac_isolation.families.FLA_BACKED_MIXERS`, matched by module and class name along the
class hierarchy, so FSDP2's renamed ``FSDP<Name>`` classes are found, and flash-linear-attention's own layers
by a rule over their ``forward``), or the modules a caller names with the arguments it names. Mixers known to
drop the offsets (:data:`~fla_ac_isolation.families.LEAKING_MIXERS`, FLA's ``Mamba2``, ...), and hooked ones
that leak without a package missing here (transformers' Gated DeltaNets without ``causal_conv1d``), are named
in a :class:`LeakingMixerWarning`: their packed documents leak into each other, which no isolation fixes. A hook
(:class:`~fla_ac_isolation.offsets_hook.OffsetsHook`) that receives none of its offsets arguments while the
call carries offsets-like keywords (``cu_seq_lens_q``: the names are wrong) raises at that call; a call
without any (an unpacked batch) passes untouched. Where the foreign forward hands FLA's own keywords on to
the kernel (transformers), the hook also adds the host offsets (``cu_seqlens_cpu``) and FLA's precomputed chunk
schedule (``chunk_indices``), computed once per offsets object from a validated
:class:`~fla_ac_isolation.LayerLocalSeqlens`.

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

from fla_ac_isolation.families import (
    FLA_BACKED_MIXERS,
    FLA_LAYER_MODULES,
    LeakingMixer,
    UpstreamMixer,
    foreign_mixer,
    upstream_mixers,
)
from fla_ac_isolation.offsets_hook import CallCounter, HostOffsets, OffsetsHook

__all__ = ["IsolationHandle", "LeakingMixerWarning", "PartialIsolationWarning", "is_isolated", "isolate_seqlens"]

_MARK = "_fla_ac_isolation_hook"  # in a hooked module's __dict__: the RemovableHandle of its hook


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
    """

    def __init__(self) -> None:
        self.paths: list[str] = []
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


def is_isolated(module: nn.Module) -> bool:
    """``module`` carries a hook of :func:`isolate_seqlens` (not removed)."""
    return _MARK in vars(module)


# ------------------------------------------------------------------------------------------------- API
def _hookable(module: nn.Module, sources: dict) -> tuple[UpstreamMixer, type] | None:
    found = foreign_mixer(module, sources)
    return found if found is not None and isinstance(found[0], UpstreamMixer) and found[0].offsets else None


def _leaking(module: nn.Module, sources: dict) -> tuple[LeakingMixer, type] | None:
    found = foreign_mixer(module, sources)
    return found if found is not None and isinstance(found[0], LeakingMixer) else None


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


def _plan(model: nn.Module, chosen: list | None, arg_names: tuple[str, ...] | None, sources: dict):
    """``[(path, module, names, fla_keywords, matched upstream class or None)]`` to hook."""
    if chosen is None:
        found = [(p, m, k) for p, m in model.named_modules() if (k := _hookable(m, sources)) is not None]
        for p, m, _ in found if arg_names is not None else ():
            _check_accepted(p, m, arg_names)
        return [(p, m, arg_names or k[0].offsets, () if arg_names else k[0].fla_keywords, k) for p, m, k in found]
    plan = []
    for path, module in _resolve(model, chosen):
        leaking = _leaking(module, sources)
        if leaking is not None:
            raise ValueError(
                f"isolate_seqlens: {path!r} ({type(module).__name__}) {leaking[0].why}: documents are not kept "
                f"apart, and isolating its arguments cannot change that; {leaking[0].remedy()}"
            )
        known = _hookable(module, sources)
        if arg_names is None and known is None:
            raise ValueError(
                f"isolate_seqlens: {path!r} ({type(module).__name__}) is not a known FLA-backed mixer; pass "
                "arg_names=[...] naming the forward arguments that carry its offsets"
            )
        if arg_names is not None:
            _check_accepted(path, module, arg_names)
        names = arg_names or known[0].offsets
        plan.append((path, module, names, () if arg_names else known[0].fla_keywords, known))
    return plan


def _warn_leaking(model: nn.Module, sources: dict) -> list[str]:
    """One :class:`LeakingMixerWarning` per class of ``model`` whose packed documents leak: those known to drop
    the offsets (their paths are returned) and those that leak without a package missing here
    (:meth:`~fla_ac_isolation.families.UpstreamMixer.leak`, asked once per class)."""
    by_class: dict[str, tuple[UpstreamMixer | LeakingMixer, list[str]]] = {}
    for path, module in model.named_modules():
        found = foreign_mixer(module, sources)
        if found is not None and (isinstance(found[0], LeakingMixer) or found[0].leaks_without is not None):
            by_class.setdefault(found[0].qualified, (found[0], []))[1].append(path)
    dropping = []
    for entry, paths in by_class.values():
        shown = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
        where = f"{entry.name} ({entry.framework}; {len(paths)} in the model: {shown})"
        if isinstance(entry, LeakingMixer):
            dropping += paths
            text = f"{where} {entry.why}: documents are not kept apart: {entry.remedy()}"
        elif (why := entry.leak()) is not None:
            text = (f"{where} hands FLA its offsets, but {why}: documents are not kept apart: "
                    f"{entry.leak_remedy()}")
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


def _warn_if_forward_overridden(path: str, module: nn.Module, known: tuple[UpstreamMixer, type] | None) -> None:
    if known is None:
        return
    upstream, cls = known
    if type(module).forward is not cls.forward:
        warnings.warn(
            f"isolate_seqlens: {path!r} ({type(module).__name__}) subclasses {upstream.qualified} and overrides "
            f"forward; its offsets are refreshed by the names {list(upstream.offsets)}: check that they still "
            "reach FLA that way (or pass modules= and arg_names=)",
            stacklevel=3,
        )


def _nothing_found(model: nn.Module, leaking: list[str]) -> None:
    """Raise (nothing to isolate) or warn (everything is isolated already)."""
    already = [p for p, m in model.named_modules() if _MARK in vars(m)]
    if already:
        warnings.warn(
            f"isolate_seqlens: nothing new to isolate; the {len(already)} FLA-backed mixer(s) of "
            f"{type(model).__name__} are hooked already ({already[0]!r}, ...)",
            stacklevel=3,
        )
        return
    ours = tuple({family.mixer_class(u) for u, family in upstream_mixers()})
    own = [p for p, m in model.named_modules() if isinstance(m, ours)]
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

    Known mixers (:func:`~fla_ac_isolation.families.foreign_mixer`, matched along the class hierarchy) and
    the arguments refreshed:

    * transformers 5.24's Gated DeltaNets: ``Qwen3_5MoeGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``,
      ``Qwen4ExpTextGatedDeltaNet`` (Qwen3.8-Flash-Next), ``Qwen3NextGatedDeltaNet``, ``OlmoHybridGatedDeltaNet``,
      ``LaraMiniGatedDeltaNet``: ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (keywords, ``[N + 1]`` int32); the hook
      also adds ``cu_seqlens_cpu`` (``[N + 1]`` on the host) and ``chunk_indices`` (``[NT, 2]``, FLA's
      64-token chunk schedule), which transformers hands on to FLA's ``chunk_gated_delta_rule``;
    * flash-linear-attention 0.6's own layers and models (``fla.layers``, ``fla.models``: ``GatedDeltaNet``,
      ``KimiDeltaAttention``, ``GatedLinearAttention``, RWKV7's blocks and feed-forwards, ...), found by a rule
      over the class (:func:`~fla_ac_isolation.families.fla_layer_mixer`): ``cu_seqlens``;
    * torchtitan's ``models.qwen3_5.model.GatedDeltaNet``: ``attention_masks`` (positional), a
      ``VarlenMetadata`` whose ``cu_seq_q``/``cu_seq_k`` are replaced (``_replace``);
    * OLMo-core's ``nn.attention.recurrent.GatedDeltaNet`` and ``nn.attention.kda.KimiDeltaAttention``:
      ``cu_doc_lens`` (``[N + 1]`` int32, keyword or positional).

    Host offsets and FLA's chunk schedule are handed on only where the foreign forward passes FLA's own
    keywords through to the kernel (transformers); the others take neither, so there FLA computes them itself
    on each (fresh) call.

    Mixers known to drop the offsets (:data:`~fla_ac_isolation.families.LEAKING_MIXERS`: transformers'
    ``KimiLinearDeltaAttention``, ``BailingHybridDeltaAttention``, ``Glm5NextTextLinearAttention`` and
    ``NemotronHMamba2Mixer``, OLMo-core's ``NemotronMamba2Mixer``; FLA's ``BasedLinearAttention``,
    ``ReBasedLinearAttention``, ``Mamba``, ``Mamba2``, ``LogLinearMamba2``) are not hooked: a
    :class:`LeakingMixerWarning` per class names them, why, and what to do (``swap_mixers`` where this package
    has a drop-in). transformers' six Gated DeltaNets are hooked, and warned about too when the ``causal_conv1d``
    package cannot be imported: their short conv then runs transformers' torch fallback across document
    boundaries (:attr:`~fla_ac_isolation.families.UpstreamMixer.leaks_without`; ``swap_mixers`` for Qwen3.5(-MoE)
    and Qwen3.8-Flash-Next).

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
    sources: dict = {}  # FLA forward sources read by the FLA rule, once per call
    plan = _plan(model, chosen, names, sources)
    leaking = _warn_leaking(model, sources)
    handle = IsolationHandle()
    host = HostOffsets()
    for path, module, offsets, fla_keywords, known in plan:
        if _MARK in vars(module):  # hooked already, by this call (a module listed twice) or an earlier one
            continue
        _warn_if_forward_overridden(path, module, known)
        registry = known[0].offsets if known is not None else ()
        hook = module.register_forward_pre_hook(
            OffsetsHook(path or type(module).__name__, module, tuple(offsets), tuple(fla_keywords), host,
                        handle._counter, registry),
            with_kwargs=True,
        )
        vars(module)[_MARK] = hook
        handle.paths.append(path)
        handle._hooks.append((weakref.ref(module), hook))
    if not handle.paths:
        _nothing_found(model, leaking)
    elif chosen is not None:
        missed = [p for p, m in model.named_modules() if _hookable(m, sources) is not None and _MARK not in vars(m)]
        if missed:
            warnings.warn(
                f"isolate_seqlens: modules= left {len(missed)} FLA-backed mixer(s) of the model unhooked "
                f"({', '.join(missed[:3])}{', ...' if len(missed) > 3 else ''}); they still share the model's "
                "offsets, so the fault moves to the first of them (isolate every FLA-backed layer)",
                PartialIsolationWarning,
                stacklevel=2,
            )
    return handle
