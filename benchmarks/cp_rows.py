"""The CP layer benchmark's rows (``benchmarks/bench_cp.py``): the document layouts that cross the rank cuts, one
row per mode from every rank's measurements, the issue's targets, the table and the JSON file.

Everything here is plain data in, text out: ``bench_cp`` measures on the ranks (``layer_step.measure``) and
hands rank 0 every rank's result (:func:`build_rows`, :func:`report`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field

from benchmarks import layer_step
from benchmarks.charts import plot
from benchmarks.layer_step import fmt, step_statistics

__all__ = ["CP_SITES", "LAYER", "MODES", "TARGET_RATIO", "CPRow", "build_rows", "cp_syncs", "crossing_documents",
           "document_layouts", "print_progress", "print_table", "rank_cuts", "report", "targets", "write_json"]

MODES = ("no-ac", "shared", "isolated", "global-disable")
LAYER = "gdn"  # the Qwen3.5-MoE Gated DeltaNet mixer (layer_step.build_layer)
CP_SITES = "fla/ops/cp/"  # a host sync whose site holds this comes from FLA's CP code (metadata, communication)
TARGET_RATIO = 1.01  # isolated / shared, paired


@dataclass
class CPRow:
    """One mode in one (tokens, layout) group, over every rank (see the module docstring for each field)."""

    tokens: int  # T, packed tokens over all ranks
    local_tokens: int  # T / W, per rank
    layout: str
    world: int  # CP degree W
    docs: int
    mode: str
    median_ms: float  # of the step time: the slowest rank per iteration
    p10_ms: float
    p90_ms: float
    x_shared: float | None
    paired_x_shared: float | None
    x_no_ac: float | None
    paired_x_no_ac: float | None
    rank_median_ms: list[float]  # per rank
    peak_mib: list[float]  # per rank (0 on CPU)
    held_mib: list[float]  # per rank (0 on CPU)
    syncs_per_step: list[int]  # per rank (0 on CPU)
    cp_syncs_per_step: list[int]  # per rank, sites in fla/ops/cp/
    helper_computations_per_step: list[int]  # per rank
    sync_sites: list[dict[str, int]]  # per rank, "file:line" -> count
    step_ms: list[float] = field(default_factory=list)  # per iteration, the slowest rank
    times_ms: list[list[float]] = field(default_factory=list)  # [rank][iteration]


# ------------------------------------------------------------------------------------------- documents
def rank_cuts(tokens: int, world: int, layout: str) -> list[int]:
    """Global token positions ``t`` where token ``t - 1`` and token ``t`` are held by different ranks.

    FLA's layouts (``fla_ac_isolation.parallel.cp_token_index``): ``contiguous`` cuts ``T`` into ``W`` equal
    parts, part ``r`` on rank ``r``; ``zigzag`` into ``2W`` parts, parts ``r`` and ``2W - 1 - r`` on rank ``r``
    (so its middle cut, between two parts of rank ``W - 1``, is not a rank cut).
    """
    parts = world if layout == "contiguous" else 2 * world
    size = tokens // parts

    def owner(part: int) -> int:
        return part if part < world else 2 * world - 1 - part

    return [k * size for k in range(1, parts) if owner(k - 1) != owner(k)]


def crossing_documents(lens: list[int], cuts: list[int]) -> list[int]:
    """Indices of the documents (lengths ``lens``, packed in order) holding tokens on both sides of a cut."""
    crossing, start = [], 0
    for i, length in enumerate(lens):
        if any(start < cut < start + length for cut in cuts):
            crossing.append(i)
        start += length
    return crossing


def document_layouts(tokens: int, docs: int, world: int, layout: str) -> list[list[int]]:
    """The group's ``NUM_BUFFERS`` document-length lists (``layer_step.doc_lengths``, seeds 0, 1, 2).

    Raises:
        ValueError: a list in which no document crosses a rank cut (every rank cut falls on a document
            boundary), naming ``--docs``.
    """
    layouts = [layer_step.doc_lengths(tokens, docs, seed) for seed in range(layer_step.NUM_BUFFERS)]
    cuts = rank_cuts(tokens, world, layout)
    for seed, lens in enumerate(layouts):
        if not crossing_documents(lens, cuts):
            raise ValueError(
                f"--docs {docs}: the document lengths of seed {seed} for --tokens {tokens} put a document boundary "
                f"on every rank cut {cuts} ({layout} layout over {world} ranks), so no document crosses a rank; "
                "choose another --docs"
            )
    return layouts


# ------------------------------------------------------------------------------------------------ rows
def cp_syncs(sites: dict[str, int]) -> int:
    """Host syncs of ``sites`` (``"file:line" -> count``) whose site is in FLA's CP code (:data:`CP_SITES`)."""
    return sum(n for site, n in sites.items() if CP_SITES in site)


def build_rows(per_rank: list[dict], modes: list[str]) -> list[CPRow]:
    """One :class:`CPRow` per mode from every rank's ``bench_cp.run_group_on_rank`` result (``per_rank[r]``: rank r)."""
    first = per_rank[0]
    iters = len(first["times"][modes[0]])
    step = {mode: [max(r["times"][mode][i] for r in per_rank) for i in range(iters)] for mode in modes}
    rows = []
    for mode in modes:
        probes = [r["probes"][mode] for r in per_rank]  # (syncs, sites, helper computations) per rank
        rows.append(CPRow(
            first["tokens"], first["local_tokens"], first["layout"], len(per_rank), first["docs"], mode,
            *step_statistics(step[mode], step),
            rank_median_ms=[statistics.median(r["times"][mode]) for r in per_rank],
            peak_mib=[r["memory"][mode][0] for r in per_rank], held_mib=[r["memory"][mode][1] for r in per_rank],
            syncs_per_step=[p[0] for p in probes], cp_syncs_per_step=[cp_syncs(p[1]) for p in probes],
            helper_computations_per_step=[p[2] for p in probes], sync_sites=[dict(p[1]) for p in probes],
            step_ms=step[mode], times_ms=[list(r["times"][mode]) for r in per_rank],
        ))
    return rows


def targets(rows: list[CPRow]) -> list[str]:
    """The issue's targets per group, one line each with ``met`` / ``NOT met`` (lines need the modes they compare)."""
    lines = []
    for key in dict.fromkeys((r.tokens, r.layout) for r in rows):
        by_mode = {r.mode: r for r in rows if (r.tokens, r.layout) == key}
        name = f"T={key[0]} {key[1]}"
        iso_row, disable = by_mode.get("isolated"), by_mode.get("global-disable")
        if iso_row is None:
            continue
        if iso_row.paired_x_shared is not None:
            ok = iso_row.paired_x_shared <= TARGET_RATIO
            lines.append(f"{name}: isolated / shared (paired) = {iso_row.paired_x_shared:.3f}, target <= "
                         f"{TARGET_RATIO}: {'met' if ok else 'NOT met'}")
        if disable is not None and iso_row.paired_x_shared is not None and disable.paired_x_shared is not None:
            ok = iso_row.paired_x_shared <= disable.paired_x_shared
            lines.append(f"{name}: isolated {iso_row.paired_x_shared:.3f} vs global-disable "
                         f"{disable.paired_x_shared:.3f} (paired x shared), target isolated <= global-disable: "
                         f"{'met' if ok else 'NOT met'}")
        ok = not any(iso_row.cp_syncs_per_step)
        lines.append(f"{name}: host syncs from {CP_SITES} in isolated, per rank {iso_row.cp_syncs_per_step}, "
                     f"target none: {'met' if ok else 'NOT met'}")
    return lines


# ---------------------------------------------------------------------------------------------- output
def _per_rank(values: list, spec: str) -> str:
    return " / ".join(format(v, spec) for v in values)


def print_table(rows: list[CPRow], title: str) -> None:
    """The rows as one rich table; per-rank columns read ``rank 0 / rank 1 / ...``."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("T", "T/rank", "layout", "mode", "median ms", "p10-p90 ms", "x shared (paired)", "x no-ac (paired)",
                "rank medians ms", "peak MiB", "d peak vs shared", "syncs/step", "fla/ops/cp syncs",
                "helper computations"):
        table.add_column(col, justify="right")
    for row in rows:
        shared = next((r for r in rows if (r.tokens, r.layout, r.mode) == (row.tokens, row.layout, "shared")), None)
        d_peak = max(p - s for p, s in zip(row.peak_mib, shared.peak_mib)) if shared else None
        table.add_row(
            str(row.tokens), str(row.local_tokens), row.layout, row.mode, f"{row.median_ms:.3f}",
            f"{row.p10_ms:.3f}-{row.p90_ms:.3f}", fmt(row.paired_x_shared, ".3f"),
            fmt(row.paired_x_no_ac, ".3f"), _per_rank(row.rank_median_ms, ".3f"), _per_rank(row.peak_mib, ".1f"),
            fmt(d_peak, "+.2f"), _per_rank(row.syncs_per_step, "d"), _per_rank(row.cp_syncs_per_step, "d"),
            _per_rank(row.helper_computations_per_step, "d"),
        )
    Console(width=250).print(table)


def write_json(path: str, meta: dict, rows: list[CPRow], groups: list[dict]) -> None:
    """``{"meta", "groups" (document layouts, rank cuts, crossing documents), "rows" (raw times included)}``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "groups": groups, "rows": [asdict(r) for r in rows]}, f, indent=1)


def report(rows: list[CPRow], groups: list[dict], args: argparse.Namespace, meta: dict) -> None:
    """Rank 0: the table, the sync sites, the targets; ``--json`` and ``--png``."""
    if args.json:
        write_json(args.json, meta, rows, groups)
    if args.png:
        plot(rows, args.png, label=lambda r: f"{LAYER} CP={r.world} {r.layout}")
    smoke = " - CPU SMOKE TEST, not a measurement" if args.device == "cpu" else ""
    print_table(rows, f"CP={meta['world']} {LAYER} layer step (forward + recompute + backward), {meta['dtype']}, "
                      f"slowest rank per iteration, {args.iters} interleaved iterations{smoke}")
    for row in rows:
        for rank, sites in enumerate(row.sync_sites):
            if sites:
                print(f"sync sites T={row.tokens} {row.layout} {row.mode} rank {rank}: {sites}")
    for line in targets(rows):
        print(f"target {line}{' (CPU smoke: not a measurement)' if smoke else ''}")


def print_progress(rows: list[CPRow]) -> list[CPRow]:
    """One line per row as soon as its group is done (rank 0); returns ``rows``."""
    for r in rows:
        print(f"T={r.tokens} ({r.local_tokens}/rank) {r.layout} {r.mode}: {r.median_ms:.3f} ms (slowest rank), "
              f"paired x shared {fmt(r.paired_x_shared, '.3f')}, peak MiB {_per_rank(r.peak_mib, '.1f')}, "
              f"syncs {_per_rank(r.syncs_per_step, 'd')} (fla/ops/cp: {_per_rank(r.cp_syncs_per_step, 'd')})",
              flush=True)
    return rows
