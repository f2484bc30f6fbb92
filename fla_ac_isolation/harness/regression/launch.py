"""The launcher: one set of rank processes per mode (fork server on CPU, ``spawn`` on CUDA or with
``spec.rank_env``), and how their failures are collected. A failing mode is recorded, its surviving ranks are
killed within ``FAILURE_GRACE_S``, and the next mode starts fresh; the report is always complete."""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.modes import modes_with_role
from fla_ac_isolation.harness.regression.mesh import ParallelMesh
from fla_ac_isolation.harness.regression.processes import death, environment_variables, free_port, mp_context, stop
from fla_ac_isolation.harness.regression.rank import RankContext, setup_process
from fla_ac_isolation.harness.regression.spec import (
    CP1_REFERENCE,
    PP1_REFERENCE,
    ModeResult,
    RegressionResult,
    RegressionSpec,
)
from fla_ac_isolation.harness.regression.train import run_mode_on_rank

__all__ = ["FAILURE_GRACE_S", "REFERENCES", "UNGUARDED_MAIN", "environment_variables", "free_port", "mode_mesh",
           "run_spawned"]

FAILURE_GRACE_S = 3.0
"""Seconds the surviving ranks of a failed mode get before they are killed."""


REFERENCES: tuple[str, ...] = ("no-ac", CP1_REFERENCE, PP1_REFERENCE)
"""The modes whose gradients the other modes compare with (saved per rank and step)."""


def mode_mesh(spec: RegressionSpec, mode: str) -> ParallelMesh:
    """The ranks of ``mode``: ``spec.mesh``, or one rank for the CP1/PP1 references."""
    return ParallelMesh() if mode in (CP1_REFERENCE, PP1_REFERENCE) else spec.mesh


def _run_mode(spec: RegressionSpec, mode: str, ctx: RankContext, workdir: str, events) -> None:
    """Train ``mode`` on this rank and report its result."""
    rank = ctx.rank
    reference = _load(workdir, "no-ac", rank) if mode not in REFERENCES else None
    cp1_reference = _load(workdir, CP1_REFERENCE, 0) if spec.cp > 1 and mode != CP1_REFERENCE else None
    pp1_reference = _load(workdir, PP1_REFERENCE, 0) if spec.pp > 1 and mode != PP1_REFERENCE else None
    on_step = (lambda step: events.put(("step", rank, step))) if rank == 0 else None
    result, grads = run_mode_on_rank(spec, mode, ctx, reference, on_step, cp1_reference=cp1_reference,
                                     pp1_reference=pp1_reference)
    if mode in REFERENCES:
        torch.save(grads, os.path.join(workdir, f"{mode}.rank{rank}.pt"))
    events.put(("result", rank, asdict(result)))


def _report_and_exit(rank: int, err: BaseException, events) -> None:
    events.put(("error", rank, (first_line(err), traceback.format_exc())))
    events.close()
    events.join_thread()
    os._exit(1)


def _worker_main(rank: int, port: int, spec: RegressionSpec, mode: str, workdir: str, events) -> None:
    """Entry point of one rank for one mode; reports through ``events``, never hangs on failure."""
    import torch.distributed as dist

    mesh = mode_mesh(spec, mode)
    try:
        device, notes, _held = setup_process(spec, rank)
        for note in notes:
            events.put(("note", rank, note))
        if mesh.world > 1:
            dist.init_process_group(
                "nccl" if spec.device == "cuda" else "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=mesh.world,
                timeout=datetime.timedelta(seconds=spec.timeout_s),
                device_id=device if spec.device == "cuda" else None,
            )
        ctx = RankContext.create(rank, mesh, device)
        events.put(("started", rank, os.getpid()))
        _run_mode(spec, mode, ctx, workdir, events)
        if mesh.world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as err:
        _report_and_exit(rank, err, events)


def _serial_main(spec: RegressionSpec, workdir: str, tasks, events) -> None:
    """Entry point of the spawned process that runs one-rank modes in turn; ``None`` ends it, as does a failure."""
    try:
        device, notes, _held = setup_process(spec, 0)
        for note in notes:
            events.put(("note", 0, note))
        while (mode := tasks.get()) is not None:
            ctx = RankContext.create(0, mode_mesh(spec, mode), device)
            events.put(("started", 0, os.getpid()))
            _run_mode(spec, mode, ctx, workdir, events)
    except BaseException as err:
        _report_and_exit(0, err, events)


class _SerialRank:
    """A spawned process shared by the one-rank modes of a run while they succeed."""

    def __init__(self, mp_ctx, spec: RegressionSpec, workdir: str) -> None:
        self.tasks, self.events = mp_ctx.Queue(), mp_ctx.Queue()
        self.process = mp_ctx.Process(target=_serial_main, args=(spec, workdir, self.tasks, self.events),
                                      daemon=True, name="fla-ac-regress-one-rank")
        with environment_variables(spec.rank_env):
            self.process.start()

    def close(self) -> None:
        """Ask the process to end, then stop it and the queues."""
        with contextlib.suppress(Exception):
            self.tasks.put(None)
        self.process.join(2.0)
        stop([self.process])
        for q in (self.tasks, self.events):
            with contextlib.suppress(Exception):
                q.close()


@dataclass(frozen=True)
class _Hooks:

    on_step: Callable[[str, int], None] | None = None
    on_rank_start: Callable[[str, int, int], None] | None = None


def _load(workdir: str, mode: str, rank: int) -> list[torch.Tensor] | None:
    """The per-step gradients a reference run saved, if it completed."""
    path = os.path.join(workdir, f"{mode}.rank{rank}.pt")
    return torch.load(path) if os.path.exists(path) else None


@dataclass
class _Outcome:
    """What the ranks of one launch reported: results and errors by rank."""

    results: dict[int, dict] = field(default_factory=dict)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)  # the first is the cause
    timed_out: bool = False


def _record_killed(procs, out: _Outcome, reporting: int) -> None:
    """Record ranks ended by a signal, ahead of ``reporting``'s error (the others get 0.1 s to show theirs)."""
    deadline = time.monotonic() + 0.1
    for r, p in enumerate(procs):
        if r in out.errors or r == reporting:
            continue
        if p.exitcode is None:
            p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is not None and p.exitcode < 0:
            out.errors[r] = (death(p.exitcode), "")


def _watch(procs, events, spec: RegressionSpec, mode: str, notes: list[str], hooks: _Hooks,
           persistent: bool = False) -> _Outcome:
    """Read the ranks' events until all exited, a failure's grace ran out, or the mode timed out."""
    out = _Outcome()
    start = time.monotonic()
    first_failure: float | None = None
    while True:
        try:
            kind, rank, payload = events.get(timeout=0.05)
        except queue_module.Empty:
            kind = None
        if kind == "started" and hooks.on_rank_start is not None:
            hooks.on_rank_start(mode, rank, payload)
        elif kind == "note" and payload not in notes:
            notes.append(payload)
        elif kind == "step" and hooks.on_step is not None:
            hooks.on_step(mode, payload)
        elif kind == "result":
            out.results[rank] = payload
        elif kind == "error":
            _record_killed(procs, out, rank)  # a peer killed before this error caused it
            out.errors.setdefault(rank, payload)
            first_failure = first_failure or time.monotonic()
        if persistent and kind in ("result", "error"):
            return out  # one rank, still running: its report ends the mode
        if kind is not None:
            continue  # drain queued events before judging the processes
        now = time.monotonic()
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in out.errors:
                first_failure = first_failure or now
                if p.exitcode < 0 or now - first_failure > 0.5:  # a signal; else its own report had time
                    out.errors[r] = (death(p.exitcode), "")
        if all(p.exitcode is not None for p in procs):
            return out
        if first_failure is not None and now - first_failure > FAILURE_GRACE_S:
            return out
        if now - start > spec.timeout_s:
            out.timed_out = True
            return out


def _merge(outcome: _Outcome, spec: RegressionSpec, mode: str, seconds: float, nprocs: int) -> ModeResult:
    """One :class:`ModeResult` of a launch: rank 0's numbers, cache counts summed, the first error."""
    merged = ModeResult(mode, seconds=seconds)
    if 0 in outcome.results:
        merged = ModeResult(**{**outcome.results[0], "seconds": seconds, "cache": {}, "cache_by_helper": {}})
        for payload in outcome.results.values():
            for outcome_name, n in payload["cache"].items():
                merged.cache[outcome_name] = merged.cache.get(outcome_name, 0) + n
            for helper, counts in payload["cache_by_helper"].items():
                mine = merged.cache_by_helper.setdefault(helper, {})
                for outcome_name, n in counts.items():
                    mine[outcome_name] = mine.get(outcome_name, 0) + n
    if outcome.errors:
        first = next(iter(outcome.errors))  # later errors are usually consequences (a peer's connection reset)
        text, trace = outcome.errors[first]
        merged.error = f"rank {first}: {text}" if nprocs > 1 else text
        merged.traceback = trace or None
        merged.failed_ranks = list(outcome.errors)
    elif outcome.timed_out:
        merged.error = f"timed out after {spec.timeout_s:.0f} s"
        merged.timed_out = True
    elif len(outcome.results) < nprocs:
        merged.error = "ranks exited without a result"
    return merged


def _launch_mode(mp_ctx, spec: RegressionSpec, mode: str, workdir: str, notes: list[str], hooks: _Hooks) -> ModeResult:
    """Start the ranks of ``mode``, watch them, stop the survivors (however this ends), merge their reports."""
    events = mp_ctx.Queue()
    procs = []
    nprocs = mode_mesh(spec, mode).world
    start = time.monotonic()
    try:
        port = free_port()
        procs = [
            mp_ctx.Process(target=_worker_main, args=(r, port, spec, mode, workdir, events), daemon=True,
                           name=f"fla-ac-regress-{mode}-rank{r}")
            for r in range(nprocs)
        ]
        with environment_variables(spec.rank_env):
            for p in procs:
                p.start()
        outcome = _watch(procs, events, spec, mode, notes, hooks)
    finally:
        stop(procs)
        with contextlib.suppress(Exception):
            events.close()
    return _merge(outcome, spec, mode, time.monotonic() - start, nprocs)


def _run_on_serial_rank(serial: _SerialRank, spec: RegressionSpec, mode: str, notes: list[str],
                        hooks: _Hooks) -> tuple[ModeResult, bool]:
    """Run a one-rank mode in ``serial``: ``(result, whether the process can take the next mode)``."""
    start = time.monotonic()
    serial.tasks.put(mode)
    outcome = _watch([serial.process], serial.events, spec, mode, notes, hooks, persistent=True)
    reusable = not outcome.errors and not outcome.timed_out and serial.process.exitcode is None
    return _merge(outcome, spec, mode, time.monotonic() - start, 1), reusable


def _execution_order(spec: RegressionSpec) -> list[str]:
    """``spec.ordered_modes`` with the unsafe modes last, so a failure cannot spoil the modes that decide."""
    unsafe = set(modes_with_role("unsafe"))
    return [m for m in spec.ordered_modes if m not in unsafe] + [m for m in spec.ordered_modes if m in unsafe]


_BOOTSTRAPPING = "An attempt has been made to start a new process before the"  # multiprocessing's, in a child
UNGUARDED_MAIN = ("RuntimeError: the regression was started while a process was importing the main module: the rank "
                  "processes re-import it (the spawn and forkserver start methods do), so guard your script's entry "
                  "with `if __name__ == \"__main__\":`")
"""The launcher's failure for multiprocessing's bootstrapping ``RuntimeError``: a script without the guard."""


def _launcher_error(err: Exception) -> str:
    """A mode's error for the launcher's ``err``: ``launcher: <first line>``, naming the fix of a known one."""
    if isinstance(err, RuntimeError) and str(err).lstrip().startswith(_BOOTSTRAPPING):
        return f"launcher: {UNGUARDED_MAIN}"
    return f"launcher: {first_line(err)}"


def run_spawned(
    spec: RegressionSpec,
    on_step: Callable[[str, int], None] | None,
    on_rank_start: Callable[[str, int, int], None] | None = None,
) -> RegressionResult:
    """Run every mode of ``spec`` in rank processes; return the results in ``spec.ordered_modes`` order.

    ``on_step(mode, step)`` is called after each step of rank 0, ``on_rank_start(mode, rank, pid)`` when a
    rank's process group is up. An ``Exception`` of the launcher or a hook is recorded as that mode's failure;
    ``KeyboardInterrupt`` stops the run after the workers are stopped.
    """
    mp_ctx = mp_context(spec.device, spec.rank_env)
    share_one_rank = mp_ctx.get_start_method() == "spawn"
    hooks = _Hooks(on_step, on_rank_start)
    notes: list[str] = []
    modes: dict[str, ModeResult] = {}
    serial: _SerialRank | None = None
    with tempfile.TemporaryDirectory(prefix="fla-ac-regress-") as workdir:
        try:
            for mode in _execution_order(spec):
                try:
                    if share_one_rank and mode_mesh(spec, mode).world == 1:
                        serial = serial or _SerialRank(mp_ctx, spec, workdir)
                        modes[mode], reusable = _run_on_serial_rank(serial, spec, mode, notes, hooks)
                        if not reusable:
                            serial.close()
                            serial = None
                    else:
                        modes[mode] = _launch_mode(mp_ctx, spec, mode, workdir, notes, hooks)
                except Exception as err:
                    modes[mode] = ModeResult(mode, error=_launcher_error(err),
                                             traceback=traceback.format_exc())
        finally:
            if serial is not None:
                serial.close()
    return RegressionResult(spec, {m: modes[m] for m in spec.ordered_modes if m in modes}, notes)
