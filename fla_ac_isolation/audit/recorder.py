"""The dispatch mode that records one pass of one region and compares a recompute with its forward op by op."""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import TorchDispatchMode

from fla_ac_isolation.audit.explain import explain, foreign_fix
from fla_ac_isolation.audit.labels import running_modules
from fla_ac_isolation.audit.records import (
    OpRecord,
    Pass,
    Region,
    autocast_caching,
    cache_differences,
    format_op,
    implicating_fla,
    op_name,
    out_meta,
    scope_change,
)

if TYPE_CHECKING:
    from fla_ac_isolation.audit.session import AuditSession

__all__ = ["PassRecorder", "ReplayDivergenceError", "ReplayDivergenceWarning"]


class ReplayDivergenceError(RuntimeError):
    """A recompute ran a different op than its forward at the same position (``on_divergence="raise"``)."""


class ReplayDivergenceWarning(UserWarning):
    """A recompute diverged from its forward (``on_divergence="warn"``)."""


class PassRecorder(TorchDispatchMode):
    """Records one pass (forward or recompute) of one region; the user's context (SAC's mode) is entered
    beneath it, so it sees every op before SAC does, including ops SAC answers from storage."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as SAC: compiled graphs run whole (one inductor_compiled_code op)

    def __init__(self, session: AuditSession, region: Region, kind: str, inner: Any, label_from: Any) -> None:
        super().__init__()
        self._session = session
        self._region = region
        self._kind = kind
        self._inner = inner
        self._label_from = label_from
        self._stack: contextlib.ExitStack | None = None
        self._pass: Pass | None = None
        self._forward_ops: list[OpRecord] = []
        self._ignored = session.ignored
        self._fsdp_depth = 0  # inside FSDP2's own profiler scopes: not recorded (records.scope_change)

    # -- lifecycle
    def __enter__(self):
        stack = contextlib.ExitStack()
        if self._inner is not None:
            stack.enter_context(self._inner)
        probe_events = self._session.probe_events()
        self._events_src = probe_events
        self._events_start = len(probe_events) if probe_events is not None else 0
        p = Pass(self._kind, autocast_cache=autocast_caching())  # type: ignore[arg-type]  # inside the user's context
        self._pass = p
        region = self._region
        if self._kind == "forward":
            region.forward = p
            self._session.add_region(region, self._label_from)
        else:
            if region.forward is None:
                raise RuntimeError("ReplayAudit: a recompute started for a region whose forward was not recorded")
            region.recomputes.append(p)
            self._forward_ops = region.forward.ops
        self._session.running.append(region)  # a region whose forward starts now is inside this one
        self._stack = stack
        try:
            return super().__enter__()
        except BaseException:
            self._session.pass_ended(region)
            stack.close()
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            p = self._pass
            self._session.pass_ended(self._region)
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
        depth = scope_change(func, args, self._fsdp_depth)
        if depth or self._fsdp_depth:
            self._fsdp_depth = depth
            return func(*args, **kwargs)
        p = self._pass
        if self._kind == "forward":
            out = func(*args, **kwargs)
            p.ops.append((func, out_meta(out)))
            return out
        i = len(p.ops)
        fwd = self._forward_ops
        check = p.first_diff is None
        if check and (i >= len(fwd) or fwd[i][0] is not func):
            self._diverge(i, (func, None))  # before running it: SAC has not replayed anything yet
            check = False
        out = func(*args, **kwargs)
        rec = (func, out_meta(out))
        p.ops.append(rec)
        if check and fwd[i][1] != rec[1]:
            self._diverge(i, rec)
        return out

    def _diverge(self, i: int, rec: OpRecord | None) -> None:
        p = self._pass
        p.first_diff = i
        fwd = self._forward_ops
        fwd_op = format_op(fwd[i] if i < len(fwd) else None, f"<end of forward after {len(fwd)} ops>")
        if rec is not None and rec[1] is None:
            rec_op = op_name(rec[0])
        else:
            rec_op = format_op(rec, f"<end of recompute after {i} ops>")
        self._collect_events()
        if rec is not None:
            p.where = self._session.namer.where(self._region.label)
            p.fix = foreign_fix(running_modules())
        diffs = implicating_fla(cache_differences(self._region.forward.events, p.events, rec_complete=rec is None))
        p.message = explain(self._region.label, p.where, i, fwd_op, rec_op, list(diffs), fix=p.fix,
                            autocast_cache=p.autocast_cache)
        mode = self._session.on_divergence
        if mode == "raise":
            raise ReplayDivergenceError(p.message)
        if mode == "warn":
            warnings.warn(p.message, ReplayDivergenceWarning, stacklevel=2)
