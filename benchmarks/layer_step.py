"""One layer step, measured: what the layer benchmarks (``bench_isolation``, ``bench_cp``) share.

A *group* (one layer kind and token count, on one rank or on every rank of a CP group) holds one copy of the
mixer per mode, rotating inputs and document layouts; it has ``prepare(mode, i, layer=None) -> Step``,
``device`` and ``synchronize()`` (``bench_isolation.Group``, ``bench_cp.CPGroup``). The functions here build
a mode's layer and offsets, run and measure steps, and interleave the modes:

* :func:`build_layer` - the family's mixer of a layer kind at the benchmark's widths
  (:func:`fla_ac_isolation.harness.layer_widths.layer_fields`); :func:`wrap_for_mode` - in torch's checkpoint wrapper
  with the mode's SAC policy (:func:`mode_policy`) when the mode checkpoints.
* :func:`make_seqlens`, :func:`cache_context`, :func:`base_mode` - a benchmark mode's offsets and FLA cache
  context, from the library's modes (:data:`VARIANTS` of ``isolated``, the saveable modes of :data:`SAVED`).
* :func:`warm_step`, :func:`time_step`, :func:`probe_step`, :func:`memory_step` and :func:`measure`,
  which interleaves them (:func:`rotated`); :func:`step_statistics` and :func:`paired_ratio` summarise.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fla_ac_isolation.harness.layer_widths import family_for_layer, layer_fields
from fla_ac_isolation.mixers import family_drop_in

__all__ = [
    "MIB",
    "NUM_BUFFERS",
    "SAVED",
    "VARIANTS",
    "Step",
    "base_mode",
    "build_layer",
    "cache_context",
    "doc_lengths",
    "fmt",
    "make_seqlens",
    "measure",
    "memory_step",
    "mode_policy",
    "paired_ratio",
    "probe_step",
    "rotated",
    "step_statistics",
    "time_step",
    "warm_step",
    "wrap_for_mode",
]

MIB = 2**20
NUM_BUFFERS = 3  # rotating inputs (and document layouts) per group
# the saveable modes: the FLA operations each saves (save_fla_ops names; a layer runs one of the two cores)
SAVED = {
    "isolated+save-core": ("gated_delta_rule", "ssd"),
    "isolated+save-core+conv": ("gated_delta_rule", "ssd", "causal_conv1d"),
}


# ----------------------------------------------------------------------------------------------- layers
def build_layer(kind: str, hidden: int, dtype: torch.dtype, device: str, backend: str = "fla", saveable: bool = False):
    """One mixer of layer kind ``kind`` (``gdn``: Qwen3.5-MoE's GDN, ``mamba2``: Nemotron-H's Mamba2, the first
    family of that kind, :func:`fla_ac_isolation.harness.layer_widths.family_for_layer`) with the widths of
    :func:`fla_ac_isolation.harness.layer_widths.layer_fields` at model width ``hidden``."""
    family = family_for_layer(kind)
    config = family.config_class()(**layer_fields(family.layer, hidden))
    layer = family_drop_in(family)(config, layer_idx=0, backend=backend, saveable=saveable)
    return layer.to(device=device, dtype=dtype)


def mode_policy(mode: str):
    """The SAC policy of a checkpointed mode: torchtitan's, plus ``save_fla_ops`` for the saveable modes."""
    from fla_ac_isolation.policies import any_of, save_fla_ops, torchtitan_selective

    if mode in SAVED:
        return any_of(save_fla_ops(SAVED[mode]), torchtitan_selective())
    return torchtitan_selective()


def wrap_for_mode(layer: torch.nn.Module, mode: str, marker: Callable | None = None) -> torch.nn.Module:
    """``layer`` itself for a mode that does not checkpoint (``no-ac``); otherwise a non-reentrant checkpoint
    wrapper with :func:`mode_policy`.

    ``marker`` (``recompute_profile.marked`` with a synchronisation bound) wraps the ``context_fn`` for
    profiling.
    """
    if not base_mode(mode).checkpointed:
        return layer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from fla_ac_isolation.policies import sac_context_fn

    context_fn = sac_context_fn(mode_policy(mode))
    if marker is not None:
        context_fn = marker(context_fn)
    return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context_fn)


# --------------------------------------------------------------------------------------------- seqlens
def doc_lengths(tokens: int, docs: int, seed: int) -> list[int]:
    """``docs`` document lengths (tokens, each >= 1) summing to ``tokens``, cut at seeded random points."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(1, tokens, (docs - 1,), generator=g).tolist())
    bounds = [0, *cuts, tokens]
    return [b - a for a, b in itertools.pairwise(bounds)]


# the benchmark's variants of the isolated mode: extra keywords for LayerLocalSeqlens
VARIANTS = {
    "isolated+cpu": ("isolated", {"with_host": True}),
    "isolated-no-indices": ("isolated", {"chunk_indices": False}),
    "isolated+save-core": ("isolated", {}),
    "isolated+save-core+conv": ("isolated", {}),
}


def base_mode(mode: str):
    """The :class:`fla_ac_isolation.harness.modes.Mode` a benchmark mode runs (its variants run ``isolated``)."""
    from fla_ac_isolation.harness.modes import get_mode

    return get_mode(VARIANTS.get(mode, (mode, {}))[0])


def make_seqlens(mode: str, lens: list[int], device: str, *, with_host: bool = False, **kwargs: Any):
    """New offsets for one step of ``mode`` (see the module docstring), as a loader would build them.

    ``with_host``: the loader also hands over the host offsets (``cu_seqlens_cpu``, as ``isolated+cpu``
    does; needed under context parallelism). ``kwargs``: more keywords of the mode's ``seqlens`` (``cp=``: the
    mode's ``CPSeqlens``).
    """
    host = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    options = dict(VARIANTS.get(mode, (mode, {}))[1])
    if options.pop("with_host", False) or with_host:
        options["cu_seqlens_cpu"] = host
    return base_mode(mode).seqlens(host.to(device), **options, **kwargs)


def cache_context(mode: str):
    """The mode's FLA cache context: ``tensor_cache_disabled()`` for ``global-disable``, else a no-op."""
    return base_mode(mode).cache_context()


def rotated(modes: list[str], i: int) -> list[str]:
    """The order of iteration ``i``: ``modes`` starting at index ``i % len(modes)``."""
    k = i % len(modes)
    return modes[k:] + modes[:k]


# ------------------------------------------------------------------------------------------------ steps
@dataclass
class Step:
    """One layer step: ``forward()`` returns the output, ``backward(out)`` runs recompute + backward."""

    layer: torch.nn.Module
    x: torch.Tensor
    seqlens: Any
    grad_out: torch.Tensor

    def forward(self) -> torch.Tensor:
        return self.layer(self.x, seqlens=self.seqlens)

    def backward(self, out: torch.Tensor) -> None:
        out.backward(self.grad_out)
        self.x.grad = None

    def __call__(self) -> None:
        self.backward(self.forward())


def warm_step(group, mode: str, i: int) -> None:
    """One untimed step of ``mode`` (inside ``tensor_cache_disabled()`` for ``global-disable``)."""
    with cache_context(mode):
        group.prepare(mode, i)()


def elapsed_ms(device: str, run: Callable[[], None]) -> float:
    """Milliseconds of ``run()``: its wall time (``time.perf_counter``) on ``"cpu"``, its device time between two
    CUDA events otherwise (synchronised after). The caller synchronises before."""
    if device == "cpu":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end)


def time_step(group, mode: str, i: int) -> float:
    """Milliseconds of one step of ``mode`` (:func:`elapsed_ms`).

    ``group`` is any group (see the module docstring); so are the other ``*_step`` functions' and
    :func:`measure`'s.
    """
    with cache_context(mode):
        step = group.prepare(mode, i)
        group.synchronize()  # Group: the device (nothing on CPU); a CP group adds a barrier of its ranks
        return elapsed_ms(group.device, step)


def probe_step(group, mode: str, i: int) -> tuple[int, dict[str, int], int]:
    """One untimed step of ``mode``: ``(host syncs, {"file:line": syncs}, FLA helper computations)``.

    Host syncs are counted only on CUDA (0 on CPU).
    """
    from fla_ac_isolation.fla_seam.cache import probe_tensor_cache
    from fla_ac_isolation.harness.testing.gpu import host_sync_sites

    with cache_context(mode):
        step = group.prepare(mode, i)
        group.synchronize()
        syncs = host_sync_sites() if group.device != "cpu" else contextlib.nullcontext([])
        with syncs as sites, probe_tensor_cache() as probe:
            step()
        group.synchronize()
    return len(sites), dict(collections.Counter(sites)), probe.misses + probe.bypasses


def memory_step(group, mode: str, i: int) -> tuple[float, float]:
    """``(peak, held)`` MiB of one untimed step of ``mode`` above what was allocated before it (0, 0 on CPU).

    ``held``: allocated after the forward, before the backward (what the layer keeps for its backward, its
    output included); ``peak``: the step's maximum.
    """
    with cache_context(mode):
        step = group.prepare(mode, i)
        if group.device == "cpu":
            step()
            return 0.0, 0.0
        return peak_and_held_mib(step)


def peak_and_held_mib(step: Step) -> tuple[float, float]:
    """``(peak, held)`` MiB of one CUDA step above what was allocated before it: ``held`` after its forward
    (what it keeps for its backward, its output included), ``peak`` its maximum."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step.forward()
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / MIB
    step.backward(out)
    del out
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB, held


def measure(group, modes: list[str], warmup: int, iters: int) -> tuple[dict, dict, dict]:
    """Warm up, probe, measure memory and time every mode of ``group``, interleaved (:func:`rotated`).

    ``warmup`` untimed iterations, one probe step and one memory step per mode, then ``iters`` timed
    iterations; each iteration runs every mode once, starting at mode ``i % len(modes)``, so every process
    that calls this with the same arguments runs the same modes in the same order.

    Returns:
        ``(times, memory, probes)`` keyed by mode: step times in ms in iteration order (:func:`time_step`),
        ``(peak, held)`` MiB (:func:`memory_step`), ``(host syncs, {"file:line": syncs}, FLA helper
        computations)`` (:func:`probe_step`).
    """
    for i in range(warmup):
        for mode in rotated(modes, i):
            warm_step(group, mode, i)
    group.synchronize()
    probes = {mode: probe_step(group, mode, 0) for mode in modes}
    memory = {mode: memory_step(group, mode, 1) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(iters):
        for mode in rotated(modes, i):
            times[mode].append(time_step(group, mode, i))
    return times, memory, probes


# ------------------------------------------------------------------------------------------- statistics
def paired_ratio(times: list[float], reference: list[float]) -> float:
    """Median over iterations of ``times[i] / reference[i]`` (both in the same unit, one per iteration)."""
    return statistics.median(t / r for t, r in zip(times, reference, strict=True))


def step_statistics(mine: list[float], times: dict[str, list[float]]) -> tuple:
    """``(median, p10, p90, x_shared, paired_x_shared, x_no_ac, paired_x_no_ac)`` of step times ``mine`` (ms).

    ``times`` holds every mode's step times of the group (one per iteration, same order); the ratios
    against a mode missing from it are ``None``. The percentiles interpolate linearly within the data
    (``statistics.quantiles(method="inclusive")``); with one sample both are that sample.
    """
    median = statistics.median(mine)
    q = statistics.quantiles(mine, n=10, method="inclusive") if len(mine) > 1 else [median]
    ratios = []
    for reference in ("shared", "no-ac"):
        other = times.get(reference)
        ratios += [median / statistics.median(other), paired_ratio(mine, other)] if other else [None, None]
    return (median, q[0], q[-1], *ratios)


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for ``None``."""
    return "-" if value is None else format(value, spec)
