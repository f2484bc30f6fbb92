"""Pipeline parallelism on ONE device in ONE process: the regression's tiny decoder split into stages that all live
on one rank, run by torch's own schedules with more microbatches in flight than FLA's cache holds (issue 31's
substitute while two GPUs are not lent).

The process joins a process group of world size 1 (gloo on a CPU, NCCL on CUDA; a ``FileStore`` in a temporary
file) and builds every stage of the decoder (:class:`fla_ac_isolation.harness.regression.pipeline.DecoderStage`, torch's
``PipelineStage``) on that rank. Schedules (torch's classes, nothing ordered here):

* ``interleaved-1f1b`` (``ScheduleInterleaved1F1B``) and ``looped-bfs`` (``ScheduleLoopedBFS``, GPipe's order
  over a rank's local stages) with 2 or 4 local stages;
* ``interleaved-zero-bubble`` (``ScheduleInterleavedZeroBubble``, 2 local stages): under full AC only, as torch's
  selective AC allows one backward per region (:data:`fla_ac_isolation.harness.regression.schedule.ZERO_BUBBLE_SAC`);
* ``gpipe`` (``ScheduleGPipe``) and ``1f1b`` (``Schedule1F1B``): torch's single-stage schedules take exactly one
  stage per rank, so in one process they run the whole decoder as ONE stage (microbatches in flight, no split);
  a two-stage GPipe or 1F1B needs two ranks.

Per (dtype, schedule, stages) the reference ``no-ac`` runs twice (its repeat says whether a step is
deterministic); then, under each AC policy (``save-d2h-copies``, ``save-all-copies``: the field's SAC policies;
``full-ac``), ``isolated``, ``global-disable`` and the unsafe ``shared``. Per cell: the outcome against no-ac
under the same schedule (``exact``: losses and every gradient bit for bit; else the largest gradient difference;
else the first line of the error), the median step (CUDA events on a GPU, wall time on a CPU) after warm-up,
and on CUDA the host syncs of one step (:func:`fla_ac_isolation.harness.testing.gpu.host_sync_sites`).
``in flight`` is the most (stage, microbatch) forwards whose backward had not yet run, over the rank, read from
torch's action list (``pipeline_order``) or, for the single-stage schedules, from their rule (GPipe ``M``, 1F1B
on its only stage 1): FLA's identity cache is process-wide, and each stage call's shared offsets take one entry.

Run on one H200 from the repository root (bf16 and fp32, about 2-4 minutes with ``--first-config``)::

    python -m benchmarks.bench_pp_one_gpu --first-config --lift-hopper-guard --out pp_one_gpu.json

``--device cpu`` (reference backend, float32, tiny widths) is the smoke test of ``tests/test_bench_pp_one_gpu.py``;
its outcomes are exact facts, its times mean nothing. torch 2.11 (the GPU image) opens a multi-stage schedule with
a send and a receive between neighbouring stages even when they share the rank; on gloo at world size 1 that
fails (``Pair is not connected``, measured on CPU), torch 2.13 and 2.15 skip it; a schedule that torch refuses is
recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import inspect
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks import outcome
from benchmarks.layer_step import doc_lengths, elapsed_ms
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.modes import MODES, Mode
from fla_ac_isolation.parallel import PackedMicrobatches, split_packed_microbatches

__all__ = ["CHECKPOINTED", "POLICY_NAMES", "SCHEDULES", "Cell", "main", "parse_args", "run_group"]

SCHEDULES: dict[str, tuple[str, tuple[int, ...], bool]] = {
    "gpipe": ("ScheduleGPipe", (1,), False),
    "1f1b": ("Schedule1F1B", (1,), False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", (2, 4), False),
    "looped-bfs": ("ScheduleLoopedBFS", (2, 4), False),
    "interleaved-zero-bubble": ("ScheduleInterleavedZeroBubble", (2,), True),
}
"""Schedule name -> (torch's class, local stage counts run, zero bubble: full AC only). The single-stage ones run
first: they send nothing, while torch 2.11 opens a multi-stage schedule with sends to the rank itself."""

POLICY_NAMES = ("save-d2h-copies", "save-all-copies", "full-ac")
CHECKPOINTED = ("isolated", "global-disable", "shared")
VOCAB = 256


@dataclass
class Cell:
    """One (dtype, schedule, stages, policy, mode) run. ``outcome``: ``exact``, ``max grad diff ...`` or the
    first error line; ``times_ms`` the timed steps; ``syncs`` host syncs of one step (CUDA only)."""

    dtype: str
    schedule: str
    stages: int
    policy: str
    mode: str
    in_flight: int | None = None
    outcome: str = ""
    error: str | None = None
    loss: float | None = None
    times_ms: list[float] = field(default_factory=list)
    median_ms: float | None = None
    syncs: int | None = None
    sync_sites: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------- data
def make_batch(microbatches: int, tokens: int, seed: int = 0) -> tuple[PackedMicrobatches, int]:
    """``microbatches`` microbatches of ``tokens`` tokens each: per microbatch 4 to 7 documents (one of zero
    length) over 7/8 of its tokens, cut by :func:`~fla_ac_isolation.parallel.split_packed_microbatches` (which
    pads each to ``tokens``); random token ids, next-token labels inside each document. Returns the microbatches
    and the step's target count (the loss divides by it)."""
    g = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    for i in range(microbatches):
        docs = 4 + i % 4
        lens += [*doc_lengths(tokens * 7 // 8, docs, seed + i), 0]
    ids, labels = [], []
    for n in lens:
        doc = torch.randint(0, VOCAB, (n,), generator=g)
        ids.append(doc)
        labels.append(torch.cat([doc[1:], torch.tensor([-100])]) if n else doc)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    split = split_packed_microbatches({"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None]},
                                      offsets, microbatches, tokens=tokens, pad_values={"labels": -100})
    return split, sum(max(n - 1, 0) for n in lens)


# ------------------------------------------------------------------------------------------------ build
def _policy(name: str):
    from fla_ac_isolation.policies import POLICIES

    return None if name == "full-ac" else POLICIES[name]()


def build_run(args, schedule: str, stages: int, mode: Mode, policy: str, dtype: torch.dtype, device: torch.device):
    """A fresh decoder (seed 0) checkpointed as ``mode`` and ``policy`` say, cut into ``stages`` stages of torch's
    ``PipelineStage`` on this one rank, and torch's schedule over them: a
    :class:`~fla_ac_isolation.harness.regression.pipeline.PipelineRun`."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    from fla_ac_isolation.harness.regression.model import ModelSize, build_model
    from fla_ac_isolation.harness.regression.pipeline import DecoderStage, PipelineRun, TokenLoss, stage_layers
    from fla_ac_isolation.policies import checkpoint_layers

    torch.manual_seed(0)
    size = ModelSize(hidden_size=args.hidden, num_layers=args.layers, num_experts=args.experts, top_k=2)
    model = build_model(args.model, size, backend=args.backend).to(device=device, dtype=dtype)
    if mode.checkpointed:
        made = _policy(policy)
        checkpoint_layers(model, mode="full" if made is None else "selective", policy=made)
    model.train()
    modules, torch_stages = [], []
    for s, layer_ids in enumerate(stage_layers(args.layers, stages)):
        module = DecoderStage(model, layer_ids, first=s == 0, last=s == stages - 1, seqlens_class=mode.seqlens_class)
        modules.append(module)
        torch_stages.append(PipelineStage(module, s, stages, device))
    loss = TokenLoss()
    cls = getattr(pipelining, SCHEDULES[schedule][0])
    options: dict[str, Any] = {"n_microbatches": args.microbatches, "loss_fn": loss, "scale_grads": False}
    if "kwargs_chunk_spec" in inspect.signature(cls).parameters:  # ScheduleLoopedBFS chunks kwargs on dim 0 anyway
        options["kwargs_chunk_spec"] = {"cu_seqlens": TensorChunkSpec(0)}
    sched = cls(torch_stages[0] if stages == 1 else torch_stages, **options)
    return PipelineRun(modules, torch_stages, sched, loss)


def in_flight(run, schedule: str, microbatches: int) -> int:
    """The most (stage, microbatch) forwards of the rank whose backward (full or input part) had not run."""
    order = getattr(run.schedule, "pipeline_order", None)
    if not order:  # single-stage schedules keep no action list: GPipe runs every forward first, 1F1B on 1 stage 1
        return microbatches if schedule == "gpipe" else 1
    live = most = 0
    for action in order[0]:
        kind = None if action is None else str(action.computation_type.value)
        if kind == "F":
            live += 1
        elif kind in ("B", "I"):
            live -= 1
        most = max(most, live)
    return most


# ------------------------------------------------------------------------------------------------- steps
def _step(run, batch: PackedMicrobatches, num_targets: int, mode: Mode) -> torch.Tensor:
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
    from fla_ac_isolation.harness.regression.pipeline import pipeline_step

    for p in run.parameters():
        p.grad = None
    clear_tensor_cache()
    with mode.cache_context():
        return pipeline_step(run, batch, num_targets)


def _grads(run) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in run.named_parameters() if p.grad is not None}


def compare(grads: dict[str, torch.Tensor], loss: float, ref: dict[str, torch.Tensor], ref_loss: float) -> str:
    """``exact`` (same loss and every gradient bit for bit), else ``max grad diff X`` (largest absolute difference
    in float32, ``, loss differs`` appended when it does); a gradient missing on either side is named."""
    if set(grads) != set(ref):
        return f"gradients differ in names: {sorted(set(grads) ^ set(ref))[:3]}"
    diff = max((grads[k].float() - ref[k].float()).abs().max().item() for k in ref)
    if diff == 0.0 and loss == ref_loss:
        return "exact"
    return f"max grad diff {diff:.3g}" + ("" if loss == ref_loss else ", loss differs")


def measure(cell: Cell, run, batch, num_targets: int, mode: Mode, args, device: torch.device,
            reference: tuple[dict, float] | None) -> tuple[dict, float] | None:
    """Fill ``cell``: outcome of the first step against ``reference``, host syncs of one step (CUDA), then
    ``--warmup`` untimed and ``--iters`` timed steps. Returns the first step's ``(gradients, loss)``, or ``None``
    when the step raised (the error's first line is the outcome)."""
    try:
        loss = float(_step(run, batch, num_targets, mode))
    except Exception as err:  # the unsafe mode's fault is a result
        cell.error = cell.outcome = first_line(err)
        return None
    grads = _grads(run)
    cell.loss = loss
    cell.outcome = "reference" if reference is None else compare(grads, loss, *reference)
    if device.type == "cuda":
        from fla_ac_isolation.harness.testing.gpu import host_sync_sites

        torch.cuda.synchronize()
        with host_sync_sites() as sites:
            _step(run, batch, num_targets, mode)
            torch.cuda.synchronize()
        cell.syncs, cell.sync_sites = len(sites), dict(collections.Counter(sites).most_common(6))
    for _ in range(args.warmup):
        _step(run, batch, num_targets, mode)
    for _ in range(args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        cell.times_ms.append(elapsed_ms(device.type, lambda: _step(run, batch, num_targets, mode)))
    cell.median_ms = statistics.median(cell.times_ms) if cell.times_ms else None
    return grads, loss


def run_group(args, dtype_name: str, schedule: str, stages: int, device: torch.device) -> list[Cell]:
    """Every cell of one (dtype, schedule, stages): no-ac twice (the reference and its repeat), then each
    checkpointed mode under each policy (zero-bubble schedules: full AC only)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    batch, num_targets = make_batch(args.microbatches, args.tokens)
    cells: list[Cell] = []
    reference = None
    for repeat in ("no-ac", "no-ac (repeat)"):
        cell = Cell(dtype_name, schedule, stages, "-", repeat)
        try:
            run = build_run(args, schedule, stages, MODES["no-ac"], "-", dtype, device)
            cell.in_flight = in_flight(run, schedule, args.microbatches)
            got = measure(cell, run, batch, num_targets, MODES["no-ac"], args, device, reference)
        except Exception as err:  # torch refused the schedule here: recorded, the group stops
            cell.error = cell.outcome = f"schedule not run: {first_line(err)}"
            got = None
        cells.append(cell)
        if got is None:
            return cells
        reference = reference or got
    policies = ("full-ac",) if SCHEDULES[schedule][2] else args.policies
    for policy in policies:
        for name in CHECKPOINTED:
            cell = Cell(dtype_name, schedule, stages, policy, name, in_flight=cells[0].in_flight)
            try:
                run = build_run(args, schedule, stages, MODES[name], policy, dtype, device)
                measure(cell, run, batch, num_targets, MODES[name], args, device, reference)
            except Exception as err:  # a build failure is a result too
                cell.error = cell.outcome = first_line(err)
            cells.append(cell)
            del run
    return cells


# ------------------------------------------------------------------------------------------------ report
def table(cells: list[Cell]) -> str:
    head = (f"{'dtype':5} {'schedule':24} {'st':>2} {'infl':>4} {'policy':16} {'mode':15} {'median ms':>10} "
            f"{'x no-ac':>8} {'syncs':>5}  outcome vs no-ac (same schedule)")
    lines = [head, "-" * len(head)]
    ref_ms: dict[tuple, float] = {}
    for c in cells:
        key = (c.dtype, c.schedule, c.stages)
        if c.mode == "no-ac" and c.median_ms:
            ref_ms[key] = c.median_ms
        ratio = c.median_ms / ref_ms[key] if c.median_ms and key in ref_ms else None
        lines.append(
            f"{c.dtype:5} {c.schedule:24} {c.stages:>2} {c.in_flight if c.in_flight is not None else '-':>4} "
            f"{c.policy:16} {c.mode:15} {'-' if c.median_ms is None else format(c.median_ms, '.2f'):>10} "
            f"{'-' if ratio is None else format(ratio, '.3f'):>8} {'-' if c.syncs is None else c.syncs:>5}  "
            f"{c.outcome}"
        )
    return "\n".join(lines)


def sync_verdicts(cells: list[Cell]) -> list[str]:
    """One line per (group, policy) on CUDA: isolated's host syncs per step against no-ac's (isolation must add
    none) and against shared's under the same policy (what a recompute adds for every checkpointed mode, e.g. a
    recomputed device-to-host copy that the policy does not save, is in both)."""
    out = []
    refs = {(c.dtype, c.schedule, c.stages): c.syncs for c in cells if c.mode == "no-ac"}
    shared = {(c.dtype, c.schedule, c.stages, c.policy): c.syncs for c in cells if c.mode == "shared"}
    for c in cells:
        ref = refs.get((c.dtype, c.schedule, c.stages))
        if c.mode == "isolated" and c.syncs is not None and ref is not None:
            word = "adds none" if c.syncs <= ref else f"ADDS {c.syncs - ref}"
            other = shared.get((c.dtype, c.schedule, c.stages, c.policy))
            out.append(f"syncs {c.dtype} {c.schedule} x{c.stages} {c.policy}: isolated {c.syncs} vs no-ac {ref} "
                       f"({word}); shared {'-' if other is None else other}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=outcome.EPILOG)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", nargs="+", choices=["bf16", "fp32"], help="default: bf16 fp32 (CPU: fp32)")
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--stages", nargs="+", type=int, help="local stage counts (default: each schedule's own)")
    parser.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=list(POLICY_NAMES))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--cache-size", type=int, help="FLA_TENSOR_CACHE_SIZE for the run (default: FLA's own)")
    parser.add_argument("--tokens", type=int, help="tokens per microbatch (default 2048; CPU 48)")
    parser.add_argument("--hidden", type=int, help="model width (default 256; CPU 64)")
    parser.add_argument("--layers", type=int, default=8, help="decoder blocks (8: every one of 4 stages has GDN)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--model", default="qwen3_5_moe")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--first-config", action="store_true", help="every Triton autotuner's first config only")
    parser.add_argument("--lift-hopper-guard", action="store_true", help="lift FLA's #640 guard (printed)")
    parser.add_argument("--out", help="raw JSON (rewritten after every group)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        parser.error("--device cuda (the default) needs a CUDA device; use --device cpu for a smoke test")
    args.dtype = args.dtype or (["fp32"] if cpu else ["bf16", "fp32"])
    args.tokens = args.tokens or (48 if cpu else 2048)
    args.hidden = args.hidden or (64 if cpu else 256)
    args.backend = "reference" if cpu else "fla"
    if args.microbatches < 1 or args.iters < 0 or args.warmup < 0:
        parser.error("--microbatches must be >= 1, --iters and --warmup >= 0")
    if args.cache_size is not None and args.cache_size < 1:
        parser.error(f"--cache-size must be >= 1, got {args.cache_size}")
    if args.tokens < 64 and not cpu:
        parser.error("--tokens must be at least 64 on CUDA")
    if args.stages and (min(args.stages) < 1 or max(args.stages) > args.layers):
        parser.error(f"--stages must lie in [1, --layers={args.layers}], got {args.stages}")
    return args


def groups(args) -> list[tuple[str, str, int]]:
    out = []
    for dtype in args.dtype:
        for schedule in args.schedules:
            counts = SCHEDULES[schedule][1]
            if args.stages:
                counts = [n for n in args.stages if (n == 1) == (counts == (1,))]
            out += [(dtype, schedule, n) for n in counts]
    return out


@outcome.stops_on_missing_module("bench_pp_one_gpu")
def main(argv=None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    import torch.distributed as dist

    from fla_ac_isolation.fla_seam.cache import cache_size, tensor_cache_size
    from fla_ac_isolation.harness.environment import versions
    from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config
    from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan

    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    notes = ensure_torch_compat()
    setup_torchtitan(args.device)
    store_dir = tempfile.mkdtemp(prefix="pp_one_gpu_")
    store_path = os.path.join(store_dir, "store")
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.FileStore(store_path, 1),
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))  # a hung send ends
    results: dict[str, Any] = {"meta": {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "versions": versions(),
        "world_size": 1, "backend": args.backend, "model": args.model, "hidden": args.hidden, "layers": args.layers,
        "experts": args.experts, "microbatches": args.microbatches, "tokens_per_microbatch": args.tokens,
        "iters": args.iters, "warmup": args.warmup, "first_config": args.first_config,
        "hopper_guard_lifted": args.lift_hopper_guard, "torch_compat_notes": notes,
        "single_stage_note": "gpipe and 1f1b are torch's single-stage schedules: one stage per rank, so in one "
                             "process the whole decoder is one stage",
    }, "cells": []}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    try:
        with contextlib.ExitStack() as stack:
            if args.lift_hopper_guard:
                from fla_ac_isolation.harness.testing.gpu import lift_hopper_gdn_guard

                stack.enter_context(lift_hopper_gdn_guard())
            if args.first_config:
                stack.enter_context(first_autotune_config())
            if args.cache_size is not None:
                stack.enter_context(tensor_cache_size(args.cache_size))
            results["meta"]["fla_cache_size"] = cache_size()
            print(f"world size 1 ({'gloo' if device.type == 'cpu' else 'nccl'}), FLA cache size {cache_size()}, "
                  f"{args.microbatches} microbatches of {args.tokens} tokens, backend {args.backend}", flush=True)
            for dtype, schedule, stages in groups(args):
                t0 = time.monotonic()
                cells = run_group(args, dtype, schedule, stages, device)
                results["cells"] += [asdict(c) for c in cells]
                print(table(cells), f"\n({time.monotonic() - t0:.1f} s)", flush=True)
                save()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store_dir, ignore_errors=True)  # the FileStore may have removed its file already
    cells = [Cell(**c) for c in results["cells"]]
    results["meta"]["total_s"] = round(time.monotonic() - start, 1)
    results["sync_verdicts"] = sync_verdicts(cells)
    save()
    print(table(cells))
    for line in results["sync_verdicts"]:
        print(line)
    print(f"total {results['meta']['total_s']} s" + (" - CPU SMOKE TEST: outcomes are facts, times mean nothing"
                                                      if device.type == "cpu" else ""))
    return outcome.finish("bench_pp_one_gpu", outcome.by_mode(((c.mode, c.error) for c in cells), "cells"))


if __name__ == "__main__":
    raise SystemExit(main())
