"""``check`` as a library call: one training step of the user's own model under :class:`~fla_ac_isolation.ReplayAudit`,
which FLA-backed classes it holds (exposed, covered, leaking), and the one-line fix (``fla-ac-isolation check``
renders what :func:`run_check` returns).

The model comes from one of (:class:`CheckSpec`):

* ``model="module:callable"`` (or ``"path/to/file.py:callable"``): ``callable()`` takes no argument and returns
  ``(model, batch)``: an ``nn.Module`` (without activation checkpointing: the check applies it) and ONE packed
  batch, a dict of the keyword arguments of ``model(**batch)`` (e.g. transformers' ``input_ids``, ``labels``,
  ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``use_cache=False``; FLA's ``input_ids``,
  ``labels``, ``cu_seqlens``; OLMo-core's ``cu_doc_lens``): its packed offsets must be there, a 1-D integer
  tensor (or a NamedTuple holding one), and must reach FLA. ``model(**batch)`` returns the loss: a scalar
  tensor, or an object with ``.loss`` (transformers' and FLA's ``ModelOutput``, OLMo-core's
  ``LMOutputWithLoss``). The callable is called again (for a fresh model) when the fix is verified.
* ``config="<model_type or config class name>"``: a tiny model of transformers or FLA
  (:func:`fla_ac_isolation.harness.foreign_models.build_tiny`).

The step: every layer of the model's layer list (:func:`~fla_ac_isolation.policies.checkpoint_layers`:
``model.layers``, ``model.model.layers``, ``blocks``, ...) checkpointed with the chosen SAC policy (default
``save-all-copies``, the field's most sensitive on a CPU) or full AC; model and batch on ``device`` (``cpu``:
FLA's kernels served by :func:`fla_ac_isolation.harness.reference_kernels.reference_kernels`; ``cuda``: FLA's own);
FLA's cache cleared first. Before it, the same step runs once without AC: a batch the model cannot take (a
wrong keyword, a bad shape) fails there and is bad input, not a divergence. When a region diverges and a fix
exists for the classes found (``swap_mixers`` for a leaking class with a drop-in, then ``isolate_seqlens``), a
fresh model gets it and runs the same step.

Outcome (:attr:`CheckResult.exit_code`): 0 when every checkpointed region is aligned, the step ran and no mixer
leaks across packed documents here (a class known to drop the offsets, or one that leaks without a package
missing here: transformers' Gated DeltaNets without ``causal_conv1d``); 1 otherwise. Bad input raises
:class:`CheckInputError` (the command exits with 2): also a batch without packed offsets (nothing to check), a
step that fails without AC, and a step the audit could not judge (no checkpointed region recomputed, or regions run
as reentrant checkpoints, which it cannot look into). A step that fails without AC because FLA refuses this
environment (its #640 guard: the gated backward on a Hopper GPU with Triton >= 3.4 and < 3.7.1) raises
:class:`CheckEnvironmentError` instead, naming what to install (the command exits with 3): neither the model nor AC
is at fault.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.families import drop_in_for, leak_remedy, remedy
from fla_ac_isolation.foreign_classes import FLA_BACKED_MIXERS, ForeignClass, LeakingMixer, UpstreamMixer
from fla_ac_isolation.harness.environment import resolve_device
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.mixer_plan import DROP_IN, EXPOSED, LEAKING, PlannedMixer, classify
from fla_ac_isolation.policies import POLICIES

__all__ = ["CheckEnvironmentError", "CheckInputError", "CheckResult", "CheckSpec", "CheckStep", "MixerFinding",
           "RegionVerdict", "autotune_notice", "load_callable", "load_model", "resolve_policy", "run_check",
           "survey"]

OWN_CODE_FIX = ("your own FLA-calling code: build a LayerLocalSeqlens once per forward and hand each layer "
                "seqlens.local() inside its forward (docs/own-model.md)")


class CheckInputError(ValueError):
    """What the check was given cannot be checked: the spec, the callable, what it returned, or the model's
    layers (the message names which)."""


class CheckEnvironmentError(RuntimeError):
    """The environment cannot run the check: FLA refuses it (its #640 guard, recognised by
    :func:`fla_ac_isolation.fla_seam.versions.is_hopper_gdn_refusal`); the message names what to install and
    FLA's own error. Not the model's fault, nor AC's (the command exits with 3)."""


@dataclass(frozen=True)
class CheckSpec:
    """What to check; :meth:`validate` checks every field.

    Attributes:
        model: ``"module:callable"`` or ``"path/to/file.py:callable"`` returning ``(model, batch)``.
        config: a tiny model instead (:func:`fla_ac_isolation.harness.foreign_models.tiny_names`); exactly one of
            the two.
        ac: ``"selective"`` (with ``policy``) or ``"full"``. Ignored for a model that checkpoints itself (its
            factory's model already calls ``checkpoint``): it is audited as it is, with its own policy.
        policy: the SAC policy: a name (:data:`fla_ac_isolation.policies.POLICIES`), ``"module:callable"`` /
            ``"path/to/file.py:callable"`` naming the user's own policy function, or that function itself: a
            function as ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes it,
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (one with a ``fresh()`` method is renewed for
            every checkpointed call).
        device: ``cpu``, ``cuda`` or ``auto`` (``cuda`` when a GPU is visible).
        seed: the tiny model's weights and batch (``config`` only).
        verify_fix: when the model diverges, run the fix on a fresh model too.
        first_config: on CUDA, every Triton autotuner of FLA keeps its first config (no autotuning: the first
            step takes seconds, not minutes; the kernels run untuned, the verdict is the same). No effect on CPU.
    """

    model: str | None = None
    config: str | None = None
    ac: str = "selective"
    policy: str | Callable = "save-all-copies"
    device: str = "auto"
    seed: int = 0
    verify_fix: bool = True
    first_config: bool = False

    def validate(self) -> CheckSpec:
        """Return self after checking every field.

        Raises:
            CheckInputError: naming the field and what it must be.
        """
        if (self.model is None) == (self.config is None):
            raise CheckInputError("give exactly one of model ('module:callable') and config (a model_type)")
        if self.model is not None and (not isinstance(self.model, str) or self.model.count(":") != 1
                                       or not all(self.model.split(":"))):
            raise CheckInputError(f"model must be 'module:callable' or 'path/to/file.py:callable', got {self.model!r}")
        if self.config is not None:
            from fla_ac_isolation.harness.foreign_models import tiny_names

            names = tiny_names()
            if self.config not in names:
                raise CheckInputError(f"config must be one of {sorted(names)}, got {self.config!r}")
        if self.ac not in ("full", "selective"):
            raise CheckInputError(f"ac must be 'full' or 'selective', got {self.ac!r}")
        if self.ac == "selective":
            resolve_policy(self.policy)
        try:
            resolve_device(self.device)
        except ValueError as err:
            raise CheckInputError(str(err)) from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise CheckInputError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.first_config, bool):
            raise CheckInputError(f"first_config must be a bool, got {self.first_config!r}")
        return self

    @property
    def policy_name(self) -> str:
        """How the report names the policy: its name, its ``module:callable``, or the function's name."""
        if isinstance(self.policy, str):
            return self.policy
        return getattr(self.policy, "__qualname__", None) or type(self.policy).__name__


POLICY_EXPECTED = ("one of {names}, 'module:callable' or 'path/to/file.py:callable' naming your own SAC policy, or "
                   "that function: (ctx, op, *args, **kwargs) -> CheckpointPolicy, as "
                   "torch.utils.checkpoint.create_selective_checkpoint_contexts takes it")


def resolve_policy(policy: Any) -> Callable:
    """The SAC policy function of ``policy`` (:attr:`CheckSpec.policy`): a named policy is built fresh, a
    ``module:callable`` is imported (:func:`load_callable`), a function is returned as it is.

    Raises:
        CheckInputError: naming ``policy`` and what it must be: an unknown name, a target that cannot be
            imported, or a function that does not take ``(ctx, op, ...)`` (e.g. a policy constructor uncalled).
    """
    from fla_ac_isolation.policies import sac_context_fn

    expected = POLICY_EXPECTED.format(names=sorted(POLICIES))
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    if isinstance(policy, str):
        if policy.count(":") != 1 or not all(policy.split(":")):
            raise CheckInputError(f"policy must be {expected}, got {policy!r}")
        fn = load_callable(policy, "policy")
    elif callable(policy):
        fn = policy
    else:
        raise CheckInputError(f"policy must be {expected}, got {type(policy).__name__}")
    try:
        sac_context_fn(fn)
    except TypeError as err:
        raise CheckInputError(f"policy {_shown(policy)}: {err}") from None
    return fn


def _shown(policy: Any) -> str:
    return repr(policy) if isinstance(policy, str) else getattr(policy, "__qualname__", repr(policy))


@dataclass(frozen=True)
class MixerFinding:
    """One FLA-backed class found in the model.

    Attributes:
        cls: ``"module.Class"``; name: the class name; framework: its library in prose.
        status: ``"exposed"`` (hands shared offsets to FLA: the fault), ``"covered"`` (hooked by
            ``isolate_seqlens``, or one of this package's drop-ins), ``"leaking"`` (drops the offsets: packed
            documents leak into each other).
        paths: where it sits in the model.
        offsets: the arguments ``isolate_seqlens`` refreshes (exposed, covered).
        why: how its packed documents leak into each other here: a leaking class, or an exposed / covered one
            that leaks without a package missing here (its short conv); ``None``: they do not.
        fix: the one-line fix (of the fault when exposed, of the leak when leaking), ``None`` when covered.
        leak_fix: for an exposed or covered class whose documents leak here (``why``), what to do about that.
        observed: ``"fresh offsets"``: the class is of those that take shared offsets, but in the audited step
            every call of every instance handed FLA's kernels a ``cu_seqlens`` object no other call (another
            layer, or its forward / recompute) handed them (``LayerLocalSeqlens.local()``, a hook, the user's
            own copy): covered by what the step observed (on a CPU, where the served kernels record what they
            receive). ``None``: decided from the class (and its hook).
    """

    cls: str
    name: str
    framework: str
    status: str
    paths: tuple[str, ...]
    offsets: tuple[str, ...] = ()
    why: str | None = None
    fix: str | None = None
    leak_fix: str | None = None
    observed: str | None = None


@dataclass(frozen=True)
class RegionVerdict:
    """One checkpointed region: ``aligned``, ``divergent`` (first differing op, the FLA helpers whose cache state
    differed, the module running there) or ``not recomputed``."""

    label: str
    verdict: str
    first_diff: int | None = None
    forward_op: str | None = None
    recompute_op: str | None = None
    fla_helpers: tuple[str, ...] = ()
    where: str | None = None


@dataclass(frozen=True)
class CheckStep:
    """One audited step: the regions, the first line of an error the step raised (``None``: it ran), how
    often the regions' forwards called FLA's cached index helpers (0: no packed offsets reached FLA), why the
    audit could not judge some or all of what was checkpointed (:attr:`ReplayAudit.why_blind
    <fla_ac_isolation.ReplayAudit.why_blind>`: no region recomputed, reentrant regions; ``None``: every region
    that ran was looked into, or none ran), the largest absolute difference of its gradients from the step
    without AC (``None``: not compared: the model checkpoints itself, or the step failed), and the paths of the
    FLA-backed modules every call of which handed FLA's kernels an offsets object of its own
    (:attr:`MixerFinding.observed`; CPU only)."""

    regions: tuple[RegionVerdict, ...]
    error: str | None = None
    fla_helper_calls: int = 0
    blind: str | None = None
    grad_diff: float | None = None
    fresh_offsets: tuple[str, ...] = ()

    @property
    def aligned(self) -> bool:
        """The step ran, at least one region was checkpointed, and none diverged."""
        return self.error is None and bool(self.regions) and not self.divergent

    @property
    def divergent(self) -> bool:
        """A region's recompute ran other ops than its forward."""
        return any(r.verdict == "divergent" for r in self.regions)


@dataclass
class CheckResult:
    """What :func:`run_check` found.

    Attributes:
        spec: the validated spec (device resolved).
        model: the model's class name.
        mixers: the FLA-backed classes found (:func:`survey`), one entry per class and status.
        as_given: the step of the model as given.
        fixed: the same step after ``fix_applied``, or ``None`` (not needed, or no fix this package applies).
        fix_applied: the calls made for ``fixed`` (``"swap_mixers(model)"``, ``"isolate_seqlens(model)"``).
        fixes: the one-line fixes to apply, in order.
        self_checkpointed: the model checkpoints itself (its blocks call ``checkpoint``): audited as it is,
            under its own policy (``spec.ac`` / ``spec.policy`` are not applied).
    """

    spec: CheckSpec
    model: str
    mixers: list[MixerFinding]
    as_given: CheckStep
    fixed: CheckStep | None = None
    fix_applied: tuple[str, ...] = ()
    fixes: list[str] = field(default_factory=list)
    self_checkpointed: bool = False

    @property
    def leaking(self) -> list[MixerFinding]:
        """The classes whose packed documents leak into each other here (``status`` leaking, or ``leak_fix``)."""
        return [m for m in self.mixers if m.status == "leaking" or m.leak_fix is not None]

    @property
    def harmless_under_full_ac(self) -> bool:
        """Under full AC (applied by the check) a region diverged, yet the step ran and its gradients equal
        those of the step without AC: full AC replays nothing by index, so the op sequence changed no result;
        under SAC the same divergence hands the recompute other ops' saved outputs."""
        step = self.as_given
        return (self.spec.ac == "full" and not self.self_checkpointed and step.error is None and bool(step.regions)
                and not step.aligned and step.grad_diff == 0.0)

    @property
    def exit_code(self) -> int:
        """0: aligned and nothing leaks, or (full AC) divergent but with the gradients of the step without AC
        (:attr:`harmless_under_full_ac`) and nothing leaks; 1: a region diverged (under SAC, or with other
        gradients), the step failed under AC, or a mixer leaks."""
        return 0 if (self.as_given.aligned or self.harmless_under_full_ac) and not self.leaking else 1

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: every field, ``aligned`` per step and the exit code."""
        out = asdict(self)
        out["spec"]["policy"] = self.spec.policy_name
        out["harmless_under_full_ac"] = self.harmless_under_full_ac
        out["as_given"]["aligned"] = self.as_given.aligned
        if self.fixed is not None:
            out["fixed"]["aligned"] = self.fixed.aligned
        out["exit_code"] = self.exit_code
        return out


# ------------------------------------------------------------------------------------------- loading
def _module_not_found_hint(err: BaseException, where: str) -> str:
    top = where.split(".")[0]
    if not isinstance(err, ModuleNotFoundError) or err.name is None or err.name.split(".")[0] != top:
        return ""
    return (f" (module:callable imports from the working directory {os.getcwd()} and sys.path: run from the "
            f"folder that holds {top}.py or the {top}/ package, or give path/to/file.py:callable)")


def load_callable(target: str, argument: str = "model") -> Callable:
    """The callable of ``target``: ``"path/to/file.py:callable"`` (the file, run as a module) or
    ``"module:callable"``, imported with the working directory on ``sys.path`` (first, as pytest and uvicorn
    put it; it stays there), so a module next to where the command runs is found.

    Raises:
        CheckInputError: naming ``argument`` and ``target``: no such file, the import fails (a
            ``ModuleNotFoundError`` of the module itself says where modules are looked up), no such attribute,
            or it is not callable.
    """
    where, _, name = target.partition(":")
    try:
        if where.endswith(".py") or "/" in where:
            path = pathlib.Path(where)
            if not path.is_file():
                raise CheckInputError(f"{argument} {target!r}: no file {where}")
            spec = importlib.util.spec_from_file_location(f"_fla_ac_isolation_check_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up while a class is created
            spec.loader.exec_module(module)
        else:
            cwd = os.getcwd()
            if cwd not in sys.path and "" not in sys.path:
                sys.path.insert(0, cwd)
            module = importlib.import_module(where)
    except CheckInputError:
        raise
    except Exception as err:
        raise CheckInputError(f"{argument} {target!r}: importing {where} failed: {first_line(err)}"
                              f"{_module_not_found_hint(err, where)}") from err
    if not hasattr(module, name):
        raise CheckInputError(f"{argument} {target!r}: {where} has no callable {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        shown = f"{where}:{name}" if where.endswith(".py") or "/" in where else f"{where}.{name}"
        raise CheckInputError(f"{argument} {target!r}: {shown} is not callable ({type(fn).__name__})")
    return fn


def _holds_offsets(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        return value.dim() == 1 and integer
    return isinstance(value, tuple) and any(_holds_offsets(v) for v in value)  # torchtitan's VarlenMetadata


def _offsets_keywords() -> str:
    """The keywords the known classes' models read packed offsets from: ``cu_seq_lens_q (transformers), ...``."""
    known = {}
    for entry in FLA_BACKED_MIXERS:
        known.setdefault(entry.framework, entry.offsets[0])
    known.setdefault("flash-linear-attention's models", "cu_seqlens")  # what the FLA rule's classes read
    return ", ".join(f"{keyword} ({framework})" for framework, keyword in known.items())


def _require_offsets(batch: dict) -> None:
    """Refuse a batch without packed offsets: nothing of the fault (or a leak) can show in its step."""
    if any(_holds_offsets(v) for v in batch.values()):
        return
    raise CheckInputError(
        f"the batch carries no packed offsets (no 1-D integer tensor among model(**batch)'s keywords: "
        f"{', '.join(batch) or 'none'}), so nothing can be checked: give one packed batch with its offsets under "
        f"the keyword the model reads: {_offsets_keywords()}"
    )


def load_model(spec: CheckSpec) -> tuple[nn.Module, dict]:
    """``(model, batch)`` of ``spec`` (a fresh model on each call), on the spec's device.

    Raises:
        CheckInputError: the callable cannot be imported, raises, or returns something else than
            ``(nn.Module, dict)``; the batch holds no packed offsets (no 1-D integer tensor, or tuple holding one).
    """
    if spec.config is not None:
        from fla_ac_isolation.harness.foreign_models import build_tiny

        model, batch, _ = build_tiny(spec.config, seed=spec.seed)
    else:
        fn = load_callable(spec.model)
        try:
            got = fn()
        except Exception as err:
            raise CheckInputError(f"model {spec.model!r}: calling it failed: {first_line(err)}") from err
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], nn.Module)
                and isinstance(got[1], dict)):
            raise CheckInputError(f"model {spec.model!r} must return (nn.Module, dict of forward keyword arguments), "
                                  f"got {type(got).__name__}")
        model, batch = got
        _require_offsets(batch)
    device = torch.device(spec.device)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return model.to(device).train(), batch


# -------------------------------------------------------------------------------------------- survey
def _finding(entry: UpstreamMixer | LeakingMixer, status: str, paths: list[str]) -> MixerFinding:
    if status == "leaking":
        return MixerFinding(entry.qualified, entry.name, entry.framework, status, tuple(paths), why=entry.why,
                            fix=remedy(entry))
    fix = None
    if status == "exposed":
        swap = drop_in_for(entry)
        fix = "isolate_seqlens(model)" + (" (or swap_mixers(model): a drop-in replaces it)" if swap else "")
    why = entry.leak()  # e.g. transformers' Gated DeltaNets without causal_conv1d: their conv mixes documents
    return MixerFinding(entry.qualified, entry.name, entry.framework, status, tuple(paths), entry.offsets, why=why,
                        fix=fix, leak_fix=leak_remedy(entry) if why else None)


_CHECK_STATUS = {EXPOSED: "exposed", LEAKING: "leaking"}  # hooked and drop-in: "covered"


def survey(model: nn.Module, plan: tuple[PlannedMixer, ...] | None = None) -> list[MixerFinding]:
    """The FLA-backed classes of ``model`` this package knows, and its own drop-ins, grouped by class and status
    (``exposed``, ``covered``: hooked or a drop-in, ``leaking``), in module order.

    Args:
        model: the model.
        plan: its plan (:func:`~fla_ac_isolation.mixer_plan.classify`), when the caller has it (not classified
            again); ``None``: classified here.
    """
    plan = classify(model) if plan is None else plan
    groups: dict[tuple[str, str], tuple[PlannedMixer, list[str]]] = {}
    for p in plan:
        groups.setdefault((p.cls, _CHECK_STATUS.get(p.status, "covered")), (p, []))[1].append(p.path)
    out = []
    for (qualified, status), (first, paths) in groups.items():
        if first.status == DROP_IN:
            out.append(MixerFinding(qualified, first.matched.__name__, "fla_ac_isolation", status, tuple(paths)))
        else:
            out.append(_finding(first.entry, status, paths))
    return out


# ---------------------------------------------------------------------------------------------- step
def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CheckInputError(f"model(**batch) must return a scalar loss or an object with .loss (labels in the "
                              f"batch?), got {type(out).__name__}")
    return loss


def autotune_notice(device: str, first_config: bool) -> str | None:
    """What the check tells the user before a step on ``device`` (``None``: nothing to tell: a CPU, whose FLA
    kernels are served by reference stand-ins and never autotune)."""
    if device == "cpu":
        return None
    if first_config:
        return ("FLA's Triton autotuners keep their first config (--first-config): kernels compile once per "
                "shape, untuned; the verdict does not depend on it")
    return ("FLA compiles and autotunes its Triton kernels on first use: the first step can take minutes with no "
            "output (rerun with --first-config, or CheckSpec(first_config=True), to keep each autotuner's first "
            "config: seconds, untuned kernels, the same verdict)")


def _serving(spec: CheckSpec):
    if spec.device != "cpu":
        if not spec.first_config:
            return contextlib.nullcontext()
        from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config

        return first_autotune_config()
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    return reference_kernels()


def _grads(model: nn.Module) -> dict[int, torch.Tensor]:
    """The gradients by parameter object (checkpoint wrappers rename parameters, they keep the objects)."""
    return {id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None}


def _grad_diff(model: nn.Module, reference: dict[int, torch.Tensor] | None) -> float | None:
    if reference is None:
        return None
    got = _grads(model)
    if got.keys() != reference.keys():
        return float("inf")
    return max((float((got[n].double() - reference[n].double()).abs().max()) for n in got), default=0.0)


def _dry_run(model: nn.Module, batch: dict, spec: CheckSpec) -> tuple[bool, dict[int, torch.Tensor] | None]:
    """One step of ``model`` as given, before the check applies AC, under a :class:`ReplayAudit` that sees
    whether the model checkpoints itself; gradients are dropped after it.

    Returns:
        ``(self_checkpointed, gradients)``: whether a checkpointed region ran (the model's own ``checkpoint``
        calls), and the gradients of the step when it ran without AC (``None`` when it checkpoints itself).

    Raises:
        CheckInputError: the step raised without AC, or the forward of a model that checkpoints itself raised
            (a forward runs the ops it runs without AC: only the backward recomputes), naming its error: the
            batch or the model is wrong, not AC; or the forward returns no loss.
    """
    model.zero_grad(set_to_none=True)
    error, in_forward = None, True
    with _serving(spec), ReplayAudit(model, on_divergence="record") as audit:
        try:
            loss = _loss(model(**batch))
            in_forward = False
            loss.backward()
        except CheckInputError:
            raise
        except Exception as err:
            error = err
    self_checkpointed = bool(audit.regions)
    if error is not None:
        _refuse_environment(error)
    if error is not None and not self_checkpointed:
        raise CheckInputError(f"model(**batch) fails without activation checkpointing, so the model or the "
                              f"batch is wrong, not AC: {first_line(error)}") from error
    if error is not None and in_forward:
        raise CheckInputError(f"model(**batch) fails in its forward, before any recompute (the model checkpoints "
                              f"itself; its forward runs the ops it runs without AC), so the model or the batch is "
                              f"wrong, not AC: {first_line(error)}") from error
    grads = None if self_checkpointed else _grads(model)
    model.zero_grad(set_to_none=True)
    return self_checkpointed, grads


def _refuse_environment(err: Exception) -> None:
    """Raise :class:`CheckEnvironmentError` when ``err`` is FLA's #640 refusal (the seam recognises it)."""
    from fla_ac_isolation.fla_seam.versions import HOPPER_GDN_REMEDY, fla_version, is_hopper_gdn_refusal

    if not is_hopper_gdn_refusal(err):
        return
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "(version unknown)"
    raise CheckEnvironmentError(
        f"FLA refuses this environment, not the model: FLA {fla_version()} refuses the gated backward "
        f"(chunk_bwd_dqkwg: gated delta rule, simple GLA) on a Hopper GPU with Triton {triton} (Triton >= 3.4.0 and "
        f"< 3.7.1 miscompile it, FLA issue #640); {HOPPER_GDN_REMEDY}, then run check again; FLA's error: "
        f"{first_line(err)}"
    ) from err


class _OffsetsSeen:
    """The tensors FLA's cached index helpers received during each call of each watched module
    (``{(path, n-th call): [the tensors of each helper call]}``; a forward and each recompute are separate calls),
    as :func:`~fla_ac_isolation.fla_cache.probe_tensor_cache` records them (``arguments=True``: a hit's are those
    of the entry it matched): on any device. The batch's own tensors are nobody's own."""

    def __init__(self, model: nn.Module, paths: list[str], probe: Any, batch: dict) -> None:
        self.probe = probe
        self.shared = {id(v): v for v in _tensors(batch.values())}  # kept: their ids stay theirs
        self.seen: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
        self.started: dict[str, int] = {}  # path -> how many events were recorded when its call began
        self.handles = []
        for path in paths:
            module = model.get_submodule(path)
            self.handles.append(module.register_forward_pre_hook(self._pre(path)))
            self.handles.append(module.register_forward_hook(self._post(path)))

    def _pre(self, path: str):
        def hook(module, args):
            self.started[path] = self.probe.mark()
        return hook

    def _post(self, path: str):
        def hook(module, args, output):
            start = self.started.pop(path)
            n = sum(p == path for p, _ in self.seen)
            self.seen[(path, n)] = [e.arguments for e in self.probe.events[start:]]
        return hook

    def fresh(self) -> tuple[str, ...]:
        """The watched paths each call of which handed FLA's helpers, in every helper call, a tensor no other call
        (nor the batch) handed them: no entry another call made can be hit (FLA's cache compares every argument
        by identity). A path one of whose calls made no helper call is left out: nothing to judge."""
        owner: dict[int, set[tuple[str, int] | None]] = {i: {None} for i in self.shared}
        for key, calls in self.seen.items():
            for arguments in calls:
                for t in arguments:
                    owner.setdefault(id(t), set()).add(key)
        out = []
        for path in dict.fromkeys(p for p, _ in self.seen):
            keys = [k for k in self.seen if k[0] == path]
            if all(self.seen[k] and all(any(owner[id(t)] == {k} for t in arguments) for arguments in self.seen[k])
                   for k in keys):
                out.append(path)
        return tuple(out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values``, those in tuples too (torchtitan's ``VarlenMetadata``)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, tuple):
            out += _tensors(v)
    return out


def _step(model: nn.Module, batch: dict, spec: CheckSpec, *, self_checkpointed: bool = False,
          watch: tuple[str, ...] = (), reference: dict[int, torch.Tensor] | None = None) -> CheckStep:
    """One audited step: ``model`` checkpointed by the check (``spec.ac``, ``spec.policy``), or as it is when
    it checkpoints itself; ``watch``: the FLA-backed modules whose offsets objects are recorded
    (:attr:`CheckStep.fresh_offsets`); ``reference``: the gradients without AC to compare with."""
    from fla_ac_isolation.fla_cache import clear_tensor_cache, probe_tensor_cache
    from fla_ac_isolation.policies import checkpoint_layers

    if not self_checkpointed:
        try:
            checkpoint_layers(model, spec.ac, resolve_policy(spec.policy) if spec.ac == "selective" else None)
        except ValueError as err:
            raise CheckInputError(f"cannot checkpoint the model's layers: {err}") from err
    clear_tensor_cache()
    model.zero_grad(set_to_none=True)
    error = None
    with (_serving(spec), probe_tensor_cache(arguments=True) as probe,
          ReplayAudit(model, on_divergence="record") as audit):
        seen = _OffsetsSeen(model, list(watch), probe, batch)
        try:
            _loss(model(**batch)).backward()
        except CheckInputError:
            raise
        except Exception as err:
            error = first_line(err)
        finally:
            seen.remove()
    regions = tuple(
        RegionVerdict(r.label, r.verdict, r.first_diff, r.forward_op, r.recompute_op,
                      tuple(d.helper for d in r.fla), r.where)
        for r in audit.regions
    )
    calls = sum(n for r in audit.regions for counts in r.forward_cache.values() for n in counts.values())
    blind = audit.why_blind if audit.regions or audit.unaudited else None  # none ran: CheckStep.aligned's rule
    diff = _grad_diff(model, reference) if error is None else None
    return CheckStep(regions, error, calls, blind=blind, grad_diff=diff, fresh_offsets=seen.fresh())


def _require_judged(step: CheckStep, mixers: list[MixerFinding]) -> None:
    """The one rule of what a step that ran must have shown to be judged (the CLI and the pytest plugin read it
    from here): refuse a step in which the audit could not judge every checkpointed region (none was recomputed,
    or some ran as reentrant checkpoints it cannot look into), in which no checkpointed region ran, or in which
    nothing of FLA's offsets was seen: the model's foreign FLA-backed layers ran but FLA never received packed
    offsets (no call of its cached index helpers: the offsets sit under a keyword the model does not read, FLA's
    models take unknown keywords silently, and the batch ran as one sequence), or the model holds no FLA-backed
    class and its regions called none of FLA's index helpers. Passing any of them would call unseen regions or an
    unseen fault aligned. Our drop-ins count as seen: on CUDA they hand FLA a precomputed chunk schedule."""
    if step.error is not None:
        return
    if step.blind is not None:
        raise CheckInputError(
            f"the audit could not judge this step ({step.blind}), so nothing can be passed: checkpoint with "
            f"use_reentrant=False and make the loss depend on every checkpointed layer"
        )
    if not step.regions:
        raise CheckInputError("no checkpointed region ran: nothing was recomputed, so nothing was judged: the "
                              "model's forward must call the layers of its layer list")
    takes = [m.name for m in mixers if m.status != "leaking" and m.framework != "fla_ac_isolation"]  # foreign
    if step.fla_helper_calls == 0 and takes:
        raise CheckInputError(
            f"no packed offsets reached FLA: the model's FLA-backed layers ({', '.join(takes)}) called none of "
            f"FLA's index helpers, so they ran the batch as one sequence and nothing can be checked; give the "
            f"offsets under the keyword the model reads: {_offsets_keywords()}"
        )
    if step.fla_helper_calls == 0 and not mixers:
        raise CheckInputError(
            "nothing was judged: the step found no FLA-backed class and its checkpointed regions called none of "
            "FLA's index helpers, so no packed offsets reached FLA and nothing of the fault could show; check a "
            "model whose layers call FLA, with its offsets under the keyword it reads"
        )


def _apply_fix(model: nn.Module, mixers: list[MixerFinding]) -> tuple[str, ...]:
    """``swap_mixers`` where a leaking class has a drop-in, then ``isolate_seqlens`` for what stays exposed:
    ``mixers`` is the survey of the plan (:func:`survey`) of a model built by the same factory, so what stays
    exposed is read from it (its exposed paths that ``swap_mixers`` did not replace), not classified again."""
    from fla_ac_isolation.isolate import isolate_seqlens
    from fla_ac_isolation.swap import swap_mixers

    applied, swapped = [], set()
    leaking = [m for m in mixers if m.status == "leaking" or m.leak_fix is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the leaking classes are reported already
        if any(drop_in_for(ForeignClass(*m.cls.rsplit(".", 1))) for m in leaking):
            swapped = set(swap_mixers(model))
            applied.append("swap_mixers(model)")
        if any(p not in swapped for m in mixers if m.status == EXPOSED for p in m.paths):
            isolate_seqlens(model)
            applied.append("isolate_seqlens(model)")
    return tuple(applied)


def _observed_covered(mixers: list[MixerFinding], fresh: tuple[str, ...]) -> list[MixerFinding]:
    """An exposed class every instance of which the step saw hand FLA fresh offsets in every call is covered."""
    out = []
    for m in mixers:
        if m.status == "exposed" and m.paths and all(p in fresh for p in m.paths):
            m = replace(m, status="covered", fix=None, observed="fresh offsets")
        out.append(m)
    return out


def run_check(spec: CheckSpec) -> CheckResult:
    """Check the model of ``spec``: survey its FLA-backed classes, audit one step, verify the fix.

    A model that checkpoints itself (its dry step runs checkpointed regions) is audited as it is, under its
    own policy; otherwise the check checkpoints its layers with ``spec.ac`` / ``spec.policy``. An exposed
    class whose every call the audited step saw hand FLA an offsets object of its own is reported covered
    (:attr:`MixerFinding.observed`).

    Raises:
        CheckInputError: an invalid ``spec``, a model that cannot be loaded, a batch without packed offsets
            (or whose offsets never reach FLA), a step the audit could not judge (no region recomputed, or
            reentrant regions), a step that fails without AC, a model without a layer list to
            checkpoint, or a forward that returns no loss.
        CheckEnvironmentError: the step without AC fails because FLA refuses this environment (#640).
    """
    spec = spec.validate()
    if spec.device == "auto":
        spec = replace(spec, device=resolve_device("auto"))
    model, batch = load_model(spec)
    mixers = survey(model, classify(model))
    self_checkpointed, reference = _dry_run(model, batch, spec)
    watch = tuple(p for m in mixers if m.status == "exposed" for p in m.paths)
    as_given = _step(model, batch, spec, self_checkpointed=self_checkpointed, watch=watch, reference=reference)
    _require_judged(as_given, mixers)
    mixers = _observed_covered(mixers, as_given.fresh_offsets)
    result = CheckResult(spec, type(model).__name__, mixers, as_given, self_checkpointed=self_checkpointed)
    result.fixes = [f"{m.name}: {m.fix}" for m in mixers if m.fix]
    result.fixes += [f"{m.name}, to keep packed documents apart: {m.leak_fix}" for m in mixers if m.leak_fix]
    if as_given.divergent and not any(m.status == "exposed" for m in mixers):
        result.fixes.append(OWN_CODE_FIX)
    if spec.verify_fix and not as_given.aligned:
        fresh, fresh_batch = load_model(spec)
        applied = _apply_fix(fresh, mixers)
        if applied:
            result.fixed = _step(fresh, fresh_batch, spec, self_checkpointed=self_checkpointed)
            result.fix_applied = applied
    return result
