"""The fix step of ``check``: the one-line fixes of what it found, the classes covered by what the step observed,
and the fix applied to a fresh model (``swap_mixers``, then ``isolate_seqlens``) read from the survey's plan.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from torch import nn

from fla_ac_isolation.foreign_classes import ForeignClass, drop_in_name
from fla_ac_isolation.harness.check.findings import CheckStep, MixerFinding
from fla_ac_isolation.mixer_plan import EXPOSED

__all__ = ["AUTOCAST_CHECK_FIX", "OWN_CODE", "OWN_CODE_FIX", "apply_fix", "fixes", "observed_covered",
           "observed_own"]

AUTOCAST_CHECK_FIX = ("your checkpointing, under torch.autocast: pass context_fn=sac_context_fn(policy) "
                      "(fla_ac_isolation.policies; it turns autocast's weight-cast cache off inside each region) "
                      "instead of torch's create_selective_checkpoint_contexts, or call backward() outside the "
                      "autocast block (docs/check.md)")
OWN_CODE_FIX = ("your own FLA-calling code: build a LayerLocalSeqlens once per model forward, hand it to every "
                "layer, and call seqlens.local() inside each layer's forward (inside its checkpointed region), giving "
                "FLA its tensors (docs/own-model.md)")
OWN_CODE = "your code"
"""The framework of a class :func:`observed_own` reports: the user's own, found calling FLA in the step."""


def _local_outside(regions: tuple[str, ...]) -> str:
    """The fix for checkpointed regions handed a ``LocalSeqlens``: ``.local()`` ran outside them."""
    named = ", ".join(regions[:3]) + (", ..." if len(regions) > 3 else "")
    return (f"call seqlens.local() inside each layer's forward (inside its checkpointed region), not once outside: "
            f"{named} {'was' if len(regions) == 1 else 'were'} handed the LocalSeqlens of one .local() call made "
            f"outside {'it' if len(regions) == 1 else 'them'}, so {'its' if len(regions) == 1 else 'their'} forward "
            f"and recompute gave FLA the same offsets objects (docs/own-model.md)")



def apply_fix(model: nn.Module, mixers: list[MixerFinding]) -> tuple[str, ...]:
    """``swap_mixers`` where a leaking class has a drop-in, then ``isolate_seqlens`` for what stays exposed:
    ``mixers`` is the survey of the plan (:func:`survey`) of a model built by the same factory, so what stays
    exposed is read from it (its exposed paths that ``swap_mixers`` did not replace), not classified again."""
    from fla_ac_isolation.isolate import isolate_seqlens
    from fla_ac_isolation.swap import swap_mixers

    applied, swapped = [], set()
    leaking = [m for m in mixers if m.status == "leaking" or m.leak_fix is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the leaking classes are reported already
        if any(drop_in_name(ForeignClass(*m.cls.rsplit(".", 1))) for m in leaking):
            swapped = set(swap_mixers(model))
            applied.append("swap_mixers(model)")
        if any(p not in swapped for m in mixers if m.status == EXPOSED and m.framework != OWN_CODE for p in m.paths):
            isolate_seqlens(model)
            applied.append("isolate_seqlens(model)")
    return tuple(applied)


def observed_covered(mixers: list[MixerFinding], fresh: tuple[str, ...]) -> list[MixerFinding]:
    """An exposed class every instance of which the step saw hand FLA fresh offsets in every call is covered."""
    out = []
    for m in mixers:
        if m.status == EXPOSED and m.paths and all(p in fresh for p in m.paths):
            m = replace(m, status="covered", fix=None, observed="fresh offsets")
        out.append(m)
    return out


def observed_own(step: CheckStep) -> list[MixerFinding]:
    """The user's own classes that called FLA in the step (:attr:`CheckStep.own_callers`), one finding per class:
    covered when every call of every instance handed FLA offsets of its own, else exposed, with the fix (named
    for regions handed a ``LocalSeqlens``: ``.local()`` ran outside them)."""
    groups: dict[str, list] = {}
    for c in step.own_callers:
        groups.setdefault(c.cls, []).append(c)
    out = []
    for cls, callers in groups.items():
        name = cls.rpartition(".")[2]
        paths = tuple(c.path for c in callers)
        if all(c.fresh for c in callers):
            out.append(MixerFinding(cls, name, OWN_CODE, "covered", paths, observed="fresh offsets"))
            continue
        fix = _local_outside(step.handed_local) if step.handed_local else (
            f"build a LayerLocalSeqlens once per model forward, hand it to every layer, and call seqlens.local() "
            f"inside {name}'s forward (inside its checkpointed region), giving FLA its tensors (docs/own-model.md)")
        out.append(MixerFinding(cls, name, OWN_CODE, EXPOSED, paths, fix=fix, observed="shared offsets"))
    return out


def fixes(mixers: list[MixerFinding], step: CheckStep) -> list[str]:
    """The one-line fixes, in order: each exposed or leaking class's, each class's leak's, the checkpointing's
    (a region diverged at a cast torch.autocast's weight-cast cache skipped), and (a region diverged otherwise,
    with no exposed class to blame) the fix of the user's own FLA-calling code."""
    out = [f"{m.name}: {m.fix}" for m in mixers if m.fix]
    out += [f"{m.name}, to keep packed documents apart: {m.leak_fix}" for m in mixers if m.leak_fix]
    divergent = [r for r in step.regions if r.verdict == "divergent"]
    if any(r.autocast_cast for r in divergent):
        out.append(AUTOCAST_CHECK_FIX)
    if any(not r.autocast_cast for r in divergent) and not any(m.status == EXPOSED for m in mixers):
        out.append(f"your own FLA-calling code: {_local_outside(step.handed_local)}" if step.handed_local
                   else OWN_CODE_FIX)
    return out
