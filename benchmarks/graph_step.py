"""One training step (forward, recompute, backward) captured in a CUDA graph and replayed across packings.

torch's whole-network capture (``torch.cuda.graph``, after a warm-up on a side stream) records every kernel
of one step at fixed addresses; :class:`~fla_ac_isolation.graphs.StaticSeqlens` keeps the varlen
metadata at fixed addresses and fixed sizes, so the same graph replays any packing of ``T`` tokens in at
most ``max_docs`` documents. What a replay needs before it runs, on the replaying stream:

* this step's inputs copied into the static input (``GraphedStep.load``);
* this step's offsets written into the static buffers: ``static.fill(cu_seqlens_cpu)``.

Gradients land in the tensors the capture allocated (the ``.grad`` of the parameters and of the input at the
end of the capture: :attr:`GraphedStep.grads`); each replay overwrites them (the capture ran with every
``.grad`` set to ``None``, so a replay assigns, it does not accumulate).

Used by ``bench_recompute`` and the GPU tests (``tests/test_graphs_gpu.py``); needs CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["GraphedStep", "capture", "mismatches"]


def capture(step: Callable[[], None], *, warmup: int = 2,
            reset: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, int]:
    """Run ``step`` ``warmup`` times on a side stream (compiles, autotunes, fills FLA's caches, as torch asks
    before a capture), then capture one call in a new ``torch.cuda.CUDAGraph`` with its own memory pool.

    ``reset`` runs before every warm-up call and before the capture (e.g. setting every ``.grad`` to ``None``).
    Returns the graph and the bytes the capture reserved (its pool, as ``torch.cuda.memory_reserved`` moved).
    """
    reset = reset or (lambda: None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            reset()
            step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph, torch.cuda.memory_reserved() - before


@dataclass
class GraphedStep:
    """A module's step ``module(x, seqlens).backward(grad_out)`` captured once, replayable for any packing.

    Build with :meth:`build`: ``x`` is the static input ``[1, T, D]`` (requires grad), ``seqlens`` the filled
    ``StaticSeqlens`` the capture ran with.
    """

    module: torch.nn.Module
    x: torch.Tensor
    grad_out: torch.Tensor
    graph: torch.cuda.CUDAGraph
    params: list[torch.nn.Parameter]
    grads: list[torch.Tensor] = field(default_factory=list)  # x.grad, then each parameter's, as captured
    pool_mib: float = 0.0  # device memory the capture reserved (its private pool)

    @classmethod
    def build(cls, module: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor, seqlens,
              *, warmup: int = 2) -> GraphedStep:
        """Warm up and capture ``module(x, seqlens)`` + its backward; ``x`` must be a leaf requiring grad."""
        params = [p for p in module.parameters() if p.requires_grad]

        def step() -> None:
            module(x, seqlens).backward(grad_out)

        def clear() -> None:
            x.grad = None
            for p in params:
                p.grad = None

        graph, pool = capture(step, warmup=warmup, reset=clear)
        grads = [x.grad, *(p.grad for p in params)]
        return cls(module, x, grad_out, graph, params, grads, pool / 2**20)

    def load(self, x: torch.Tensor) -> None:
        """Copy this step's input into the static input (on the current stream)."""
        with torch.no_grad():
            self.x.copy_(x)

    def replay(self) -> None:
        self.graph.replay()

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the gradients the last replay wrote (``x.grad`` first)."""
        return [g.clone() for g in self.grads]

    def eager_grads(self, seqlens) -> list[torch.Tensor]:
        """The same step run eagerly (no graph) with ``seqlens``: ``[x.grad, *parameter grads]``, fresh tensors.

        Leaves the parameters' ``.grad`` as this call made them; the graph keeps writing into its own.
        """
        x = self.x.detach().clone().requires_grad_()
        for p in self.params:
            p.grad = None
        self.module(x, seqlens).backward(self.grad_out)
        return [x.grad, *(p.grad for p in self.params)]

    def release(self) -> None:
        """Drop the graph and its pool (and the gradients it owns)."""
        self.graph.reset()
        self.grads.clear()
        for p in self.params:
            p.grad = None


def mismatches(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], names: Sequence[str]) -> dict[str, float]:
    """``{name: max |got - want|}`` for every pair that is not equal bit for bit (empty: all equal)."""
    out = {}
    for name, a, b in zip(names, got, want, strict=True):
        if a is None and b is None:
            continue
        if a is None or b is None or not torch.equal(a, b):
            out[name] = float("inf") if a is None or b is None else (a.float() - b.float()).abs().max().item()
    return out
