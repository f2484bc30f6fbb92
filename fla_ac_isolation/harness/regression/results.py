"""What a regression run returns: :class:`ModeResult` per mode and :class:`RegressionResult` for the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fla_ac_isolation.harness.regression.spec import RegressionSpec

__all__ = ["ModeResult", "RegressionResult"]


@dataclass
class ModeResult:
    """Outcome of one mode, reduced over all ranks.

    Attributes:
        mode: the mode.
        losses: global loss per completed step.
        grad_norms: global gradient norm per completed step.
        grad_diffs: per completed step, max ``|grad - grad_no_ac|`` (``None`` for ``no-ac`` or no reference).
        ref_grad_max: per step, max ``|grad_no_ac|`` (the scale for relative differences).
        cp1_grad_diffs, cp1_ref_grad_max: under CP, per step, max ``|grad - grad_cp1|`` and ``|grad_cp1|``.
        pp1_grad_diffs, pp1_ref_grad_max: under PP, per step, max ``|grad - grad_pp1|`` and ``|grad_pp1|``.
        idle_experts: per step, the largest number of experts without any token in one MoE layer.
        cache: FLA tensor-cache events summed over ranks and steps, ``{"hit": .., "miss": .., "bypass": ..}``.
        cache_by_helper: the same per helper name.
        error: ``"<Type>: <first line>"`` of the first failure, else ``None``.
        timed_out: the mode was stopped at ``timeout_s``: not a verdict on the fault.
        failed_ranks: ranks that raised (or died), in order of arrival.
        traceback: full traceback text of the first failure.
        seconds: wall time of the mode.
        step_seconds: per completed step, the forward + backward wall time of the slowest rank.
    """

    mode: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grad_diffs: list[float | None] = field(default_factory=list)
    ref_grad_max: list[float | None] = field(default_factory=list)
    cp1_grad_diffs: list[float | None] = field(default_factory=list)
    cp1_ref_grad_max: list[float | None] = field(default_factory=list)
    pp1_grad_diffs: list[float | None] = field(default_factory=list)
    pp1_ref_grad_max: list[float | None] = field(default_factory=list)
    idle_experts: list[int] = field(default_factory=list)
    cache: dict[str, int] = field(default_factory=dict)
    cache_by_helper: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False
    failed_ranks: list[int] = field(default_factory=list)
    traceback: str | None = None
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)


@dataclass
class RegressionResult:
    """Every mode's :class:`ModeResult`, the spec, and notes."""

    spec: RegressionSpec
    modes: dict[str, ModeResult]
    notes: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "modes": {name: asdict(r) for name, r in self.modes.items()},
            "notes": list(self.notes),
            "environment": dict(self.environment),
        }
