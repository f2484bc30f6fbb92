"""What isolation costs under context parallelism: one CP=2 Gated DeltaNet layer step, forward + recompute + backward.

One Qwen3.5-MoE Gated DeltaNet mixer (``Qwen3_5MoeGatedDeltaNet``, backend ``fla``: FLA's CP-aware causal conv
and gated delta rule, bf16) per rank of a context-parallel (CP) group of ``--nproc`` ranks (default 2; NCCL, one
GPU per rank). ``T`` packed tokens in total (``--tokens``, default 65536 and 262144) are cut across the ranks in
FLA's layout (``--layout contiguous``, the default, and/or ``zigzag``): each rank holds ``T / W`` tokens. The
documents (``--docs``, seeded lengths, ``layer_step.doc_lengths``) cross the rank cuts: every document
layout is checked to hold at least one document with tokens on two ranks.

Modes (``fla_ac_isolation.harness.modes``; every mode but ``no-ac`` wraps the mixer in torch's non-reentrant
checkpoint wrapper with torchtitan 0.3's op-level SAC policy, ``policies.torchtitan_selective``, as
``bench_isolation`` does). Every mode gets the global offsets on the device and on the host
(``cu_seqlens_cpu``; CP metadata is computed on the host, and ``CPSeqlens`` refuses device offsets without them):

    no-ac           no checkpointing, ``SharedCPSeqlens``: the floor for time, the ceiling for memory
    shared          SAC, ``SharedCPSeqlens``: one FLA CP context for every layer call (the UNSAFE path;
                    no precomputed chunk schedule, so FLA builds it from the context's offsets)
    isolated        SAC, ``CPSeqlens``: FLA's CP context built once per batch on the host,
                    a fresh copy (fresh offsets, precomputed chunk schedule) per ``.local()`` call
    global-disable  SAC, ``SharedCPSeqlens``, FLA's tensor cache disabled process-wide
                    (``tensor_cache_disabled()``) on every rank, for every step of this mode only

Method. Per (tokens, layout) group each rank builds every mode's layer up front (one build from seed 0, so the
same weights on every rank, deep-copied per mode) and 3 rotating input buffers ``[1, T / W, hidden]`` (seeded per
rank) with one ``grad_out``. ``layer_step.measure`` then runs ``--warmup`` untimed iterations, one probe
step and one memory step per mode, and ``--iters`` timed iterations; each iteration runs every mode once, in
an order rotated by the iteration index (iteration ``i`` starts at mode ``i % n_modes``), so every rank runs
the same mode at the same time without exchanging anything. Each step builds new offsets (as a data loader
does: ``CPSeqlens`` construction, FLA's CP context and the chunk schedule included) outside the timed
region, then synchronises the device and the ranks (``dist.barrier()``), then times one layer forward, its
recompute and its backward with CUDA events on every rank. The gradients of the replicated parameters are
left per rank (a data-parallel reduction would add the same all-reduce to every mode).

Per row (one mode in one group; the ``step`` of an iteration is its slowest rank):

* ``median_ms``, ``p10_ms``, ``p90_ms``: step time (ms) over the timed iterations: per iteration the largest
  of the ranks' times, then median and linearly interpolated percentiles over iterations.
* ``x_shared``, ``paired_x_shared`` (and ``x_no_ac``, ``paired_x_no_ac``): ratio of medians, and the median
  over iterations of (this mode's step / ``shared``'s step in the same iteration), as in ``bench_isolation``.
* ``rank_median_ms``: each rank's own median (ms); ``times_ms[rank][iteration]``: every raw time;
  ``step_ms[iteration]``: the slowest rank's.
* ``peak_mib``, ``held_mib``: per rank, the step's peak memory and what the forward left allocated, above what
  was allocated before the step (MiB).
* ``syncs_per_step``, ``sync_sites``: per rank, host synchronisations in one step
  (``fla_ac_isolation.harness.testing.gpu.host_sync_sites``: ``torch.cuda.set_sync_debug_mode("warn")``) and their
  ``"file:line" -> count``; ``cp_syncs_per_step``: those whose site is in FLA's CP code (``fla/ops/cp/``: its
  CP metadata and communication). The target is none in ``isolated``.
* ``helper_computations_per_step``: per rank, FLA index-helper computations in one step (cache misses +
  bypasses, ``fla_cache.probe_tensor_cache``).

Output: a table on rank 0, the sync sites, the issue's targets with a verdict (isolated / shared <= 1.01
paired; isolated <= global-disable; no device-to-host sync from ``fla/ops/cp/`` in ``isolated``), ``--json``
(meta, every row with its raw times, the document layouts and which documents cross a rank cut), ``--png``
(matplotlib: median step time per mode, one panel per group).

Launch: one command spawns the ranks itself (``torch.multiprocessing.spawn``; NCCL on CUDA, one GPU per rank;
NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are set for every rank, overriding the environment). Under ``torchrun`` it uses
the processes torchrun started (``--nproc``, if given, must equal the world size)::

    python -m benchmarks.bench_cp --nproc 2 --first-config --lift-hopper-guard \\
        --json h200x2_cp_layer.json --png h200x2_cp_layer.png 2>&1 | tee h200x2_cp_layer.log
    torchrun --nproc-per-node 2 -m benchmarks.bench_cp --first-config --lift-hopper-guard

Budget on 2 H200s (an estimate, not yet a measurement). ``bench_isolation`` measured this layer (hidden 2048,
bf16, ``--first-config``) on one H200: no-ac 34 ms and SAC 42-46 ms per step at T = 32768, no-ac 129 ms and
SAC 145-151 ms at T = 131072. CP=2 holds 32768 (T = 65536) or 131072 (T = 262144) tokens per GPU; FLA's CP
adds its exchange of conv history and recurrent states and its CP pre- and post-processing kernels (assumed
+10-20 %), and each step a barrier and new offsets (a few ms). One iteration of the 4 modes then takes about
0.2 s (T = 65536) + 0.7 s (T = 262144), about 1 s with the overheads. The defaults (``--iters 50 --warmup 3``,
plus one probe and one memory step per mode: 55 iterations) take about 1 minute of steps, plus about 1.5
minutes of start-up (spawning the ranks, imports, NCCL, ``--first-config`` compilation of FLA's kernels, the
CP ones included, as ``bench_isolation``'s 70 s): about 2.5-3 minutes in all, 4-5 if every estimate is off by
2x. Each ``--layout`` more adds the step part again (about 1 minute); without ``--first-config`` every rank
autotunes every kernel (minutes more).

``--device cpu`` is a smoke test of this script, not a measurement: 2 gloo ranks (spawned with
``TRITON_INTERPRET=1`` in their environment, so FLA's kernels run in Triton's interpreter), FLA's CP kernels
through the seam's interpreter backend (``fla_ac_isolation.harness.fla_seam.interpreter.cpu_cp_kernels``), float32,
and tiny default shapes (hidden 32, i.e. 4 heads of 8; T = 128; 3 documents; 1 iteration, no warm-up). It
times with ``time.perf_counter`` after a barrier and reports host syncs and memory as 0. Under ``torchrun`` on
a CPU, export ``TRITON_INTERPRET=1`` first. It costs about 80 s of CPU with the defaults (measured: 12
interpreted steps of about 3 s per rank, plus about 5 s of imports per rank).

On Hopper with Triton < 3.7.1 FLA refuses the gated backward (its issue #640); ``--lift-hopper-guard`` sets
FLA's flag on every rank, printing so. ``--first-config`` runs every Triton autotuner's first config only
(``fla_ac_isolation.harness.fla_seam.interpreter.first_autotune_config``): the same kernels in every mode, not the
tuned ones. The rows, targets, table and JSON are ``benchmarks/cp_rows.py``; the measuring loop is
``benchmarks/layer_step.py`` (shared with ``bench_isolation``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import outcome
from benchmarks.cp_rows import (
    LAYER,
    MODES,
    CPRow,
    build_rows,
    crossing_documents,
    document_layouts,
    print_progress,
    rank_cuts,
    report,
)
from benchmarks.layer_step import NUM_BUFFERS, Step, build_layer, make_seqlens, measure, wrap_for_mode
from fla_ac_isolation.harness.environment import versions
from fla_ac_isolation.harness.layer_widths import layer_fields
from fla_ac_isolation.harness.regression.launch import environment_variables, free_port
from fla_ac_isolation.harness.regression.torchrun import under_torchrun

# NVLink multicast must stay off on the shared GPU hosts: set for every rank, whatever the environment says
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULTS = {  # per --device, for the flags left unset
    "cuda": {"tokens": [65536, 262144], "hidden": 2048, "docs": 8, "iters": 50, "warmup": 3},
    "cpu": {"tokens": [128], "hidden": 32, "docs": 3, "iters": 1, "warmup": 0},
}
TIMEOUT_S = 300  # a collective waiting this long for a peer fails the run (a crashed or hung rank), in seconds


# ---------------------------------------------------------------------------------------------- group
@dataclass
class CPGroup:
    """What one (tokens, layout) group shares on one rank (a group of ``layer_step``; ``bench_isolation.Group``'s
    interface)."""

    tokens: int
    layout: str
    device: str
    cp: Any  # fla_ac_isolation.parallel.CPConfig over the whole world
    layers: dict[str, torch.nn.Module]
    inputs: list[torch.Tensor]  # NUM_BUFFERS x [1, T / W, hidden], requires grad
    grad_out: torch.Tensor  # [1, T / W, hidden]
    lens: list[list[int]]  # NUM_BUFFERS GLOBAL document-length lists, the same on every rank

    @classmethod
    def build(cls, tokens: int, layout: str, modes: list[str], args: argparse.Namespace, device: str) -> CPGroup:
        """Every mode's mixer from one seeded build (same weights on every rank) and this rank's inputs."""
        import torch.distributed as dist

        from fla_ac_isolation.parallel import CPConfig

        fields = layer_fields(LAYER, args.hidden)
        cp = CPConfig(group=dist.group.WORLD, layout=layout, conv_kernel_size=fields["linear_conv_kernel_dim"])
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        torch.manual_seed(0)
        base = build_layer(LAYER, args.hidden, dtype, device, backend="fla")
        layers = {mode: wrap_for_mode(copy.deepcopy(base), mode) for mode in modes}
        torch.manual_seed(1 + cp.rank)
        shape = (1, cp.local_num_tokens(tokens), args.hidden)
        inputs = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(NUM_BUFFERS)]
        grad_out = torch.randn(shape, device=device, dtype=dtype)
        lens = document_layouts(tokens, args.docs, cp.world_size, layout)
        return cls(tokens, layout, device, cp, layers, inputs, grad_out, lens)

    def prepare(self, mode: str, i: int, layer: torch.nn.Module | None = None) -> Step:
        """Iteration ``i``'s fresh GLOBAL offsets (device + host) for ``mode`` under CP, and its step."""
        seqlens = make_seqlens(mode, self.lens[i % NUM_BUFFERS], self.device, with_host=True, cp=self.cp)
        return Step(layer or self.layers[mode], self.inputs[i % NUM_BUFFERS], seqlens, self.grad_out)

    def synchronize(self) -> None:
        """Wait for this rank's device, then for every rank (``dist.barrier``)."""
        import torch.distributed as dist

        if self.device != "cpu":
            torch.cuda.synchronize()
        dist.barrier()


def run_group_on_rank(tokens: int, layout: str, args: argparse.Namespace, device: str) -> dict:
    """Measure one group on this rank (``layer_step.measure``); plain data for ``all_gather_object``."""
    group = CPGroup.build(tokens, layout, args.modes, args, device)
    times, memory, probes = measure(group, args.modes, args.warmup, args.iters)
    cuts = rank_cuts(tokens, group.cp.world_size, layout)
    result = {
        "tokens": tokens, "layout": layout, "docs": args.docs, "local_tokens": group.inputs[0].shape[1],
        "lens": group.lens, "rank_cuts": cuts, "crossing": [crossing_documents(lens, cuts) for lens in group.lens],
        "times": times, "memory": {m: list(v) for m, v in memory.items()},
        "probes": {m: list(v) for m, v in probes.items()},
    }
    del group
    if device != "cpu":
        torch.cuda.empty_cache()
    return result


def run_meta(args: argparse.Namespace, world: int, launcher: str) -> dict:
    """What the JSON records about the run besides the rows."""
    cuda = args.device == "cuda"
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "world": world, "launcher": launcher,
        "process_group": "nccl" if cuda else "gloo", "kernels": "fla" if cuda else "fla (Triton interpreter)",
        "dtype": "bfloat16" if cuda else "float32", "versions": versions(),
        "layer": "Qwen3_5MoeGatedDeltaNet", "layer_fields": layer_fields(LAYER, args.hidden),
        "policy": "policies.torchtitan_selective", "hidden": args.hidden, "docs": args.docs, "iters": args.iters,
        "warmup": args.warmup, "modes": args.modes, "layouts": args.layout, "tokens": args.tokens,
        "order": "interleaved; iteration i starts at mode i % len(modes), the same on every rank",
        "step_time": "per iteration the slowest rank's time (CUDA events after a barrier)",
        "first_config": args.first_config, "hopper_guard_lifted": args.lift_hopper_guard,
        "environment": {name: os.environ.get(name) for name in NO_MULTICAST},
    }


# ----------------------------------------------------------------------------------------------- ranks
@contextlib.contextmanager
def rank_harness(args: argparse.Namespace) -> Iterator[None]:
    """CPU: one torch thread, FLA's CP kernels under the seam's interpreter backend; CUDA: the requested GPU
    switches."""
    from fla_ac_isolation.harness.fla_seam.interpreter import cpu_cp_kernels, first_autotune_config

    if args.device == "cpu":
        torch.set_num_threads(1)
        with cpu_cp_kernels():
            yield
        return
    from fla_ac_isolation.harness.testing.gpu import lift_hopper_gdn_guard

    with (
        lift_hopper_gdn_guard() if args.lift_hopper_guard else contextlib.nullcontext(),
        first_autotune_config() if args.first_config else contextlib.nullcontext(),
    ):
        yield


def run_rank(rank: int, world: int, local_rank: int, args: argparse.Namespace, init_method: str,
             launcher: str) -> None:
    """One rank: join the process group, measure every group, gather the results on rank 0, which reports."""
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)  # before NCCL starts (spawned ranks already have it)
    cuda = args.device == "cuda"
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S),
                            device_id=torch.device(device) if cuda else None)
    try:
        rows: list[CPRow] = []
        groups: list[dict] = []
        with rank_harness(args):
            for layout in args.layout:
                for tokens in args.tokens:
                    gathered: list[Any] = [None] * world
                    dist.all_gather_object(gathered, run_group_on_rank(tokens, layout, args, device))
                    if rank == 0:
                        rows += print_progress(build_rows(gathered, args.modes))
                        groups.append({k: gathered[0][k] for k in ("tokens", "layout", "lens", "rank_cuts",
                                                                   "crossing")})
        dist.barrier()  # every rank is done measuring; rank 0 reports after it, so no peer waits on its output
        if rank == 0:
            report(rows, groups, args, run_meta(args, world, launcher))
    finally:
        dist.destroy_process_group()


def _spawned_rank(index: int, world: int, port: int, args: argparse.Namespace) -> None:
    """Entry point of a rank started by :func:`spawn_ranks` (rank = local rank = ``index``)."""
    run_rank(index, world, index, args, f"tcp://127.0.0.1:{port}", "spawn")


def spawn_ranks(args: argparse.Namespace) -> int:
    """Start ``--nproc`` ranks (``torch.multiprocessing.spawn``) and wait; 1 if a rank failed (its error is printed
    with the ``pip install`` of a missing module, :func:`benchmarks.outcome.stopped`).

    On CPU the ranks get ``TRITON_INTERPRET=1`` (read when FLA's kernels are decorated, so it must be in the
    environment before the rank imports FLA) and ``OMP_NUM_THREADS=1``. When one rank fails, torch stops
    the others.
    """
    import torch.multiprocessing as mp

    port = free_port()
    env = dict(NO_MULTICAST)
    if args.device == "cpu":
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    with environment_variables(tuple(env.items())):
        try:
            mp.spawn(_spawned_rank, args=(args.nproc, port, args), nprocs=args.nproc, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            return outcome.stopped("bench_cp", f"a rank failed: {err}")
    return 0


# ------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=outcome.EPILOG)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: NCCL, FLA kernels, bf16; cpu: gloo, FLA kernels in Triton's interpreter, float32 "
                             "(a smoke test only)")
    parser.add_argument("--nproc", type=int, help="CP ranks to spawn, one GPU each (default 2; under torchrun: its "
                                                  "world size)")
    parser.add_argument("--tokens", nargs="+", type=int, help="GLOBAL packed tokens T, split across the ranks "
                                                              "(default 65536 262144; cpu: 128)")
    parser.add_argument("--layout", nargs="+", default=["contiguous"], choices=["contiguous", "zigzag"])
    parser.add_argument("--docs", type=int, help="documents per batch, seeded lengths (default 8; cpu: 3)")
    parser.add_argument("--hidden", type=int, help="model width; head counts follow it (default 2048; cpu: 32)")
    parser.add_argument("--iters", type=int, help="timed iterations, each runs every mode once (default 50; cpu: 1)")
    parser.add_argument("--warmup", type=int, help="untimed iterations first (default 3; cpu: 0)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--lift-hopper-guard", action="store_true", help="lift FLA's #640 guard (printed)")
    parser.add_argument("--first-config", action="store_true",
                        help="skip Triton autotuning (first config of each kernel; same kernels in every mode)")
    parser.add_argument("--json", help="write the meta, the rows and every raw time here")
    parser.add_argument("--png", help="write a bar chart of the median step times here (matplotlib)")
    return parser


def _check_world(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--nproc`` against torchrun's world and the visible GPUs."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world:
            parser.error(f"--nproc {args.nproc} differs from torchrun's world size {world}; leave --nproc out")
        args.nproc = world
        if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu under torchrun needs TRITON_INTERPRET=1 exported before torchrun starts")
    args.nproc = 2 if args.nproc is None else args.nproc
    if args.nproc < 2:
        parser.error(f"--nproc must be at least 2 (one rank has no rank cut for a document to cross), got {args.nproc}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda (the default) needs CUDA devices; use --device cpu for a smoke test")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc))
        if torch.cuda.device_count() < local:
            parser.error(f"--nproc {args.nproc} needs {local} CUDA devices on this host (one GPU per rank), "
                         f"found {torch.cuda.device_count()}")


def _check_shapes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--hidden``, ``--docs``, ``--iters``, ``--warmup`` and every ``--tokens`` value under every ``--layout``."""
    from fla_ac_isolation.parallel import CPConfig

    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    try:
        conv = layer_fields(LAYER, args.hidden)["linear_conv_kernel_dim"]
    except ValueError as err:
        parser.error(str(err))
    if args.docs < 1:
        parser.error(f"--docs must be at least 1, got {args.docs}")
    for layout in args.layout:
        parts, need = (args.nproc, "--nproc") if layout == "contiguous" else (2 * args.nproc, "2 * --nproc")
        for tokens in args.tokens:
            if tokens % parts:
                parser.error(f"--tokens {tokens} must be a multiple of {need} = {parts} (the {layout} layout cuts the "
                             f"batch into {parts} equal parts)")
            if tokens < args.docs:
                parser.error(f"--tokens {tokens} must be at least --docs = {args.docs} (every document holds a token)")
            try:
                CPConfig(world_size=args.nproc, rank=0, layout=layout, conv_kernel_size=conv).check_num_tokens(
                    tokens, name="--tokens")
                document_layouts(tokens, args.docs, args.nproc, layout)
            except ValueError as err:
                parser.error(str(err))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check the flags; unset shape flags take the ``--device``'s :data:`DEFAULTS`.

    Errors (``SystemExit`` 2, the message naming the flag): ``--nproc`` < 2, more ranks than visible GPUs, or
    not torchrun's world size; no CUDA for ``--device cuda``; ``--tokens`` not a multiple of ``--nproc``
    (contiguous) or ``2 * --nproc`` (zigzag), below ``--docs``, or leaving an interval shorter than the conv;
    ``--hidden`` that does not split into heads; ``--iters`` < 1, ``--warmup`` < 0, ``--docs`` < 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.modes = [m for m in MODES if m in args.modes]  # canonical order, no duplicates
    args.layout = list(dict.fromkeys(args.layout))
    _check_world(parser, args)
    _check_shapes(parser, args)
    for flag, module, needed in (("", "rich", True), ("--png ", "matplotlib", args.png)):
        if needed and importlib.util.find_spec(module) is None:
            parser.error(f"{flag or 'the table '}needs {module} (pip install 'fla-ac-isolation[cli]')")
    return args


@outcome.stops_on_missing_module("bench_cp")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if under_torchrun():
        rank, world, local_rank = (int(os.environ[n]) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        run_rank(rank, world, local_rank, args, "env://", "torchrun")
        return 0
    return spawn_ranks(args)


if __name__ == "__main__":
    raise SystemExit(main())
