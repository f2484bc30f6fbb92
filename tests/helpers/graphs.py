"""A CPU stand-in for a CUDA graph, to run ``benchmarks.graph_step`` / ``recompute_cells.graphed_phase`` logic.

:func:`cpu_capture` replaces ``benchmarks.graph_step.capture``: it warms ``step`` up and "captures" it by
running it once, as torch's capture runs the Python of one step. :class:`CpuGraph` ``.replay()`` reruns that
step eagerly against the static buffers' current contents and writes the gradients into the tensors the
capture produced, as a real replay writes into the graph's memory. It checks the wiring around a graph
(which tensors hold the gradients, refills, comparisons), never CUDA: the GPU tests do that.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CpuGraph", "cpu_capture"]


class CpuGraph:
    """Replays ``step`` (a ``GraphedStep.build`` closure over ``module``, ``x``, ``seqlens``) eagerly."""

    def __init__(self, step: Callable[[], None]) -> None:
        self.cells = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__), strict=True))
        self.step = step
        self.owned = None

    def _grads(self) -> list:
        params = [p for p in self.cells["module"].parameters() if p.requires_grad]
        return params, [self.cells["x"].grad, *(p.grad for p in params)]

    def replay(self) -> None:
        params, current = self._grads()
        if self.owned is None:
            self.owned = current  # what the capture produced (GraphedStep.grads)
        self.cells["x"].grad = None
        for p in params:
            p.grad = None
        self.step()
        _, new = self._grads()
        for dst, src in zip(self.owned, new, strict=True):
            dst.copy_(src)

    def reset(self) -> None:
        self.owned = None


def cpu_capture(step: Callable[[], None], *, warmup: int = 2, reset: Callable[[], None] | None = None):
    """``benchmarks.graph_step.capture`` on a CPU: warm-up calls, one "captured" call, a :class:`CpuGraph`."""
    for _ in range(warmup):
        if reset:
            reset()
        step()
    if reset:
        reset()
    step()
    return CpuGraph(step), 0
