"""Where the recompute's time goes: per-kernel times of one checkpointed layer's recompute (``torch.profiler``).

Used by ``bench_isolation.py --profile``. :func:`marked` wraps a checkpoint ``context_fn`` so that the
recompute runs inside a ``record_function`` range with a device synchronisation at either end: no kernel of
the forward or of the backward runs inside the range, and every kernel launched in it has finished before it
closes. :func:`recompute_breakdown` then sums, per kernel name, the device time of the kernels launched from
inside the range (the profiler links each kernel to the CPU event that launched it). Without that link it
falls back to the device kernels that ran inside the range's time window. On a CPU (the smoke path) it
lists every operator under the range by its self time (CPU times, not kernels; an operator whose output
SAC saved still appears once, as the dispatch that returns the stored output, with nothing under it).

Reported per recompute: ``wall_ms`` (the range on the host, synchronised: kernels plus launch gaps and host
work), ``kernel_ms`` (sum of the kernels' device time), ``launches`` and ``kernels`` (name, calls,
total_ms), most expensive first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

RANGE = "fla_ac_isolation::recompute"


def marked(context_fn: Callable[[], tuple], synchronize: Callable[[], None]) -> Callable[[], tuple]:
    """``context_fn`` whose recompute context also opens the profiler range :data:`RANGE`, synchronised."""

    def fn() -> tuple:
        forward_ctx, recompute_ctx = context_fn()
        return forward_ctx, _in_range(recompute_ctx, synchronize)

    return fn


@contextlib.contextmanager
def _in_range(ctx: Any, synchronize: Callable[[], None]) -> Iterator[None]:
    synchronize()
    with torch.profiler.record_function(RANGE):
        try:
            with ctx:
                yield
        finally:
            synchronize()


def _descendants(event) -> Iterator[Any]:
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        yield child
        stack.extend(child.cpu_children)


def recompute_breakdown(events: list, device: str) -> dict:
    """Per-kernel device time of the recompute ranges in ``events`` (``profile.events()``), see the module docstring."""
    from torch.autograd import DeviceType

    ranges = [e for e in events if e.name == RANGE and e.device_type == DeviceType.CPU]
    rows: dict[str, list[float]] = {}  # name -> [calls, microseconds]
    method = "cpu operators"
    for window in ranges:
        if device == "cpu":  # every operator under the range, by its self time (no double counting)
            found = [(e.name, e.self_cpu_time_total) for e in _descendants(window)]
        else:
            found = [(k.name, k.duration) for e in _descendants(window) for k in e.kernels]
            method = "kernels linked to their launches"
            if not found:
                start, end = window.time_range.start, window.time_range.end
                found = [(e.name, e.time_range.elapsed_us()) for e in events  # not the range's GPU annotation
                         if e.device_type == DeviceType.CUDA and e.name != RANGE and start <= e.time_range.start <= end]
                method = "device kernels inside the synchronised range"
        for name, micros in found:
            row = rows.setdefault(name, [0, 0.0])
            row[0] += 1
            row[1] += micros
    kernels = sorted(({"name": n, "calls": c, "total_ms": us / 1e3} for n, (c, us) in rows.items()),
                     key=lambda r: -r["total_ms"])
    return {"ranges": len(ranges), "method": method,
            "wall_ms": sum(w.time_range.elapsed_us() for w in ranges) / 1e3,
            "kernel_ms": sum(r["total_ms"] for r in kernels), "launches": sum(r["calls"] for r in kernels),
            "kernels": kernels}


def profile(step: Callable[[], None], device: str) -> dict:
    """Run ``step`` (one forward + recompute + backward of a layer wrapped with :func:`marked`) under the
    profiler and return :func:`recompute_breakdown` of it."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
    return recompute_breakdown(list(prof.events()), device)


def format_breakdown(title: str, breakdown: dict, top: int = 12) -> str:
    """Text of one breakdown: totals, then the ``top`` kernels and the rest as one line."""
    what = "CPU operators (smoke path)" if breakdown["method"] == "cpu operators" else "kernels"
    lines = [f"{title}: recompute {breakdown['wall_ms']:.3f} ms on the host (synchronised), "
             f"{breakdown['kernel_ms']:.3f} ms in {breakdown['launches']} {what} ({breakdown['method']})"]
    total = breakdown["kernel_ms"] or 1.0
    for row in breakdown["kernels"][:top]:
        lines.append(f"  {row['total_ms']:9.3f} ms {100 * row['total_ms'] / total:5.1f} %  x{row['calls']:<3} "
                     f"{row['name'][:90]}")
    rest = breakdown["kernels"][top:]
    if rest:
        ms = sum(r["total_ms"] for r in rest)
        lines.append(f"  {ms:9.3f} ms {100 * ms / total:5.1f} %  x{sum(r['calls'] for r in rest):<3} "
                     f"({len(rest)} other names)")
    return "\n".join(lines)
