"""The benchmarks' chart: median step time per mode, one panel per group (matplotlib)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["COLORS", "plot"]

COLORS = {
    "no-ac": "#999999", "shared": "#e63946", "isolated": "#2a9d8f", "isolated+cpu": "#52b788",
    "isolated-no-indices": "#457b9d", "global-disable": "#f4a261", "isolated+save-core": "#6a4c93",
    "isolated+save-core+conv": "#b5838d",
}
"""A colour per benchmark mode."""


def plot(rows: list, path: str, label: Callable[[Any], str] = lambda row: row.layer) -> None:
    """One panel per (``label(row)``, tokens) group, one bar per mode (median ms per step).

    ``rows``: ``bench_isolation.Row`` s or any rows with ``tokens``, ``mode`` and ``median_ms`` (``label`` names the
    group; by default the layer).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(label(r), r.tokens) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 3.8), squeeze=False)
    for ax, (layer, tokens) in zip(axes[0], groups):
        sub = [r for r in rows if label(r) == layer and r.tokens == tokens]
        ax.bar([r.mode for r in sub], [r.median_ms for r in sub], color=[COLORS[r.mode] for r in sub])
        ax.set_title(f"{layer}, T={tokens}")
        ax.set_ylabel("median ms / step")
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
