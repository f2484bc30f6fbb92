"""Draw ``bench_recompute``'s JSON: the ratio to no-AC per mode, eager and graphed, and the stack's time and memory.

    python -m benchmarks.recompute_chart recompute.json recompute.png

Left panels (one per layer group): the paired ratio of each checkpointed mode's step to ``no-ac`` (eager bars
against eager ``no-ac``, graphed bars against graphed ``no-ac``), with the 1.10 line. Right panel: the stack's
median step time against the memory its policy holds from forward to backward (eager ``held_mib``), one point
per mode, graphed times as open markers.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import outcome

__all__ = ["plot"]


def plot(results: dict, path: str) -> None:
    """Write the chart of ``results`` (``bench_recompute``'s JSON document) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    groups = sorted({(r["group"], r["tokens"]) for r in rows if r["group"] != "stack"})
    stack = [r for r in rows if r["group"] == "stack"]
    panels = len(groups) + (1 if stack else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(4.8 * max(panels, 1), 4.2), squeeze=False)
    for ax, (group, tokens) in zip(axes[0], groups):
        sub = [r for r in rows if (r["group"], r["tokens"]) == (group, tokens) and r["mode"] != "no-ac"]
        modes = list(dict.fromkeys(r["mode"] for r in sub))
        for offset, graphed, colour in ((-0.2, False, "#457b9d"), (0.2, True, "#e76f51")):
            values = [next((r["x_no_ac"] for r in sub if r["mode"] == m and r["graphed"] == graphed), None)
                      for m in modes]
            xs = [i + offset for i, v in enumerate(values) if v is not None]
            ax.bar(xs, [v for v in values if v is not None], width=0.4, color=colour,
                   label="graphed" if graphed else "eager")
        ax.axhline(1.10, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(modes)), modes, rotation=35, ha="right")
        ax.set_ylim(0.95, max([1.3, *[r["x_no_ac"] or 0 for r in sub]]) + 0.02)
        ax.set_title(f"{group}, T={tokens}: x no-AC (paired)")
        ax.legend(fontsize=8)
    if stack:
        ax = axes[0][len(groups)]
        held = {r["mode"]: r["held_mib"] for r in stack if not r["graphed"]}
        for r in stack:
            if held.get(r["mode"]) is None:
                continue
            ax.scatter(held[r["mode"]] / 1024, r["median_ms"], marker="o",
                       facecolors="none" if r["graphed"] else "#2a9d8f", edgecolors="#2a9d8f")
            ax.annotate(r["mode"] + (" (graph)" if r["graphed"] else ""), (held[r["mode"]] / 1024, r["median_ms"]),
                        fontsize=6)
        ax.set_xlabel("held from forward to backward, GiB (eager)")
        ax.set_ylabel("median step ms")
        ax.set_title(f"stack, T={stack[0]['tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@outcome.stops_on_missing_module("recompute_chart")
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="exit codes: 0 drawn; 1 the JSON holds no row (its run measured nothing) "
                                            "or a missing module stopped it; 2 invalid arguments")
    parser.add_argument("json", help="bench_recompute's --json output")
    parser.add_argument("png")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        results = json.load(f)
    if not results["rows"]:
        print(f"recompute_chart: nothing to draw: {args.json} holds no row (its run measured nothing)", file=sys.stderr)
        return 1
    plot(results, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
