"""``check`` as a library call: one training step of the user's own model under :class:`~fla_ac_isolation.ReplayAudit`,
which FLA-backed classes it holds (exposed, covered, leaking), and the one-line fix (``fla-ac-isolation check``
renders what :func:`run_check` returns).

The model comes from one of (:class:`~fla_ac_isolation.harness.check.spec.CheckSpec`):

* ``model="module:callable"`` (or ``"path/to/file.py:callable"``): ``callable()`` takes no argument and returns
  ``(model, batch)``: an ``nn.Module`` (without activation checkpointing: the check applies it; or one that
  checkpoints itself: audited as it is) and ONE packed batch, a dict of the keyword arguments of
  ``model(**batch)`` (e.g. transformers' ``input_ids``, ``labels``, ``position_ids``, ``cu_seq_lens_q/k``,
  ``max_length_q/k``, ``use_cache=False``; FLA's ``input_ids``, ``labels``, ``cu_seqlens``; OLMo-core's
  ``cu_doc_lens``): its packed offsets must be there, a 1-D integer tensor (or a NamedTuple holding one), and
  must reach FLA. ``model(**batch)`` returns the loss: a scalar tensor, or an object with ``.loss``
  (transformers' and FLA's ``ModelOutput``, OLMo-core's ``LMOutputWithLoss``). The callable is called again (for
  a fresh model) when the fix is verified.
* ``config="<model_type or config class name>"``: a tiny model of transformers or FLA
  (:func:`fla_ac_isolation.harness.foreign_models.build_tiny`).

The step (:mod:`~fla_ac_isolation.harness.check.step`): every layer of the model's layer list
(:func:`~fla_ac_isolation.policies.checkpoint_layers`: ``model.layers``, ``model.model.layers``, ``blocks``, ...)
checkpointed with the chosen SAC policy (default ``save-all-copies``, the field's most sensitive on a CPU) or full
AC; model and batch on ``device`` (``cpu``: FLA's kernels served by
:func:`fla_ac_isolation.harness.reference_kernels.reference_kernels`; ``cuda``: FLA's own); FLA's cache cleared
first. Before it, the same step runs once without AC: a batch the model cannot take (a wrong keyword, a bad
shape) fails there and is bad input, not a divergence; so does a forward that fails in a model that checkpoints
itself (a forward runs the ops it runs without AC). When a region diverges and a fix exists for the classes found
(``swap_mixers`` for a leaking class with a drop-in, then ``isolate_seqlens``), a fresh model gets it and runs
the same step (:mod:`~fla_ac_isolation.harness.check.fix`).

Outcome (:attr:`CheckResult.exit_code`): 0 when every checkpointed region is aligned, the step ran and no mixer
leaks across packed documents here (a class known to drop the offsets, or one that leaks without a package
missing here: transformers' Gated DeltaNets without ``causal_conv1d``); 1 otherwise. Bad input raises
:class:`CheckInputError` (the command exits with 2): also a batch without packed offsets (nothing to check), a
step that fails without AC (or in the forward of a model that checkpoints itself), and a step that judged nothing
(:func:`run_check`'s one rule, which the pytest plugin renders too: no checkpointed region recomputed, regions
run as reentrant checkpoints, which the audit cannot look into, no packed offsets reaching FLA, or no FLA-backed
class and no call of FLA's index helpers). A step that fails without AC because FLA refuses this environment (its
#640 guard: the gated backward on a Hopper GPU with Triton >= 3.4 and < 3.7.1) raises
:class:`CheckEnvironmentError` instead, naming what to install (the command exits with 3): neither the model nor AC
is at fault.

This module holds the order of the check and that rule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from fla_ac_isolation.harness.check.findings import CheckResult, CheckStep, MixerFinding, survey
from fla_ac_isolation.harness.check.fix import apply_fix, fixes, observed_covered, observed_own
from fla_ac_isolation.harness.check.load import load_model, offsets_keywords
from fla_ac_isolation.harness.check.spec import (
    CheckInputError,
    CheckSpec,
)
from fla_ac_isolation.harness.check.step import audited_step, dry_run
from fla_ac_isolation.harness.environment import resolve_device
from fla_ac_isolation.mixer_plan import classify

if TYPE_CHECKING:
    from torch import nn

__all__ = ["run_check"]

def _misspelt(step: CheckStep, mixers: list[MixerFinding]) -> str | None:
    """Advice for layer calls that were handed offsets under keywords their class does not read (a misspelt
    ``cu_seq_lens=`` in the model's own call): name the call, the keyword given and the one the class reads."""
    reads = {p: m for m in mixers for p in m.paths}
    wrong = [(path, names, reads[path]) for path, names in step.offsets_keywords
             if path in reads and reads[path].offsets and not set(names) & set(reads[path].offsets)]
    if not wrong:
        return None
    path, names, m = wrong[0]
    others = Counter(other.name for _, _, other in wrong[1:])  # in the order the layers were called
    listed = ", ".join(f"{k} x{n}" for k, n in others.items())
    more = f" (and {len(wrong) - 1} more layer(s): {listed})" if others else ""
    return (f"the model's call of {path} ({m.name}){more} passed the offsets as {', '.join(n + '=' for n in names)}, "
            f"a keyword {m.name} does not read: fix the call: pass them as {m.offsets[0]}=")


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
            f"FLA's index helpers, so they ran the batch as one sequence and nothing can be checked; "
            + (_misspelt(step, mixers) or f"give the offsets under the keyword the model reads: {offsets_keywords()}")
        )
    if step.fla_helper_calls == 0 and not mixers:
        raise CheckInputError(
            "nothing was judged: the step found no FLA-backed class and its checkpointed regions called none of "
            "FLA's index helpers, so no packed offsets reached FLA and nothing of the fault could show; check a "
            "model whose layers call FLA, with its offsets under the keyword it reads"
        )


def _not_checkpointed(model: nn.Module, step: CheckStep) -> tuple[str, ...]:
    """The paths of the model's layers (its layer list, as ``checkpoint_layers`` finds it) that no region of the
    step is labelled with, nor holds (a region labelled by a module inside the layer)."""
    from fla_ac_isolation.checkpointing import find_layers

    try:
        layers = find_layers(model)
    except ValueError:
        return ()
    path = next((p for p, m in model.named_modules() if m is layers), None)
    if path is None:
        return ()
    names = [f"{path}.{k}" if path else str(k) for k, _ in layers.named_children()]
    labels = [r.label for r in step.regions]
    return tuple(n for n in names if not any(x == n or x.startswith(n + ".") for x in labels))


def run_check(spec: CheckSpec) -> CheckResult:
    """Check the model of ``spec``: survey its FLA-backed classes, audit one step, verify the fix.

    A model that checkpoints itself (its dry step runs checkpointed regions) is audited as it is, under its
    own policy; otherwise the check checkpoints its layers with ``spec.ac`` / ``spec.policy``. An exposed
    class whose every call the audited step saw hand FLA an offsets object of its own is reported covered
    (:attr:`MixerFinding.observed`); so is a class of the user's own code that called FLA itself, or exposed
    when its calls shared offsets objects.

    Raises:
        CheckInputError: an invalid ``spec``, a model that cannot be loaded, a batch without packed offsets,
            a step that judged nothing (:func:`_require_judged`: no region recomputed, reentrant regions, offsets
            never reaching FLA, no FLA at all), a step that fails without AC (or in the forward of a model that
            checkpoints itself), a model without a layer list to checkpoint, or a forward that returns no loss.
        CheckEnvironmentError: the step without AC fails because FLA refuses this environment (#640).
    """
    spec = spec.validate()
    if spec.device == "auto":
        spec = replace(spec, device=resolve_device("auto"))
    model, batch = load_model(spec)
    mixers = survey(model, classify(model))
    self_checkpointed, reference = dry_run(model, batch, spec)
    watch = tuple(p for m in mixers if m.status == "exposed" for p in m.paths)
    surveyed = tuple(p for m in mixers for p in m.paths)
    as_given = audited_step(model, batch, spec, self_checkpointed=self_checkpointed, watch=watch, surveyed=surveyed,
                     reference=reference)
    _require_judged(as_given, mixers)
    mixers = observed_covered(mixers, as_given.fresh_offsets) + observed_own(as_given)
    result = CheckResult(spec, type(model).__name__, mixers, as_given, self_checkpointed=self_checkpointed,
                         not_checkpointed=_not_checkpointed(model, as_given) if self_checkpointed else ())
    result.fixes = fixes(mixers, as_given)
    if spec.verify_fix and not as_given.aligned:
        fresh, fresh_batch = load_model(spec)
        applied = apply_fix(fresh, mixers)
        if applied:
            result.fixed = audited_step(fresh, fresh_batch, spec, self_checkpointed=self_checkpointed)
            result.fix_applied = applied
    return result
