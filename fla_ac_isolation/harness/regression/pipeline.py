"""The tiny decoders split into stages run by ``torch.distributed.pipelining`` (``spec.pp > 1``), under the
decoder's parameter names; each stage call builds one ``seqlens`` from its microbatch's offsets row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.regression.attention import AttentionLayout
from fla_ac_isolation.harness.regression.model import TinyDecoder
from fla_ac_isolation.harness.regression.schedule import SCHEDULES, build_schedule, stage_indices
from fla_ac_isolation.parallel import PackedMicrobatches, StageRegionTags, microbatch_seqlens
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["DecoderStage", "PipelineRun", "TokenLoss", "build_pipeline", "pipeline_step", "stage_layers"]


def stage_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """The blocks of each stage: contiguous runs, the first ``num_layers % num_stages`` one block longer.

    Raises:
        ValueError: fewer blocks than stages.
    """
    if num_layers < num_stages:
        raise ValueError(f"num_layers ({num_layers}) must be >= the number of pipeline stages ({num_stages})")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [list(range(bounds[s], bounds[s + 1])) for s in range(num_stages)]


class DecoderStage(nn.Module):
    """Blocks ``layer_ids`` of a ``TinyDecoder`` (the same modules), with the embedding when ``first`` and the
    final norm and LM head when ``last``.

    Forward: ``x`` (``input_ids [1, T_mb]`` first, else ``[1, T_mb, D]``) and ``cu_seqlens [1, W]`` -> hidden
    states ``[1, T_mb, D]``, or float32 logits ``[1, T_mb, vocab]`` on the last stage.
    """

    def __init__(self, model: TinyDecoder, layer_ids: list[int], *, first: bool, last: bool,
                 seqlens_class: type[LayerLocalSeqlens]) -> None:
        super().__init__()
        if first:
            self.embed_tokens = model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if last:
            self.norm, self.lm_head = model.norm, model.lm_head
        self.first, self.last, self.seqlens_class = first, last, seqlens_class

    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor) -> torch.Tensor:
        seqlens = microbatch_seqlens(cu_seqlens, x.shape[1], seqlens_class=self.seqlens_class)
        hidden = self.embed_tokens(x) if self.first else x
        layout = AttentionLayout.from_seqlens(seqlens, hidden.device)
        for block in self.layers.values():
            hidden = block(hidden, seqlens, layout)
        return self.lm_head(self.norm(hidden)).float() if self.last else hidden

    def moes(self) -> list[nn.Module]:
        """torchtitan's MoE modules of this stage, in layer order."""
        from torchtitan.models.common.moe import MoE

        return [m for m in self.modules() if isinstance(m, MoE)]


class TokenLoss:
    """Token cross-entropy sum over the step's target count (:attr:`num_targets`, set per step); ``-100`` ignored."""

    def __init__(self) -> None:
        self.num_targets = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum") / self.num_targets


@dataclass
class PipelineRun:
    """This rank's part of the pipeline.

    Attributes:
        modules: the :class:`DecoderStage` of each local stage.
        stages: torch's ``PipelineStage`` of each.
        schedule: torch's schedule object.
        loss: the schedule's loss function (set ``loss.num_targets`` per step).
        tags: region tags for ``ReplayAudit(region_tag=run.tags)``.
    """

    modules: list[DecoderStage]
    stages: list[Any]
    schedule: Any
    loss: TokenLoss
    tags: StageRegionTags = field(default_factory=StageRegionTags)

    @property
    def has_first(self) -> bool:
        """This rank holds the first stage."""
        return any(m.first for m in self.modules)

    @property
    def has_last(self) -> bool:
        """This rank holds the last stage."""
        return any(m.last for m in self.modules)

    def parameters(self) -> list[nn.Parameter]:
        """The local stages' parameters, each once."""
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` under the decoder's names (checkpoint wrappers dropped)."""
        out = []
        for m in self.modules:
            for name, p in m.named_parameters():
                out.append((name.replace("._checkpoint_wrapped_module", ""), p))
        return out

    def moes(self) -> list[nn.Module]:
        """torchtitan's MoE modules of the local stages."""
        return [moe for m in self.modules for moe in m.moes()]


def build_pipeline(
    model: TinyDecoder,
    *,
    schedule: str,
    pp_rank: int,
    pp: int,
    microbatches: int,
    seqlens_class: type[LayerLocalSeqlens],
    device: torch.device,
    group: Any = None,
) -> PipelineRun:
    """Split ``model`` (checkpointed and expert-sharded already, if wanted) into this PP rank's stages.

    Args:
        model: the whole decoder (built on every PP rank from the same seed).
        schedule: a key of :data:`~fla_ac_isolation.harness.regression.schedule.SCHEDULES`.
        pp_rank: this rank's place in the PP group.
        pp: the PP degree.
        microbatches: microbatches per step.
        seqlens_class: the mode's offsets class.
        device: the stage device.
        group: the PP process group (``None``: the default group).
    """
    from torch.distributed.pipelining import PipelineStage

    num_stages = SCHEDULES[schedule].num_stages(pp)
    layers = stage_layers(len(model.layers), num_stages)
    modules, stages = [], []
    tags = StageRegionTags()
    for s in stage_indices(schedule, pp_rank, pp):
        module = DecoderStage(model, layers[s], first=s == 0, last=s == num_stages - 1, seqlens_class=seqlens_class)
        module.train()
        stage = PipelineStage(module, s, num_stages, device, group=group)
        tags.attach(stage)
        modules.append(module)
        stages.append(stage)
    loss = TokenLoss()
    return PipelineRun(modules, stages, build_schedule(schedule, stages, microbatches, loss), loss, tags)


def pipeline_step(run: PipelineRun, batch: PackedMicrobatches, num_targets: int) -> torch.Tensor:
    """One training step of the schedule over ``batch`` (every PP rank passes the same). Returns this rank's
    summed microbatch loss, a 0-d tensor (0 without the last stage).

    Raises:
        RuntimeError: what the schedule raised, with a wrapped stage error's first line appended.
    """
    device = run.stages[0].device
    losses: list[torch.Tensor] | None = [] if run.has_last else None
    run.loss.num_targets = num_targets
    args = (batch.tensors["input_ids"].to(device),) if run.has_first else ()
    target = batch.tensors["labels"].to(device) if run.has_last else None
    try:
        run.schedule.step(*args, target=target, losses=losses, cu_seqlens=batch.cu_seqlens.to(device),
                          return_outputs=False)
    except RuntimeError as err:
        named = _with_cause(err)
        if named is err:
            raise
        raise named from err
    if not losses:
        return torch.zeros((), device=device)
    return torch.stack([x.detach().float().reshape(()) for x in losses]).sum()


def _with_cause(err: RuntimeError) -> RuntimeError:
    """``err``, or a ``RuntimeError`` whose first line also names the error ``err`` wraps."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if err.__cause__ is None or not lines or not lines[0].endswith(":"):
        return err
    return RuntimeError(f"{lines[0]} {first_line(err.__cause__)}")
