"""Under ``torchrun``: every mode runs in the already-launched processes, in turn. A mode failing on every rank
is recorded; one failing on some ranks ends the job (the others wait in a collective)."""

from __future__ import annotations

import datetime
import os
import time
import traceback

import torch

from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.regression.launch import FAILURE_GRACE_S, mode_mesh
from fla_ac_isolation.harness.regression.rank import RankContext, all_reduce, setup_process
from fla_ac_isolation.harness.regression.spec import (
    CP1_REFERENCE,
    PP1_REFERENCE,
    ModeResult,
    RegressionResult,
    RegressionSpec,
)
from fla_ac_isolation.harness.regression.train import run_mode_on_rank

__all__ = ["run_under_torchrun", "under_torchrun"]


def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (or another launcher setting ``RANK``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _merge_statuses(result: ModeResult, statuses: list[str], ctx: RankContext, world: int) -> ModeResult:
    """The mode's result on every rank: the first failing rank's error, or the cache counts summed."""
    errs = [(r, s[len("error:"):]) for r, s in enumerate(statuses) if s.startswith("error:")]
    if errs and result.error is None:
        result = ModeResult(result.mode)
    if errs:
        result.error = f"rank {errs[0][0]}: {errs[0][1]}" if world > 1 else errs[0][1]
        result.failed_ranks = [r for r, _ in errs]
    else:
        cache = torch.tensor([result.cache.get(k, 0) for k in ("hit", "miss", "bypass")], dtype=torch.int64)
        all_reduce(cache, ctx)
        result.cache = dict(zip(("hit", "miss", "bypass"), cache.tolist()))
    return result


def run_under_torchrun(spec: RegressionSpec, on_step) -> RegressionResult:
    """Run every mode of ``spec`` in the processes ``torchrun`` started (every rank returns the same result)."""
    notes: list[str] = []
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != spec.world:
        raise ValueError(
            f"torchrun started {world} processes but the spec runs {spec.world} ranks (--ep, times --cp or --pp under "
            "context or pipeline parallelism); make them equal"
        )
    device, shim_notes, _held = setup_process(spec, int(os.environ["LOCAL_RANK"]))
    notes.extend(n for n in shim_notes if n not in notes)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            "nccl" if spec.device == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=spec.timeout_s),
            device_id=device if spec.device == "cuda" else None,
        )
    store = dist.distributed_c10d._get_default_store()
    results: dict[str, ModeResult] = {}
    reference = cp1_reference = pp1_reference = None
    for mode in spec.ordered_modes:
        mesh = mode_mesh(spec, mode)  # every rank runs the one-rank reference itself
        ctx = RankContext.create(0 if mesh.world == 1 else rank, mesh, device)
        start = time.monotonic()
        try:
            result, grads = run_mode_on_rank(
                spec, mode, ctx, reference, (lambda s, m=mode: on_step(m, s)) if on_step and rank == 0 else None,
                cp1_reference=cp1_reference, pp1_reference=pp1_reference,
            )
            store.set(f"fla-ac-regress/{mode}/{rank}", "ok")
            if mode == "no-ac":
                reference = grads
            elif mode == CP1_REFERENCE:
                cp1_reference = grads
            elif mode == PP1_REFERENCE:
                pp1_reference = grads
        except Exception as err:
            result = ModeResult(mode, error=first_line(err), traceback=traceback.format_exc(), failed_ranks=[rank])
            store.set(f"fla-ac-regress/{mode}/{rank}", "error:" + first_line(err))
        # every rank reports; a rank stuck in a collective never does -> end the job with the error
        keys = [f"fla-ac-regress/{mode}/{r}" for r in range(world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=FAILURE_GRACE_S if result.error else spec.timeout_s))
        except Exception:
            print(f"fla-ac-isolation regress: mode {mode!r} failed on rank {rank} while other ranks still wait "
                  f"in a collective; ending the job. Error: {result.error}", flush=True)
            os._exit(1)
        result = _merge_statuses(result, [store.get(k).decode() for k in keys], ctx, world)
        result.seconds = time.monotonic() - start
        results[mode] = result
    if owns_group:  # leave no live gloo/NCCL group to interpreter shutdown
        dist.barrier()
        dist.destroy_process_group()
    return RegressionResult(spec, results, notes)
