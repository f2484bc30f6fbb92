"""The audit as a library call (what ``fla-ac-isolation audit`` runs): one training step of a tiny model under
:class:`~fla_ac_isolation.ReplayAudit` per checkpointing mode, in this process. A mode that raises is recorded as
failed and the others still run; the unsafe ``shared`` mode is expected to diverge."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.families import FAMILY_NAMES
from fla_ac_isolation.harness.environment import resolve_device
from fla_ac_isolation.harness.extras import MissingExtraError, require
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.modes import MODES, Mode, get_mode
from fla_ac_isolation.harness.spec_fields import check_checkpointing, check_counts, check_seed, policy_name, sac_policy
from fla_ac_isolation.ops.backend import check_backend

__all__ = ["AUDIT_MODELS", "AUDIT_MODES", "FAULT_STACK", "AuditResult", "AuditRun", "AuditSpec", "audit_mode",
           "run_audit"]

AUDIT_MODES: tuple[str, ...] = tuple(name for name, mode in MODES.items() if mode.checkpointed)
"""The modes an audit can run: those that checkpoint (``no-ac`` has no recompute to compare)."""
FAULT_STACK = "fault-stack"
"""The model name of :mod:`fla_ac_isolation.harness.fault_stack` (FLA's index helpers, no kernels)."""
AUDIT_MODELS: tuple[str, ...] = (*FAMILY_NAMES, FAULT_STACK)
"""Every model an audit can run."""


@dataclass(frozen=True)
class AuditSpec:
    """What to audit. ``device="auto"`` is resolved when the spec is built; :meth:`validate` checks every field.

    Attributes:
        model: one of :data:`AUDIT_MODELS` (the families need the ``ep`` extra; ``fault-stack`` the core install).
        modes: a non-empty subset of :data:`AUDIT_MODES`, run in this order.
        ac: ``"full"`` or ``"selective"`` checkpointing.
        policy: the SAC policy of ``ac="selective"``: a name (:data:`fla_ac_isolation.policies.POLICIES`), your
            own as ``"module:callable"`` / ``"path/to/file.py:callable"``, or that function
            (:func:`~fla_ac_isolation.harness.spec_fields.resolve_policy`); ``None``:
            :data:`~fla_ac_isolation.harness.spec_fields.DEFAULT_POLICY`. Refused with ``ac="full"``, which saves
            no op.
        freq: checkpoint every ``freq``-th block.
        backend: the families' mixer backend, ``auto`` | ``fla`` | ``reference``.
        device: ``cpu``, ``cuda``, or ``auto`` (``cuda`` when a GPU is visible). The fault stack runs on the CPU.
        hidden_size, num_layers, num_experts, top_k: the family decoder's sizes (``num_layers``: the fault
            stack's depth too).
        seed: weights and data.
        early_stop: torch's checkpoint early stop.
    """

    model: str = "qwen3_5_moe"
    modes: tuple[str, ...] = ("shared", "isolated")
    ac: str = "selective"
    policy: str | Callable | None = None
    freq: int = 1
    backend: str = "auto"
    device: str = "auto"
    hidden_size: int = 128
    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 4
    seed: int = 0
    early_stop: bool = True

    def __post_init__(self) -> None:
        if self.device == "auto":
            object.__setattr__(self, "device", resolve_device("auto"))

    def validate(self) -> AuditSpec:
        """Return self after checking every field.

        Raises:
            ValueError: naming the field and what it must be.
        """
        if self.model not in AUDIT_MODELS:
            raise ValueError(f"model must be one of {AUDIT_MODELS}, got {self.model!r}")
        modes = tuple(self.modes) if isinstance(self.modes, (tuple, list)) else ()
        if not modes or any(m not in AUDIT_MODES for m in modes):
            raise ValueError(f"modes must be a non-empty subset of {AUDIT_MODES}, got {self.modes!r}")
        check_counts(self, ("freq", "hidden_size", "num_layers", "num_experts", "top_k"))
        check_checkpointing(self.ac, self.policy)
        check_backend(self.backend)
        resolve_device(self.device)  # 'cuda' needs a visible GPU
        check_seed(self.seed)
        return self

    def policy_fn(self):
        """The SAC policy (``ac="selective"``), or ``None`` for full AC."""
        return sac_policy(self.ac, self.policy)

    @property
    def policy_name(self) -> str:
        """The name of the SAC policy of ``ac="selective"``
        (:data:`~fla_ac_isolation.harness.spec_fields.DEFAULT_POLICY` when not given)."""
        return policy_name(self.policy)


@dataclass
class AuditRun:
    """One audited mode.

    Attributes:
        mode: the mode.
        audit: the :class:`~fla_ac_isolation.ReplayAudit` of its step (``None`` when it failed before its step).
        error: ``"<Type>: <first line>"`` of an error the step raised under the audit, else ``None``.
        failure: ``"<Type>: <first line>"`` when the mode could not run at all.
    """

    mode: str
    audit: ReplayAudit | None
    error: str | None = None
    failure: str | None = None

    @property
    def aligned(self) -> bool:
        """The mode ran, at least one region was checkpointed, and every region is aligned."""
        return self.judged and self.audit.ok

    @property
    def judged(self) -> bool:
        """The mode ran and the audit saw at least one checkpointed region (aligned or not)."""
        return self.failure is None and self.audit is not None and bool(self.audit.regions)

    @property
    def decides(self) -> bool:
        """Whether this mode decides the outcome (it is not unsafe)."""
        return get_mode(self.mode).role != "unsafe"


@dataclass
class AuditResult:
    """Every mode's :class:`AuditRun`, in the order of ``spec.modes``."""

    spec: AuditSpec
    runs: list[AuditRun] = field(default_factory=list)

    @property
    def unjudged(self) -> str | None:
        """Why nothing was judged (no mode that decides ran a checkpointed region: none was asked for, each failed
        before its step, or its step ran no region), naming each such mode's failure; ``None`` when one was."""
        deciding = [run for run in self.runs if run.decides]
        if any(run.judged for run in deciding):
            return None
        if not deciding:
            return f"only unsafe modes ran ({', '.join(run.mode for run in self.runs)}), and they never decide"
        return "no mode that decides ran a checkpointed region: " + "; ".join(
            f"{run.mode}: FAILED: {run.failure}" if run.failure else
            f"{run.mode}: no checkpointed region ran" + (f" (the step failed: {run.error})" if run.error else "")
            for run in deciding)

    @property
    def exit_code(self) -> int:
        """0 when every mode that decides is aligned; 2 when none was judged (:attr:`unjudged`); 1 otherwise."""
        if self.unjudged is not None:
            return 2
        return 0 if all(run.aligned for run in self.runs if run.decides) else 1


def _fault_stack_step(spec: AuditSpec, mode: Mode) -> AuditRun:
    from fla_ac_isolation.harness.fault_stack import run_stack

    with ReplayAudit(on_divergence="record") as audit:
        res = run_stack(mode.name, spec.policy_fn(), num_layers=spec.num_layers, freq=spec.freq,
                        early_stop=spec.early_stop, seed=spec.seed)
    return AuditRun(mode.name, audit, res.error)


def _family_step(spec: AuditSpec, mode: Mode) -> AuditRun:
    """One step of a regression family's tiny decoder in this process."""
    import torch
    import torch.nn.functional as F

    require("torchtitan", "ep", f"fla-ac-isolation audit --model {spec.model}")
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
    from fla_ac_isolation.harness.regression.data import global_batch
    from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan
    from fla_ac_isolation.harness.regression.model import ModelSize, build_model
    from fla_ac_isolation.policies import checkpoint_layers

    device = torch.device(spec.device)
    ensure_torch_compat()
    setup_torchtitan(device.type)
    size = ModelSize(spec.hidden_size, spec.num_layers, spec.num_experts, spec.top_k)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, size, backend=spec.backend, ep_enabled=False).to(device)
    checkpoint_layers(model, mode=spec.ac, policy=spec.policy_fn(), freq=spec.freq, early_stop=spec.early_stop)
    model.train()
    batch = global_batch(0, 2, seed=spec.seed, vocab_size=size.vocab_size)
    seqlens = mode.from_seq_lens(list(batch.seq_lens), device=device)
    input_ids, labels = batch.input_ids.to(device), batch.labels.to(device)
    clear_tensor_cache()
    error = None
    with ReplayAudit(model, on_divergence="record") as audit, mode.cache_context(), \
            torch.utils.checkpoint.set_checkpoint_early_stop(spec.early_stop):
        try:
            logits = model(input_ids, seqlens)
            loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
            (loss / batch.num_targets_global).backward()
        except Exception as err:
            error = first_line(err)
    return AuditRun(mode.name, audit, error)


def audit_mode(spec: AuditSpec, mode: str) -> AuditRun:
    """Run one audited step of ``spec.model`` in ``mode``; an exception outside the step is the mode's failure.

    Raises:
        ValueError: an invalid ``spec`` or a ``mode`` not in ``spec.modes``.
        MissingExtraError: a family model without the ``ep`` extra (torchtitan), naming the install.
    """
    spec.validate()
    if mode not in spec.modes:
        raise ValueError(f"mode must be one of spec.modes {tuple(spec.modes)}, got {mode!r}")
    step = _fault_stack_step if spec.model == FAULT_STACK else _family_step
    try:
        return step(spec, get_mode(mode))
    except MissingExtraError:
        raise
    except Exception as err:  # the other modes still run
        return AuditRun(mode, None, failure=first_line(err))


def run_audit(spec: AuditSpec, *, on_run: Callable[[AuditRun], None] | None = None) -> AuditResult:
    """Audit every mode of ``spec``, in order; ``on_run(run)`` is called as each mode finishes.

    Raises:
        ValueError: an invalid ``spec``.
        MissingExtraError: a family model without the ``ep`` extra.
    """
    result = AuditResult(spec.validate())
    for mode in result.spec.modes:
        run = audit_mode(result.spec, mode)
        result.runs.append(run)
        if on_run is not None:
            on_run(run)
    return result
