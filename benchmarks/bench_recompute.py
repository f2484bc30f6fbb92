"""The recompute at its limit: one GDN / Mamba2 layer step and a 4-block hybrid stack, eager and graphed, per lever.

One command measures, on one GPU and within a time budget (issue 25):

* **layer cells** (``gdn``, ``mamba2`` at each ``--tokens``): forward + recompute + backward of one checkpointed
  mixer (Qwen3.5-MoE's GDN, Nemotron-H's Mamba2; hidden 2048, bf16) in every mode of ``benchmarks.levers``
  (``no-ac``, torchtitan's SAC with isolation ``sac``, ``+save-core``, ``+save-core+conv``, ``+save-small``,
  ``+save-core+small``; ``sac+static``: ``sac``'s eager step with the graphs' padded metadata), eager and
  replayed from a CUDA graph, over 4 packing layouts of 5-16 documents
  (``benchmarks.recompute_cells``): median step, paired ratio to ``no-ac`` (eager to eager, graphed to
  graphed), peak and held memory, host syncs per eager step with their sites, and whether a replay of a layout
  the graph was not captured with equals the same step run eagerly, bit for bit;
* **stack cell**: the same for ``benchmarks.stack`` (GDN, GDN, Mamba2, SwiGLU MLP) at 32768 tokens, with
  ``full-ac`` too.

Order: the eager phase of every 32768-token group, then their graphed phase, then the same for the larger
token counts (``cells``), so eager numbers are taken before any graph could fail badly. Robustness: each cell
runs in ``try/except``, and each mode inside it (the failure's text is recorded and the run goes on); the JSON
is rewritten after every cell; ``--budget-s`` bounds the whole run (from the start of this module): a cell
starts only while ``--reserve`` seconds of budget remain for it (estimated per cell, ``PLAN``), its timing
loops stop at its own deadline, keeping their samples, and the cells left are listed as skipped.

Run on a CUDA machine from the repository root (about 6 minutes on one H200 with the defaults)::

    python -m benchmarks.bench_recompute --first-config --lift-hopper-guard --json recompute.json

``--device cpu`` is a smoke test of this script: the reference backend in float32 at tiny shapes, no graphs,
no syncs counted, no memory; its numbers mean nothing. ``python -m benchmarks.recompute_chart recompute.json
recompute.png`` draws the results.
"""

from __future__ import annotations

import time

START = time.monotonic()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict  # noqa: E402

import torch  # noqa: E402

from benchmarks import outcome  # noqa: E402
from benchmarks.levers import MODES  # noqa: E402
from benchmarks.recompute_cells import LAYOUTS, Group, Row, eager_phase, graphed_phase, padded_vs_plain  # noqa: E402

LAYER_MODES = ["no-ac", "sac", "sac+static", "sac+save-core", "sac+save-core+conv", "sac+save-small",
               "sac+save-core+small"]
LONG_MODES = ["no-ac", "sac", "sac+save-core", "sac+save-core+small"]  # tokens above 32768: fewer modes
STACK_MODES = ["no-ac", "full-ac", "sac", "sac+save-core", "sac+save-core+conv", "sac+save-small",
               "sac+save-core+small"]
PLAN = {  # (group, tokens, phase) -> seconds one H200 is expected to need (first-config kernels; the first cell
    # compiles them), about 1.5x the estimate from the step times in docs/benchmarks.md
    ("gdn", 32768, "eager"): 70, ("mamba2", 32768, "eager"): 45, ("stack", 32768, "eager"): 35,
    ("gdn", 32768, "graphed"): 15, ("mamba2", 32768, "graphed"): 25, ("stack", 32768, "graphed"): 45,
    ("gdn", 131072, "eager"): 15, ("mamba2", 131072, "eager"): 30,
    ("gdn", 131072, "graphed"): 20, ("mamba2", 131072, "graphed"): 40,
}


def cells(args) -> list[tuple[str, int, list[str], str]]:
    """``(group, tokens, modes, phase)`` in the order they run: the eager phase of every group at the first
    ``--tokens`` (and the stack), then their graphed phase, then the same for the larger token counts. Eager
    numbers come first, so a graph that fails badly (a CUDA error poisons the process) cannot take them; the
    cells most likely to be cut by the budget come last."""
    first, *rest = args.tokens
    batches = [[(kind, first, LAYER_MODES) for kind in args.layers]
               + ([("stack", args.stack_tokens, STACK_MODES)] if args.stack else []),
               [(kind, tokens, LONG_MODES) for tokens in rest for kind in args.layers]]
    phases = ["eager"] + (["graphed"] if args.device == "cuda" and not args.no_graphs else [])
    return [(kind, tokens, modes, phase) for batch in batches for phase in phases for kind, tokens, modes in batch]


def run_cell(kind: str, tokens: int, modes: list[str], phase: str, args, deadline: float,
             failures: dict[str, str]) -> list[Row]:
    """One phase of one group; modes that failed are in ``failures`` (mode -> error text). ``failures`` holds the
    eager phase's failures when the graphed phase starts: those modes are not graphed."""
    modes = [m for m in modes if m not in failures]
    group = Group.build(kind, tokens, modes, args.hidden, args.device, args.max_docs)
    if phase == "graphed":
        return graphed_phase(group, modes, args.iters, deadline, failures) if "no-ac" in modes else []
    rows = eager_phase(group, modes, args.warmup, args.iters, deadline, failures)
    sac = next((r for r in rows if r.mode == "sac"), None)
    if tokens == args.tokens[0] and sac is not None:
        try:
            sac.padded_vs_plain = padded_vs_plain(group, "sac", len(LAYOUTS) - 1)
        except Exception as error:  # recorded, the cell goes on
            failures["sac (padded vs plain)"] = f"{type(error).__name__}: {error}"
    return rows


def table(rows: list[Row]) -> str:
    head = (f"{'group':7} {'T':>6} {'mode':22} {'graph':5} {'median ms':>10} {'p10-p90 ms':>16} {'x no-ac':>8} "
            f"{'peak MiB':>9} {'held MiB':>9} {'pool MiB':>9} {'syncs':>5}  replay==eager / padded==plain")
    lines = [head, "-" * len(head)]
    for r in rows:
        def num(v, spec):
            return "-" if v is None else format(v, spec)

        check = "" if r.replay_vs_eager is None else ("equal" if not r.replay_vs_eager else f"DIFF {r.replay_vs_eager}")
        if r.padded_vs_plain is not None:
            check += "padded equal" if not r.padded_vs_plain else f"padded DIFF {r.padded_vs_plain}"
        lines.append(
            f"{r.group:7} {r.tokens:>6} {r.mode:22} {'yes' if r.graphed else 'no':5} {r.median_ms:>10.3f} "
            f"{r.p10_ms:>7.2f}-{r.p90_ms:<8.2f} {num(r.x_no_ac, '.3f'):>8} {num(r.peak_mib, '.0f'):>9} "
            f"{num(r.held_mib, '.0f'):>9} {num(r.pool_mib, '.0f'):>9} {num(r.syncs_per_step, 'd'):>5}  {check}"
        )
    return "\n".join(lines)


def meta(args) -> dict:
    from fla_ac_isolation.harness.environment import versions

    return {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "dtype": "float32" if args.device == "cpu" else "bfloat16", "versions": versions(), "hidden": args.hidden,
        "iters": args.iters, "warmup": args.warmup, "layouts_docs": list(LAYOUTS), "max_docs": args.max_docs,
        "first_config": args.first_config, "hopper_guard_lifted": args.lift_hopper_guard, "budget_s": args.budget_s,
        "modes": {name: asdict(MODES[name]) for name in dict.fromkeys([*LAYER_MODES, *STACK_MODES])},
        "order": "eager: modes interleaved, iteration i starts at mode i % n; graphed: each mode's graph "
                 "alternating with no-ac's graph",
    }


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=outcome.EPILOG)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", nargs="+", default=["gdn", "mamba2"], choices=["gdn", "mamba2"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--stack-tokens", type=int, default=32768)
    parser.add_argument("--no-stack", dest="stack", action="store_false")
    parser.add_argument("--no-graphs", action="store_true", help="eager rows only")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--max-docs", type=int, default=32, help="document bound of the graphs' static metadata")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=420.0, help="whole run, from the start of this module")
    parser.add_argument("--reserve", type=float, default=1.0,
                        help="a cell starts only if (its PLAN estimate x this) seconds of budget remain")
    parser.add_argument("--first-config", action="store_true")
    parser.add_argument("--lift-hopper-guard", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda (the default) needs a CUDA device; use --device cpu for a smoke test")
    if args.iters < 2 or args.warmup < 1:
        parser.error("--iters must be at least 2 and --warmup at least 1")
    if max(LAYOUTS) > args.max_docs:
        parser.error(f"--max-docs must be at least {max(LAYOUTS)} (the layouts' largest document count)")
    if any(t < 2 * max(LAYOUTS) for t in [*args.tokens, args.stack_tokens]):
        parser.error(f"every token count must be at least {2 * max(LAYOUTS)}")
    return args


def run_outcome(cells: list[dict], rows: int) -> outcome.Outcome:
    """What the run did, per mode of each cell: each of the ``rows`` ran; a failure recorded in a cell, or the error
    of a cell that failed as a whole (once per mode it attempted), failed; the modes of a skipped cell were
    skipped."""
    failed: list[str] = []
    skipped = 0
    for cell in cells:
        if cell["status"] == "skipped":
            skipped += len(cell["modes"])
        elif cell["status"] == "failed":
            failed += [cell["error"]] * len(cell["attempted"])
        else:
            failed += list(cell["failures"].values())
    return outcome.Outcome(rows, failed, skipped, "modes")


@outcome.stops_on_missing_module("bench_recompute")
def main(argv=None) -> int:
    args = parse_args(argv)
    from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config
    from fla_ac_isolation.harness.testing.gpu import lift_hopper_gdn_guard

    results = {"meta": meta(args), "cells": [], "rows": []}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    with (
        lift_hopper_gdn_guard() if args.lift_hopper_guard else contextlib.nullcontext(),
        first_autotune_config() if args.first_config else contextlib.nullcontext(),
    ):
        group_failures: dict[tuple[str, int], dict[str, str]] = {}
        for kind, tokens, modes, phase in cells(args):
            now = time.monotonic() - START
            estimate = PLAN.get((kind, tokens, phase), 60) * args.reserve if args.device == "cuda" else 0
            cell = {"group": kind, "tokens": tokens, "phase": phase, "modes": modes, "start_s": round(now, 1)}
            if now + estimate > args.budget_s:
                cell.update(status="skipped", reason=f"{now:.0f} s elapsed + {estimate:.0f} s estimated > budget")
                print(f"[skip] {kind} T={tokens} {phase}: {cell['reason']}", flush=True)
            else:
                deadline = START + min(args.budget_s, now + 2 * estimate if estimate else args.budget_s)
                failures = group_failures.setdefault((kind, tokens), {})
                known = set(failures)
                try:
                    rows = run_cell(kind, tokens, modes, phase, args, deadline, failures)
                    results["rows"] += [asdict(r) for r in rows]
                    cell["failures"] = {m: e for m, e in failures.items() if m not in known}
                    cell["status"] = "ok" if not cell["failures"] else "partial"
                    print(table(rows), flush=True)
                    for mode, error in cell["failures"].items():
                        print(f"[failed] {kind} T={tokens} {mode}: {error}", flush=True)
                except Exception as error:  # a cell's failure is a result; the run goes on
                    cell.update(status="failed", error=f"{type(error).__name__}: {error}",
                                attempted=[m for m in modes if m not in known],
                                traceback=traceback.format_exc()[-4000:])
                    print(f"[failed] {kind} T={tokens} {phase}: {cell['error']}", flush=True)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            cell["seconds"] = round(time.monotonic() - START - now, 1)
            results["cells"].append(cell)
            save()
    results["meta"]["total_s"] = round(time.monotonic() - START, 1)
    save()
    print(table([Row(**r) for r in results["rows"]]))
    for cell in results["cells"]:
        detail = cell.get("error") or cell.get("reason") or cell.get("failures") or ""
        print(f"cell {cell['group']} T={cell['tokens']} {cell['phase']}: {cell['status']} ({cell.get('seconds')} s) "
              f"{detail}")
    print(f"total {results['meta']['total_s']} s" + (" - CPU SMOKE TEST, not a measurement" if args.device == "cpu"
                                                      else ""))
    return outcome.finish("bench_recompute", run_outcome(results["cells"], len(results["rows"])))


if __name__ == "__main__":
    raise SystemExit(main())
