"""Draw docs/img/fault.png: forward vs recompute op sequences and SAC's shifted replay.

Run: python docs/diagrams/fault_diagram.py  (matplotlib only; the PNG is committed).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

FLA = "#f4a261"  # ops FLA's index helpers run on a cache miss
OWN = "#8ecae6"  # the layer's own ops
BAD = "#e63946"


def box(ax, x, y, text, color, w=1.55, h=0.55):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.03", fc=color, ec="#333", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5, family="monospace")


def row(ax, y, label, ops):
    ax.text(-0.2, y + 0.27, label, ha="right", va="center", fontsize=10, weight="bold")
    for i, (text, color) in enumerate(ops):
        box(ax, i * 1.75, y, text, color)


def main(out: Path) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(13, 6.2))
    forward = [("sub  #0", FLA), ("cumsum", FLA), ("sub  #1", FLA), ("_to_copy #0", FLA),
               ("linear", OWN), ("sub  #2", OWN), ("sub  #3", OWN), ("_to_copy #1", OWN)]
    recompute_shared = [("linear", OWN), ("sub  #0", OWN), ("sub  #1", OWN), ("_to_copy #0", OWN)]
    recompute_local = forward

    for ax, title, rec, bad in (
        (axes[0], "shared cu_seqlens: layer 0 misses FLA's cache in forward, hits it in the recompute",
         recompute_shared, True),
        (axes[1], "LayerLocalSeqlens: a fresh cu_seqlens per layer call, both passes miss", recompute_local, False),
    ):
        ax.set_xlim(-2.2, 14.2)
        ax.set_ylim(-0.3, 2.3)
        ax.axis("off")
        ax.set_title(title, fontsize=11, loc="left")
        row(ax, 1.4, "forward", forward)
        row(ax, 0.0, "recompute", rec)
        if bad:
            # SAC replays by (op, index): the layer's own sub #0 gets FLA's saved sub #0, and so on
            for src, dst in ((0, 1), (2, 2), (3, 3)):
                arrow = FancyArrowPatch((src * 1.75 + 0.78, 1.4), (dst * 1.75 + 0.78, 0.55),
                                        arrowstyle="-|>", mutation_scale=12, color=BAD, lw=1.6)
                ax.add_patch(arrow)
            ax.text(8.3, 0.25, "replayed outputs belong to FLA's ops:\n"
                    "int tensors reach autograd, shapes mismatch,\nor gradients are silently wrong",
                    fontsize=9, color=BAD, va="center")
        else:
            for i in range(len(forward)):
                ax.add_patch(FancyArrowPatch((i * 1.75 + 0.78, 1.4), (i * 1.75 + 0.78, 0.55),
                                             arrowstyle="-|>", mutation_scale=10, color="#2a9d8f", lw=1.2))
    handles = [plt.Rectangle((0, 0), 1, 1, fc=FLA, ec="#333"), plt.Rectangle((0, 0), 1, 1, fc=OWN, ec="#333")]
    fig.legend(handles, ["op run by an FLA index helper on a cache miss", "the layer's own op"],
               loc="lower center", ncol=2, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(Path(__file__).resolve().parents[1] / "img" / "fault.png")
