"""What the audit records: per region, each pass's ops and FLA cache events; what is ignored; how ops print.

An ``OpRecord`` is ``(op overload, per output leaf (shape, dtype, device) or type name)``: no tensor is held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_leaves

from fla_ac_isolation.fla_seam.cache import CacheEvent
from fla_ac_isolation.op_inputs import autocast_caching  # re-exported: the audit records it per pass

__all__ = [
    "CacheDifference",
    "OpRecord",
    "Pass",
    "Region",
    "UnauditedRegion",
    "autocast_caching",
    "by_helper",
    "cache_differences",
    "format_op",
    "ignored_ops",
    "implicating_fla",
    "op_name",
    "out_meta",
    "scope_change",
]


def ignored_ops() -> frozenset:
    """Ops SAC does not count (and neither do we): its own list where torch has one."""
    import torch.utils.checkpoint as cp

    ops = getattr(cp, "SAC_IGNORED_OPS", None)
    if ops is None:  # older torch: detach and prim.device are the ones that differ between passes
        ops = {torch.ops.aten.detach.default, torch.ops.prim.device.default}
    return frozenset(ops)


_SCOPE_ENTER = torch.ops.profiler._record_function_enter_new.default
_SCOPE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
FSDP_SCOPE = "FSDP::"
"""Prefix of the ``record_function`` scopes FSDP2 (``fully_shard``) wraps its own work in."""


def scope_change(func: Any, args: tuple, depth: int) -> int:
    """The depth of FSDP2 ``FSDP::`` scopes after ``func`` (+1 entering, -1 leaving): their ops (unshard,
    reshard) are skipped in the recompute, so they are not recorded. Exits are counted, not matched by name."""
    if func is _SCOPE_ENTER and (depth or (args and str(args[0]).startswith(FSDP_SCOPE))):
        return depth + 1
    if func is _SCOPE_EXIT and depth:
        return depth - 1
    return depth


OpRecord = tuple[Any, tuple]


def out_meta(out: Any) -> tuple:
    meta = []
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            meta.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        else:
            meta.append(type(leaf).__name__)
    return tuple(meta)


def format_op(rec: OpRecord | None, end_note: str = "") -> str:
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
    return f"{op_name(op)} -> " + (", ".join(outs) if outs else "()")


def op_name(op: Any) -> str:
    name = str(op)
    return name if name.startswith(("aten.", "prim.", "prims.")) else getattr(op, "__name__", name)


@dataclass(frozen=True)
class CacheDifference:
    """An FLA cached helper whose cache state differed between the forward and a recompute: ``forward`` /
    ``recompute`` are ``"hit"``, ``"miss"``, ``"bypass"`` or ``"not called"`` (its n-th call ran in one pass only)."""

    helper: str
    forward: str
    recompute: str


@dataclass
class Pass:
    kind: Literal["forward", "recompute"]
    ops: list[OpRecord] = field(default_factory=list)
    events: list[CacheEvent] = field(default_factory=list)
    done: bool = False
    complete: bool = False  # ran to its end (no early stop, no error)
    stopped_early: bool = False
    error: str | None = None
    first_diff: int | None = None  # recompute only
    where: str | None = None  # innermost module running at the first divergent op
    fix: str | None = None  # the fix for a known foreign FLA-backed mixer running there (explain.foreign_fix)
    message: str | None = None
    autocast_cache: bool = False  # torch.autocast on, with its weight-cast cache, when the pass began


@dataclass
class Region:
    index: int
    label: str | None
    forward: Pass | None = None
    recomputes: list[Pass] = field(default_factory=list)
    outer: int | None = None  # the index of the region whose forward or recompute ran when this one's forward began


@dataclass(frozen=True)
class UnauditedRegion:
    """A checkpointed region that ran under the audit but that it cannot look into.

    Attributes:
        label: the region's name, as a recorded region's.
        reason: ``"reentrant checkpoint: not audited"`` or ``"debug checkpoint: not audited"``.
    """

    label: str
    reason: str


def by_helper(events: list[CacheEvent]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for e in events:
        out.setdefault(e.helper, {"hit": 0, "miss": 0, "bypass": 0})[e.outcome] += 1
    return out


def implicating_fla(diffs: list[CacheDifference]) -> tuple[CacheDifference, ...]:
    """``diffs`` when some helper's n-th call hit in one pass and missed (or bypassed) in the other, else ``()``."""
    if any("not called" not in (d.forward, d.recompute) for d in diffs):
        return tuple(diffs)
    return ()


def cache_differences(fwd: list[CacheEvent], rec: list[CacheEvent], rec_complete: bool) -> list[CacheDifference]:
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

