"""ReplayAudit: name the first op where a checkpointed region's recompute diverges from its forward.

Activation checkpointing reruns each checkpointed region (the *recompute*) during backward. Selective AC
(SAC) hands the recompute the outputs it saved in forward by op and invocation index (torch >= 2.13) or
from one FIFO queue per op (torch 2.11); both assume that the recompute runs the same aten ops, in the
same order, as the forward. When the region consults state that changed in between (FLA's identity-keyed
``tensor_cache``, a memoised mask builder, a global flag), the two passes differ, and SAC replays saved
tensors into the wrong ops: an error far from the cause, or silently wrong gradients.

:class:`ReplayAudit` records, for every checkpointed region, the ops of its forward and of each of its
recomputes and compares them op by op. Per recorded op it keeps the op overload (e.g.
``aten.sub.Tensor``) and, per output tensor, its shape, dtype and device, never a tensor. Ops that SAC
itself ignores (``aten.detach``, ``prim.device`` and tensor-metadata ops) are ignored here too.

While the audit is active (``with ReplayAudit(): ...``) it also runs FLA's cache probe
(:func:`~fla_ac_isolation.fla_cache.probe_tensor_cache`), and slices its hit/miss events per region and
pass, so a divergence caused by FLA names the index helper whose cache state differed, and every region
reports its cache telemetry.

How regions are found:

* ``with ReplayAudit():`` patches ``torch.utils.checkpoint``'s non-reentrant implementation for the
  duration of the block, so *every* non-reentrant checkpoint call made inside it is audited: full AC and
  SAC alike, :func:`~fla_ac_isolation.checkpoint_layers`, torch's and torchtitan's ``checkpoint_wrapper``
  (``ptd_checkpoint_wrapper``), transformers' ``gradient_checkpointing_enable(...)`` (non-reentrant) and
  plain ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. The user's own ``context_fn``
  (e.g. a SAC policy) keeps working: the audit wraps it.
* :meth:`ReplayAudit.context_fn` builds a ``context_fn`` for checkpoint calls made elsewhere, e.g.
  ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
  "context_fn": audit.context_fn(sac_context_fn(policy))})``; it works inside and outside the ``with``
  block (outside it, without FLA telemetry).

Labels: a user ``label``, else the module path of the checkpointed module, or when the checkpointed
callable is not a module, of the module calling checkpoint (``layers.0``, with
``_checkpoint_wrapped_module`` and ``_orig_mod`` dropped) inside ``model`` or, when no model was given,
inside the outermost module whose forward is running when the region starts; else ``region #i (ClassName)``
or ``region #i``.

What it sees and does not see:

* Eager regions: every aten op. Early-stopped recomputes (torch's default ``early_stop=True``) are
  compared as prefixes of their forward; regions never recomputed (no backward, or backward stopped by an
  error) are reported as such; a second recompute (``retain_graph=True``) is compared too.
* Compiled code inside a region (``torch.compile(layer, fullgraph=False)``, then checkpointed): the
  recorder, like SAC's modes, lets compiled graphs run whole (``ignore_compile_internals``), so it sees
  exactly the ops SAC sees there: the aten ops inductor's generated code still sends through the
  dispatcher (extern kernels such as ``aten.addmm.out``, fallbacks such as FLA's ``repeat_interleave``)
  and the eager ops between graphs. Ops fused into generated kernels are invisible (a layer of 54 eager
  ops records 8). FLA's ``tensor_cache`` lookup breaks the graph and runs eagerly, so the probe still
  attributes a divergence; a divergence that stays inside one fused kernel cannot be seen (nor can SAC
  misreplay it). See ``tests/test_audit_compile.py``.
* torch 2.11 (SAC replays from one FIFO queue per op) and torch >= 2.13 (by op and invocation index):
  the recorder does not depend on how SAC replays; any divergence it reports shifts both.
* Checkpoint calls traced *into* a compiled graph (``torch.compile`` around the checkpoint call) do not
  reach torch's eager checkpoint and are not audited (nor are reentrant checkpoints).

Modes (``on_divergence``):

* ``"raise"`` (default): raise :class:`ReplayDivergenceError` (from ``backward()``) at the first
  divergent op of a recompute; when the op itself differs, before it runs, so before SAC replays a wrong
  tensor or fails with its own error. The message names the region, the op index, the innermost module
  running there (``layers.0.mixer``), both ops, the FLA helpers whose cache state differed and the fix.
* ``"warn"``: emit a :class:`ReplayDivergenceWarning` with the same text once per divergent recompute
  and carry on (SAC may still fail afterwards, or silently replay wrong tensors).
* ``"record"``: stay silent; read :attr:`ReplayAudit.regions` / :meth:`ReplayAudit.summary` afterwards.
  Recording never changes results: the recorder only observes (results are bit-equal to no audit).

Overhead (measured on this project's 2-core CPU machines, torch 2.13, under load, so +-30%): about
8 to 13 microseconds per recorded aten op (one Python ``__torch_dispatch__`` call plus a tuple of output
metadata; 1000 tiny ``add`` s checkpointed: 10-24 ms -> 37-41 ms per step); on realistic steps little:
the fault stack (4 small layers, 416 recorded ops) 231 -> 242 ms (1.05x), 4 checkpointed
``[512, 1024] -> 1024 -> 1024`` MLP layers 637 -> 663 ms (1.04x), one step of the tiny ``qwen3_5_moe``
regression model (~6,300 recorded ops) about 1.03x. Memory: roughly 200 bytes per recorded op, freed
with the audit. Outside checkpointed regions nothing is recorded. A debugging tool: wrap one step.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fla_ac_isolation.fla_cache import CacheEvent, probe_tensor_cache

__all__ = [
    "CacheDifference",
    "RegionReport",
    "ReplayAudit",
    "ReplayDivergenceError",
    "ReplayDivergenceWarning",
]

OnDivergence = Literal["raise", "warn", "record"]
_MODES = ("raise", "warn", "record")


def _ignored_ops() -> frozenset:
    """Ops SAC does not count (and neither do we): its own list where torch has one."""
    import torch.utils.checkpoint as cp

    ops = getattr(cp, "SAC_IGNORED_OPS", None)
    if ops is None:  # older torch: detach and prim.device are the ones that differ between passes
        ops = {torch.ops.aten.detach.default, torch.ops.prim.device.default}
    return frozenset(ops)


class ReplayDivergenceError(RuntimeError):
    """A recompute ran a different op than its forward at the same position (``on_divergence="raise"``)."""


class ReplayDivergenceWarning(UserWarning):
    """A recompute diverged from its forward (``on_divergence="warn"``)."""


# --------------------------------------------------------------------------------------- records
# One recorded op: (op overload, ((shape, dtype, device) | type name, ...) per output leaf). Plain
# tuples keep the per-op cost and memory low; nothing refers to a tensor.
_Record = tuple[Any, tuple]


def _out_meta(out: Any) -> tuple:
    meta = []
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            meta.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        else:
            meta.append(type(leaf).__name__)
    return tuple(meta)


def _format_op(rec: _Record | None, end_note: str = "") -> str:
    if rec is None:
        return end_note or "<nothing>"
    op, meta = rec
    outs = []
    for m in meta:
        if isinstance(m, tuple):
            shape, dtype, device = m
            outs.append(f"{list(shape)} {str(dtype).removeprefix('torch.')} {device}")
        else:
            outs.append(m)
    return f"{_op_name(op)} -> " + (", ".join(outs) if outs else "()")


def _op_name(op: Any) -> str:
    name = str(op)
    return name if name.startswith(("aten.", "prim.", "prims.")) else getattr(op, "__name__", name)


@dataclass(frozen=True)
class CacheDifference:
    """An FLA cached helper whose cache state differed between the forward and a recompute.

    ``forward`` / ``recompute`` are ``"hit"``, ``"miss"``, ``"bypass"`` or ``"not called"`` (its n-th
    call happened in one pass only; nested helper calls, e.g. ``prepare_lens`` inside a missing
    ``prepare_chunk_indices``, show up that way).
    """

    helper: str
    forward: str
    recompute: str


@dataclass
class _Pass:
    kind: Literal["forward", "recompute"]
    ops: list[_Record] = field(default_factory=list)
    events: list[CacheEvent] = field(default_factory=list)
    done: bool = False
    complete: bool = False  # ran to its end (no early stop, no error)
    stopped_early: bool = False
    error: str | None = None
    first_diff: int | None = None  # recompute only
    where: str | None = None  # innermost module running at the first divergent op
    message: str | None = None


@dataclass
class _Region:
    index: int
    label: str | None
    forward: _Pass | None = None
    recomputes: list[_Pass] = field(default_factory=list)


@dataclass(frozen=True)
class RegionReport:
    """What the audit found for one checkpointed region (one checkpoint call).

    Attributes:
        index: order in which the region's forward ran (0-based).
        label: module path (``layers.0``), user label, or ``region #i``.
        verdict: ``"aligned"``, ``"divergent"`` or ``"not recomputed"``.
        forward_ops: number of recorded ops in the forward.
        recompute_ops: number of recorded ops in the (first divergent, else last) recompute, or ``None``.
        prefix: the recompute stopped early (torch ``early_stop``) or was aborted by an error; it was
            compared as a prefix of the forward.
        first_diff: index of the first differing op, or ``None``.
        where: path of the innermost module that was running at ``first_diff`` in the recompute
            (e.g. ``layers.0.linear_attn``), or ``None``.
        forward_op / recompute_op: the two ops at ``first_diff`` (``"aten.sub.Tensor -> [23] int64 cpu"``).
        fla: FLA helpers whose cache state differed (empty when FLA is not involved).
        forward_cache / recompute_cache: ``{helper: {"hit": n, "miss": n, "bypass": n}}`` per pass.
        recompute_error: first line of an error that ended the recompute, if any.
        message: the full, actionable explanation for a divergent region (``None`` otherwise).
    """

    index: int
    label: str
    verdict: str
    forward_ops: int
    recompute_ops: int | None
    prefix: bool
    first_diff: int | None
    where: str | None
    forward_op: str | None
    recompute_op: str | None
    fla: tuple[CacheDifference, ...]
    forward_cache: dict[str, dict[str, int]]
    recompute_cache: dict[str, dict[str, int]]
    recompute_error: str | None
    message: str | None

    @property
    def aligned(self) -> bool:
        return self.verdict == "aligned"


def _by_helper(events: list[CacheEvent]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for e in events:
        out.setdefault(e.helper, {"hit": 0, "miss": 0, "bypass": 0})[e.outcome] += 1
    return out


def _cache_differences(fwd: list[CacheEvent], rec: list[CacheEvent], rec_complete: bool) -> list[CacheDifference]:
    """Pair each helper's n-th call in forward with its n-th call in the recompute; list the mismatches."""
    per_fwd: dict[str, list[str]] = {}
    per_rec: dict[str, list[str]] = {}
    for e in fwd:
        per_fwd.setdefault(e.helper, []).append(e.outcome)
    for e in rec:
        per_rec.setdefault(e.helper, []).append(e.outcome)
    order = list(dict.fromkeys([e.helper for e in rec] + [e.helper for e in fwd]))
    diffs = []
    for helper in order:
        f, r = per_fwd.get(helper, []), per_rec.get(helper, [])
        pair = next(((a, b) for a, b in zip(f, r) if a != b), None)
        if pair is not None:
            diffs.append(CacheDifference(helper, *pair))
        elif len(r) > len(f):
            diffs.append(CacheDifference(helper, "not called", r[len(f)]))
        elif len(f) > len(r) and rec_complete:
            diffs.append(CacheDifference(helper, f[len(r)], "not called"))
    return diffs


_VERBS = {"miss": "missed", "hit": "hit", "bypass": "bypassed the cache", "not called": "was not called"}


def _explain(label: str, where: str | None, idx: int, fwd_op: str, rec_op: str, diffs: list[CacheDifference]) -> str:
    inside = f" (in {where})" if where and where != label else ""
    lines = [f"ReplayAudit: region {label}: recompute op #{idx}{inside} is {rec_op}, forward had {fwd_op}."]
    main = [d for d in diffs if "not called" not in (d.forward, d.recompute)] or diffs
    if main:
        groups: dict[tuple[str, str], list[str]] = {}
        for d in main:
            groups.setdefault((d.forward, d.recompute), []).append(d.helper)
        for (f, r), helpers in groups.items():
            lines.append(
                f"FLA {', '.join(helpers)} {_VERBS[f]} in forward and {_VERBS[r]} in recompute."
            )
        if any(d.forward == "miss" and d.recompute == "hit" for d in main):
            lines.append(
                "The cu_seqlens object this region passed to FLA was already in FLA's tensor_cache when the "
                "recompute ran, because it is shared with other layers."
            )
        if any(d.forward == "hit" and d.recompute == "miss" for d in main):
            lines.append(
                "An entry this region hit in forward was evicted from FLA's tensor_cache before its "
                "recompute (other calls in between filled the queue)."
            )
        lines.append(
            "Fix: give each layer its own cu_seqlens (build a LayerLocalSeqlens once per forward and call "
            ".local() inside each layer's forward), or disable FLA's cache (tensor_cache_disabled())."
        )
    else:
        lines.append(
            "Something inside the region reads state that changed between forward and backward (a cache "
            "keyed by object identity, a "
            "memoised mask or index builder, a global flag or counter, data-dependent control flow)."
        )
        lines.append(
            "Fix: make the checkpointed region a pure function of its inputs: build that state outside the "
            "region and pass it in, or build it fresh inside the region on every call."
        )
    lines.append(
        "Under selective AC the saved outputs after this point are replayed into the wrong ops (an error "
        "later in backward, or silently wrong gradients); under full AC the recompute can save tensors "
        "that do not match the forward's."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- recorder
class _PassRecorder(TorchDispatchMode):
    """Records one pass (forward or recompute) of one region; enters the user's context around itself.

    The user's context (e.g. SAC's caching/cached dispatch mode) is entered first, so this mode sits on
    top of the mode stack and sees every op before SAC does, including ops SAC then answers from storage.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as SAC: compiled graphs run whole (one inductor_compiled_code op)

    def __init__(self, audit: ReplayAudit, region: _Region, kind: str, inner: Any, label_from: Any) -> None:
        super().__init__()
        self._audit = audit
        self._region = region
        self._kind = kind
        self._inner = inner
        self._label_from = label_from
        self._stack: contextlib.ExitStack | None = None
        self._pass: _Pass | None = None
        self._forward_ops: list[_Record] = []
        self._ignored = audit._ignored

    # -- lifecycle
    def __enter__(self):
        stack = contextlib.ExitStack()
        if self._inner is not None:
            stack.enter_context(self._inner)
        probe = self._audit._probe
        if probe is None:  # used outside `with ReplayAudit()`: no shared probe, so no FLA telemetry
            probe_events = None
        else:
            probe_events = probe.events
        self._events_src = probe_events
        self._events_start = len(probe_events) if probe_events is not None else 0
        p = _Pass(self._kind)  # type: ignore[arg-type]
        self._pass = p
        region = self._region
        if self._kind == "forward":
            region.forward = p
            if region.label is None:
                region.label = self._audit._label_for(self._label_from)
            self._audit._add_region(region)
        else:
            if region.forward is None:
                raise RuntimeError("ReplayAudit: a recompute started for a region whose forward was not recorded")
            region.recomputes.append(p)
            self._forward_ops = region.forward.ops
        self._stack = stack
        try:
            return super().__enter__()
        except BaseException:
            stack.close()
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            p = self._pass
            self._collect_events()
            p.done = True
            p.complete = exc_type is None
            if exc_type is not None:
                from torch.utils.checkpoint import _StopRecomputationError

                if issubclass(exc_type, _StopRecomputationError):
                    p.stopped_early = True
                elif not issubclass(exc_type, ReplayDivergenceError):
                    p.error = f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            try:
                if (
                    self._kind == "recompute"
                    and p.complete
                    and p.first_diff is None
                    and len(p.ops) < len(self._forward_ops)
                ):
                    self._diverge(len(p.ops), None)  # the recompute ended before its forward did
            finally:
                stack, self._stack = self._stack, None
                stack.__exit__(exc_type, exc, tb)
        return False

    def _collect_events(self) -> None:
        if self._events_src is not None:
            self._pass.events = self._events_src[self._events_start:]

    # -- recording
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._ignored:
            return func(*args, **kwargs)
        p = self._pass
        if self._kind == "forward":
            out = func(*args, **kwargs)
            p.ops.append((func, _out_meta(out)))
            return out
        i = len(p.ops)
        fwd = self._forward_ops
        check = p.first_diff is None
        if check and (i >= len(fwd) or fwd[i][0] is not func):
            self._diverge(i, (func, None))  # before running it: SAC has not replayed anything yet
            check = False
        out = func(*args, **kwargs)
        rec = (func, _out_meta(out))
        p.ops.append(rec)
        if check and fwd[i][1] != rec[1]:
            self._diverge(i, rec)
        return out

    def _diverge(self, i: int, rec: _Record | None) -> None:
        p = self._pass
        p.first_diff = i
        fwd = self._forward_ops
        fwd_op = _format_op(fwd[i] if i < len(fwd) else None, f"<end of forward after {len(fwd)} ops>")
        if rec is not None and rec[1] is None:
            rec_op = _op_name(rec[0])
        else:
            rec_op = _format_op(rec, f"<end of recompute after {i} ops>")
        self._collect_events()
        if rec is not None:
            p.where = self._audit._where(self._region.label)
        diffs = _cache_differences(self._region.forward.events, p.events, rec_complete=rec is None)
        p.message = _explain(self._region.label, p.where, i, fwd_op, rec_op, diffs)
        mode = self._audit.on_divergence
        if mode == "raise":
            raise ReplayDivergenceError(p.message)
        if mode == "warn":
            warnings.warn(p.message, ReplayDivergenceWarning, stacklevel=2)


# --------------------------------------------------------------------------------------- audit
def _module_of(fn: Any) -> nn.Module | None:
    """The module a checkpointed callable runs: itself, a bound method's owner, a partial's target."""
    for _ in range(8):
        if isinstance(fn, nn.Module):
            return fn
        if isinstance(fn, functools.partial):
            if fn.args and isinstance(fn.args[0], nn.Module):  # partial(forward, module) (transformers)
                return fn.args[0]
            fn = fn.func
        elif hasattr(fn, "__self__"):
            fn = fn.__self__
        else:
            return None
    return None


def _running_modules() -> list[nn.Module]:
    """Modules whose ``forward`` is on the Python stack right now, innermost first."""
    frame = sys._getframe(1)
    found: list[nn.Module] = []
    while frame is not None:
        obj = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames[:1] else None
        if isinstance(obj, nn.Module) and (not found or found[-1] is not obj):
            found.append(obj)
        frame = frame.f_back
    return found


def _clean_path(path: str) -> str:
    parts = [p for p in path.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod", "")]
    return ".".join(parts)


class ReplayAudit:
    """Record and compare the forward and recompute op sequences of every checkpointed region.

    Use it as a context manager around one training step (forward and backward)::

        with ReplayAudit(model, on_divergence="record") as audit:
            loss = model(**batch).loss
            loss.backward()
        print(audit.summary())
        audit.divergent        # [RegionReport(label='model.layers.0.linear_attn', first_diff=0, ...)]

    or build a ``context_fn`` for checkpoint calls made elsewhere (:meth:`context_fn`).

    Args:
        model: optional root module, used to name regions by module path. Without it the path is taken
            inside the outermost module running when the region starts.
        on_divergence: ``"raise"`` (default), ``"warn"`` or ``"record"``; see the module docstring.
        probe_fla: run FLA's cache probe while active (per-region hit/miss telemetry and attribution).

    Raises:
        ValueError: unknown ``on_divergence``.
        TypeError: ``model`` is not an ``nn.Module``.
        ReplayDivergenceError: (``"raise"``) at the first divergent op of a recompute, from backward.

    Overhead: ~8-13 us per recorded op, ~1.05x on a realistic step (measured: see the module docstring).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        on_divergence: OnDivergence = "raise",
        probe_fla: bool = True,
    ) -> None:
        if on_divergence not in _MODES:
            raise ValueError(f"on_divergence must be one of {_MODES}, got {on_divergence!r}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        self.on_divergence: OnDivergence = on_divergence
        self.probe_fla = probe_fla
        self._model_ref = weakref.ref(model) if model is not None else None
        self._regions: list[_Region] = []
        self._next_index = 0
        self._probe = None
        self._stack: contextlib.ExitStack | None = None
        self._ignored = _ignored_ops()
        self._paths: dict[int, tuple[weakref.ref, dict[int, str]]] = {}

    # -- context manager
    def __enter__(self) -> ReplayAudit:
        if self._stack is not None:
            raise RuntimeError("ReplayAudit is not reentrant; use a new instance for a nested block")
        stack = contextlib.ExitStack()
        try:
            if self.probe_fla:
                with contextlib.suppress(ImportError):
                    self._probe = stack.enter_context(probe_tensor_cache())
            stack.enter_context(self._patched_checkpoint())
        except BaseException:
            stack.close()
            self._probe = None
            raise
        self._stack = stack
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack, self._stack = self._stack, None
        try:
            stack.__exit__(exc_type, exc, tb)
        finally:
            self._probe = None
        return False

    @contextlib.contextmanager
    def _patched_checkpoint(self) -> Iterator[None]:
        """Route every non-reentrant checkpoint call through :meth:`context_fn` inside the block."""
        import torch.utils.checkpoint as cp

        targets = [cp]
        composable = sys.modules.get("torch.distributed._composable.checkpoint_activation")
        if composable is not None and hasattr(composable, "_checkpoint_without_reentrant_generator"):
            targets.append(composable)
        originals = [t._checkpoint_without_reentrant_generator for t in targets]
        audit = self

        def make(original):
            def audited_generator(
                fn, preserve_rng_state=True, context_fn=cp.noop_context_fn, determinism_check=None,
                debug=False, early_stop=True, *args, **kwargs,
            ):
                if determinism_check is None:
                    determinism_check = cp._DEFAULT_DETERMINISM_MODE
                if not getattr(context_fn, "_replay_audit", False) and not debug:
                    inner = None if context_fn is cp.noop_context_fn else context_fn
                    context_fn = audit.context_fn(inner, _label_from=fn)
                return original(
                    fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args, **kwargs
                )

            return audited_generator

        for t, original in zip(targets, originals):
            t._checkpoint_without_reentrant_generator = make(original)
        try:
            yield
        finally:
            for t, original in zip(targets, originals):
                t._checkpoint_without_reentrant_generator = original

    # -- context_fn
    def context_fn(
        self,
        inner: Callable[[], tuple[Any, Any]] | None = None,
        *,
        label: str | None = None,
        _label_from: Any = None,
    ) -> Callable[[], tuple[TorchDispatchMode, TorchDispatchMode]]:
        """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

        Args:
            inner: the ``context_fn`` to wrap (e.g. ``sac_context_fn(policy)`` or
                ``functools.partial(create_selective_checkpoint_contexts, policy)``); ``None`` for full AC.
            label: name for every region checkpointed with this ``context_fn`` (default: module path).

        Returns:
            A callable returning ``(forward_mode, recompute_mode)``, two ``TorchDispatchMode`` s that
            record the ops and enter ``inner``'s contexts beneath themselves.
        """

        def audited_context_fn():
            fwd_ctx, rec_ctx = inner() if inner is not None else (None, None)
            region = _Region(-1, label)
            return (
                _PassRecorder(self, region, "forward", fwd_ctx, _label_from),
                _PassRecorder(self, region, "recompute", rec_ctx, _label_from),
            )

        audited_context_fn._replay_audit = True  # type: ignore[attr-defined]
        return audited_context_fn

    # -- labels
    def _add_region(self, region: _Region) -> None:
        region.index = self._next_index
        self._next_index += 1
        self._regions.append(region)

    def _label_for(self, fn: Any) -> str:
        """Module path of the checkpointed module (or, when ``fn`` names none, of the module calling
        checkpoint), inside ``model`` or the outermost running module; else ``region #i``."""
        number = f"region #{self._next_index}"
        running = _running_modules()
        module = _module_of(fn)
        if module is None:
            module = running[0] if running else None
        if module is None:
            return number
        root = self._model_ref() if self._model_ref is not None else None
        if root is None:
            root = running[-1] if running else None
        path = self._path_in(root, module) if root is not None else None
        return path or f"{number} ({type(module).__name__})"

    def _where(self, label: str) -> str | None:
        """Path of the innermost module running now (inside a recompute), for messages."""
        running = _running_modules()
        if not running:
            return None
        root = self._model_ref() if self._model_ref is not None else None
        if root is not None:
            path = self._path_in(root, running[0])
            if path:
                return path
        sub = self._path_in(running[-1], running[0])  # inside the region's own module
        return f"{label}.{sub}" if sub else label

    def _path_in(self, root: nn.Module, module: nn.Module) -> str | None:
        cached = self._paths.get(id(root))
        if cached is None or cached[0]() is not root:
            names = {}
            for name, m in root.named_modules(remove_duplicate=False):
                names.setdefault(id(m), _clean_path(name))
            cached = (weakref.ref(root), names)
            self._paths[id(root)] = cached
        return cached[1].get(id(module))

    # -- results
    @property
    def regions(self) -> list[RegionReport]:
        """One :class:`RegionReport` per checkpointed region whose forward ran, in forward order."""
        return [self._report(r) for r in self._regions]

    @property
    def divergent(self) -> list[RegionReport]:
        """The regions whose recompute diverged from their forward."""
        return [r for r in self.regions if r.verdict == "divergent"]

    @property
    def ok(self) -> bool:
        """No region diverged (regions that were not recomputed do not count against it)."""
        return not self.divergent

    def _report(self, region: _Region) -> RegionReport:
        fwd = region.forward
        assert fwd is not None
        rec = next((p for p in region.recomputes if p.first_diff is not None), None)
        if rec is None and region.recomputes:
            rec = region.recomputes[-1]
        fwd_cache = _by_helper(fwd.events)
        if rec is None:
            return RegionReport(
                region.index, region.label or f"region #{region.index}", "not recomputed", len(fwd.ops), None,
                False, None, None, None, None, (), fwd_cache, {}, None, None,
            )
        i = rec.first_diff
        diffs: tuple[CacheDifference, ...] = ()
        fwd_op = rec_op = None
        message = rec.message
        if i is not None:
            diffs = tuple(_cache_differences(fwd.events, rec.events, rec.complete))
            fwd_op = _format_op(fwd.ops[i] if i < len(fwd.ops) else None, f"<end of forward after {len(fwd.ops)} ops>")
            rec_op = _format_op(rec.ops[i] if i < len(rec.ops) else None, f"<end of recompute after {i} ops>")
            if rec.done:  # rebuilt with every helper call of the pass (raise/warn saw those up to the op)
                message = _explain(region.label or f"region #{region.index}", rec.where, i, fwd_op, rec_op,
                                   list(diffs))
        return RegionReport(
            index=region.index,
            label=region.label or f"region #{region.index}",
            verdict="aligned" if i is None else "divergent",
            forward_ops=len(fwd.ops),
            recompute_ops=len(rec.ops),
            prefix=not rec.complete,
            first_diff=i,
            where=rec.where if i is not None else None,
            forward_op=fwd_op,
            recompute_op=rec_op,
            fla=diffs,
            forward_cache=fwd_cache,
            recompute_cache=_by_helper(rec.events),
            recompute_error=rec.error,
            message=message,
        )

    def summary(self, *, messages: bool = True) -> str:
        """A plain-text table of every region's verdict and FLA cache telemetry (+ divergence messages)."""
        rows = [("region", "fwd ops", "rec ops", "verdict", "FLA fwd hit/miss", "FLA rec hit/miss")]

        def hm(cache: dict[str, dict[str, int]]) -> str:
            if not cache:
                return "-"
            hits = sum(c["hit"] for c in cache.values())
            miss = sum(c["miss"] for c in cache.values())
            byp = sum(c["bypass"] for c in cache.values())
            return f"{hits}/{miss}" + (f" (+{byp} bypass)" if byp else "")

        reports = self.regions
        for r in reports:
            if r.verdict == "divergent":
                verdict = f"DIVERGENT at op #{r.first_diff}"
            elif r.verdict == "aligned":
                verdict = "aligned (prefix)" if r.prefix else "aligned"
            else:
                verdict = r.verdict
            rows.append((
                r.label, str(r.forward_ops), "-" if r.recompute_ops is None else str(r.recompute_ops), verdict,
                hm(r.forward_cache), hm(r.recompute_cache) if r.recompute_ops is not None else "-",
            ))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        if not reports:
            lines.append("(no checkpointed region ran)")
        if messages:
            for r in reports:
                if r.message:
                    lines += ["", r.message]
                if r.recompute_error:
                    lines.append(f"  (the recompute of {r.label} then failed: {r.recompute_error})")
        return "\n".join(lines)
