"""Pipeline parallelism (PP=2) on a CPU: the 2-layer GDN + MoE model of ``own_model.py`` split into two stages run by
``torch.distributed.pipelining`` (1F1B, 4 microbatches) on two gloo ranks, under selective AC.

This is *user* code around torch's pipelining. The three things that make it safe:

* ``split_packed_microbatches`` cuts the packed batch into microbatches of whole documents, all padded to one
  token count (torch fixes the stages' activation shapes at their first step), each with its own offsets row;
* the ``[M, W]`` offsets go to ``schedule.step(..., cu_seqlens=offsets)``: torch chunks tensor keywords on dim 0,
  so every stage call receives its microbatch's ``[1, W]`` row;
* ``Stage.forward`` builds one ``LayerLocalSeqlens`` per call from that row; each layer's mixer calls ``.local()``.

It trains one step three ways on both ranks (one launch; each mode builds its stages and schedule afresh):
``no-ac``; ``isolated`` (the above, SAC ``save_all_copies``); ``shared`` (the same, but every layer of a stage
gets one ``SharedSeqlens``: what passing one offsets tensor to a stage's layers does). Each rank compares its
stage's gradients with ``no-ac``; the parent compares them with one process training the whole batch without PP.

Run: ``python examples/pipeline_parallel.py`` (a few seconds on a 2-core CPU).
"""

from __future__ import annotations

import datetime
import itertools
import multiprocessing
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")  # FLA's notice on CPU-only machines
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from own_model import TinyGDNMoE  # noqa: E402  (the model of examples/own_model.py)

from fla_ac_isolation import LayerLocalSeqlens  # noqa: E402
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache  # noqa: E402
from fla_ac_isolation.harness.modes import SharedSeqlens  # noqa: E402
from fla_ac_isolation.parallel import microbatch_seqlens, split_packed_microbatches  # noqa: E402
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies  # noqa: E402

DOC_LENS = [70, 0, 23, 41, 9, 33, 5, 17]  # 198 tokens, one zero-length document
MICROBATCHES = 4


class Stage(nn.Module):
    """Layers ``first..last`` of the model (+ its embedding on stage 0, its norm and head on the last stage)."""

    def __init__(self, model: TinyGDNMoE, index: int, seqlens_class=LayerLocalSeqlens) -> None:
        super().__init__()
        self.index, self.seqlens_class = index, seqlens_class
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleDict({str(index): model.layers[index]})  # the model's own names: layers.1...
        self.norm, self.head = (model.norm, model.head) if index == 1 else (None, None)

    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor) -> torch.Tensor:
        # ONE seqlens per stage call, from this microbatch's [1, W] offsets row; each layer calls .local()
        seqlens = microbatch_seqlens(cu_seqlens, x.shape[1], seqlens_class=self.seqlens_class)
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h, seqlens)
        return self.head(self.norm(h)) if self.head is not None else h


def batch() -> tuple[dict[str, torch.Tensor], list[int], int]:
    """The packed batch: ``input_ids`` and next-token ``labels`` ``[1, T]`` (-100 at each document's end)."""
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 128, (n,), generator=gen) for n in DOC_LENS]
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs if d.numel()])
    offsets = [0, *itertools.accumulate(DOC_LENS)]
    return {"input_ids": torch.cat(docs)[None], "labels": labels[None]}, offsets, int((labels != -100).sum())


def rank_step(rank: int, mode: str) -> dict:
    """One step of ``mode`` on this rank's stage: ``{"loss" (last stage), "grads"}``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    model = TinyGDNMoE()
    if mode != "no-ac":
        checkpoint_layers(model, mode="selective", policy=save_all_copies())
    stage = Stage(model, rank, SharedSeqlens if mode == "shared" else LayerLocalSeqlens)
    tensors, offsets, targets = batch()
    mbs = split_packed_microbatches(tensors, offsets, MICROBATCHES)  # labels padded with -100

    def loss_fn(logits, labels):  # a microbatch's token sum over the whole batch's targets
        return F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum") / targets

    schedule = Schedule1F1B(PipelineStage(stage, rank, 2, torch.device("cpu")), n_microbatches=MICROBATCHES,
                            loss_fn=loss_fn, scale_grads=False)
    losses: list = []
    clear_tensor_cache()
    schedule.step(*([mbs.tensors["input_ids"]] if rank == 0 else []), target=mbs.tensors["labels"] if rank else None,
                  losses=losses, cu_seqlens=mbs.cu_seqlens)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in stage.named_parameters()}
    return {"loss": float(sum(x.item() for x in losses)) if rank else None, "grads": grads}


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    for mode in ("no-ac", "isolated", "shared"):  # shared last: a failing peer ends the other rank's wait
        try:
            results.put((rank, mode, rank_step(rank, mode)))
        except Exception as err:
            results.put((rank, mode, {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"}))
            break
    results.close()
    results.join_thread()  # what this rank put is sent
    os._exit(0)  # leave at once: a peer still waiting for this rank gets a connection error, not a timeout


def whole_batch() -> tuple[float, dict[str, torch.Tensor]]:
    """One process, no PP, no microbatches, no AC: the loss and gradients of the whole batch."""
    torch.manual_seed(0)
    model = TinyGDNMoE()
    tensors, offsets, targets = batch()
    logits = model(tensors["input_ids"], LayerLocalSeqlens(torch.tensor(offsets, dtype=torch.int32)))
    loss = F.cross_entropy(logits[0], tensors["labels"][0], ignore_index=-100, reduction="sum") / targets
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def main() -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # the parent has only imported: forking is safe and fast
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    runs: dict[str, dict[int, dict]] = {}
    while sum(len(v) for v in runs.values()) < 6:
        try:
            rank, mode, out = results.get(timeout=120)
        except Exception:
            break
        runs.setdefault(mode, {})[rank] = out
    for p in procs:
        p.join(10)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    whole_loss, whole = whole_batch()
    torch.set_num_threads(threads)
    print(f"PP=2 over 2 gloo ranks, Schedule1F1B, {MICROBATCHES} microbatches; SAC save_all_copies; documents "
          f"{DOC_LENS} ({sum(DOC_LENS)} tokens)")
    _, offsets, _ = batch()
    mbs = split_packed_microbatches({}, offsets, MICROBATCHES)
    print(f"microbatches (whole documents, padded to {mbs.tokens} tokens): {[list(s) for s in mbs.seq_lens]}")
    largest = max(g.abs().max().item() for g in whole.values())
    print(f"  {'no PP':9s} loss {whole_loss:.8f}  largest gradient {largest:.3g}  "
          "(one process, the whole batch, no AC)")
    summary = {"no PP": {"loss": whole_loss, "largest": largest}}
    for mode in ("no-ac", "isolated", "shared"):
        ranks = runs.get(mode, {})
        errors = {r: o["error"] for r, o in ranks.items() if "error" in o}  # in order of arrival: the cause first
        if errors or len(ranks) < 2:
            first = next(iter(errors), None)
            then = " and its peer lost the connection" if len(errors) > 1 else ""
            text = f"raised {errors[first]} (rank {first}{then})" if errors else "did not finish"
            summary[mode] = {"error": errors.get(first)}
        else:
            grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
            ref = {**runs["no-ac"][0]["grads"], **runs["no-ac"][1]["grads"]}
            vs_no_ac = max((grads[n] - ref[n]).abs().max().item() for n in ref)
            vs_whole = max((grads[n] - whole[n]).abs().max().item() for n in whole)
            text = f"loss {ranks[1]['loss']:.8f}  max |grad - no-ac| {vs_no_ac:.3g}  max |grad - no PP| {vs_whole:.2g}"
            summary[mode] = {"loss": ranks[1]["loss"], "vs_no_ac": vs_no_ac, "vs_whole": vs_whole}
        print(f"  {mode:9s} {text}")
    return summary


if __name__ == "__main__":
    main()
