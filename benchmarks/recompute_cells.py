"""The cells of ``bench_recompute``: one group (a GDN or Mamba2 layer, or the hybrid stack, at ``T`` tokens),
measured eagerly and from CUDA graphs over changing packing layouts.

A :class:`Group` holds one module per mode (same weights; ``levers.MODES``), 3 rotating inputs, one
``grad_out`` and :data:`LAYOUTS` document layouts of ``T`` tokens with different document counts (so ``N``
and the chunk count ``NT`` both change from step to step).

* :func:`eager_phase` - the modes interleaved (iteration ``i`` starts at mode ``i % n``), new
  ``LayerLocalSeqlens`` per step as a loader builds them (outside the timed region): warm-up, one step per mode
  counting host syncs (CUDA), one measuring memory (peak and held), then timed steps (CUDA events).
* :func:`graphed_phase` - per checkpointed mode, a graph of its whole step and one of ``no-ac``'s, both captured
  with layout 0 (``StaticSeqlens`` bound: ``max_docs``), replayed alternately over all layouts (before each
  replay: the layout written into the static buffers and the input copied in, outside the timed region); then
  one layout never captured is replayed and compared with the same step run eagerly, bit for bit.

Every timing loop stops at ``deadline`` (``time.monotonic()``), keeping what it measured (at least 2 samples).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.layer_step import (
    Step,
    build_layer,
    doc_lengths,
    elapsed_ms,
    paired_ratio,
    peak_and_held_mib,
    rotated,
)
from benchmarks.levers import MODES
from benchmarks.stack import apply_mode, build_stack

__all__ = ["LAYOUTS", "Group", "Row", "eager_phase", "graphed_phase"]

LAYOUTS = (8, 5, 13, 16)  # documents per layout; layout 0 is the one graphs are captured with
NUM_INPUTS = 3


@dataclass
class Row:
    group: str  # "gdn" | "mamba2" | "stack"
    tokens: int
    mode: str
    graphed: bool
    median_ms: float
    p10_ms: float
    p90_ms: float
    x_no_ac: float | None  # paired: median over iterations of time / no-ac's time (graphed: no-ac's graph)
    peak_mib: float | None = None  # eager step, above what was allocated before it
    held_mib: float | None = None  # after the forward, before the backward (what the policy keeps)
    pool_mib: float | None = None  # graphed: memory the capture reserved
    syncs_per_step: int | None = None
    sync_sites: dict[str, int] = field(default_factory=dict)
    replay_vs_eager: dict[str, float] | None = None  # graphed: {tensor: max |diff|} that differ (empty: equal)
    padded_vs_plain: dict[str, float] | None = None  # eager, static (padded) vs ordinary metadata
    times_ms: list[float] = field(default_factory=list)


def _stats(times: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]]
    return statistics.median(times), q[0], q[-1]


@dataclass
class Group:
    """One group's modules, inputs and layouts (see the module docstring)."""

    kind: str
    tokens: int
    device: str
    dtype: torch.dtype
    modules: dict[str, torch.nn.Module]
    inputs: list[torch.Tensor]
    grad_out: torch.Tensor
    layouts: list[list[int]]
    max_docs: int
    statics: dict = field(default_factory=dict)  # mode -> StaticSeqlens, for the modes whose eager steps pad

    @classmethod
    def build(cls, kind: str, tokens: int, modes: list[str], hidden: int, device: str, max_docs: int) -> Group:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        backend = "reference" if device == "cpu" else "fla"

        def base(saveable: bool) -> torch.nn.Module:
            if kind == "stack":
                return build_stack(hidden, dtype, device, backend, saveable)
            torch.manual_seed(0)
            return build_layer(kind, hidden, dtype, device, backend, saveable)

        plain, saveable = base(False), base(True)
        saveable.load_state_dict(plain.state_dict())
        modules = {}
        for name in modes:
            mode = MODES[name]
            module = copy.deepcopy(saveable if mode.saveable else plain)
            modules[name] = apply_mode(module, mode, tokens) if kind == "stack" else mode.wrap(module, tokens)
        shape = (1, tokens, hidden)
        inputs = [torch.randn(shape, device=device, dtype=dtype) for _ in range(NUM_INPUTS)]
        layouts = [doc_lengths(tokens, docs, seed) for seed, docs in enumerate(LAYOUTS)]
        from fla_ac_isolation.graphs import StaticSeqlens

        statics = {name: StaticSeqlens(tokens, max_docs, device=device) for name in modes if MODES[name].static}
        return cls(kind, tokens, device, dtype, modules, inputs, torch.randn(shape, device=device, dtype=dtype),
                   layouts, max_docs, statics)

    def host_offsets(self, i: int) -> torch.Tensor:
        lens = self.layouts[i % len(self.layouts)]
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def seqlens(self, i: int, static=None):
        """Layout ``i``'s offsets as a loader hands them over (host and device), or written into ``static`` (then
        ``static`` itself, which holds them until the next fill)."""
        from fla_ac_isolation import LayerLocalSeqlens

        host = self.host_offsets(i)
        if static is not None:
            static.fill(host)
            return static
        return LayerLocalSeqlens(host.to(self.device), cu_seqlens_cpu=host)

    def step(self, mode: str, i: int) -> Step:
        """Mode ``mode``'s eager step on layout and input ``i`` (offsets built now, as a loader would)."""
        x = self.inputs[i % NUM_INPUTS].detach().requires_grad_()
        return Step(self.modules[mode], x, self.seqlens(i, self.statics.get(mode)), self.grad_out)

    def sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()

    def layout_sizes(self) -> list[dict[str, int]]:
        from fla_ac_isolation.fla_seam.layout import chunk_indices_for

        return [{"docs": len(lens), "chunks": int(chunk_indices_for(self.host_offsets(i)).shape[0])}
                for i, lens in enumerate(self.layouts)]


def _timed(group: Group, run: Callable[[], None]) -> float:
    group.sync()
    return elapsed_ms(group.device, run)


def _syncs(group: Group, step: Step) -> list[str]:
    if group.device == "cpu":
        step()
        return []
    from fla_ac_isolation.harness.testing.gpu import host_sync_sites

    group.sync()
    with host_sync_sites() as sites:
        step()
    group.sync()
    return sites


def _memory(group: Group, step: Step) -> tuple[float | None, float | None]:
    if group.device == "cpu":
        step()
        return None, None
    return peak_and_held_mib(step)


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def eager_phase(group: Group, modes: list[str], warmup: int, iters: int, deadline: float,
                failures: dict[str, str]) -> list[Row]:
    """The eager rows of ``group`` (see the module docstring). A mode whose warm-up raises is dropped and its
    error recorded in ``failures`` (``no-ac`` is then still the reference of the others); none left: no row."""
    import collections

    for i in range(warmup):
        for mode in rotated(list(modes), i):
            if mode in failures:
                continue
            try:
                group.step(mode, i)()
            except Exception as error:  # a mode's failure is a result
                failures[mode] = _failure(error)
    modes = [m for m in modes if m not in failures]
    if not modes:  # every mode failed its warm-up: nothing to time
        return []
    sites = {mode: _syncs(group, group.step(mode, 0)) for mode in modes}
    memory = {mode: _memory(group, group.step(mode, 1)) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(iters):
        if i >= 2 and time.monotonic() > deadline:
            break
        for mode in rotated(modes, i):
            step = group.step(mode, i)
            times[mode].append(_timed(group, step))
    rows = []
    for mode in modes:
        median, p10, p90 = _stats(times[mode])
        ratio = paired_ratio(times[mode], times["no-ac"]) if "no-ac" in times else None
        peak, held = memory[mode]
        rows.append(Row(group.kind, group.tokens, mode, False, median, p10, p90, ratio, peak, held, None,
                        len(sites[mode]), dict(collections.Counter(sites[mode])), times_ms=times[mode]))
    return rows


def padded_vs_plain(group: Group, mode: str, i: int) -> dict[str, float]:
    """Eager gradients of ``mode`` with static (padded) vs ordinary metadata for layout ``i``: the tensors that
    differ, with their largest difference (empty: equal bit for bit)."""
    from benchmarks.graph_step import mismatches
    from fla_ac_isolation.graphs import StaticSeqlens

    static = StaticSeqlens(group.tokens, group.max_docs, device=group.device)
    module = group.modules[mode]
    grads = []
    for seqlens in (group.seqlens(i, static), group.seqlens(i)):
        x = group.inputs[i % NUM_INPUTS].detach().clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        module(x, seqlens).backward(group.grad_out)
        grads.append([x.grad, *(p.grad for p in module.parameters())])
    names = ["x", *(n for n, _ in module.named_parameters())]
    return mismatches(grads[0], grads[1], names)


def graphed_phase(group: Group, modes: list[str], iters: int, deadline: float, failures: dict[str, str],
                  warmup: int = 2) -> list[Row]:
    """The graphed rows of ``group`` (see the module docstring); needs CUDA. A mode whose capture or replay
    raises is recorded in ``failures`` under ``"<mode> (graphed)"`` and the next mode runs."""
    from benchmarks.graph_step import GraphedStep, mismatches
    from fla_ac_isolation.graphs import StaticSeqlens

    static = StaticSeqlens(group.tokens, group.max_docs, device=group.device)
    unseen = len(group.layouts) - 1  # never captured

    def build(mode: str) -> GraphedStep:
        module = copy.deepcopy(group.modules[mode])
        x = group.inputs[0].detach().clone().requires_grad_()
        return GraphedStep.build(module, x, group.grad_out, group.seqlens(0, static), warmup=warmup)

    def check(graphed: GraphedStep) -> dict[str, float]:
        seqlens = group.seqlens(unseen, static)
        graphed.load(group.inputs[unseen % NUM_INPUTS])
        graphed.replay()
        got = graphed.snapshot()
        want = graphed.eager_grads(seqlens)
        names = ["x", *(n for n, p in graphed.module.named_parameters() if p.requires_grad)]
        return mismatches(got, want, names)

    rows = []
    reference = build("no-ac")
    reference_times: list[float] = []
    for mode in [m for m in modes if m != "no-ac" and not MODES[m].static]:  # graphed steps are all static
        if time.monotonic() > deadline:
            failures[f"{mode} (graphed)"] = "skipped: the cell's deadline passed"
            continue
        graphed = None
        try:
            graphed = build(mode)
            times: dict[str, list[float]] = {"no-ac": [], mode: []}
            for i in range(iters):
                if i >= 2 and time.monotonic() > deadline:
                    break
                for name, g in rotated([("no-ac", reference), (mode, graphed)], i):
                    group.seqlens(i, static)  # this step's layout, written into the static buffers
                    g.load(group.inputs[i % NUM_INPUTS])
                    times[name].append(_timed(group, g.replay))
            median, p10, p90 = _stats(times[mode])
            rows.append(Row(group.kind, group.tokens, mode, True, median, p10, p90,
                            paired_ratio(times[mode], times["no-ac"]), pool_mib=graphed.pool_mib,
                            replay_vs_eager=check(graphed), times_ms=times[mode]))
            reference_times += times["no-ac"]
        except Exception as error:  # a mode's failure is a result
            failures[f"{mode} (graphed)"] = _failure(error)
        finally:
            if graphed is not None:
                graphed.release()
            del graphed
            torch.cuda.empty_cache()
    if reference_times:
        median, p10, p90 = _stats(reference_times)
        rows.insert(0, Row(group.kind, group.tokens, "no-ac", True, median, p10, p90, 1.0,
                           pool_mib=reference.pool_mib, replay_vs_eager=check(reference), times_ms=reference_times))
    reference.release()
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return rows
