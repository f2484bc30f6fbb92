"""What a regression run is asked to do (:class:`RegressionSpec`), its defaults and its rules; the result types
(:mod:`~fla_ac_isolation.harness.regression.results`) are re-exported here. ``regress`` builds its spec here."""

from __future__ import annotations

import contextlib
import math
import pickle
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fla_ac_isolation.families import FAMILIES
from fla_ac_isolation.harness.environment import resolve_device
from fla_ac_isolation.harness.modes import ALL_MODES, CP_MODES, MODE_NAMES
from fla_ac_isolation.harness.regression.mesh import ParallelMesh
from fla_ac_isolation.harness.regression.results import ModeResult, RegressionResult
from fla_ac_isolation.harness.regression.schedule import SCHEDULES, check_schedule
from fla_ac_isolation.harness.spec_fields import check_checkpointing, check_counts, check_seed, policy_name
from fla_ac_isolation.harness.user_code import callable_target
from fla_ac_isolation.ops.backend import check_backend
from fla_ac_isolation.parallel import LAYOUTS

__all__ = [
    "CP1_REFERENCE",
    "DTYPES",
    "KERNELS",
    "PP1_REFERENCE",
    "ModeResult",
    "RegressionResult",
    "RegressionSpec",
]

CP1_REFERENCE = "no-ac-cp1"
"""Under context parallelism: the run without AC and without CP (one rank, the whole batch), first."""

PP1_REFERENCE = "no-ac-pp1"
"""Under pipeline parallelism: the run without AC, PP, EP or microbatches (one rank, every rank's batch), first."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Parameter/activation dtypes by the names a spec takes."""

KERNELS: tuple[str, ...] = ("native", "interpreter")
"""How the ranks run FLA's kernels: ``native``, or ``interpreter`` (Triton's interpreter on a CPU,
:func:`~fla_ac_isolation.harness.fla_seam.interpreter.cpu_cp_kernels` entered by every rank)."""

@dataclass(frozen=True)
class RegressionSpec:
    """What to run. Fields left at ``None`` or ``"auto"`` are resolved when the spec is built; :meth:`validate`
    checks every field.

    Attributes:
        model: family name, a key of :data:`fla_ac_isolation.families.FAMILIES`.
        mixer: a user's mixer for the linear-attention slots (:mod:`~fla_ac_isolation.harness.regression.user_mixer`):
            a class built as ``cls(config, layer_idx)``, or a factory function built as ``factory(layer_idx)``;
            the object (kept as its ``"module:qualname"``) or ``"module:qualname"`` / ``"path/to/file.py:qualname"``
            (the rank processes load it again by name); called as ``mixer(hidden_states [1, T, D], seqlens)``.
            :meth:`validate` builds one and runs its forward once on ``[1, 16, D]`` (widths that do not fit are
            named). ``None``: the family's drop-in. Needs ``backend="auto"`` and ``cp == 1``.
        mixer_config: the ``config`` a mixer class is built with, instead of the family's transformers config at
            the tiny sizes (for a trainer's own config with fields transformers' lacks); pickled into the rank
            processes (its class importable by module name: a ``SimpleNamespace``, a dict, or your package's
            class). Not with a factory, which builds its own.
        ep: expert-parallel degree; ``None``: 2 without CP or PP, else 1. Without CP the EP ranks are
            data-parallel ranks; with CP they are the CP ranks, and ``ep`` is 1 or ``cp`` (:attr:`mesh`).
        cp: context-parallel degree (1 = none). With ``cp > 1`` the ranks train on one global batch sharded in
            ``cp_layout``, after a :data:`CP1_REFERENCE` run; the ``field`` mode runs by default.
        cp_layout: ``"contiguous"`` or ``"zigzag"``.
        pp: pipeline-parallel degree per data-parallel rank (1 = none). With ``pp > 1`` the decoder is split into
            stages run by ``schedule`` over ``microbatches`` (documents whole), after a :data:`PP1_REFERENCE`
            run. Not combined with ``cp > 1``.
        microbatches: per step under PP; ``None``: ``2 * pp``. At most 8 (documents are not split).
        schedule: a key of :data:`~fla_ac_isolation.harness.regression.schedule.SCHEDULES`; zero-bubble ones need
            ``ac="full"``.
        steps: AdamW steps per mode; ``None``: 3, or 2 with ``cp > 1`` or ``pp > 1``.
        ac: ``"full"`` or ``"selective"`` checkpointing for the AC modes.
        policy: the SAC policy of ``ac="selective"``: a name (:data:`fla_ac_isolation.policies.POLICIES`), your
            own as ``"module:callable"`` / ``"path/to/file.py:callable"``, or a module-level function (kept as its
            target: the rank processes load it by module and name; a lambda or a function defined inside another
            is refused); ``None``: :data:`~fla_ac_isolation.harness.spec_fields.DEFAULT_POLICY`. Refused with
            ``ac="full"``, which saves no op.
        freq: checkpoint every ``freq``-th block.
        backend: ``auto`` | ``fla`` | ``reference``. ``auto`` on a CPU under CP, for a family with
            :attr:`Family.fla_cp <fla_ac_isolation.families.Family.fla_cp>`, becomes ``fla`` (run by Triton's
            interpreter); elsewhere the mixers resolve ``auto`` themselves.
        device: ``cpu``, ``cuda``, or ``auto``: ``cuda`` when at least :attr:`world` GPUs are visible.
        dtype: ``float32``, ``bfloat16``, ``float16``; ``auto``: ``bfloat16`` on CUDA, ``float32`` on a CPU.
        hidden_size: ``None``: 512 on CUDA, 64 on a CPU under CP, else 128.
        num_layers, num_experts, top_k: model sizes.
        data_ranks: ranks the data is generated for; ``None`` = ``ep`` (``ep=1, data_ranks=2``: one rank trains
            on both ranks' documents).
        seed: weights and data.
        lr: AdamW learning rate.
        modes: modes to run; ``no-ac`` always runs first. ``None``: :data:`~fla_ac_isolation.harness.modes.MODES`,
            plus ``field`` under CP for families whose mixers build FLA's CP context (not Nemotron-H).
        timeout_s: wall-clock limit per mode in seconds, > 0 (also the process-group timeout).
        early_stop: torch's checkpoint early stop.
        fail_on: testing hook, ``(mode, rank)`` or ``(mode, rank, message)``: that rank raises
            ``RuntimeError(message)`` between the first forward and backward of that mode.
        kernels: one of :data:`KERNELS`; ``auto``: ``interpreter`` on a CPU under CP with ``backend="fla"``,
            else ``native``. ``interpreter`` needs ``device="cpu"``.
        rank_setup: a module-level function (pickled) called in every rank process before training; a context
            manager it returns is kept entered for the life of the process (inside the default
            :attr:`serves_fla_on_cpu` serving, which it does not replace). ``None``: nothing.
        env: environment variables set in every rank process before any import; ranks then start with
            ``spawn`` instead of the preloaded fork server (:attr:`rank_env`).
    """

    model: str = "qwen3_5_moe"
    mixer: str | type | Callable | None = None
    mixer_config: Any = None
    ep: int | None = None
    cp: int = 1
    cp_layout: str = "contiguous"
    pp: int = 1
    microbatches: int | None = None
    schedule: str = "1f1b"
    steps: int | None = None
    ac: str = "selective"
    policy: str | Callable | None = None
    freq: int = 1
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    hidden_size: int | None = None
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
    kernels: str = "auto"
    rank_setup: Callable[[], Any] | None = None
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        """Resolve the ``None`` and ``"auto"`` defaults (see the attributes); nothing is checked here."""

        def resolve(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        cp = self.cp > 1 if isinstance(self.cp, int) else False
        pp = self.pp > 1 if isinstance(self.pp, int) and not isinstance(self.pp, bool) else False
        if isinstance(self.mixer, (type, types.FunctionType)):  # kept as its target (validate() loads it)
            resolve("mixer", callable_target(self.mixer))
        if isinstance(self.policy, types.FunctionType):  # likewise: the ranks load the policy by name
            resolve("policy", callable_target(self.policy))
        if self.ep is None:
            resolve("ep", 1 if cp or pp else 2)
        if self.steps is None:
            resolve("steps", 2 if cp or pp else 3)
        if self.microbatches is None and pp:
            resolve("microbatches", 2 * self.pp)
        if self.device == "auto":
            with contextlib.suppress(ValueError):  # an invalid mesh: validate() names it
                resolve("device", resolve_device("auto", self.mesh.world))
        if self.dtype == "auto":
            resolve("dtype", "bfloat16" if self.device == "cuda" else "float32")
        if self.hidden_size is None:
            resolve("hidden_size", 512 if self.device == "cuda" else 64 if cp else 128)
        interpreted = cp and self.device == "cpu" and self._fla_cp
        if interpreted and self.backend == "auto":
            resolve("backend", "fla")
        if self.kernels == "auto":
            resolve("kernels", "interpreter" if interpreted and self.backend == "fla" else "native")

    @property
    def mesh(self) -> ParallelMesh:
        """The ranks' layout: ``ParallelMesh(ep=ep, cp=cp, pp=pp)``.

        Raises:
            ValueError: ``ep``, ``cp`` or ``pp`` is not an int >= 1, or ``ep`` is neither 1 nor ``cp`` under CP.
        """
        return ParallelMesh(ep=self.ep, cp=self.cp, pp=self.pp)

    @property
    def world(self) -> int:
        """Number of rank processes."""
        return self.mesh.world

    @property
    def serves_fla_on_cpu(self) -> bool:
        """Whether every rank serves FLA's kernels on the CPU with
        :func:`~fla_ac_isolation.harness.reference_kernels.reference_kernels` (as ``check`` does): for a user's
        ``mixer`` on ``device="cpu"`` with ``kernels="native"``. This package's own mixers pick the reference
        backend on a CPU themselves."""
        return self.mixer is not None and self.device == "cpu" and self.kernels == "native"

    @property
    def rank_env(self) -> tuple[tuple[str, str], ...]:
        """``env``, plus ``TRITON_INTERPRET=1`` with ``kernels="interpreter"``."""
        extra = (("TRITON_INTERPRET", "1"),) if self.kernels == "interpreter" else ()
        return (*self.env, *(item for item in extra if item not in self.env))

    def validate(self) -> RegressionSpec:
        """Return self after checking every field.

        Raises:
            ValueError: naming the first field that breaks a rule.
        """
        if self.model not in FAMILIES:
            raise ValueError(f"model must be one of {sorted(FAMILIES)}, got {self.model!r}")
        mesh = self.mesh  # how the ranks are laid out comes before what must divide by them
        check_counts(self, ("steps", "freq", "hidden_size", "num_layers", "num_experts", "top_k"))
        self._validate_width()
        self._validate_mixer()
        self._validate_policy()
        check_backend(self.backend)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {tuple(DTYPES)}, got {self.dtype!r}")
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
        check_seed(self.seed)
        self._validate_fail_on()
        self._validate_cp()
        self._validate_pp()
        self._validate_ranks()
        resolve_device(self.device, mesh.world)  # a CUDA run needs one GPU per rank
        if self.mixer is not None:  # last: it builds the user's mixer and runs its forward once
            from fla_ac_isolation.harness.regression.user_mixer import check_fits, mixer_builder

            check_fits(mixer_builder(self.mixer, self.mixer_config), self._tiny_config(), self.device)
        return self

    def _validate_width(self) -> None:
        """``hidden_size`` must split into an even number of heads."""
        from fla_ac_isolation.harness.regression.model import ModelSize

        head_dim = ModelSize(hidden_size=self.hidden_size).head_dim
        if self.hidden_size % (2 * head_dim):
            raise ValueError(
                f"hidden_size must be a multiple of {2 * head_dim} (an even number of {head_dim}-channel heads at "
                f"this width), got {self.hidden_size}"
            )

    def _validate_mixer(self) -> None:
        if self.mixer is None:
            if self.mixer_config is not None:
                raise ValueError(f"mixer_config is the config of a user's mixer class (mixer=...); with mixer=None "
                                 f"the family's drop-in is built from its own, got mixer_config={self.mixer_config!r}")
            return
        from fla_ac_isolation.harness.regression.user_mixer import mixer_builder

        mixer_builder(self.mixer, self.mixer_config)
        if self.backend != "auto":
            raise ValueError(f"backend applies to this package's mixers; with mixer={self.mixer!r} it must be 'auto' "
                             f"(your mixer picks its own kernels), got {self.backend!r}")
        if self.cp > 1:
            raise ValueError(f"mixer={self.mixer!r} runs without context parallelism: cp must be 1, got {self.cp}")

    def _validate_policy(self) -> None:
        """``policy`` passes the shared rule and reaches the rank processes by name."""
        expected = ("a name, 'module:callable', 'path/to/file.py:callable' or a module-level function (the rank "
                    "processes load it again by module and name)")
        if self.policy is not None and not isinstance(self.policy, str):
            raise ValueError(f"policy must be {expected}, got {type(self.policy).__name__}")
        if isinstance(self.policy, str) and ("<lambda>" in self.policy or "<locals>" in self.policy):
            raise ValueError(f"policy {self.policy!r} is a lambda or is defined inside a function: the rank processes "
                             f"load the policy by module and name (it is not pickled), so define it with def at "
                             f"module level, or give 'module:name' naming a module-level variable that holds it")
        check_checkpointing(self.ac, self.policy)

    def _tiny_config(self) -> Any:
        """The family's transformers config at this spec's sizes (what a mixer class is built with)."""
        from fla_ac_isolation.harness.regression.model import ModelSize, tiny_config

        return tiny_config(self.model, ModelSize(self.hidden_size, self.num_layers, self.num_experts, self.top_k))

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

    def _validate_pp(self) -> None:
        from fla_ac_isolation.harness.regression.data import PP_MAX_MICROBATCHES

        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {self.schedule!r}")
        if self.pp == 1:
            if self.microbatches is not None:
                raise ValueError(f"microbatches is used only with pp > 1 (pipeline parallelism), got "
                                 f"{self.microbatches!r}")
            return
        if self.cp > 1:
            raise ValueError(f"pp ({self.pp}) and cp ({self.cp}) > 1 together: the regression runs pipeline and "
                             "context parallelism one at a time")
        if self.data_ranks is not None:
            raise ValueError(f"data_ranks is not used with pp > 1 (each data-parallel rank trains its own batch), got "
                             f"{self.data_ranks!r}")
        info = check_schedule(self.schedule, pp=self.pp, microbatches=self.microbatches,
                              selective_ac=self.ac == "selective")
        if self.microbatches > PP_MAX_MICROBATCHES:
            raise ValueError(
                f"microbatches must be <= {PP_MAX_MICROBATCHES} (the regression's PP batches hold "
                f"{PP_MAX_MICROBATCHES} non-empty documents at their smallest, and documents are not split), got "
                f"{self.microbatches}"
            )
        stages = info.num_stages(self.pp)
        if self.num_layers < stages:
            raise ValueError(f"num_layers ({self.num_layers}) must be >= the number of pipeline stages ({stages}: pp "
                             f"{self.pp} x {info.stages_per_rank} per rank for schedule {self.schedule!r})")

    def _validate_ranks(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be 'auto' or one of {KERNELS}, got {self.kernels!r}")
        if self.kernels == "interpreter" and self.device != "cpu":
            raise ValueError(
                f"kernels='interpreter' runs FLA's kernels under Triton's interpreter on a CPU; device must be "
                f"'cpu', got {self.device!r}"
            )
        if self.rank_setup is not None:
            try:
                pickle.dumps(self.rank_setup)
                picklable = callable(self.rank_setup)
            except (pickle.PicklingError, AttributeError, TypeError):
                picklable = False
            if not picklable:
                raise ValueError(
                    "rank_setup must be a module-level function (it is pickled into every rank process), got "
                    f"{self.rank_setup!r}"
                )
        if not all(isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item)
                   for item in self.env):
            raise ValueError(f"env must be a tuple of (name, value) string pairs, got {self.env!r}")

    @property
    def _fla_cp(self) -> bool:
        return self.model in FAMILIES and FAMILIES[self.model].fla_cp

    @property
    def ordered_modes(self) -> tuple[str, ...]:
        """What runs, in order: the CP1/PP1 reference if any, ``no-ac``, then the others."""
        wanted = self.modes if self.modes is not None else (
            (*MODE_NAMES, *CP_MODES) if self.cp > 1 and self._fla_cp else MODE_NAMES
        )
        order = [*MODE_NAMES[1:], *CP_MODES]
        first = (CP1_REFERENCE,) if self.cp > 1 else (PP1_REFERENCE,) if self.pp > 1 else ()
        return (*first, "no-ac", *(m for m in order if m in wanted))

    @property
    def policy_name(self) -> str:
        """The name of the SAC policy of ``ac="selective"``
        (:data:`~fla_ac_isolation.harness.spec_fields.DEFAULT_POLICY` when not given)."""
        return policy_name(self.policy)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON data; ``policy`` named (:attr:`policy_name`), ``rank_setup`` as
        ``"module:function"``, ``mixer_config`` as its ``repr``."""
        out = asdict(self)
        out["policy"] = self.policy_name
        out["mixer_config"] = None if self.mixer_config is None else repr(self.mixer_config)
        setup = self.rank_setup
        out["rank_setup"] = None if setup is None else f"{setup.__module__}:{setup.__qualname__}"
        return out
