"""Context parallelism (CP=2) on a CPU: two gloo ranks running FLA's CP kernels under ``TRITON_INTERPRET=1``.

Run by ``tests/test_context_parallel_gloo.py`` in a fresh process: ``TRITON_INTERPRET`` must be set before
FLA's kernels are decorated. The parent imports everything, then forks two rank processes (no import
cost per rank) that join a gloo group (with a timeout, so that a rank waiting in a collective for a peer
that raised cannot hang the test) and enter ``fla_ac_isolation.harness.fla_seam.interpreter.cpu_cp_kernels``. One
launch runs every case; rank 0 reports all of them as one JSON object on the last line of stdout, with
the CPU seconds each case took on rank 0. References are independent: CP=1 with the pure-torch reference
backend (mixers) or the regression's one-rank run (decoders).

    TRITON_INTERPRET=1 python tests/cp_cases.py
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import sys
import time
import traceback
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import multiprocessing  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import FAMILIES  # noqa: E402

import fla_ac_isolation.harness.regression._preload  # noqa: E402,F401  (torchtitan, transformers, FLA)
from fla_ac_isolation import LayerLocalSeqlens  # noqa: E402
from fla_ac_isolation.harness.failures import first_line  # noqa: E402
from fla_ac_isolation.harness.regression.spec import CP1_REFERENCE, RegressionSpec  # noqa: E402
from fla_ac_isolation.parallel import CPConfig, CPSeqlens, gather_unshard, shard_packed_batch  # noqa: E402

# documents crossing the cuts, a zero-length document, and rank 1 holding no document start, per layout
LENS = {"contiguous": [10, 0, 30, 88], "zigzag": [10, 0, 20, 70, 28]}
TIMEOUT_S = 90


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _offsets(lens: list[int]) -> list[int]:
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


def _rank_facts(shard, cp: CPConfig) -> dict:
    """What each rank holds: its local offsets and whether a document starts on it (all ranks)."""
    mine = {"local_cu_seqlens": shard.cu_seqlens.tolist(), "doc_start": bool((shard.position_ids == 0).any())}
    facts = [None] * cp.world_size
    dist.all_gather_object(facts, mine, group=cp.group)
    return {"local_cu_seqlens": [f["local_cu_seqlens"] for f in facts], "doc_start": [f["doc_start"] for f in facts]}


def case_mixer(name: str, layout: str, cp_backend: str = "fla", n_groups: int | None = None) -> dict:
    """A whole mixer under CP=2 (its CP path) against CP=1 on the reference backend: output, input
    gradient, and every parameter gradient summed over the CP ranks (also the conv weight's without the sum).
    ``n_groups`` overrides Nemotron-H's B/C groups (1: both ranks read the one group)."""
    family, lens = FAMILIES[name], LENS[layout]
    cp = CPConfig(group=dist.group.WORLD, layout=layout, conv_kernel_size=4)
    if n_groups is not None:
        config = family.config()
        config.n_groups = n_groups
        family = dataclasses.replace(family, config=lambda: config)
    reference, sharded = family.build(seed=3, backend="reference"), family.build(seed=3, backend=cp_backend)
    if hasattr(reference, "A_log") and name != "nemotron_h":  # see tests/interpret_cases.py: float32 decay range
        with torch.no_grad():
            for mixer in (reference, sharded):
                mixer.A_log.copy_(torch.linspace(-2.0, 0.0, mixer.A_log.numel()))
    whole = LayerLocalSeqlens.from_seq_lens(lens)
    tokens = whole.num_tokens
    x = 0.5 * torch.randn(1, tokens, reference.hidden_size, generator=torch.Generator().manual_seed(4))
    weight = torch.cos(torch.arange(x.numel(), dtype=torch.float32)).reshape(x.shape)

    x1 = x.clone().requires_grad_()
    out1 = reference(x1, whole)
    (out1 * weight).sum().backward()

    shard = shard_packed_batch({"x": x, "weight": weight}, _offsets(lens), cp)
    x2 = shard.tensors["x"].clone().requires_grad_()
    out2 = sharded(x2, CPSeqlens.from_seq_lens(lens, cp=cp))
    (out2 * shard.tensors["weight"]).sum().backward()

    result = {"output": _error(gather_unshard(out2.detach(), cp), out1.detach()),
              "dx": _error(gather_unshard(x2.grad, cp), x1.grad), "grads": {}, **_rank_facts(shard, cp)}
    reference_grads = dict(reference.named_parameters())
    for pname, p in sharded.named_parameters():
        local = p.grad.clone()
        if pname == "conv1d.weight":
            result["conv1d.weight_without_sum"] = _error(local, reference_grads[pname].grad)
        dist.all_reduce(local, group=cp.group)  # what the regression's data-parallel reduction does
        result["grads"][pname] = _error(local, reference_grads[pname].grad)
    return result


def _decoder_spec(family: str, layout: str, modes: tuple[str, ...]) -> RegressionSpec:
    return RegressionSpec(
        model=family, ep=2, cp=2, cp_layout=layout, steps=1, backend="fla", hidden_size=32, num_layers=2,
        num_experts=4, top_k=2, modes=modes, timeout_s=TIMEOUT_S,
    ).validate()


def _audit_findings(audit) -> dict:
    """ReplayAudit's verdict: every region aligned, or the first divergent one (label, op index, FLA helpers)."""
    divergent = audit.divergent
    if not divergent:
        return {"ok": audit.ok, "regions": len(audit.regions)}
    first = divergent[0]
    return {"ok": audit.ok, "label": first.label, "first_diff": first.first_diff,
            "fla": [f"{c.helper} {c.forward}->{c.recompute}" for c in first.fla]}


def case_decoder(family: str, layout: str, modes: tuple[str, ...]) -> dict:
    """The regression's own per-rank loop (``run_mode_on_rank``) on a 2-block decoder (GDN + MoE, attention
    + MoE) under CP=2 x EP=2 (torchtitan's MoE, experts sharded over the CP ranks): the one-rank run without
    CP on rank 0 as the reference, then every mode under ``ReplayAudit`` (recording); an unsafe mode's
    exception is recorded per rank."""
    from fla_ac_isolation import ReplayAudit
    from fla_ac_isolation.harness.regression.mesh import ParallelMesh
    from fla_ac_isolation.harness.regression.train import RankContext, run_mode_on_rank

    spec = _decoder_spec(family, layout, modes)
    rank = dist.get_rank()
    ctx = RankContext.create(rank, spec.mesh, torch.device("cpu"))
    holder = [None]
    if rank == 0:
        one_rank = RankContext.create(0, ParallelMesh(), torch.device("cpu"))
        cp1, cp1_grads = run_mode_on_rank(spec, CP1_REFERENCE, one_rank, None)
        holder = [(cp1.losses, cp1_grads)]
    dist.broadcast_object_list(holder, src=0)
    cp1_losses, cp1_grads = holder[0]
    out = {CP1_REFERENCE: {"losses": cp1_losses}}
    reference = None
    for mode in spec.ordered_modes[1:]:
        audit = ReplayAudit(on_divergence="record")
        try:
            with audit:
                result, grads = run_mode_on_rank(spec, mode, ctx, reference, cp1_reference=cp1_grads)
            reference = grads if mode == "no-ac" else reference
            out[mode] = {"losses": result.losses, "grad_diffs": result.grad_diffs,
                         "cp1_grad_diffs": result.cp1_grad_diffs, "cp1_ref_grad_max": result.cp1_ref_grad_max}
        except Exception as err:  # the unsafe modes: every rank's error, exactly
            errors = [None, None]
            dist.all_gather_object(errors, first_line(err))
            out[mode] = {"errors": errors}
        out[mode]["audit"] = _audit_findings(audit)
    return out


def case_errors() -> dict:
    """Errors that need a real process group (the others are tested in one process)."""
    found = {}
    for key, kwargs in {"group_size": {"world_size": 3}, "rank": {"rank": 1 - dist.get_rank()}}.items():
        try:
            CPConfig(group=dist.group.WORLD, **kwargs)
            found[key] = None
        except ValueError as err:
            found[key] = str(err)
    return found


CASES = [
    ("qwen3_5_moe_mixer_contiguous", lambda: case_mixer("qwen3_5_moe", "contiguous")),
    ("qwen3_5_moe_mixer_zigzag", lambda: case_mixer("qwen3_5_moe", "zigzag")),
    ("qwen3_8_mixer_contiguous", lambda: case_mixer("qwen3_8", "contiguous")),
    ("qwen3_8_mixer_zigzag", lambda: case_mixer("qwen3_8", "zigzag")),
    ("nemotron_h_head_parallel_contiguous", lambda: case_mixer("nemotron_h", "contiguous", "reference")),
    ("nemotron_h_head_parallel_zigzag", lambda: case_mixer("nemotron_h", "zigzag", "reference")),
    ("nemotron_h_head_parallel_one_group", lambda: case_mixer("nemotron_h", "zigzag", "reference", n_groups=1)),
    ("qwen3_5_moe_decoder_zigzag", lambda: case_decoder("qwen3_5_moe", "zigzag", ("shared", "isolated", "field"))),
    ("qwen3_8_decoder_contiguous", lambda: case_decoder("qwen3_8", "contiguous", ("isolated", "field"))),
    ("errors", case_errors),
]


def _worker(rank: int, port: int, names: list[str], queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        from fla_ac_isolation.harness.fla_seam.interpreter import cpu_cp_kernels
        from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan

        ensure_torch_compat()
        setup_torchtitan("cpu")
        results = {}
        with cpu_cp_kernels():
            for name, run in CASES:
                if name not in names:
                    continue
                start = time.process_time()
                results[name] = run()
                results[name]["cpu_seconds"] = round(time.process_time() - start, 2)
                dist.barrier()
        if rank == 0:
            queue.put(("result", results))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        queue.close()
        queue.join_thread()
        os._exit(1)


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else [name for name, _ in CASES]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = multiprocessing.get_context("fork")  # ranks inherit the imports: no second import of torch & co.
    queue = mp.Queue()
    procs = [mp.Process(target=_worker, args=(r, port, names, queue), daemon=True) for r in range(2)]
    start = time.time()
    for p in procs:
        p.start()
    kind, payload = queue.get(timeout=len(names) * 4 * TIMEOUT_S)
    for p in procs:
        p.join(10 if kind == "result" else 2)
        if p.is_alive():
            p.kill()
    if kind == "error":
        print(payload, file=sys.stderr)
        raise SystemExit(1)
    payload["wall_seconds"] = round(time.time() - start, 1)
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
