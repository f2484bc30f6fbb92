"""What isolation costs: one GDN layer and one Mamba2 layer, forward + recompute + backward under SAC.

Modes (one copy of the same mixer, same weights, per mode; every mode but ``no-ac`` wraps it in torch's
non-reentrant checkpoint wrapper with torchtitan 0.3's op-level SAC policy, ``policies.torchtitan_selective``):

    no-ac                no checkpointing; ``SharedSeqlens`` (the floor for time, the ceiling for memory)
    shared               SAC, ``SharedSeqlens``: every ``.local()`` call returns the same ``cu_seqlens``
                         object, as models pass it today (the unsafe path; no host offsets)
    isolated             SAC, ``LayerLocalSeqlens(cu)``: device offsets only (validation's host copy is
                         handed to every layer as ``cu_seqlens_cpu``) and FLA's chunk schedule
                         precomputed once per batch (``chunk_indices=True``, the default; a fresh copy per
                         ``.local()`` call, passed to the conv and the gated delta rule)
    isolated+cpu         as ``isolated``, plus ``cu_seqlens_cpu`` given by the loader (validation compares
                         instead of copying; the layer step is the same)
    isolated-no-indices  SAC, ``LayerLocalSeqlens(cu, chunk_indices=False)``: no precomputed schedule, so
                         each layer's FLA calls build it from its fresh ``cu_seqlens`` (the behaviour
                         before the schedule was precomputed)
    global-disable       SAC, ``SharedSeqlens``, FLA's tensor cache disabled process-wide: every step of
                         this mode (warm-up, probe, memory, timing) runs inside ``tensor_cache_disabled()``,
                         the other modes outside it
    isolated+save-core   as ``isolated``, with the mixer's FLA calls as custom operators (``saveable=True``)
                         and the policy ``any_of(save_fla_ops(("gated_delta_rule", "ssd")),
                         torchtitan_selective())``: the layer's core (gated delta rule | SSD) is not recomputed
    isolated+save-core+conv  the same, saving the causal conv's output too

Method. For one (layer, tokens) group every mode's layer is built up front (one build, deep-copied), and
all modes share the same 3 rotating input buffers ``[1, T, hidden]`` and one ``grad_out``. Each iteration
runs every mode once, in an order rotated by the iteration index (iteration ``i`` starts at mode
``i % n_modes``), so drift (clocks, allocator, thermals) hits every mode alike. Each step builds new
offsets (as a data loader does; ``LayerLocalSeqlens`` construction, its validation and any chunk-index
precomputation included) outside the timed region; the timed region is one layer's forward, its
recompute and its backward.

Per row (one mode in one group):

* ``median_ms``, ``p10_ms``, ``p90_ms``: step time in milliseconds over ``--iters`` timed iterations after
  ``--warmup`` (CUDA events after a ``torch.cuda.synchronize()``; ``time.perf_counter`` on CPU); the
  percentiles interpolate linearly between samples (``statistics.quantiles(method="inclusive")``).
* ``x_shared``: ratio of medians, this mode's over ``shared``'s.
* ``paired_x_shared``: median over iterations of (this mode's time / ``shared``'s time in the same
  iteration); robust to drift between iterations. Exactly 1.0 for ``shared``.
* ``x_no_ac``, ``paired_x_no_ac``: the same against ``no-ac`` (the floor the saveable modes aim at).
* ``peak_mib``: peak memory of one step above what was allocated before it, MiB.
* ``held_mib``: memory allocated after the forward (before the backward) above what was allocated before
  the step, MiB: what the layer keeps for its backward, its output included. For the saveable modes the
  excess over ``isolated`` should equal ``saved_outputs_mib``.
* ``saved_outputs_mib``: the outputs of the FLA operators the mode saves, computed from the layer's shapes
  by the operators' fake kernels (``benchmarks/saved_outputs.py``; ``fla`` backend, bf16), MiB.
* ``syncs_per_step``: host syncs in one step (``torch.cuda.set_sync_debug_mode("warn")``, one warning per
  synchronising call), with ``sync_sites`` (``"file:line" -> count``).
* ``helper_computations_per_step``: FLA index-helper computations in one step (misses + bypasses, from
  ``fla_cache.probe_tensor_cache``).
* ``times_ms``: every timed step, in iteration order (the raw data behind the statistics).

Run on a CUDA machine (the defaults are the H200 shapes: hidden 2048, T = 32768 and 131072, 8 documents)::

    python -m benchmarks.bench_isolation --first-config --lift-hopper-guard --json bench.json --png bench.png

The saveable-ops table and the recompute profile (issue 16), one command, about 4 minutes on one H200
(estimated from the measured budget below: ~70 s start-up, ~2.5 s per iteration with these 4 modes, then
3 profiled steps per group)::

    python -m benchmarks.bench_isolation --first-config --lift-hopper-guard --iters 30 --warmup 3 \
        --modes no-ac isolated isolated+save-core isolated+save-core+conv --profile \
        --json h200_saveable_ops.json --png h200_saveable_ops.png 2>&1 | tee h200_saveable_ops.log

``--profile`` adds, per group and checkpointed mode, one profiled step whose recompute runs between two
device synchronisations inside a profiler range, and prints (and writes to the JSON) the recompute's
per-kernel device times (``benchmarks/recompute_profile.py``); timing steps are never profiled.

Budget on one H200 (measured with 5 modes, scaled to 6): about 70 s of imports and first-config compilation,
then about 3.6 s per iteration for the four default groups; ``--iters 36 --warmup 3`` takes about 4 minutes,
the defaults (50 and 5) about 5.

``--device cpu`` runs the mixers' pure-torch ``reference`` backend in float32 with tiny shapes (e.g.
``--hidden 64 --tokens 256 --docs 4``) on one torch thread; it times with ``time.perf_counter`` and reports
host syncs and peak memory as 0. CPU numbers are only a smoke test of this script, not a measurement.

On Hopper with Triton < 3.7.1 FLA refuses the gated backward (its issue #640); ``--lift-hopper-guard``
sets FLA's flag for this process, printing so. Every mode runs the same kernels, so the comparison is fair.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks import outcome, recompute_profile, saved_outputs
from benchmarks.charts import plot
from benchmarks.layer_step import (
    NUM_BUFFERS,
    SAVED,
    Step,
    base_mode,
    build_layer,
    cache_context,
    doc_lengths,
    fmt,
    make_seqlens,
    measure,
    step_statistics,
    wrap_for_mode,
)
from fla_ac_isolation.harness.environment import versions
from fla_ac_isolation.harness.layer_widths import layer_fields

MODES = ("no-ac", "shared", "isolated", "isolated+cpu", "isolated-no-indices", "global-disable", "isolated+save-core",
         "isolated+save-core+conv")


@dataclass
class Row:
    layer: str
    tokens: int
    docs: int
    mode: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    x_shared: float | None  # median_ms / shared's median_ms; None without a shared mode
    paired_x_shared: float | None  # median over iterations of (time / shared's time, same iteration)
    x_no_ac: float | None  # the same two against no-ac; None without a no-ac mode
    paired_x_no_ac: float | None
    peak_mib: float
    held_mib: float  # allocated after the forward, above the step's start (CUDA; 0 on CPU)
    saved_outputs_mib: float  # FLA operator outputs the mode saves, from the shapes (0 for other modes)
    syncs_per_step: int
    helper_computations_per_step: int
    sync_sites: dict[str, int]  # "file:line" of the Python code that triggered each host sync
    times_ms: list[float] = field(default_factory=list)  # every timed step, in iteration order


# ------------------------------------------------------------------------------------------------ group
@dataclass
class Group:
    """Everything one (layer, tokens) group shares: per-mode layers, inputs, ``grad_out``, document layouts."""

    kind: str
    tokens: int
    docs: int
    device: str
    layers: dict[str, torch.nn.Module]
    inputs: list[torch.Tensor]  # NUM_BUFFERS x [1, T, hidden], requires grad
    grad_out: torch.Tensor  # [1, T, hidden]
    lens: list[list[int]]  # NUM_BUFFERS document-length lists

    @classmethod
    def build(cls, kind: str, tokens: int, docs: int, modes: list[str], args) -> Group:
        """Every mode's layer from one build (deep copies; the saveable modes' layers get its weights)."""
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        backend = "reference" if args.device == "cpu" else "fla"
        torch.manual_seed(0)
        base = build_layer(kind, args.hidden, dtype, args.device, backend)
        saveable = build_layer(kind, args.hidden, dtype, args.device, backend, saveable=True)
        saveable.load_state_dict(base.state_dict())
        layers = {mode: wrap_for_mode(copy.deepcopy(saveable if mode in SAVED else base), mode) for mode in modes}
        shape = (1, tokens, args.hidden)
        inputs = [torch.randn(shape, device=args.device, dtype=dtype, requires_grad=True) for _ in range(NUM_BUFFERS)]
        grad_out = torch.randn(shape, device=args.device, dtype=dtype)
        lens = [doc_lengths(tokens, docs, seed) for seed in range(NUM_BUFFERS)]
        return cls(kind, tokens, docs, args.device, layers, inputs, grad_out, lens)

    def prepare(self, mode: str, i: int, layer: torch.nn.Module | None = None) -> Step:
        """Build iteration ``i``'s fresh offsets for ``mode`` now; return its step (``layer`` overrides the mode's)."""
        seqlens = make_seqlens(mode, self.lens[i % NUM_BUFFERS], self.device)
        return Step(layer or self.layers[mode], self.inputs[i % NUM_BUFFERS], seqlens, self.grad_out)

    def synchronize(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()


def profile_step(group: Group, mode: str, i: int) -> dict:
    """The recompute's per-kernel breakdown of one step of checkpointed ``mode`` (``recompute_profile``)."""
    layer = group.layers[mode]
    marker = lambda context_fn: recompute_profile.marked(context_fn, group.synchronize)  # noqa: E731
    profiled = wrap_for_mode(layer._checkpoint_wrapped_module, mode, marker)  # same weights, marked recompute
    with cache_context(mode):
        step = group.prepare(mode, i, layer=profiled)
        group.synchronize()
        return recompute_profile.profile(step, group.device)


# ----------------------------------------------------------------------------------------- one group
def run_group(kind: str, tokens: int, docs: int, modes: list[str], args) -> tuple[list[Row], list[dict]]:
    """Warm up, probe, measure memory and time every mode of one group, interleaved; profile on request.

    Returns one :class:`Row` per mode and, with ``--profile``, one recompute breakdown per checkpointed mode.
    """
    group = Group.build(kind, tokens, docs, modes, args)
    times, memory, probes = measure(group, modes, args.warmup, args.iters)
    saved = {mode: saved_outputs.saved_mib(kind, tokens, args.hidden, SAVED.get(mode, ())) for mode in modes}
    rows = [summarise(group, mode, times, memory[mode], saved[mode], probes[mode]) for mode in modes]
    profiles = []
    if args.profile:
        for mode in modes:
            if base_mode(mode).checkpointed:
                profiles.append({"layer": kind, "tokens": tokens, "mode": mode, **profile_step(group, mode, 2)})
    return rows, profiles


def summarise(group: Group, mode: str, times: dict[str, list[float]], memory: tuple[float, float],
              saved_mib: float, probe: tuple[int, dict[str, int], int]) -> Row:
    """The :class:`Row` of ``mode``: statistics of its step times (ms) and the untimed measurements."""
    syncs, sites, computations = probe
    peak, held = memory
    return Row(group.kind, group.tokens, group.docs, mode, *step_statistics(times[mode], times), peak, held,
               saved_mib, syncs, computations, sites, list(times[mode]))


# --------------------------------------------------------------------------------------------- output
def _same_group(rows: list[Row], row: Row, mode: str) -> Row | None:
    return next((r for r in rows if (r.layer, r.tokens, r.mode) == (row.layer, row.tokens, mode)), None)


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("layer", "T", "mode", "median ms", "p10-p90 ms", "x shared (paired)", "x no-ac (paired)",
                "peak MiB", "d peak vs shared", "held MiB", "d held vs isolated", "FLA outputs saved MiB",
                "syncs/step", "helper computations/step"):
        table.add_column(col, justify="right")
    for row in rows:
        shared, isolated = _same_group(rows, row, "shared"), _same_group(rows, row, "isolated")
        table.add_row(
            row.layer, str(row.tokens), row.mode, f"{row.median_ms:.3f}", f"{row.p10_ms:.3f}-{row.p90_ms:.3f}",
            fmt(row.paired_x_shared, ".3f"), fmt(row.paired_x_no_ac, ".3f"), f"{row.peak_mib:.1f}",
            fmt(row.peak_mib - shared.peak_mib if shared else None, "+.2f"), f"{row.held_mib:.1f}",
            fmt(row.held_mib - isolated.held_mib if isolated else None, "+.2f"), f"{row.saved_outputs_mib:.1f}",
            str(row.syncs_per_step), str(row.helper_computations_per_step),
        )
    Console(width=240).print(table)


# ------------------------------------------------------------------------------------------------ main
@contextlib.contextmanager
def one_cpu_thread(device: str):
    """On CPU, run torch single-threaded inside the block (restored on exit); nothing on CUDA.

    The CPU smoke shapes make thousands of tiny ops, for which intra-op threads only add contention
    (measured: 1.7 s with one thread, 22 s with two on a busy 2-core machine).
    """
    if device != "cpu":
        yield
        return
    prior = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prior)


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=outcome.EPILOG)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: FLA kernels, bf16; cpu: reference backend, float32 (a smoke test only)")
    parser.add_argument("--layers", nargs="+", default=["gdn", "mamba2"], choices=["gdn", "mamba2"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048, help="model width; head counts follow it")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations (each runs every mode once)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before probing and timing")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--lift-hopper-guard", action="store_true")
    parser.add_argument("--first-config", action="store_true",
                        help="skip Triton autotuning (first config of each kernel; same kernels in every mode)")
    parser.add_argument("--where-syncs", action="store_true", help="print where each host sync was triggered")
    parser.add_argument("--profile", action="store_true",
                        help="per checkpointed mode, one profiled step: per-kernel times of the recompute")
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda (the default) needs a CUDA device; use --device cpu for a smoke test")
    if args.iters < 2:
        parser.error("--iters must be at least 2 (p10/p90 need two samples)")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if any(t < args.docs or args.docs < 1 for t in args.tokens):
        parser.error("every --tokens value must be at least --docs, and --docs at least 1")
    try:
        for kind in args.layers:
            layer_fields(kind, args.hidden)
    except ValueError as e:
        parser.error(str(e))
    args.modes = [m for m in MODES if m in args.modes]  # canonical order, no duplicates
    return args


@outcome.stops_on_missing_module("bench_isolation")
def main(argv=None) -> int:
    args = parse_args(argv)
    from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config
    from fla_ac_isolation.harness.testing.gpu import lift_hopper_gdn_guard

    rows: list[Row] = []
    profiles: list[dict] = []
    with (
        lift_hopper_gdn_guard() if args.lift_hopper_guard else contextlib.nullcontext(),
        first_autotune_config() if args.first_config else contextlib.nullcontext(),
        one_cpu_thread(args.device),
    ):
        for kind in args.layers:
            for tokens in args.tokens:
                group_rows, group_profiles = run_group(kind, tokens, args.docs, args.modes, args)
                for row in group_rows:
                    print(f"{kind} T={tokens} {row.mode}: {row.median_ms:.3f} ms, paired x shared "
                          f"{fmt(row.paired_x_shared, '.3f')}, paired x no-ac {fmt(row.paired_x_no_ac, '.3f')}, "
                          f"held {row.held_mib:.1f} MiB, {row.syncs_per_step} syncs, "
                          f"{row.helper_computations_per_step} helper computations", flush=True)
                rows += group_rows
                profiles += group_profiles
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "backend": "reference" if args.device == "cpu" else "fla", "dtype": dtype, "versions": versions(),
        "hidden": args.hidden, "docs": args.docs, "iters": args.iters, "warmup": args.warmup,
        "modes": args.modes, "order": "interleaved; iteration i starts at mode i % len(modes)",
        "first_config": args.first_config, "hopper_guard_lifted": args.lift_hopper_guard,
        "layer_fields": {kind: layer_fields(kind, args.hidden) for kind in args.layers},
        "saved_ops": {mode: SAVED[mode] for mode in args.modes if mode in SAVED},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows], "profile": profiles}, f, indent=1)
    if args.png:
        plot(rows, args.png)
    if args.where_syncs:
        for row in rows:
            print(f"sync sites {row.layer} T={row.tokens} {row.mode}: {row.sync_sites}")
    smoke = " - CPU SMOKE TEST, not a measurement" if args.device == "cpu" else ""
    print_table(rows, f"isolation cost per layer step (forward + recompute + backward), {dtype}, "
                      f"{args.iters} interleaved iterations{smoke}")
    for entry in profiles:
        title = f"{entry['layer']} T={entry['tokens']} {entry['mode']}"
        print(recompute_profile.format_breakdown(title, entry))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
