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
:class:`CheckInputError` (the command exits with 2): also a batch without packed offsets (nothing to check) and
a step that fails without AC.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pathlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.families import (
    FLA_BACKED_MIXERS,
    ForeignClass,
    LeakingMixer,
    UpstreamMixer,
    drop_in_for,
    foreign_mixer,
)
from fla_ac_isolation.harness.environment import resolve_device
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.isolate import is_isolated
from fla_ac_isolation.policies import POLICIES

__all__ = ["CheckInputError", "CheckResult", "CheckSpec", "CheckStep", "MixerFinding", "RegionVerdict",
           "load_model", "run_check", "survey"]

OWN_CODE_FIX = ("your own FLA-calling code: build a LayerLocalSeqlens once per forward and hand each layer "
                "seqlens.local() inside its forward (docs/own-model.md)")


class CheckInputError(ValueError):
    """What the check was given cannot be checked: the spec, the callable, what it returned, or the model's
    layers (the message names which)."""


@dataclass(frozen=True)
class CheckSpec:
    """What to check; :meth:`validate` checks every field.

    Attributes:
        model: ``"module:callable"`` or ``"path/to/file.py:callable"`` returning ``(model, batch)``.
        config: a tiny model instead (:func:`fla_ac_isolation.harness.foreign_models.tiny_names`); exactly one of the
            two.
        ac: ``"selective"`` (with ``policy``) or ``"full"``.
        policy: SAC policy name (:data:`fla_ac_isolation.policies.POLICIES`).
        device: ``cpu``, ``cuda`` or ``auto`` (``cuda`` when a GPU is visible).
        seed: the tiny model's weights and batch (``config`` only).
        verify_fix: when the model diverges, run the fix on a fresh model too.
    """

    model: str | None = None
    config: str | None = None
    ac: str = "selective"
    policy: str = "save-all-copies"
    device: str = "auto"
    seed: int = 0
    verify_fix: bool = True

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
        if self.ac == "selective" and self.policy not in POLICIES:
            raise CheckInputError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        try:
            resolve_device(self.device)
        except ValueError as err:
            raise CheckInputError(str(err)) from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise CheckInputError(f"seed must be an int, got {self.seed!r}")
        return self


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
    """One audited step: the regions, the first line of an error the step raised (``None``: it ran), and how
    often the regions' forwards called FLA's cached index helpers (0: no packed offsets reached FLA)."""

    regions: tuple[RegionVerdict, ...]
    error: str | None = None
    fla_helper_calls: int = 0

    @property
    def aligned(self) -> bool:
        """The step ran, at least one region was checkpointed, and none diverged."""
        return self.error is None and bool(self.regions) and all(r.verdict != "divergent" for r in self.regions)


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
    """

    spec: CheckSpec
    model: str
    mixers: list[MixerFinding]
    as_given: CheckStep
    fixed: CheckStep | None = None
    fix_applied: tuple[str, ...] = ()
    fixes: list[str] = field(default_factory=list)

    @property
    def leaking(self) -> list[MixerFinding]:
        """The classes whose packed documents leak into each other here (``status`` leaking, or ``leak_fix``)."""
        return [m for m in self.mixers if m.status == "leaking" or m.leak_fix is not None]

    @property
    def exit_code(self) -> int:
        """0: aligned and nothing leaks; 1: a region diverged, the step failed under AC, or a mixer leaks."""
        return 0 if self.as_given.aligned and not self.leaking else 1

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: every field, ``aligned`` per step and the exit code."""
        out = asdict(self)
        out["as_given"]["aligned"] = self.as_given.aligned
        if self.fixed is not None:
            out["fixed"]["aligned"] = self.fixed.aligned
        out["exit_code"] = self.exit_code
        return out


# ------------------------------------------------------------------------------------------- loading
def _callable(target: str) -> Callable[[], Any]:
    where, _, name = target.partition(":")
    try:
        if where.endswith(".py") or "/" in where:
            path = pathlib.Path(where)
            if not path.is_file():
                raise CheckInputError(f"model {target!r}: no file {where}")
            spec = importlib.util.spec_from_file_location(f"_fla_ac_isolation_check_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up while a class is created
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except CheckInputError:
        raise
    except Exception as err:
        raise CheckInputError(f"model {target!r}: importing {where} failed: {first_line(err)}") from err
    if not hasattr(module, name):
        raise CheckInputError(f"model {target!r}: {where} has no callable {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        shown = f"{where}:{name}" if where.endswith(".py") or "/" in where else f"{where}.{name}"
        raise CheckInputError(f"model {target!r}: {shown} is not callable ({type(fn).__name__})")
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
        fn = _callable(spec.model)
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
                            fix=entry.remedy())
    fix = None
    if status == "exposed":
        swap = drop_in_for(entry)
        fix = "isolate_seqlens(model)" + (" (or swap_mixers(model): a drop-in replaces it)" if swap else "")
    why = entry.leak()  # e.g. transformers' Gated DeltaNets without causal_conv1d: their conv mixes documents
    return MixerFinding(entry.qualified, entry.name, entry.framework, status, tuple(paths), entry.offsets, why=why,
                        fix=fix, leak_fix=entry.leak_remedy() if why else None)


def _drop_in(cls: type) -> bool:
    """``cls`` is one of this package's mixers (:mod:`fla_ac_isolation.mixers`' public classes), not one of
    their sub-modules (gates, norms)."""
    if not cls.__module__.startswith("fla_ac_isolation.mixers"):
        return False
    mixers = importlib.import_module("fla_ac_isolation.mixers")
    return getattr(mixers, cls.__qualname__, None) is cls


def survey(model: nn.Module) -> list[MixerFinding]:
    """The FLA-backed classes of ``model`` this package knows (:func:`~fla_ac_isolation.families.foreign_mixer`),
    and its own drop-ins, grouped by class and status, in module order."""
    sources: dict = {}
    groups: dict[tuple[str, str], tuple[Any, list[str]]] = {}
    for path, module in model.named_modules():
        cls = type(module)
        if _drop_in(cls):
            key = (f"{cls.__module__}.{cls.__qualname__}", "covered")
            groups.setdefault(key, (cls, []))[1].append(path)
            continue
        found = foreign_mixer(module, sources)
        if found is None or (isinstance(found[0], UpstreamMixer) and not found[0].offsets):
            continue
        entry = found[0]
        status = "leaking" if isinstance(entry, LeakingMixer) else ("covered" if is_isolated(module) else "exposed")
        groups.setdefault((entry.qualified, status), (entry, []))[1].append(path)
    out = []
    for (qualified, status), (entry, paths) in groups.items():
        if isinstance(entry, type):  # one of our drop-ins
            out.append(MixerFinding(qualified, entry.__name__, "fla_ac_isolation", status, tuple(paths)))
        else:
            out.append(_finding(entry, status, paths))
    return out


# ---------------------------------------------------------------------------------------------- step
def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CheckInputError(f"model(**batch) must return a scalar loss or an object with .loss (labels in the "
                              f"batch?), got {type(out).__name__}")
    return loss


def _serving(device: str):
    if device != "cpu":
        return contextlib.nullcontext()
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    return reference_kernels()


def _without_ac(model: nn.Module, batch: dict, spec: CheckSpec) -> None:
    """One step of ``model`` as given, before AC is applied; gradients are dropped after it.

    Raises:
        CheckInputError: the step raised (naming its error: the batch or the model is wrong, not AC), or the
            forward returns no loss.
    """
    model.zero_grad(set_to_none=True)
    with _serving(spec.device):
        try:
            _loss(model(**batch)).backward()
        except CheckInputError:
            raise
        except Exception as err:
            raise CheckInputError(f"model(**batch) fails without activation checkpointing, so the model or the "
                                  f"batch is wrong, not AC: {first_line(err)}") from err
    model.zero_grad(set_to_none=True)


def _step(model: nn.Module, batch: dict, spec: CheckSpec) -> CheckStep:
    from fla_ac_isolation.fla_cache import clear_tensor_cache
    from fla_ac_isolation.policies import checkpoint_layers

    try:
        checkpoint_layers(model, spec.ac, POLICIES[spec.policy]() if spec.ac == "selective" else None)
    except ValueError as err:
        raise CheckInputError(f"cannot checkpoint the model's layers: {err}") from err
    clear_tensor_cache()
    model.zero_grad(set_to_none=True)
    error = None
    with _serving(spec.device), ReplayAudit(model, on_divergence="record") as audit:
        try:
            _loss(model(**batch)).backward()
        except CheckInputError:
            raise
        except Exception as err:
            error = first_line(err)
    regions = tuple(
        RegionVerdict(r.label, r.verdict, r.first_diff, r.forward_op, r.recompute_op,
                      tuple(d.helper for d in r.fla), r.where)
        for r in audit.regions
    )
    calls = sum(n for r in audit.regions for counts in r.forward_cache.values() for n in counts.values())
    return CheckStep(regions, error, calls)


def _require_fla_offsets(step: CheckStep, mixers: list[MixerFinding]) -> None:
    """Refuse a step in which the model's foreign FLA-backed layers ran but FLA never received packed offsets (no
    call of its cached index helpers): the offsets sit under a keyword the model does not read (FLA's models
    take unknown keywords silently), and the batch ran as one sequence. Our drop-ins are left out: on CUDA they
    hand FLA a precomputed chunk schedule."""
    takes = [m.name for m in mixers if m.status != "leaking" and m.framework != "fla_ac_isolation"]  # foreign
    if step.error is None and step.fla_helper_calls == 0 and takes:
        raise CheckInputError(
            f"no packed offsets reached FLA: the model's FLA-backed layers ({', '.join(takes)}) called none of "
            f"FLA's index helpers, so they ran the batch as one sequence and nothing can be checked; give the "
            f"offsets under the keyword the model reads: {_offsets_keywords()}"
        )


def _apply_fix(model: nn.Module, mixers: list[MixerFinding]) -> tuple[str, ...]:
    """``swap_mixers`` where a leaking class has a drop-in, then ``isolate_seqlens`` for what stays exposed."""
    from fla_ac_isolation.isolate import isolate_seqlens
    from fla_ac_isolation.swap import swap_mixers

    applied = []
    leaking = [m for m in mixers if m.status == "leaking" or m.leak_fix is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the leaking classes are reported already
        if any(drop_in_for(ForeignClass(*m.cls.rsplit(".", 1))) for m in leaking):
            swap_mixers(model)
            applied.append("swap_mixers(model)")
        if any(m.status == "exposed" for m in survey(model)):
            isolate_seqlens(model)
            applied.append("isolate_seqlens(model)")
    return tuple(applied)


def run_check(spec: CheckSpec) -> CheckResult:
    """Check the model of ``spec``: survey its FLA-backed classes, audit one step, verify the fix.

    Raises:
        CheckInputError: an invalid ``spec``, a model that cannot be loaded, a batch without packed offsets
            (or whose offsets never reach FLA), a step that fails without AC, a model without a layer list to
            checkpoint, or a forward that returns no loss.
    """
    spec = spec.validate()
    if spec.device == "auto":
        spec = CheckSpec(**{**asdict(spec), "device": resolve_device("auto")})
    model, batch = load_model(spec)
    mixers = survey(model)
    _without_ac(model, batch, spec)
    as_given = _step(model, batch, spec)
    _require_fla_offsets(as_given, mixers)
    result = CheckResult(spec, type(model).__name__, mixers, as_given)
    result.fixes = [f"{m.name}: {m.fix}" for m in mixers if m.fix]
    result.fixes += [f"{m.name}, to keep packed documents apart: {m.leak_fix}" for m in mixers if m.leak_fix]
    if not as_given.aligned and not any(m.status == "exposed" for m in mixers):
        result.fixes.append(OWN_CODE_FIX)
    if spec.verify_fix and not as_given.aligned:
        fresh, fresh_batch = load_model(spec)
        applied = _apply_fix(fresh, mixers)
        if applied:
            result.fixed, result.fix_applied = _step(fresh, fresh_batch, spec), applied
    return result
