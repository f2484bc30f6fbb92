"""The regression's pipeline schedules: torch's schedule classes by name, the rules under which torch runs them,
and this rank's stage indices (``docs/pipeline-parallel.md``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SCHEDULES", "ZERO_BUBBLE_SAC", "PipelineSchedule", "build_schedule", "check_schedule", "stage_indices"]


@dataclass(frozen=True)
class PipelineSchedule:
    """One of torch's pipeline schedules, as this package runs it.

    Attributes:
        name: the name the regression and ``--schedule`` take.
        torch_class: the class in ``torch.distributed.pipelining``.
        stages_per_rank: local stages per PP rank.
        style: ``"loop"`` (rank ``r`` holds ``r, r + pp, ...``) or ``"v"`` (``r`` and ``2 pp - 1 - r``).
        zero_bubble: splits backward into input and weight passes (runs only under full AC).
    """

    name: str
    torch_class: str
    stages_per_rank: int
    style: str
    zero_bubble: bool

    def num_stages(self, pp: int) -> int:
        """Stages in all for ``pp`` PP ranks."""
        return pp * self.stages_per_rank


SCHEDULES: dict[str, PipelineSchedule] = {
    s.name: s
    for s in (
        PipelineSchedule("gpipe", "ScheduleGPipe", 1, "loop", False),
        PipelineSchedule("1f1b", "Schedule1F1B", 1, "loop", False),
        PipelineSchedule("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "loop", False),
        PipelineSchedule("interleaved-zero-bubble", "ScheduleInterleavedZeroBubble", 2, "loop", True),
        PipelineSchedule("zbv-zero-bubble", "ScheduleZBVZeroBubble", 2, "v", True),
        PipelineSchedule("dualpipev", "ScheduleDualPipeV", 2, "v", True),
    )
}
"""The schedules by name (the zero-bubble ones run under full AC only)."""

ZERO_BUBBLE_SAC = (
    "zero-bubble schedules split each backward into an input pass and a weight pass, and torch's selective AC "
    "allows one backward per checkpointed region ('Trying to backward an extra time. You are only allowed to "
    "backward once on any region computed under selective activation checkpoint.'), with or without FLA and "
    "with isolated offsets too; they run under full AC, which recomputes each region in each pass"
)
"""Why :func:`check_schedule` refuses a zero-bubble schedule under selective AC."""


def _check_int(name: str, value: object, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _schedule(schedule: str) -> PipelineSchedule:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
    return SCHEDULES[schedule]


def check_schedule(schedule: str, *, pp: int, microbatches: int, selective_ac: bool) -> PipelineSchedule:
    """The :class:`PipelineSchedule` called ``schedule``, after checking that torch runs it as asked.

    Raises:
        ValueError: an unknown ``schedule``; ``pp`` or ``microbatches`` not an int >= 1; fewer microbatches than
            stages (1F1B, DualPipeV) or not a multiple of ``max(1, microbatches // pp)`` (interleaved); a
            zero-bubble schedule under ``selective_ac`` (:data:`ZERO_BUBBLE_SAC`).
    """
    info = _schedule(schedule)
    _check_int("pp", pp)
    _check_int("microbatches", microbatches)
    stages = info.num_stages(pp)
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        raise ValueError(f"microbatches ({microbatches}) must be >= the number of stages ({stages}) for schedule "
                         f"{schedule!r} (torch's {info.torch_class})")
    rounds = max(1, microbatches // pp)
    if schedule in ("interleaved-1f1b", "interleaved-zero-bubble") and microbatches % rounds:
        raise ValueError(f"microbatches ({microbatches}) must be a multiple of the rounds of schedule {schedule!r}, "
                         f"max(1, microbatches // pp) = {rounds} (torch's {info.torch_class})")
    if info.zero_bubble and selective_ac:
        raise ValueError(f"schedule {schedule!r} cannot run under selective AC: {ZERO_BUBBLE_SAC}; use ac='full' or "
                         "gpipe, 1f1b, interleaved-1f1b")
    return info


def stage_indices(schedule: str, pp_rank: int, pp: int) -> tuple[int, ...]:
    """The stage indices PP rank ``pp_rank`` of ``pp`` holds under ``schedule``, in torch's order (as torchtitan 0.3's
    ``pipeline_module_split``); ``ValueError`` for an unknown ``schedule`` or ``pp_rank`` not in ``[0, pp)``."""
    info = _schedule(schedule)
    _check_int("pp", pp)
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank must be an int in [0, {pp}), got {pp_rank!r}")
    if info.style == "v":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + s * pp for s in range(info.stages_per_rank))


def build_schedule(
    schedule: str,
    stages: Sequence[Any],
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    offsets_keywords: Sequence[str] = ("cu_seqlens",),
    scale_grads: bool = False,
) -> Any:
    """torch's schedule object for this rank's ``stages`` (``PipelineStage`` s in :func:`stage_indices` order).

    Args:
        schedule: a key of :data:`SCHEDULES` (check it first with :func:`check_schedule`).
        stages: this rank's stages; single-stage schedules take exactly one.
        microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target)`` of one microbatch (the last stage).
        offsets_keywords: keywords of ``step`` chunked on dim 0 (``TensorChunkSpec(0)``): per-microbatch offsets.
        scale_grads: torch's division of gradients by ``microbatches``; ``False`` when ``loss_fn`` normalises.

    Raises:
        ValueError: unknown ``schedule``; a single-stage schedule given other than one stage.
    """
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    info = _schedule(schedule)
    if len(stages) != info.stages_per_rank:
        raise ValueError(f"schedule {schedule!r} runs {info.stages_per_rank} stage(s) per rank, got {len(stages)}")
    cls = getattr(pipelining, info.torch_class)
    chunks = {name: TensorChunkSpec(0) for name in offsets_keywords}
    local = stages[0] if info.stages_per_rank == 1 else list(stages)
    return cls(local, n_microbatches=microbatches, loss_fn=loss_fn, kwargs_chunk_spec=chunks, scale_grads=scale_grads)
