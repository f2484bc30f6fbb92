"""Name the pipeline stage, microbatch and pass of every region :class:`~fla_ac_isolation.ReplayAudit` records
(``stage 1 / mb 0: layers.2``), since a layer's region runs once per microbatch and in shape inference (usage:
``docs/pipeline-parallel.md#replayaudit-inside-pipeline-stages``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["StageRegionTags"]


class _Handle:
    """Undoes one :meth:`StageRegionTags.attach`."""

    def __init__(self, stage: Any, original: Any, hooks: list[Any]) -> None:
        self._stage, self._original, self._hooks = stage, original, hooks

    def remove(self) -> None:
        """Restore the stage's ``forward_one_chunk`` and remove the module hooks."""
        for hook in self._hooks:
            hook.remove()
        if self._stage is not None:
            self._stage.forward_one_chunk = self._original
            self._stage = None


class StageRegionTags:
    """``ReplayAudit(region_tag=...)`` for pipeline stages: ``"stage S / mb I"`` inside stage ``S``'s forward of
    microbatch ``I``, ``"stage S / shape inference"`` outside a microbatch, ``None`` elsewhere; one per process."""

    def __init__(self) -> None:
        self._microbatch: dict[int, int] = {}  # stage index -> microbatch running now (forward_one_chunk)
        self._tag: str | None = None

    def __call__(self) -> str | None:
        return self._tag

    def attach(self, stage: Any) -> _Handle:
        """Tag the regions ``stage`` (a ``PipelineStage``) runs, via its public ``forward_one_chunk`` and module hooks;
        the handle's ``remove()`` undoes it. ``TypeError`` for an object that is not a stage."""
        if not all(hasattr(stage, name) for name in ("forward_one_chunk", "stage_index", "submod")):
            raise TypeError(f"stage must be a torch.distributed.pipelining PipelineStage, got {type(stage).__name__}")
        index = stage.stage_index
        original = stage.forward_one_chunk

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._microbatch[index] = fwd_chunk_id
            try:
                return original(fwd_chunk_id, *args, **kwargs)
            finally:
                self._microbatch.pop(index, None)

        def enter(_module: Any, _args: Any) -> None:
            mb = self._microbatch.get(index)
            self._tag = f"stage {index} / shape inference" if mb is None else f"stage {index} / mb {mb}"

        def leave(_module: Any, _args: Any, _output: Any) -> None:
            self._tag = None

        stage.forward_one_chunk = forward_one_chunk
        hooks = [stage.submod.register_forward_pre_hook(enter), stage.submod.register_forward_hook(leave)]
        return _Handle(stage, original, hooks)
