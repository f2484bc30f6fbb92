"""One rank trains one mode: build the model, run ``spec.steps`` AdamW steps, reduce the non-expert gradients over
ranks and compare every gradient with the reference's of the same rank and step (under CP or PP also with the
one-rank run without them). Reported numbers are all-reduced."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fla_ac_isolation.fla_seam.cache import clear_tensor_cache, probe_tensor_cache
from fla_ac_isolation.harness.modes import Mode, get_mode
from fla_ac_isolation.harness.regression.data import (
    PackedBatch,
    cp_batch,
    global_batch,
    pp_batch,
    pp_global_batch,
    pp_microbatch_tokens,
    rank_batch,
)
from fla_ac_isolation.harness.regression.expert_parallel import (
    apply_expert_parallel,
    is_expert_param,
)
from fla_ac_isolation.harness.regression.model import ModelSize, build_model
from fla_ac_isolation.harness.regression.pipeline import PipelineRun, build_pipeline, pipeline_step
from fla_ac_isolation.harness.regression.rank import RankContext, all_reduce, setup_process
from fla_ac_isolation.harness.regression.spec import CP1_REFERENCE, DTYPES, PP1_REFERENCE, ModeResult, RegressionSpec
from fla_ac_isolation.harness.spec_fields import sac_policy
from fla_ac_isolation.parallel import CPConfig, shard_packed_batch, split_packed_microbatches
from fla_ac_isolation.policies import checkpoint_layers

__all__ = ["RankContext", "all_reduce", "run_mode_on_rank", "setup_process"]


@dataclass
class _Trainee:
    """The model of one mode on one rank, with its optimizer and its parameters split by reduction."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    dense: list[torch.Tensor]  # replicated: summed over ranks
    experts: list[torch.Tensor]  # expert-parallel shards: complete on their rank
    pipeline: PipelineRun | None = None  # under PP: this rank's stages and the schedule
    microbatch_tokens: int = 0  # under PP: the one token count of every microbatch

    def moes(self) -> list[torch.nn.Module]:
        """The MoE modules this rank runs."""
        return self.pipeline.moes() if self.pipeline is not None else self.model.moes()

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` of what this rank trains, under the decoder's names."""
        if self.pipeline is not None:
            return self.pipeline.named_parameters()
        return [(n.replace("._checkpoint_wrapped_module", ""), p) for n, p in self.model.named_parameters()]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _build_trainee(spec: RegressionSpec, mode: Mode, ctx: RankContext) -> _Trainee:
    size = ModelSize(spec.hidden_size, spec.num_layers, spec.num_experts, spec.top_k)
    torch.manual_seed(spec.seed)
    expert_parallel = ctx.mesh.ep > 1
    model = build_model(spec.model, size, backend=spec.backend, ep_enabled=expert_parallel, mixer=spec.mixer,
                        mixer_config=spec.mixer_config)
    model.to(device=ctx.device, dtype=DTYPES[spec.dtype])
    if expert_parallel:
        apply_expert_parallel(model.moes(), ctx.dims)
    if mode.checkpointed:
        policy = sac_policy(spec.ac, spec.policy)
        checkpoint_layers(model, mode=spec.ac, policy=policy, freq=spec.freq, early_stop=spec.early_stop)
    model.train()
    pipeline, tokens = None, 0
    if ctx.mesh.pp > 1:
        pipeline = build_pipeline(
            model, schedule=spec.schedule, pp_rank=ctx.coordinates["pp"], pp=ctx.mesh.pp,
            microbatches=spec.microbatches, seqlens_class=mode.seqlens_class, device=ctx.device, group=ctx.pp_group,
        )
        tokens = pp_microbatch_tokens(spec.steps, ctx.mesh.dp, spec.microbatches)
    params = [p for p in (pipeline.parameters() if pipeline else model.parameters()) if p.requires_grad]
    return _Trainee(
        model=model,
        optimizer=torch.optim.AdamW(params, lr=spec.lr, foreach=False),
        params=params,
        dense=[p for p in params if not is_expert_param(p)],
        experts=[p for p in params if is_expert_param(p)],
        pipeline=pipeline,
        microbatch_tokens=tokens,
    )


def _batch(spec: RegressionSpec, step: int, ctx: RankContext) -> PackedBatch:
    data_ranks = spec.data_ranks or spec.ep
    vocab = ModelSize().vocab_size
    if spec.pp > 1:  # this data-parallel rank's batch (cut into microbatches), or every rank's (PP1_REFERENCE)
        if ctx.mesh.pp == 1:
            return pp_global_batch(step, spec.mesh.dp, seed=spec.seed, vocab_size=vocab)
        return pp_batch(step, ctx.coordinates["dp"], ctx.mesh.dp, seed=spec.seed, vocab_size=vocab)
    if spec.cp > 1:  # one global batch, sharded in _rank_inputs (or whole, for the CP1_REFERENCE run)
        parts = CPConfig(world_size=spec.cp, rank=0, layout=spec.cp_layout).num_parts
        return cp_batch(step, layout=spec.cp_layout, multiple=parts, seed=spec.seed, vocab_size=vocab)
    if ctx.mesh.dp == 1:
        return global_batch(step, data_ranks, seed=spec.seed, vocab_size=vocab)
    return rank_batch(step, ctx.coordinates["dp"], data_ranks, seed=spec.seed, vocab_size=vocab)


def _rank_inputs(spec: RegressionSpec, mode: Mode, ctx: RankContext, trainee: _Trainee, batch: PackedBatch):
    """``(input_ids, labels, seqlens)`` of this rank: the batch, or its CP shard and CP seqlens."""
    if ctx.mesh.cp == 1:
        return batch.input_ids, batch.labels, mode.from_seq_lens(batch.seq_lens, device=ctx.device)
    cp = CPConfig(group=ctx.cp_group, layout=spec.cp_layout, conv_kernel_size=trainee.model.conv_kernel_size)
    offsets = torch.tensor(batch.seq_lens).cumsum(0).tolist()
    shard = shard_packed_batch({"input_ids": batch.input_ids, "labels": batch.labels}, [0, *offsets], cp)
    seqlens = mode.from_seq_lens(batch.seq_lens, device=ctx.device, cp=cp)
    return shard.tensors["input_ids"], shard.tensors["labels"], seqlens


def _forward_backward(
    spec: RegressionSpec, mode: Mode, ctx: RankContext, trainee: _Trainee, batch: PackedBatch
) -> tuple[torch.Tensor, float, dict[str, dict[str, int]]]:
    """One forward and backward: ``(loss, slowest rank's seconds, FLA cache counts per helper)``."""
    if trainee.pipeline is None:
        input_ids, labels, seqlens = _rank_inputs(spec, mode, ctx, trainee, batch)
        input_ids, labels = input_ids.to(ctx.device), labels.to(ctx.device)
    else:
        offsets = [0, *torch.tensor(batch.seq_lens).cumsum(0).tolist()]
        microbatches = split_packed_microbatches({"input_ids": batch.input_ids, "labels": batch.labels}, offsets,
                                                 spec.microbatches, tokens=trainee.microbatch_tokens)
    clear_tensor_cache()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    started = time.perf_counter()
    with probe_tensor_cache() as probe, mode.cache_context(), torch.utils.checkpoint.set_checkpoint_early_stop(
        spec.early_stop
    ):
        if trainee.pipeline is None:
            logits = trainee.model(input_ids, seqlens)
            loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum") / batch.num_targets_global
        _maybe_fail(spec, mode, ctx)  # under PP: before the schedule runs (its peers then wait and are stopped)
        if trainee.pipeline is None:
            loss.backward()
        else:
            loss = pipeline_step(trainee.pipeline, microbatches, batch.num_targets_global)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = torch.tensor([time.perf_counter() - started], device=ctx.device)
    all_reduce(seconds, ctx, op="max", everyone=True)
    return loss, float(seconds[0]), probe.by_helper()


def _maybe_fail(spec: RegressionSpec, mode: Mode, ctx: RankContext) -> None:
    """``spec.fail_on``: raise on the chosen rank of the chosen mode."""
    if spec.fail_on is not None and tuple(spec.fail_on[:2]) == (mode.name, ctx.rank):
        default = f"injected failure on rank {ctx.rank} in mode {mode.name!r} (RegressionSpec.fail_on)"
        raise RuntimeError(spec.fail_on[2] if len(spec.fail_on) == 3 else default)


def _reduce_gradients(trainee: _Trainee, ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the dense gradients over ranks and write them back; return ``(dense, expert)`` flat."""
    for p in trainee.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    dense_flat = all_reduce(torch.cat([p.grad.reshape(-1).float() for p in trainee.dense]), ctx)
    offset = 0
    for p in trainee.dense:
        p.grad.copy_(dense_flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    expert_flat = (
        torch.cat([_local(p.grad).reshape(-1).float() for p in trainee.experts])
        if trainee.experts else dense_flat.new_zeros(0)
    )
    return dense_flat, expert_flat


def _full_flat(trainee: _Trainee) -> torch.Tensor:
    """Every parameter's complete gradient, in model order (expert shards gathered)."""
    from torch.distributed.tensor import DTensor

    return torch.cat([
        (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).reshape(-1).float() for p in trainee.params
    ])


def _compare(flat: torch.Tensor, reference: torch.Tensor | None, ctx: RankContext) -> tuple[float | None, float | None]:
    """``(max |grad - ref|, max |ref|)`` over all ranks, or ``(None, None)`` without a reference."""
    if reference is None:
        return None, None
    ref = reference.to(flat.device)
    if ref.shape == flat.shape:
        maxes = torch.stack([(flat - ref).abs().max(), ref.abs().max()])
    else:
        maxes = torch.tensor([float("inf"), 0.0], device=flat.device)
    all_reduce(maxes, ctx, op="max", everyone=True)
    return float(maxes[0]), float(maxes[1])


def _named_full_grads(trainee: _Trainee) -> dict[str, torch.Tensor]:
    """Every parameter's complete gradient by name, on the host."""
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().cpu().clone()
            for n, p in trainee.named_parameters()}


def _compare_by_name(trainee: _Trainee, reference: dict[str, torch.Tensor], ctx: RankContext) -> tuple[float, float]:
    """``(max |grad - ref|, max |ref|)`` by parameter name (a missing name or shape counts as infinite)."""
    diff, scale = 0.0, 0.0
    for name, grad in _named_full_grads(trainee).items():
        ref = reference.get(name)
        if ref is None or ref.shape != grad.shape:
            diff = float("inf")
            continue
        diff = max(diff, float((grad - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    maxes = all_reduce(torch.tensor([diff, scale], device=ctx.device), ctx, op="max", everyone=True)
    return float(maxes[0]), float(maxes[1])


def _idle_experts(trainee: _Trainee, ctx: RankContext) -> int:
    """The largest number of experts without any token in one MoE layer (all ranks); resets the counts."""
    moes = trainee.moes()  # under PP a rank's stages may hold none (Nemotron-H's Mamba2 and attention blocks)
    idle = torch.zeros(1, device=ctx.device)
    if moes:
        counts = all_reduce(torch.stack([m.tokens_per_expert_E.detach().float() for m in moes]), ctx)  # [L, E]
        for m in moes:
            m.tokens_per_expert_E.zero_()
        idle[0] = float((counts == 0).sum(-1).max())
    return int(all_reduce(idle, ctx, op="max", everyone=True)[0])


def _loss_and_norm(loss: torch.Tensor, dense_flat: torch.Tensor, expert_flat: torch.Tensor, trainee: _Trainee,
                   ctx: RankContext) -> tuple[float, float]:
    """The step's global loss and gradient norm, each gradient counted once."""
    loss = loss.detach().float().reshape(())
    if trainee.pipeline is None:
        stats = all_reduce(torch.stack([loss, expert_flat.pow(2).sum()]), ctx)
        return float(stats[0]), float((dense_flat.pow(2).sum() + stats[1]).sqrt())
    first = ctx.coordinates["dp"] == 0 and ctx.coordinates["cp"] == 0
    dense_sq = dense_flat.pow(2).sum() if first else dense_flat.new_zeros(())
    stats = all_reduce(torch.stack([loss, expert_flat.pow(2).sum() + dense_sq]), ctx, everyone=True)
    return float(stats[0]), float(stats[1].sqrt())


def _add_cache_counts(result: ModeResult, counts: dict[str, dict[str, int]]) -> None:
    for helper, by_outcome in counts.items():
        mine = result.cache_by_helper.setdefault(helper, {"hit": 0, "miss": 0, "bypass": 0})
        for outcome, n in by_outcome.items():
            mine[outcome] = mine.get(outcome, 0) + n
            result.cache[outcome] = result.cache.get(outcome, 0) + n


def run_mode_on_rank(
    spec: RegressionSpec,
    mode_name: str,
    ctx: RankContext,
    reference: list[torch.Tensor] | None,
    on_step: Callable[[int], None] | None = None,
    *,
    cp1_reference: list[torch.Tensor] | None = None,
    pp1_reference: list[dict[str, torch.Tensor]] | None = None,
) -> tuple[ModeResult, list[Any]]:
    """Train ``spec.steps`` steps of ``mode_name`` on this rank.

    Returns the mode's :class:`ModeResult` (global numbers; this rank's own FLA cache counts) and, for the
    reference modes, this rank's gradients per step (flat, or by name for :data:`~.spec.PP1_REFERENCE`).
    """
    mode = get_mode("no-ac" if mode_name in (CP1_REFERENCE, PP1_REFERENCE) else mode_name)
    trainee = _build_trainee(spec, mode, ctx)
    result = ModeResult(mode_name, cache={"hit": 0, "miss": 0, "bypass": 0})
    flat_grads: list[Any] = []
    for step in range(spec.steps):
        loss, seconds, cache_counts = _forward_backward(spec, mode, ctx, trainee, _batch(spec, step, ctx))
        result.step_seconds.append(seconds)
        _add_cache_counts(result, cache_counts)
        dense_flat, expert_flat = _reduce_gradients(trainee, ctx)
        flat = torch.cat([dense_flat, expert_flat])
        if mode_name == PP1_REFERENCE:
            flat_grads.append(_named_full_grads(trainee))
        elif not mode.checkpointed:  # the reference every other mode is compared with
            flat_grads.append(flat.cpu())
        global_loss, grad_norm = _loss_and_norm(loss, dense_flat, expert_flat, trainee, ctx)
        diff, ref_max = _compare(flat, reference[step] if reference is not None and step < len(reference) else None,
                                 ctx)
        result.losses.append(global_loss)
        result.grad_norms.append(grad_norm)
        result.grad_diffs.append(diff)
        result.ref_grad_max.append(ref_max)
        if cp1_reference is not None:
            full = _full_flat(trainee)
            cp1_diff, cp1_max = _compare(full, cp1_reference[step] if step < len(cp1_reference) else None, ctx)
            result.cp1_grad_diffs.append(cp1_diff)
            result.cp1_ref_grad_max.append(cp1_max)
        if pp1_reference is not None:
            pp1_diff, pp1_max = (_compare_by_name(trainee, pp1_reference[step], ctx) if step < len(pp1_reference)
                                 else (None, None))
            result.pp1_grad_diffs.append(pp1_diff)
            result.pp1_ref_grad_max.append(pp1_max)
        result.idle_experts.append(_idle_experts(trainee, ctx))
        trainee.optimizer.step()
        trainee.optimizer.zero_grad(set_to_none=False)
        if on_step is not None:
            on_step(step)
    return result, flat_grads
