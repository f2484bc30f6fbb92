"""Context parallelism (CP=2) on a CPU: two Qwen3.5-MoE Gated DeltaNet mixers under AC, against CP=1.

Two gloo ranks share one packed batch of 128 tokens, cut by FLA's zigzag layout: documents cross the
cuts, one is empty, and rank 1 holds no document start. The model is an embedding, two pre-norm blocks
(``Qwen3_5MoeGatedDeltaNet(config, i, backend="fla")``, then a dense MLP in place of the MoE) and an output
head. ``backend="fla"`` runs FLA's CP conv and gated delta rule, which pass the conv history and the
recurrent state between the ranks. Each rank:

1. builds ``seqlens = CPSeqlens.from_seq_lens(DOC_LENS, cp=CPConfig(group=..., layout="zigzag",
   conv_kernel_size=4))`` from the GLOBAL document lengths: FLA's CP context, once per batch, from host
   offsets;
2. takes its 64 tokens of the batch with ``shard_packed_batch`` (labels shifted before the cut);
3. runs one forward and backward with both blocks checkpointed under the ``save_all_copies`` SAC policy
   (each mixer calls ``seqlens.local()`` inside its region: a fresh context per layer call);
4. sums every parameter gradient over the CP group (the caller's reduction: FLA completes only the
   per-token gradients) and divides the loss by the GLOBAL number of targets.

The ranks run three steps from the same weights and batch: CP=2 without AC, CP=2 ``isolated`` (the
steps above), and CP=2 ``field``. ``field`` is UNSAFE, on purpose: every layer builds FLA's CP context
inside its forward from the batch's one ``cu_seqlens``, as models do
(``fla_ac_isolation.harness.modes.FieldCPSeqlens``). The parent process runs CP=1: the whole batch in one
process, no AC, the pure-torch reference ops. Expected (torch 2.13, fla-core 0.6.0):

* ``isolated`` equals CP=2 without AC bit for bit, and CP=1 within float32 rounding (gradients within
  about 1e-7);
* ``field`` fails on both ranks with ``RuntimeError: Autograd not support dtype: Long``: block 0 misses
  FLA's cache in its forward and hits it in its recompute, so SAC hands a later cast FLA's int64 offsets.
  The norms compute in float64 (as a bf16 model's norms compute in float32), which gives each block the
  casts that ``save_all_copies`` saves.

On a CPU, FLA's CP kernels need two things, both in place in each rank before its first step:

* ``TRITON_INTERPRET=1``, so that Triton's interpreter runs FLA's kernels on the CPU (slowly: hence the
  tiny shapes). Triton reads it when it is first imported, so it is set at the top of this file; the
  ranks inherit it and re-import this file first.
* ``fla_ac_isolation.harness.fla_seam.interpreter.cpu_cp_kernels()``, entered by each rank: the seam's interpreter
  backend (what ``fla-ac-isolation regress --cp 2`` enters on a CPU too). FLA's CP code refuses non-CUDA
  devices and gloo rejects its all-gather layout; inside the ``with`` block the backend patches both (and
  the interpreter's autotuning, loop variables and comparison dtype). It exists only to run FLA's CP
  kernels on a CPU. On GPUs with NCCL, leave out both it and ``TRITON_INTERPRET``; the rest is unchanged
  apart from the device (the GPU form is in docs/context-parallel.md).

Run: ``python examples/context_parallel.py`` (about 22 s on a 2-core CPU; it spawns its two ranks itself).
"""

from __future__ import annotations

import os

# FIRST, before anything imports Triton (torch._dynamo does, and fla_ac_isolation imports that): Triton reads
# TRITON_INTERPRET when it is imported. Set here, it holds in this process and in the two ranks it spawns
# (each inherits it and re-imports this file before running its rank). Leave it out on GPUs.
os.environ["TRITON_INTERPRET"] = "1"

import argparse
import datetime
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5MoeTextConfig

from fla_ac_isolation import LayerLocalSeqlens, PackedSeqlens
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.fla_seam.interpreter import cpu_cp_kernels  # FLA's CP kernels on a CPU (the interpreter)
from fla_ac_isolation.harness.modes import FieldCPSeqlens
from fla_ac_isolation.mixers import Qwen3_5MoeGatedDeltaNet
from fla_ac_isolation.parallel import CPConfig, CPSeqlens, shard_packed_batch
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies

DOC_LENS = [10, 0, 20, 70, 28]  # 128 tokens; zigzag: rank 0 holds tokens 0-31 and 96-127, rank 1 tokens 32-95
VOCAB, HIDDEN, WORLD = 128, 32, 2
RUNS = {"CP=2, no AC": "no-ac", "CP=2, isolated, SAC save_all_copies": "isolated",
        "CP=2, field (unsafe), SAC save_all_copies": "field"}


class RMSNorm(nn.Module):
    """RMSNorm computed in float64, as a bf16 model's norm computes in float32 (transformers' Qwen RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float64)
        return (self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Block(nn.Module):
    """A Qwen3.5 linear-attention block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))`` (dense, for the MoE)."""

    def __init__(self, config: Qwen3_5MoeTextConfig, layer_idx: int, backend: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.mixer = Qwen3_5MoeGatedDeltaNet(config, layer_idx, backend=backend)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN, bias=False), nn.SiLU(),
                                 nn.Linear(2 * HIDDEN, HIDDEN, bias=False))

    def forward(self, x: torch.Tensor, seqlens: PackedSeqlens) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x), seqlens)  # the mixer takes seqlens.local() inside (this block's region)
        return x + self.mlp(self.norm2(x))


class TinyModel(nn.Module):
    """Embedding -> 2 blocks -> head: ``input_ids [1, T] -> logits [1, T, VOCAB]``; the same weights everywhere."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, linear_num_key_heads=1, linear_num_value_heads=1,
                                      linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(config, i, backend) for i in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, seqlens: PackedSeqlens) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, seqlens)
        return self.head(x)


def global_batch() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``input_ids [1, T]``, ``labels [1, T]`` (next-token targets, -100 at each document's end), host offsets."""
    offsets = [0, *torch.tensor(DOC_LENS).cumsum(0).tolist()]
    input_ids = torch.randint(0, VOCAB, (1, offsets[-1]), generator=torch.Generator().manual_seed(1))
    labels = input_ids.roll(-1, dims=1)
    labels[0, [end - 1 for end in offsets[1:]]] = -100
    return input_ids, labels, offsets


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}


def _largest_diff(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((grads[n] - g).abs().max().item() for n, g in reference.items())


def cp1_step() -> tuple[float, dict[str, torch.Tensor]]:
    """CP=1: the whole batch in one process, no AC, the pure-torch reference ops."""
    model = TinyModel("reference")
    input_ids, labels, _ = global_batch()
    logits = model(input_ids, LayerLocalSeqlens.from_seq_lens(DOC_LENS))
    loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100)
    loss.backward()
    return loss.item(), _grads(model)


def cp2_step(mode: str, group: dist.ProcessGroup) -> tuple[float, dict[str, torch.Tensor]]:
    """One CP=2 step on this rank (``mode``: ``no-ac``, ``isolated`` or ``field``): the loss and gradients summed."""
    model = TinyModel("fla")                                            # FLA's CP kernels
    if mode != "no-ac":
        checkpoint_layers(model.layers, mode="selective", policy=save_all_copies())
    input_ids, labels, offsets = global_batch()                         # the GLOBAL batch, labels already shifted
    cp = CPConfig(group=group, layout="zigzag", conv_kernel_size=4)     # the model's (widest) conv width
    shard = shard_packed_batch({"input_ids": input_ids, "labels": labels}, offsets, cp)
    seqlens_class = FieldCPSeqlens if mode == "field" else CPSeqlens
    seqlens = seqlens_class.from_seq_lens(DOC_LENS, cp=cp)              # GLOBAL document lengths
    logits = model(shard.tensors["input_ids"], seqlens)                 # this rank's 64 tokens
    num_targets = (labels != -100).sum()                                # GLOBAL count, the same on every rank
    loss = F.cross_entropy(logits[0], shard.tensors["labels"][0], ignore_index=-100, reduction="sum") / num_targets
    loss.backward()
    for p in model.parameters():                                        # the caller's reduction: SUM over CP
        dist.all_reduce(p.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item(), _grads(model)


def _rank(rank: int, port: int, reference: dict[str, torch.Tensor], queue) -> None:
    """One CP rank (spawned): the interpreter, a gloo group, the seam's interpreter backend, then the three
    CP=2 steps."""
    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    group, results, no_ac = dist.group.WORLD, {}, None
    try:
        with cpu_cp_kernels():
            for name, mode in RUNS.items():
                try:
                    loss, grads = cp2_step(mode, group)
                except Exception as err:
                    if mode != "field":
                        raise
                    errors = [None] * WORLD                             # the unsafe mode: every rank's error
                    dist.all_gather_object(errors, first_line(err), group=group)
                    results[name] = {"errors": errors}
                    continue
                no_ac = grads if mode == "no-ac" else no_ac
                results[name] = {"loss": loss, "max_grad_diff_cp1": _largest_diff(grads, reference),
                                 "max_grad_diff_no_ac": _largest_diff(grads, no_ac)}
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    """Run CP=1 here and the CP=2 steps on two spawned ranks; print and return ``{run: result}``."""
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cp1_loss, cp1_grads = cp1_step()
    finally:
        torch.set_num_threads(threads)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(_free_port(), cp1_grads, queue), nprocs=WORLD, join=True)
    runs = queue.get()

    input_ids, _, offsets = global_batch()
    local = [shard_packed_batch({"x": input_ids}, offsets, CPConfig(world_size=WORLD, rank=r, layout="zigzag",
                                                                    conv_kernel_size=4)).cu_seqlens.tolist()
             for r in range(WORLD)]
    largest = max(g.abs().max().item() for g in cp1_grads.values())
    print(f"CP=2 over {WORLD} gloo ranks, zigzag layout; 2 Qwen3.5-MoE GDN mixers, backend fla (FLA's CP kernels "
          "under Triton's interpreter)")
    print(f"documents {DOC_LENS} ({offsets[-1]} tokens); local offsets: rank 0 {local[0]}, rank 1 {local[1]}")
    print(f"  {'CP=1, no AC (reference ops)':42s} loss {cp1_loss:.8f}  largest gradient {largest:.4g}")
    for name, run in runs.items():
        if "errors" in run:
            ranks = "both ranks" if run["errors"][0] == run["errors"][1] else f"rank 1: {run['errors'][1]}"
            print(f"  {name:42s} raised {run['errors'][0]} ({ranks})")
        else:
            print(f"  {name:42s} loss {run['loss']:.8f}  max |grad - CP=1| {run['max_grad_diff_cp1']:.3g}  "
                  f"max |grad - CP=2 no AC| {run['max_grad_diff_no_ac']}")
    return {"CP=1, no AC": {"loss": cp1_loss, "largest_grad": largest}, **runs}


if __name__ == "__main__":
    main()
