"""One step of ``check``: the step without AC first (gradients kept; whether the model checkpoints itself; a
failure there refused as bad input), then one step under :class:`~fla_ac_isolation.ReplayAudit` with the check's
AC (or the model's own), and which watched modules handed FLA's cached index helpers offsets of their own in
every call (read from :func:`~fla_ac_isolation.fla_seam.cache.probe_tensor_cache`, so on any device).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

import torch
from torch import nn

from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.harness.check.callers import FlaCallers, fresh_paths
from fla_ac_isolation.harness.check.findings import CheckStep, RegionVerdict
from fla_ac_isolation.harness.check.spec import (
    AUTOCAST_DTYPES,
    CheckEnvironmentError,
    CheckInputError,
    CheckSpec,
    resolve_policy,
)
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.offsets_hook import offsets_like_keywords

__all__ = ["audited_step", "autotune_notice", "dry_run"]


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


def _serving(spec: CheckSpec) -> contextlib.ExitStack:
    """What a step of ``spec`` runs inside: FLA served on a CPU (or its first configs), ``torch.autocast``."""
    stack = contextlib.ExitStack()
    if spec.device != "cpu":
        if spec.first_config:
            from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config

            stack.enter_context(first_autotune_config())
    else:
        from fla_ac_isolation.harness.reference_kernels import reference_kernels

        stack.enter_context(reference_kernels())
    if spec.autocast is not None:
        dtype = getattr(torch, AUTOCAST_DTYPES[spec.autocast])
        stack.enter_context(torch.autocast(spec.device, dtype=dtype))
    return stack


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


def dry_run(model: nn.Module, batch: dict, spec: CheckSpec) -> tuple[bool, dict[int, torch.Tensor] | None]:
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
    from fla_ac_isolation.fla_seam.versions import fla_version
    from fla_ac_isolation.harness.fla_seam.hopper_guard import HOPPER_GDN_REMEDY, is_hopper_gdn_refusal

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
    as :func:`~fla_ac_isolation.fla_seam.cache.probe_tensor_cache` records them (``arguments=True``: a hit's are those
    of the entry it matched): on any device. The batch's own tensors are nobody's own."""

    def __init__(self, model: nn.Module, paths: list[str], probe: Any, batch: dict) -> None:
        self.probe = probe
        self.shared = {id(v): v for v in _tensors(batch.values())}  # kept: their ids stay theirs
        self.seen: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
        self.started: dict[str, int] = {}  # path -> how many events were recorded when its call began
        self.keywords: dict[str, set[str]] = {}  # path -> the offsets-like keywords the model's calls gave it
        self.batch = batch
        self.handles = []
        for path in paths:
            module = model.get_submodule(path)
            self.handles.append(module.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(path)))

    def _pre(self, path: str):
        def hook(module, args, kwargs):
            self.started[path] = self.probe.mark()
            for name in offsets_like_keywords(kwargs):  # a keyword the batch gave as it is is the batch's
                if kwargs[name] is not self.batch.get(name):
                    self.keywords.setdefault(path, set()).add(name)
        return hook

    def _post(self, path: str):
        def hook(module, args, output):
            start = self.started.pop(path)
            n = sum(p == path for p, _ in self.seen)
            self.seen[(path, n)] = [e.arguments for e in self.probe.events[start:]]
        return hook

    def fresh(self) -> tuple[str, ...]:
        """The watched paths each call of which handed FLA's helpers offsets of its own (:func:`fresh_paths`)."""
        return fresh_paths(self.seen, set(self.shared))

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


def audited_step(model: nn.Module, batch: dict, spec: CheckSpec, *, self_checkpointed: bool = False,
          watch: tuple[str, ...] = (), surveyed: tuple[str, ...] = (),
          reference: dict[int, torch.Tensor] | None = None) -> CheckStep:
    """One audited step: ``model`` checkpointed by the check (``spec.ac``, ``spec.policy``), or as it is when
    it checkpoints itself; ``watch``: the FLA-backed modules whose offsets objects are recorded
    (:attr:`CheckStep.fresh_offsets`); ``surveyed``: the paths of every class the survey found (FLA calls made
    inside them are not the user's own, :attr:`CheckStep.own_callers`); ``reference``: the gradients without AC
    to compare with."""
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache, probe_tensor_cache
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
        callers = FlaCallers(model, probe, surveyed)
        try:
            _loss(model(**batch)).backward()
        except CheckInputError:
            raise
        except Exception as err:
            error = first_line(err)
        finally:
            seen.remove()
            callers.remove()
    regions = tuple(
        RegionVerdict(r.label, r.verdict, r.first_diff, r.forward_op, r.recompute_op,
                      tuple(d.helper for d in r.fla), r.where, r.autocast_cast, r.outer)
        for r in audit.regions
    )
    calls = sum(n for r in audit.regions for counts in r.forward_cache.values() for n in counts.values())
    blind = audit.why_blind if audit.regions or audit.unaudited else None  # none ran: CheckStep.aligned's rule
    diff = _grad_diff(model, reference) if error is None else None
    keywords = tuple((path, tuple(sorted(names))) for path, names in seen.keywords.items())
    handed = tuple(dict.fromkeys(r.label for r in regions if r.label in callers.handed_local))
    return CheckStep(regions, error, calls, blind=blind, grad_diff=diff, fresh_offsets=seen.fresh(),
                     offsets_keywords=keywords, own_callers=callers.own(set(seen.shared)), handed_local=handed)
