"""What ``check`` found, as data: the FLA-backed classes of the model (:func:`survey` of its plan,
:class:`MixerFinding`), each checkpointed region (:class:`RegionVerdict`), one audited step (:class:`CheckStep`) and
the whole result with its exit code (:class:`CheckResult`; rendered by ``fla_ac_isolation.harness.cli.check``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from torch import nn

from fla_ac_isolation.foreign_classes import LeakingMixer, UpstreamMixer, drop_in_name, leak_remedy, remedy
from fla_ac_isolation.harness.check.spec import CheckSpec
from fla_ac_isolation.mixer_plan import DROP_IN, EXPOSED, LEAKING, PlannedMixer, classify

__all__ = ["CheckResult", "CheckStep", "MixerFinding", "Nesting", "OwnCaller", "RegionVerdict", "survey"]


@dataclass(frozen=True)
class MixerFinding:
    """One FLA-backed class found in the model.

    Attributes:
        cls: ``"module.Class"``; name: the class name; framework: its library in prose.
        status: ``"exposed"`` (hands shared offsets to FLA: the fault), ``"covered"`` (hooked by
            ``isolate_seqlens``, one of this package's drop-ins, or observed handing fresh offsets), ``"leaking"``
            (drops the offsets: packed documents leak into each other).
        paths: where it sits in the model.
        offsets: the arguments ``isolate_seqlens`` refreshes (exposed, covered).
        why: how its packed documents leak into each other here: a leaking class, or an exposed / covered one
            that leaks without a package missing here (its short conv); ``None``: they do not.
        fix: the one-line fix (of the fault when exposed, of the leak when leaking), ``None`` when covered.
        leak_fix: for an exposed or covered class whose documents leak here (``why``), what to do about that.
        observed: ``"fresh offsets"``: the class is of those that take shared offsets, but in the audited step
            every call of every instance handed FLA's cached index helpers, in each of their calls, a tensor no
            other call (another layer, its forward / recompute, or the batch) handed them
            (``LayerLocalSeqlens.local()``, a hook, the user's own copy): covered by what the step observed,
            read from FLA's cache probe (any device: FLA's CUDA kernels call those helpers as the CPU's
            stand-ins do); for a class of the user's own code (framework ``"your code"``) that called FLA in the
            step, its status is read so too. ``"shared offsets"``: such a class of the user's own, one of whose
            calls handed FLA only offsets objects another call (or the batch) handed it too: exposed. ``None``:
            decided from the class (and its hook).
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


class OwnCaller(NamedTuple):
    """A module of the model whose own code called FLA's cached index helpers in the step (directly, or through
    FLA's modules and functions; a class of no registry): its path, its class (``module.Class``), and whether each
    of its calls handed FLA offsets objects of its own (a forward and each recompute are separate calls)."""

    path: str
    cls: str
    fresh: bool


@dataclass(frozen=True)
class RegionVerdict:
    """One checkpointed region: ``aligned``, ``divergent`` (first differing op, the FLA helpers whose cache state
    differed, the module running there) or ``not recomputed``; ``outer``: the position in the step's regions of
    the region whose forward (or recompute) ran this one's forward (a checkpoint inside a checkpoint), or
    ``None``."""

    label: str
    verdict: str
    first_diff: int | None = None
    forward_op: str | None = None
    recompute_op: str | None = None
    fla_helpers: tuple[str, ...] = ()
    where: str | None = None
    autocast_cast: bool = False  # the divergent op is a cast torch.autocast's weight-cast cache skipped
    outer: int | None = None


class Nesting(NamedTuple):
    """A checkpoint inside a checkpoint (:attr:`CheckResult.twice`): the label of the outer region and those of
    the regions whose forward ran directly inside its forward or recompute, in the order they ran."""

    outer: str
    inner: tuple[str, ...]


@dataclass(frozen=True)
class CheckStep:
    """One audited step: the regions, the first line of an error the step raised (``None``: it ran), how
    often the regions' forwards called FLA's cached index helpers (0: no packed offsets reached FLA), why the
    audit could not judge some or all of what was checkpointed (:attr:`ReplayAudit.why_blind
    <fla_ac_isolation.ReplayAudit.why_blind>`: no region recomputed, reentrant regions; ``None``: every region
    that ran was looked into, or none ran), the largest absolute difference of its gradients from the step
    without AC (``None``: not compared: the model checkpoints itself, or the step failed), and the paths of the
    FLA-backed modules every call of which handed FLA's cached index helpers offsets of its own
    (:attr:`MixerFinding.observed`), and the offsets-like keywords (``cu_*`` names holding offsets) the model's
    own calls gave each watched module (not a batch keyword passed on as it is), as ``(path, names)`` pairs; the
    modules of the user's own code that called FLA's helpers (:class:`OwnCaller`), and the checkpointed regions
    whose module was handed a ``LocalSeqlens`` (``.local()`` ran outside the region: its forward and recompute
    got the same offsets objects). :attr:`aligned`: it ran and none diverged; :attr:`divergent`: one did."""

    regions: tuple[RegionVerdict, ...]
    error: str | None = None
    fla_helper_calls: int = 0
    blind: str | None = None
    grad_diff: float | None = None
    fresh_offsets: tuple[str, ...] = ()
    offsets_keywords: tuple[tuple[str, tuple[str, ...]], ...] = ()
    own_callers: tuple[OwnCaller, ...] = ()
    handed_local: tuple[str, ...] = ()

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
        not_checkpointed: for a model that checkpoints itself, the layers of its layer list that ran with no
            checkpointed region of theirs (they run without AC and are not audited).
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
    not_checkpointed: tuple[str, ...] = ()

    @property
    def twice(self) -> tuple[Nesting, ...]:
        """The checkpoints inside a checkpoint of the step (:attr:`RegionVerdict.outer`): each region holding
        others, with the labels of the regions directly inside it (once each: an inner checkpoint runs again in
        the outer one's recompute), in forward order; an equal nesting is named once."""
        regions = self.as_given.regions
        held: dict[int, dict[str, None]] = {}
        for r in regions:
            if r.outer is not None:
                held.setdefault(r.outer, {})[r.label] = None
        return tuple(dict.fromkeys(Nesting(regions[i].label, tuple(inner)) for i, inner in sorted(held.items())))

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
        out["spec"]["model"] = self.spec.model_name
        out["harmless_under_full_ac"] = self.harmless_under_full_ac
        out["as_given"]["aligned"] = self.as_given.aligned
        if self.fixed is not None:
            out["fixed"]["aligned"] = self.fixed.aligned
        out["exit_code"] = self.exit_code
        return out



# -------------------------------------------------------------------------------------------- survey
def _finding(entry: UpstreamMixer | LeakingMixer, status: str, paths: list[str]) -> MixerFinding:
    if status == "leaking":
        return MixerFinding(entry.qualified, entry.name, entry.framework, status, tuple(paths), why=entry.why,
                            fix=remedy(entry))
    fix = None
    if status == "exposed":
        swap = drop_in_name(entry)
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
