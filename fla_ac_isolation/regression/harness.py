"""The N-step EP regression: launch the ranks, train each mode, collect losses, gradients and failures.

Modes (all from the same seed, weights and batches):

* ``no-ac``          reference: no checkpointing; one shared ``cu_seqlens`` (harmless without AC).
* ``shared``         AC with one shared ``cu_seqlens`` object for every layer (the UNSAFE path, through
                     :class:`~fla_ac_isolation.seqlens.SharedSeqlens`).
* ``isolated``       AC with one :class:`~fla_ac_isolation.LayerLocalSeqlens`; each mixer calls ``.local()``.
* ``global-disable`` AC with the shared object, FLA's tensor cache disabled for forward and backward.

Launching. :func:`run_regression` starts ``ep`` worker processes per mode (on CPU from a ``forkserver``
preloaded with torch, FLA, torchtitan and transformers, so that a start costs about a second; on CUDA
by ``spawn``); gloo on CPU, NCCL on CUDA (one GPU per rank). One launch per mode keeps modes independent: a mode that crashes,
on one rank or all, is recorded as failed; its surviving ranks are killed within
``_FAILURE_GRACE_S`` seconds (they would otherwise wait in a collective until the process-group
timeout), and the next mode starts fresh. The ``no-ac`` workers write their per-step gradients to a
temporary folder; later modes compare against them on each rank.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set), :func:`run_regression` runs every mode in the
already-launched processes, one after the other. A mode that fails on every rank is recorded and the
run continues; a rank that fails while another is still running ends the whole job with the error
(torchrun then stops the other ranks), since that other rank waits in a collective.

Per step, each rank: builds its packed batch (:mod:`.data`), runs forward and backward, sums the
non-expert gradients over ranks (the data-parallel reduction FSDP would do; expert gradients are
complete on their owning rank), takes an AdamW step. Reported per step: the global loss, the global
gradient norm, the largest absolute gradient difference to ``no-ac`` over all ranks and parameters, and
the largest number of experts that received no token in a layer; per mode: FLA cache hits/misses.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_module
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["MODES", "ModeResult", "RegressionResult", "RegressionSpec", "run_regression"]

MODES = ("no-ac", "shared", "isolated", "global-disable")
_FAILURE_GRACE_S = 3.0


@dataclass(frozen=True)
class RegressionSpec:
    """What to run.

    Attributes:
        model: family name (``qwen3_5_moe`` | ``qwen3_8`` | ``nemotron_h``).
        ep: expert-parallel degree = number of ranks.
        steps: AdamW steps per mode.
        ac: ``"full"`` or ``"selective"`` checkpointing for the AC modes.
        policy: SAC policy name (:data:`fla_ac_isolation.policies.POLICIES`), used with ``ac="selective"``.
        freq: checkpoint every ``freq``-th block.
        backend: mixers' backend, ``auto`` | ``fla`` | ``reference``.
        device: ``cpu`` or ``cuda``.
        dtype: parameter/activation dtype name (``float32``, ``bfloat16``).
        hidden_size, num_layers, num_experts, top_k: model sizes.
        data_ranks: number of ranks the data is generated for; ``None`` = ``ep``. With ``ep=1`` and
            ``data_ranks=2`` the single rank trains on both ranks' documents (the same global batch).
        seed: weights and data.
        lr: AdamW learning rate.
        modes: modes to run; ``no-ac`` is always run first (it is the reference).
        timeout_s: wall-clock limit per mode (also the process-group timeout).
        early_stop: torch's checkpoint early stop.
        fail_on: testing hook, ``(mode, rank)``: that rank raises ``RuntimeError`` between the first
            forward and backward of that mode, to show that one failing rank ends all ranks promptly.
        rank_setup: ``"module:function"`` called in every rank process before training, e.g. a GPU test
            harness switch such as ``"fla_ac_isolation.testing.gpu:lift_hopper_gdn_guard"``; when it
            returns a context manager, that is entered and kept for the life of the process.
    """

    model: str = "qwen3_5_moe"
    ep: int = 2
    steps: int = 3
    ac: str = "selective"
    policy: str = "save-all-copies"
    freq: int = 1
    backend: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    hidden_size: int = 128
    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 4
    data_ranks: int | None = None
    seed: int = 0
    lr: float = 1e-3
    modes: tuple[str, ...] = MODES
    timeout_s: float = 300.0
    early_stop: bool = True
    fail_on: tuple[str, int] | None = None
    rank_setup: str | None = None

    def validate(self) -> RegressionSpec:
        """Return self after checking every field; errors name the field (``ValueError``)."""
        from fla_ac_isolation.policies import POLICIES
        from fla_ac_isolation.regression.model import FAMILIES

        if self.model not in FAMILIES:
            raise ValueError(f"model must be one of {sorted(FAMILIES)}, got {self.model!r}")
        for name in ("ep", "steps", "freq", "hidden_size", "num_layers", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.ac not in ("full", "selective"):
            raise ValueError(f"ac must be 'full' or 'selective', got {self.ac!r}")
        if self.ac == "selective" and self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.backend not in ("auto", "fla", "reference"):
            raise ValueError(f"backend must be 'auto', 'fla' or 'reference', got {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.num_experts % self.ep:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of ep ({self.ep})")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.data_ranks is not None and self.data_ranks < self.ep:
            raise ValueError(f"data_ranks ({self.data_ranks}) must be >= ep ({self.ep})")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {self.modes!r}")
        if self.rank_setup is not None and ":" not in self.rank_setup:
            raise ValueError(f"rank_setup must be 'module:function', got {self.rank_setup!r}")
        if self.device == "cuda" and torch.cuda.device_count() < self.ep:
            raise ValueError(f"ep={self.ep} needs {self.ep} CUDA devices, found {torch.cuda.device_count()}")
        return self

    @property
    def ordered_modes(self) -> tuple[str, ...]:
        return ("no-ac",) + tuple(m for m in MODES[1:] if m in self.modes)


@dataclass
class ModeResult:
    """Outcome of one mode, reduced over all ranks.

    Attributes:
        mode: the mode.
        losses: global loss per completed step.
        grad_norms: global gradient norm per completed step.
        grad_diffs: per completed step, max ``|grad - grad_no_ac|`` over ranks and parameters
            (``None`` for ``no-ac`` itself, or when the reference is missing).
        ref_grad_max: per step, max ``|grad_no_ac|`` (the scale for relative differences).
        idle_experts: per step, the largest number of experts without any token in one MoE layer.
        cache: FLA tensor-cache events summed over ranks and steps, ``{"hit": .., "miss": .., "bypass": ..}``.
        cache_by_helper: the same per helper name.
        error: ``"<Type>: <first line>"`` of the first failure, else ``None``.
        failed_ranks: ranks that raised (or died), in order of arrival; the first one's error is ``error``.
        traceback: full traceback text of the first failure (for ``--verbose``/JSON).
        seconds: wall time of the mode.
        step_seconds: per completed step, the forward + backward wall time of the slowest rank
            (device synchronised before and after; excludes data, gradient reduction and optimizer).
    """

    mode: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grad_diffs: list[float | None] = field(default_factory=list)
    ref_grad_max: list[float | None] = field(default_factory=list)
    idle_experts: list[int] = field(default_factory=list)
    cache: dict[str, int] = field(default_factory=dict)
    cache_by_helper: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str | None = None
    failed_ranks: list[int] = field(default_factory=list)
    traceback: str | None = None
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)


@dataclass
class RegressionResult:
    """Every mode's :class:`ModeResult`, the spec, and notes (e.g. compatibility shims applied)."""

    spec: RegressionSpec
    modes: dict[str, ModeResult]
    notes: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": asdict(self.spec),
            "modes": {name: asdict(r) for name, r in self.modes.items()},
            "notes": list(self.notes),
            "environment": dict(self.environment),
        }


# ============================================================================ one rank, one mode
@dataclass
class _RankContext:
    rank: int
    world: int
    device: torch.device
    group: Any  # process group for the harness's own reductions (None when world == 1)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _policy(spec: RegressionSpec):
    if spec.ac == "full":
        return None
    from fla_ac_isolation.policies import POLICIES

    return POLICIES[spec.policy]()


def _all_reduce(t: torch.Tensor, ctx: _RankContext, op: str = "sum") -> torch.Tensor:
    if ctx.world > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=ctx.group)
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _run_mode_on_rank(
    spec: RegressionSpec,
    mode: str,
    ctx: _RankContext,
    reference: list[torch.Tensor] | None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[ModeResult, list[torch.Tensor]]:
    """Train ``spec.steps`` steps of ``mode`` on this rank; returns the rank's view and (``no-ac``) its grads.

    The returned :class:`ModeResult` holds global (all-reduced) losses/norms/diffs, and this rank's
    own cache counts (the caller sums them over ranks).
    """
    import torch.nn.functional as F

    from fla_ac_isolation.fla_cache import clear_tensor_cache, probe_tensor_cache, tensor_cache_disabled
    from fla_ac_isolation.policies import checkpoint_layers
    from fla_ac_isolation.regression.data import global_batch, rank_batch
    from fla_ac_isolation.regression.expert_parallel import apply_expert_parallel, is_expert_param
    from fla_ac_isolation.regression.model import ModelSize, build_model
    from fla_ac_isolation.seqlens import LayerLocalSeqlens, SharedSeqlens

    size = ModelSize(spec.hidden_size, spec.num_layers, spec.num_experts, spec.top_k)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, size, backend=spec.backend, ep_enabled=ctx.world > 1)
    model.to(device=ctx.device, dtype=_dtype(spec.dtype))
    if ctx.world > 1:
        apply_expert_parallel(model.moes(), ctx.world)
    if mode != "no-ac":
        policy = _policy(spec)
        checkpoint_layers(model, mode="selective" if policy is not None else "full", policy=policy,
                          freq=spec.freq, early_stop=spec.early_stop)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in params if not is_expert_param(p)]
    experts = [p for p in params if is_expert_param(p)]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, foreach=False)
    seqlens_cls = LayerLocalSeqlens if mode == "isolated" else SharedSeqlens
    data_ranks = spec.data_ranks or spec.ep

    result = ModeResult(mode)
    cache_totals = {"hit": 0, "miss": 0, "bypass": 0}
    flat_grads: list[torch.Tensor] = []
    for step in range(spec.steps):
        if ctx.world == 1:
            batch = global_batch(step, data_ranks, seed=spec.seed, vocab_size=size.vocab_size)
        else:
            batch = rank_batch(step, ctx.rank, data_ranks, seed=spec.seed, vocab_size=size.vocab_size)
        input_ids = batch.input_ids.to(ctx.device)
        labels = batch.labels.to(ctx.device)
        seqlens = seqlens_cls.from_seq_lens(batch.seq_lens, device=ctx.device)
        clear_tensor_cache()
        disable = tensor_cache_disabled() if mode == "global-disable" else contextlib.nullcontext()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        started = time.perf_counter()
        with probe_tensor_cache() as probe, disable, torch.utils.checkpoint.set_checkpoint_early_stop(
            spec.early_stop
        ):
            logits = model(input_ids, seqlens)
            loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
            loss = loss / batch.num_targets_global
            if spec.fail_on is not None and tuple(spec.fail_on) == (mode, ctx.rank):
                raise RuntimeError(f"injected failure on rank {ctx.rank} in mode {mode!r} (RegressionSpec.fail_on)")
            loss.backward()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        step_time = torch.tensor([time.perf_counter() - started], device=ctx.device)
        _all_reduce(step_time, ctx, op="max")
        result.step_seconds.append(float(step_time[0]))
        for name, counts in probe.by_helper().items():
            mine = result.cache_by_helper.setdefault(name, {"hit": 0, "miss": 0, "bypass": 0})
            for outcome, n in counts.items():
                mine[outcome] = mine.get(outcome, 0) + n
                cache_totals[outcome] = cache_totals.get(outcome, 0) + n

        # data-parallel reduction of the replicated (non-expert) gradients, in one buffer
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dense_flat = torch.cat([p.grad.reshape(-1).float() for p in dense])
        _all_reduce(dense_flat, ctx)
        offset = 0
        for p in dense:
            n = p.numel()
            p.grad.copy_(dense_flat[offset:offset + n].view_as(p.grad))
            offset += n
        expert_flat = (
            torch.cat([_local(p.grad).reshape(-1).float() for p in experts])
            if experts else dense_flat.new_zeros(0)
        )
        flat = torch.cat([dense_flat, expert_flat])
        if mode == "no-ac":  # the reference every other mode is compared with
            flat_grads.append(flat.cpu())

        stats = torch.stack([
            loss.detach().float().reshape(()),
            expert_flat.pow(2).sum(),
        ])
        _all_reduce(stats, ctx)
        grad_norm = float((dense_flat.pow(2).sum() + stats[1]).sqrt())
        diff = ref_max = None
        if reference is not None and step < len(reference):
            ref = reference[step].to(flat.device)
            maxes = torch.stack([(flat - ref).abs().max(), ref.abs().max()]) if ref.shape == flat.shape else \
                torch.tensor([float("inf"), 0.0], device=flat.device)
            _all_reduce(maxes, ctx, op="max")
            diff, ref_max = float(maxes[0]), float(maxes[1])

        counts = torch.stack([m.tokens_per_expert_E.detach().float() for m in model.moes()])  # [L, E]
        _all_reduce(counts, ctx)
        idle = int((counts == 0).sum(-1).max()) if counts.numel() else 0
        for m in model.moes():
            m.tokens_per_expert_E.zero_()

        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

        result.losses.append(float(stats[0]))
        result.grad_norms.append(grad_norm)
        result.grad_diffs.append(diff)
        result.ref_grad_max.append(ref_max)
        result.idle_experts.append(idle)
        if on_step is not None:
            on_step(step)
    result.cache = cache_totals
    return result, flat_grads


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _setup_process(spec: RegressionSpec, rank: int) -> tuple[torch.device, list[str], object]:
    """Device, notes for the report, and the entered ``rank_setup`` context (hold it while training:
    a generator-based context manager that is garbage-collected runs its exit and undoes the setup)."""
    import warnings

    from fla_ac_isolation.regression.expert_parallel import ensure_torch_compat, setup_torchtitan

    warnings.filterwarnings("ignore", message=".*[Aa]utocast.*")
    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    notes = ensure_torch_compat()
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # ranks share the cores; one thread each is also deterministic
        device = torch.device("cpu")
    setup_torchtitan(spec.device)
    out = None
    if spec.rank_setup is not None:
        import importlib

        module, _, name = spec.rank_setup.partition(":")
        out = getattr(importlib.import_module(module), name)()
        if hasattr(out, "__enter__"):
            out.__enter__()  # kept entered until the process ends; the caller holds `out`
    return device, notes, out


# ============================================================================ spawned workers
def _worker_main(rank: int, world: int, port: int, spec: RegressionSpec, mode: str, workdir: str, events) -> None:
    """Entry point of one spawned rank for one mode. Reports through ``events``; never hangs on failure."""
    import torch.distributed as dist

    try:
        device, notes, _rank_context = _setup_process(spec, rank)
        for note in notes:
            events.put(("note", rank, note))
        group = None
        if world > 1:
            dist.init_process_group(
                "nccl" if spec.device == "cuda" else "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=spec.timeout_s),
                device_id=device if spec.device == "cuda" else None,
            )
            group = dist.group.WORLD
        ctx = _RankContext(rank, world, device, group)
        reference = None
        ref_path = os.path.join(workdir, f"no-ac.rank{rank}.pt")
        if mode != "no-ac" and os.path.exists(ref_path):
            reference = torch.load(ref_path)
        on_step = (lambda step: events.put(("step", rank, step))) if rank == 0 else None
        result, grads = _run_mode_on_rank(spec, mode, ctx, reference, on_step)
        if mode == "no-ac":
            torch.save(grads, ref_path)
        events.put(("result", rank, asdict(result)))
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the parent, then this rank exits
        events.put(("error", rank, (_first_line(err), traceback.format_exc())))
        events.close()
        events.join_thread()
        os._exit(1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _launch_mode(mp_ctx, spec: RegressionSpec, mode: str, workdir: str, notes: list[str],
                 on_step: Callable[[str, int], None] | None) -> ModeResult:
    world = spec.ep
    events = mp_ctx.Queue()
    port = _free_port()
    procs = [
        mp_ctx.Process(target=_worker_main, args=(r, world, port, spec, mode, workdir, events), daemon=True,
                       name=f"fla-ac-regress-{mode}-rank{r}")
        for r in range(world)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    errors: dict[int, tuple[str, str]] = {}  # in order of arrival: the first is the cause
    first_failure: float | None = None
    timed_out = False
    while True:
        try:
            kind, rank, payload = events.get(timeout=0.05)
        except queue_module.Empty:
            kind = None
        if kind == "note" and payload not in notes:
            notes.append(payload)
        elif kind == "step" and on_step is not None:
            on_step(mode, payload)
        elif kind == "result":
            results[rank] = payload
        elif kind == "error":
            errors.setdefault(rank, payload)
            first_failure = first_failure or time.monotonic()
        if kind is not None:
            continue  # drain queued events before judging the processes
        now = time.monotonic()
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in errors:
                first_failure = first_failure or now
                if now - first_failure > 0.5:  # its own report had time to arrive
                    errors[r] = (f"rank {r} died (exit code {p.exitcode})", "")
        if all(p.exitcode is not None for p in procs):
            break
        if first_failure is not None and now - first_failure > _FAILURE_GRACE_S:
            break
        if now - start > spec.timeout_s:
            timed_out = True
            break
    _stop(procs)
    with contextlib.suppress(Exception):
        events.close()

    merged = ModeResult(mode, seconds=time.monotonic() - start)
    if 0 in results:
        merged = ModeResult(**{**results[0], "seconds": merged.seconds})
        merged.cache = {}
        merged.cache_by_helper = {}
        for payload in results.values():
            for outcome, n in payload["cache"].items():
                merged.cache[outcome] = merged.cache.get(outcome, 0) + n
            for helper, counts in payload["cache_by_helper"].items():
                mine = merged.cache_by_helper.setdefault(helper, {})
                for outcome, n in counts.items():
                    mine[outcome] = mine.get(outcome, 0) + n
    if errors:
        first = next(iter(errors))  # later errors are usually consequences (a peer's connection reset)
        merged.error = f"rank {first}: {errors[first][0]}" if world > 1 else errors[first][0]
        merged.traceback = errors[first][1] or None
        merged.failed_ranks = list(errors)
    elif timed_out:
        merged.error = f"timed out after {spec.timeout_s:.0f} s"
    elif len(results) < world:
        merged.error = "ranks exited without a result"
    return merged


def _mp_context(device: str):
    """``forkserver`` preloaded with the heavy imports on CPU; plain ``spawn`` on CUDA.

    On CUDA the preload would be unsafe: importing FLA queries the GPU (its Hopper/Triton checks), which
    initialises CUDA in the fork server, and forked children could then not use CUDA.
    """
    import multiprocessing

    if device == "cuda":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["fla_ac_isolation.regression._preload"])
    return ctx


# ============================================================================ torchrun
def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (or another launcher setting ``RANK``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _run_under_torchrun(spec: RegressionSpec, on_step, notes: list[str]) -> RegressionResult:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != spec.ep:
        raise ValueError(f"torchrun started {world} processes but --ep is {spec.ep}; make them equal")
    device, shim_notes, _rank_context = _setup_process(spec, int(os.environ["LOCAL_RANK"]))
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
    reference = None
    for mode in spec.ordered_modes:
        group = dist.new_group(backend="gloo" if spec.device == "cpu" else None)
        ctx = _RankContext(rank, world, device, group)
        start = time.monotonic()
        try:
            result, grads = _run_mode_on_rank(
                spec, mode, ctx, reference, (lambda s, m=mode: on_step(m, s)) if on_step and rank == 0 else None
            )
            store.set(f"fla-ac-regress/{mode}/{rank}", "ok")
            if mode == "no-ac":
                reference = grads
        except Exception as err:  # noqa: BLE001
            result = ModeResult(mode, error=_first_line(err), traceback=traceback.format_exc(), failed_ranks=[rank])
            store.set(f"fla-ac-regress/{mode}/{rank}", "error:" + _first_line(err))
        # every rank reports; a rank stuck in a collective never does -> end the job with the error
        keys = [f"fla-ac-regress/{mode}/{r}" for r in range(world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=_FAILURE_GRACE_S if result.error else spec.timeout_s))
        except Exception:  # noqa: BLE001
            print(f"fla-ac-isolation regress: mode {mode!r} failed on rank {rank} while other ranks still wait "
                  f"in a collective; ending the job. Error: {result.error}", flush=True)
            os._exit(1)
        statuses = [store.get(k).decode() for k in keys]
        errs = [(r, s[len("error:"):]) for r, s in enumerate(statuses) if s.startswith("error:")]
        if errs and result.error is None:
            result = ModeResult(mode)
        if errs:
            result.error = f"rank {errs[0][0]}: {errs[0][1]}" if world > 1 else errs[0][1]
            result.failed_ranks = [r for r, _ in errs]
        else:
            cache = torch.tensor([result.cache.get(k, 0) for k in ("hit", "miss", "bypass")], dtype=torch.int64)
            _all_reduce(cache, ctx)
            result.cache = dict(zip(("hit", "miss", "bypass"), cache.tolist()))
        result.seconds = time.monotonic() - start
        results[mode] = result
    if owns_group:  # leave no live gloo/NCCL group to interpreter shutdown
        dist.barrier()
        dist.destroy_process_group()
    return RegressionResult(spec, results, notes)


# ============================================================================ entry point
def run_regression(
    spec: RegressionSpec, *, on_step: Callable[[str, int], None] | None = None
) -> RegressionResult:
    """Run every mode of ``spec`` and return the results (see the module docstring).

    Launches ``spec.ep`` processes per mode itself, or, under ``torchrun``, uses the current processes
    (then every rank returns the same result; print it on rank 0).

    Args:
        spec: what to run (validated here).
        on_step: called as ``on_step(mode, step)`` after each completed step (rank 0), e.g. for a
            progress bar.

    Raises:
        ValueError: an invalid spec.
    """
    spec.validate()
    notes: list[str] = []
    if under_torchrun():
        result = _run_under_torchrun(spec, on_step, notes)
    else:
        mp_ctx = _mp_context(spec.device)
        modes: dict[str, ModeResult] = {}
        with tempfile.TemporaryDirectory(prefix="fla-ac-regress-") as workdir:
            for mode in spec.ordered_modes:
                modes[mode] = _launch_mode(mp_ctx, spec, mode, workdir, notes, on_step)
        result = RegressionResult(spec, modes, notes)
    result.environment = _environment()
    return result


def _environment() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    env = {"torch": torch.__version__}
    for dist_name in ("fla-core", "flash-linear-attention", "torchtitan", "transformers", "triton"):
        with contextlib.suppress(PackageNotFoundError):
            env[dist_name] = version(dist_name)
    return env

