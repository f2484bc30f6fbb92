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

Which mixers and arguments: :data:`~fla_ac_isolation.families.FLA_BACKED_MIXERS` (matched by module and
class name along the class hierarchy, so FSDP2's renamed ``FSDP<Name>`` classes are found), or the modules a
caller names with the arguments it names. Where the foreign forward hands FLA's own keywords on to the
kernel (transformers), the hook also adds the host offsets (``cu_seqlens_cpu``) and FLA's precomputed chunk
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

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from fla_ac_isolation.families import FLA_BACKED_MIXERS, UpstreamMixer, upstream_mixers
from fla_ac_isolation.local_seqlens import fresh_copy
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["IsolationHandle", "PartialIsolationWarning", "isolate_seqlens"]

_MARK = "_fla_ac_isolation_hook"  # in a hooked module's __dict__: the RemovableHandle of its hook
_CACHE_LIMIT = 8  # offsets objects whose host offsets and schedule are kept (one per live batch)


class PartialIsolationWarning(UserWarning):
    """``modules=`` left FLA-backed mixers of the model unhooked: the fault moves to the next such layer."""


class IsolationHandle:
    """What :func:`isolate_seqlens` returns: the hooked module paths, and :meth:`remove`.

    Also a context manager: ``with isolate_seqlens(model): ...`` removes the hooks on exit.

    Attributes:
        paths: module paths (in ``model``) hooked by this call, in ``named_modules()`` order.
    """

    def __init__(self) -> None:
        self.paths: list[str] = []
        self._hooks: list[tuple[weakref.ref, Any]] = []

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
        return f"IsolationHandle({len(self._hooks)} hooked: {shown})"


# ------------------------------------------------------------------------------------------ fresh copies
def _is_offsets(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point() \
        and not value.is_complex() and value.dtype != torch.bool


def _fresh_offsets(t: torch.Tensor) -> torch.Tensor:
    """``fresh_copy(t)``, keeping ``torch.compile``'s dynamic-shape marking (OLMo-core marks ``cu_doc_lens``)."""
    fresh = fresh_copy(t)
    dynamic = getattr(t, "_dynamo_dynamic_indices", None)
    if dynamic:
        fresh._dynamo_dynamic_indices = set(dynamic)
    return fresh


def _refresh(value: Any, name: str, where: str, memo: dict[int, torch.Tensor]) -> Any:
    """A fresh object for an offsets tensor, or a NamedTuple whose offsets tensors are fresh.

    ``memo`` keeps aliasing inside one call: an object passed twice (``cu_seq_q`` is ``cu_seq_k``) gets one
    copy. ``None`` passes through (an unpacked batch).

    Raises:
        TypeError: ``value`` is neither (e.g. a float tensor named by ``arg_names``).
    """
    if value is None:
        return None
    if _is_offsets(value):
        if id(value) not in memo:
            memo[id(value)] = _fresh_offsets(value)
        return memo[id(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields") and hasattr(value, "_replace"):
        changes = {
            field: _refresh(getattr(value, field), name, where, memo)
            for field in value._fields
            if _is_offsets(getattr(value, field))
        }
        if changes:
            return value._replace(**changes)
    kind = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
        else type(value).__name__
    raise TypeError(
        f"isolate_seqlens: argument {name!r} of {where} is a {kind}; the arguments to isolate must be 1-D "
        "integer offsets tensors (cu_seqlens) or NamedTuples holding them"
    )


# ------------------------------------------------------------------------------------------ host offsets
class _HostOffsets:
    """Per handle: a validated :class:`LayerLocalSeqlens` per offsets object, built once (one host read).

    Keyed by the identity of the model-level offsets object (weakly, so a finished batch's entry goes
    away), so a layer's recompute, which receives the same object, finds the entry its forward built.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, LayerLocalSeqlens]] = {}

    @torch.compiler.disable
    def local(self, offsets: torch.Tensor, name: str, where: str):
        entry = self._by_id.get(id(offsets))
        if entry is None or entry[0]() is not offsets:
            # invisible to SAC and the audit: the recompute finds the entry and runs none of these ops
            with _disable_current_modes(), torch.no_grad():
                try:
                    seqlens = LayerLocalSeqlens(offsets)
                except (TypeError, ValueError) as err:
                    raise type(err)(f"isolate_seqlens: {name} passed to {where} is not valid offsets: {err}") from err
            live = {k: v for k, v in self._by_id.items() if v[0]() is not None}
            self._by_id = dict(list(live.items())[-(_CACHE_LIMIT - 1):])
            entry = (weakref.ref(offsets), seqlens)
            self._by_id[id(offsets)] = entry
        return entry[1].local()


# ------------------------------------------------------------------------------------------------ hook
class _OffsetsHook:
    """The forward pre-hook of one mixer: fresh offsets in, FLA's extra keywords added where accepted."""

    def __init__(self, where: str, module: nn.Module, names: tuple[str, ...], fla_keywords: tuple[str, ...],
                 host: _HostOffsets) -> None:
        self.where = where
        self.names = names
        self.fla_keywords = fla_keywords
        self.host = host
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):  # a forward without a signature: keywords only
            params = []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.positions = {n: positional.index(n) for n in names if n in positional}  # args exclude self

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        memo: dict[int, torch.Tensor] = {}
        first = self.names[0]
        if self.fla_keywords and _is_offsets(kwargs.get(first)):
            local = self.host.local(kwargs[first], first, self.where)
            memo[id(kwargs[first])] = local.cu_seqlens
            extras = {"cu_seqlens_cpu": local.cu_seqlens_cpu, "chunk_indices": local.chunk_indices}
            for key in self.fla_keywords:
                if kwargs.get(key) is None and extras[key] is not None:
                    kwargs[key] = extras[key]
        for name in self.names:
            if name in kwargs:
                kwargs[name] = _refresh(kwargs[name], name, self.where, memo)
            elif name in self.positions and self.positions[name] < len(args):
                i = self.positions[name]
                args = (*args[:i], _refresh(args[i], name, self.where, memo), *args[i + 1:])
        return args, kwargs


# ------------------------------------------------------------------------------------------------- API
def _known(module: nn.Module) -> tuple[UpstreamMixer, type] | None:
    for upstream in FLA_BACKED_MIXERS:
        cls = upstream.in_hierarchy(module)
        if cls is not None:
            return upstream, cls
    return None


def _looked_for() -> str:
    return "; ".join(f"{u.qualified}({', '.join(u.offsets)})" for u in FLA_BACKED_MIXERS)


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


def _plan(model: nn.Module, chosen: list | None, arg_names: tuple[str, ...] | None):
    """``[(path, module, names, fla_keywords, matched upstream class or None)]`` to hook."""
    if chosen is None:
        found = [(p, m, k) for p, m in model.named_modules() if (k := _known(m)) is not None]
        for p, m, _ in found if arg_names is not None else ():
            _check_accepted(p, m, arg_names)
        return [(p, m, arg_names or k[0].offsets, () if arg_names else k[0].fla_keywords, k) for p, m, k in found]
    plan = []
    for path, module in _resolve(model, chosen):
        known = _known(module)
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


def _nothing_found(model: nn.Module) -> None:
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

    Known mixers (:data:`~fla_ac_isolation.families.FLA_BACKED_MIXERS`, matched along the class hierarchy)
    and the arguments refreshed:

    * transformers' ``Qwen3_5MoeGatedDeltaNet``, ``Qwen3_5GatedDeltaNet`` and ``Qwen4ExpTextGatedDeltaNet``
      (Qwen3.8-Flash-Next): ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (keywords, ``[N + 1]`` int32); the hook
      also adds ``cu_seqlens_cpu`` (``[N + 1]`` on the host) and ``chunk_indices`` (``[NT, 2]``, FLA's
      64-token chunk schedule), which transformers hands on to FLA's ``chunk_gated_delta_rule``;
    * torchtitan's ``models.qwen3_5.model.GatedDeltaNet``: ``attention_masks`` (positional), a
      ``VarlenMetadata`` whose ``cu_seq_q``/``cu_seq_k`` are replaced (``_replace``);
    * OLMo-core's ``nn.attention.recurrent.GatedDeltaNet`` and ``nn.attention.kda.KimiDeltaAttention``:
      ``cu_doc_lens`` (``[N + 1]`` int32, keyword or positional).

    Host offsets and FLA's chunk schedule are handed on only where the foreign forward passes FLA's own
    keywords through to the kernel (transformers); OLMo-core's dispatch functions and torchtitan's mixer take
    neither, so there FLA computes them itself on each (fresh) call.

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
        An :class:`IsolationHandle` (``.paths``, ``.remove()``, a context manager). A module hooked by an
        earlier call is skipped (idempotent): a second call returns an empty handle and warns.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``modules`` is not a list of modules/paths;
            ``arg_names`` is not a list of strings. At call time (from the mixer's forward): a named argument
            holds neither an integer offsets tensor nor a NamedTuple holding one.
        ValueError: nothing to isolate (the message lists the classes and arguments looked for); a path of
            ``modules`` is not in ``model``, a module of it is not a submodule, or it is of an unknown class
            without ``arg_names``; empty ``modules`` or ``arg_names``; a name of ``arg_names`` is not an
            argument of a chosen module's forward (one without ``**kwargs``). At call time: transformers' offsets are
            not valid (not starting at 0, decreasing; the checks of :class:`~fla_ac_isolation.LayerLocalSeqlens`).

    Example::

        model = olmo_core_config.build(init_device="meta")
        model.apply_activation_checkpointing(TransformerActivationCheckpointingMode.selected_ops)
        handle = isolate_seqlens(model)   # handle.paths == ['blocks.0._checkpoint_wrapped_module.attention', ...]
    """
    chosen, names = _check_arguments(model, modules, arg_names)
    plan = _plan(model, chosen, names)
    handle = IsolationHandle()
    host = _HostOffsets()
    for path, module, offsets, fla_keywords, known in plan:
        if _MARK in vars(module):  # hooked already, by this call (a module listed twice) or an earlier one
            continue
        _warn_if_forward_overridden(path, module, known)
        hook = module.register_forward_pre_hook(
            _OffsetsHook(path or type(module).__name__, module, tuple(offsets), tuple(fla_keywords), host),
            with_kwargs=True,
        )
        vars(module)[_MARK] = hook
        handle.paths.append(path)
        handle._hooks.append((weakref.ref(module), hook))
    if not handle.paths:
        _nothing_found(model)
    elif chosen is not None:
        missed = [p for p, m in model.named_modules() if _known(m) is not None and _MARK not in vars(m)]
        if missed:
            warnings.warn(
                f"isolate_seqlens: modules= left {len(missed)} FLA-backed mixer(s) of the model unhooked "
                f"({', '.join(missed[:3])}{', ...' if len(missed) > 3 else ''}); they still share the model's "
                "offsets, so the fault moves to the first of them (isolate every FLA-backed layer)",
                PartialIsolationWarning,
                stacklevel=2,
            )
    return handle
