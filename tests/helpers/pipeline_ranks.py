"""Two gloo ranks on a CPU for the pipeline tests that run outside the regression (the audit inside PP stages).

:func:`run_ranks` starts ``world`` processes from a fork server preloaded like the regression's (torch, FLA,
torchtitan already imported), each joins a gloo group with a short timeout and runs ``fn(rank, world, *args)``;
the parent collects ``{rank: result}`` (an exception becomes ``{"error": "<Type>: <first line>"}``) and kills the
ranks still alive a few seconds after the first failure (a peer of a failed rank waits in a receive).
:func:`audit_rank` is one such ``fn``: a tiny decoder split into stages by the regression's own builder, one
schedule step under ``ReplayAudit(region_tag=run.tags)``.
"""

from __future__ import annotations

import datetime
import multiprocessing
import queue as queue_module
import time

import torch

from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.regression.launch import free_port


def _child(rank: int, world: int, port: int, fn, args: tuple, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        results.put((rank, fn(rank, world, *args)))
    except BaseException as err:
        results.put((rank, {"error": first_line(err)}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 240.0, grace_s: float = 3.0) -> dict[int, dict]:
    """``{rank: fn(rank, world, *args)}`` over ``world`` fresh gloo ranks (see the module docstring)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["fla_ac_isolation.harness.regression._preload"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    start, failed_at = time.monotonic(), None
    try:
        while len(out) < world and time.monotonic() - start < timeout_s:
            try:
                rank, payload = results.get(timeout=0.1)
                out[rank] = payload
                if isinstance(payload, dict) and payload.get("error") and failed_at is None:
                    failed_at = time.monotonic()
            except queue_module.Empty:
                pass
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                out.setdefault(r, {"error": "killed after a peer failed"})
            p.join(5)
    return out


def audit_rank(rank: int, world: int, mode_name: str, schedule: str, microbatches: int, ac: str) -> dict:
    """One step of the tiny Qwen3.5-MoE decoder split into stages, under ``ReplayAudit(region_tag=run.tags,
    on_divergence="record")``: the step's error (or ``None``), every region's report, its recompute count, and the
    audit's summary table."""
    from fla_ac_isolation import ReplayAudit
    from fla_ac_isolation.harness.modes import get_mode
    from fla_ac_isolation.harness.regression.data import pp_batch
    from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan
    from fla_ac_isolation.harness.regression.model import ModelSize, build_model
    from fla_ac_isolation.harness.regression.pipeline import build_pipeline, pipeline_step
    from fla_ac_isolation.parallel import split_packed_microbatches
    from fla_ac_isolation.policies import checkpoint_layers, save_all_copies

    ensure_torch_compat()
    setup_torchtitan("cpu")
    mode = get_mode(mode_name)
    torch.manual_seed(0)
    model = build_model("qwen3_5_moe", ModelSize(64, 4, 8, 2), backend="reference")
    if mode.checkpointed:
        checkpoint_layers(model, mode=ac, policy=save_all_copies() if ac == "selective" else None)
    run = build_pipeline(model, schedule=schedule, pp_rank=rank, pp=world, microbatches=microbatches,
                         seqlens_class=mode.seqlens_class, device=torch.device("cpu"))
    batch = pp_batch(0, 0, 1)
    offsets = [0, *torch.tensor(batch.seq_lens).cumsum(0).tolist()]
    mbs = split_packed_microbatches({"input_ids": batch.input_ids, "labels": batch.labels}, offsets, microbatches)
    error = None
    with ReplayAudit(region_tag=run.tags, on_divergence="record") as audit, mode.cache_context():
        try:
            pipeline_step(run, mbs, batch.num_targets_global)
        except Exception as err:
            error = first_line(err)
    regions = [{"label": r.label, "verdict": r.verdict, "first_diff": r.first_diff, "where": r.where,
                "forward_op": r.forward_op, "recompute_op": r.recompute_op, "fla": [d.helper for d in r.fla],
                "message": r.message} for r in audit.regions]
    return {"error": error, "regions": regions, "recomputes": audit.recompute_counts,
            "summary": audit.summary(messages=False)}
