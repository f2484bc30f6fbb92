"""What a regression run is asked to do (:class:`RegressionSpec`) and what it returns (:class:`ModeResult`,
:class:`RegressionResult`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fla_ac_isolation.families import FAMILIES
from fla_ac_isolation.modes import ALL_MODES, CP_MODES, MODE_NAMES
from fla_ac_isolation.ops import BACKENDS
from fla_ac_isolation.parallel import LAYOUTS
from fla_ac_isolation.policies import POLICIES

__all__ = ["CP1_REFERENCE", "DTYPES", "ModeResult", "RegressionResult", "RegressionSpec"]

CP1_REFERENCE = "no-ac-cp1"
"""Under context parallelism: the run without AC and without CP (one rank, the whole batch), first."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Parameter/activation dtypes by the names a spec takes."""


@dataclass(frozen=True)
class RegressionSpec:
    """What to run.

    Attributes:
        model: family name, a key of :data:`fla_ac_isolation.families.FAMILIES`.
        ep: expert-parallel degree; the number of ranks when ``cp == 1``. Under context parallelism the
            EP ranks are borrowed from the CP ranks (as torchtitan does): ``ep`` is 1 (experts
            replicated) or ``cp``.
        cp: context-parallel degree (FLA's CP; 1 = none). With ``cp > 1`` the ranks train on ONE global
            batch sharded in ``cp_layout``, a :data:`CP1_REFERENCE` run (one rank, no CP, no AC) comes
            first, and the CP-only ``field`` mode runs by default.
        cp_layout: FLA's CP layout, ``"contiguous"`` or ``"zigzag"``.
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
        modes: modes to run; ``no-ac`` is always run first (it is the reference). ``None``: the four of
            :data:`~fla_ac_isolation.modes.MODES`, plus ``field`` under context parallelism for the families
            whose mixers build FLA's CP context (not Nemotron-H: its head-parallel Mamba2 builds none, so
            ``field`` would repeat ``shared``).
        timeout_s: wall-clock limit per mode in seconds, > 0 (also the process-group timeout).
        early_stop: torch's checkpoint early stop.
        fail_on: testing hook, ``(mode, rank)`` or ``(mode, rank, message)``: that rank raises
            ``RuntimeError(message)`` between the first forward and backward of that mode, to show that
            one failing rank ends all ranks promptly and that its error text reaches the report verbatim.
        rank_setup: ``"module:function"`` called in every rank process before training, e.g. a GPU test
            harness switch such as ``"fla_ac_isolation.testing.gpu:lift_hopper_gdn_guard"``; when it
            returns a context manager, that is entered and kept for the life of the process.
        env: environment variables set in every rank process before it imports anything, e.g.
            ``(("TRITON_INTERPRET", "1"),)`` for FLA's kernels on a CPU; rank processes are then started
            with ``spawn`` (a fresh interpreter) instead of the preloaded fork server.
    """

    model: str = "qwen3_5_moe"
    ep: int = 2
    cp: int = 1
    cp_layout: str = "contiguous"
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
    modes: tuple[str, ...] | None = None
    timeout_s: float = 300.0
    early_stop: bool = True
    fail_on: tuple[str, int] | tuple[str, int, str] | None = None
    rank_setup: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    @property
    def world(self) -> int:
        """Number of rank processes: ``cp`` under context parallelism, else ``ep``."""
        return self.cp if self.cp > 1 else self.ep

    def validate(self) -> RegressionSpec:
        """Return self after checking every field; errors name the field (``ValueError``)."""
        if self.model not in FAMILIES:
            raise ValueError(f"model must be one of {sorted(FAMILIES)}, got {self.model!r}")
        for name in ("ep", "cp", "steps", "freq", "hidden_size", "num_layers", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._validate_degrees()  # how the ranks are laid out comes before what must divide by them
        self._validate_width()
        if self.ac not in ("full", "selective"):
            raise ValueError(f"ac must be 'full' or 'selective', got {self.ac!r}")
        if self.ac == "selective" and self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.num_experts % self.ep:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of ep ({self.ep})")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.data_ranks is not None and self.data_ranks < self.ep:
            raise ValueError(f"data_ranks ({self.data_ranks}) must be >= ep ({self.ep})")
        allowed = tuple(ALL_MODES) if self.cp > 1 else MODE_NAMES
        if self.modes is not None and (not self.modes or any(m not in allowed for m in self.modes)):
            cp_only = [m for m in self.modes if m in CP_MODES]
            hint = f" ({', '.join(cp_only)} needs cp > 1)" if cp_only and self.cp == 1 else ""
            raise ValueError(f"modes must be a non-empty subset of {allowed}{hint}, got {self.modes!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not (
            0 < self.timeout_s < math.inf
        ):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not (0 <= self.lr < math.inf):
            raise ValueError(f"lr must be a finite number >= 0 (AdamW learning rate), got {self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self._validate_fail_on()
        if self.rank_setup is not None and ":" not in self.rank_setup:
            raise ValueError(f"rank_setup must be 'module:function', got {self.rank_setup!r}")
        self._validate_cp()
        if self.device == "cuda" and torch.cuda.device_count() < self.world:
            raise ValueError(f"{self.world} ranks need {self.world} CUDA devices, found {torch.cuda.device_count()}")
        return self

    def _validate_width(self) -> None:
        """The tiny decoders split ``hidden_size`` into an even number of heads (two key/value heads)."""
        from fla_ac_isolation.regression.model import ModelSize

        head_dim = ModelSize(hidden_size=self.hidden_size).head_dim
        if self.hidden_size % (2 * head_dim):
            raise ValueError(
                f"hidden_size must be a multiple of {2 * head_dim} (an even number of {head_dim}-channel heads at "
                f"this width), got {self.hidden_size}"
            )

    def _validate_fail_on(self) -> None:
        if self.fail_on is None:
            return
        fail_on = tuple(self.fail_on)
        ok = len(fail_on) in (2, 3) and fail_on[0] in ALL_MODES and isinstance(fail_on[1], int) and (
            not isinstance(fail_on[1], bool) and 0 <= fail_on[1] < self.world
        )
        if not ok or (len(fail_on) == 3 and not isinstance(fail_on[2], str)):
            raise ValueError(
                f"fail_on must be (mode, rank) or (mode, rank, message) with a mode of {tuple(ALL_MODES)} and "
                f"0 <= rank < {self.world} (the ranks), got {self.fail_on!r}"
            )

    def _validate_degrees(self) -> None:
        """The parallel degrees' rules among themselves (checked before any size that must divide by them)."""
        if self.cp > 1 and self.ep not in (1, self.cp):
            raise ValueError(
                f"ep ({self.ep}) must be 1 or equal cp ({self.cp}): the EP ranks are borrowed from the {self.cp} "
                "CP ranks (one process per CP rank)"
            )

    def _validate_cp(self) -> None:
        if self.cp_layout not in LAYOUTS:
            raise ValueError(f"cp_layout must be one of {LAYOUTS}, got {self.cp_layout!r}")
        if self.cp == 1:
            return
        runs_reference = self.backend == "reference" or (self.backend, self.device) == ("auto", "cpu")
        if self._fla_cp and runs_reference:
            raise ValueError(
                f"backend must be 'fla' for context parallelism with {self.model}: its mixers need FLA's CP "
                f"kernels, and backend={self.backend!r} on {self.device} runs the reference backend, which has none"
            )

    @property
    def _fla_cp(self) -> bool:
        """The family's mixers run FLA's CP kernels (the ``field`` mode builds FLA's CP context for them)."""
        from fla_ac_isolation.regression.model import RECIPES

        return self.model in RECIPES and RECIPES[self.model].fla_cp

    @property
    def ordered_modes(self) -> tuple[str, ...]:
        """What runs, in order: ``no-ac`` first (under CP, :data:`CP1_REFERENCE` before it), then the others."""
        wanted = self.modes if self.modes is not None else (
            (*MODE_NAMES, *CP_MODES) if self.cp > 1 and self._fla_cp else MODE_NAMES
        )
        order = [*MODE_NAMES[1:], *CP_MODES]
        return (*((CP1_REFERENCE,) if self.cp > 1 else ()), "no-ac", *(m for m in order if m in wanted))


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
        cp1_grad_diffs: under context parallelism, per step, max ``|grad - grad_cp1|`` over every
            parameter's full gradient (expert shards gathered) against :data:`CP1_REFERENCE`.
        cp1_ref_grad_max: per step, max ``|grad_cp1|``.
        idle_experts: per step, the largest number of experts without any token in one MoE layer.
        cache: FLA tensor-cache events summed over ranks and steps, ``{"hit": .., "miss": .., "bypass": ..}``.
        cache_by_helper: the same per helper name.
        error: ``"<Type>: <first line>"`` of the first failure, else ``None``.
        timed_out: the mode was stopped at ``timeout_s`` (its ``error`` says so): not a verdict on the fault.
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
    cp1_grad_diffs: list[float | None] = field(default_factory=list)
    cp1_ref_grad_max: list[float | None] = field(default_factory=list)
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
