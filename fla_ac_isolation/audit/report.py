"""The audit's results: one :class:`RegionReport` per checkpointed region, and the summary table."""

from __future__ import annotations

from dataclasses import dataclass

from fla_ac_isolation.audit.explain import autocast_skipped_cast, explain
from fla_ac_isolation.audit.records import (
    CacheDifference,
    Region,
    UnauditedRegion,
    by_helper,
    cache_differences,
    format_op,
    implicating_fla,
)

__all__ = ["RegionReport", "region_report", "summary_table"]


@dataclass(frozen=True)
class RegionReport:
    """What the audit found for one checkpointed region (one checkpoint call).

    Attributes:
        index: order in which the region's forward ran (0-based).
        label: module path (``layers.0``), user label, or ``region #i``.
        verdict: ``"aligned"``, ``"divergent"`` or ``"not recomputed"``.
        forward_ops: number of recorded ops in the forward.
        recompute_ops: number of recorded ops in the (first divergent, else last) recompute, or ``None``.
        prefix: the recompute stopped early or failed; it was compared as a prefix of the forward.
        first_diff: index of the first differing op, or ``None``.
        where: path of the innermost module running at ``first_diff`` in the recompute, or ``None``.
        forward_op / recompute_op: the two ops at ``first_diff`` (``"aten.sub.Tensor -> [23] int64 cpu"``).
        fla: FLA helpers whose cache state differed (empty when FLA is not the cause).
        forward_cache / recompute_cache: ``{helper: {"hit": n, "miss": n, "bypass": n}}`` per pass.
        recompute_error: first line of an error that ended the recompute, if any.
        message: the explanation and fix for a divergent region (``None`` otherwise).
        autocast_cast: the first differing op is a cast skipped because of ``torch.autocast``'s weight-cast cache
            (torch issue #193338), not FLA.
        outer: the ``index`` of the region whose forward (or recompute) ran this one's forward (a checkpoint inside
            a checkpoint), or ``None``.
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
    autocast_cast: bool = False
    outer: int | None = None

    @property
    def aligned(self) -> bool:
        return self.verdict == "aligned"



def region_report(region: Region) -> RegionReport:
    """The :class:`RegionReport` of a recorded region (its first divergent recompute, else its last)."""
    fwd = region.forward
    assert fwd is not None
    rec = next((p for p in region.recomputes if p.first_diff is not None), None)
    if rec is None and region.recomputes:
        rec = region.recomputes[-1]
    fwd_cache = by_helper(fwd.events)
    if rec is None:
        return RegionReport(
            region.index, region.label or f"region #{region.index}", "not recomputed", len(fwd.ops), None,
            False, None, None, None, None, (), fwd_cache, {}, None, None, outer=region.outer,
        )
    i = rec.first_diff
    diffs: tuple[CacheDifference, ...] = ()
    fwd_op = rec_op = None
    message = rec.message
    if i is not None:
        diffs = implicating_fla(cache_differences(fwd.events, rec.events, rec.complete))
        fwd_op = format_op(fwd.ops[i] if i < len(fwd.ops) else None, f"<end of forward after {len(fwd.ops)} ops>")
        rec_op = format_op(rec.ops[i] if i < len(rec.ops) else None, f"<end of recompute after {i} ops>")
        if rec.done:  # rebuilt with every helper call of the pass (raise/warn saw those up to the op)
            message = explain(region.label or f"region #{region.index}", rec.where, i, fwd_op, rec_op,
                              list(diffs), fix=rec.fix, autocast_cache=rec.autocast_cache)
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
        recompute_cache=by_helper(rec.events),
        recompute_error=rec.error,
        message=message,
        autocast_cast=i is not None and autocast_skipped_cast(fwd_op, rec_op, rec.autocast_cache),
        outer=region.outer,
    )


def summary_table(reports: list[RegionReport], *, messages: bool = True,
                  unaudited: list[UnauditedRegion] = ()) -> str:
    """A plain-text table of every region's verdict and FLA cache telemetry (+ divergence messages); an
    unaudited region's verdict is its reason."""
    rows = [("region", "fwd ops", "rec ops", "verdict", "FLA fwd hit/miss", "FLA rec hit/miss")]

    def hm(cache: dict[str, dict[str, int]]) -> str:
        if not cache:
            return "-"
        hits = sum(c["hit"] for c in cache.values())
        miss = sum(c["miss"] for c in cache.values())
        byp = sum(c["bypass"] for c in cache.values())
        return f"{hits}/{miss}" + (f" (+{byp} bypass)" if byp else "")

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
    for u in unaudited:
        rows.append((u.label, "-", "-", u.reason, "-", "-"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if not reports and not unaudited:
        lines.append("(no checkpointed region ran)")
    if messages:
        for r in reports:
            if r.message:
                lines += ["", r.message]
            if r.recompute_error:
                lines.append(f"  (the recompute of {r.label} then failed: {r.recompute_error})")
    return "\n".join(lines)
