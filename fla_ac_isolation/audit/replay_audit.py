""":class:`ReplayAudit`, the public entry point: patches torch's non-reentrant checkpoint while active."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fla_ac_isolation.audit.labels import RegionNamer
from fla_ac_isolation.audit.recorder import PassRecorder
from fla_ac_isolation.audit.records import Region, ignored_ops
from fla_ac_isolation.audit.report import RegionReport, region_report, summary_table
from fla_ac_isolation.audit.session import AuditSession, OnDivergence
from fla_ac_isolation.fla_seam.cache import probe_tensor_cache

__all__ = ["ReplayAudit"]

_ON_DIVERGENCE = ("raise", "warn", "record")


def _check_on_divergence(value: object) -> None:
    if value not in _ON_DIVERGENCE:
        raise ValueError(f"on_divergence must be one of {_ON_DIVERGENCE}, got {value!r}")


class ReplayAudit:
    """Record and compare the forward and recompute op sequences of every checkpointed region.

    Use it as a context manager around one training step (forward and backward)::

        with ReplayAudit(model, on_divergence="record") as audit:
            loss = model(**batch).loss
            loss.backward()
        print(audit.summary())
        audit.divergent        # [RegionReport(label='model.layers.0.linear_attn', first_diff=0, ...)]

    or build a ``context_fn`` for checkpoint calls made elsewhere (:meth:`context_fn`).

    Args:
        model: optional root module, used to name regions by module path. Without it the path is taken
            inside the outermost module running when the region starts.
        on_divergence: ``"raise"`` (default), ``"warn"`` or ``"record"``; see the module docstring.
        probe_fla: run FLA's cache probe while active (per-region hit/miss telemetry and attribution).
        region_tag: optional callable asked when each region's forward starts; a string it returns goes in front
            of the region's label (``"stage 1 / mb 0: layers.2"``), ``None`` leaves the label as it is. Under a
            pipeline schedule pass :class:`~fla_ac_isolation.parallel.StageRegionTags` (stage, microbatch and
            the shape-inference pass).

    Raises:
        ValueError: unknown ``on_divergence``.
        TypeError: ``model`` is not an ``nn.Module``; ``region_tag`` is not callable (or, when a region starts,
            returns something other than a string or ``None``).
        ReplayDivergenceError: (``"raise"``) at the first divergent op of a recompute, from backward.

    Overhead: ~8-13 us per recorded op, ~1.05x on a realistic step (measured: see the module docstring).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        on_divergence: OnDivergence = "raise",
        probe_fla: bool = True,
        region_tag: Callable[[], str | None] | None = None,
    ) -> None:
        _check_on_divergence(on_divergence)
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        if region_tag is not None and not callable(region_tag):
            raise TypeError(f"region_tag must be a callable returning a str or None, got {type(region_tag).__name__}")
        self.probe_fla = probe_fla
        self._session = AuditSession(on_divergence, RegionNamer(model, region_tag), ignored_ops())
        self._stack: contextlib.ExitStack | None = None

    @property
    def on_divergence(self) -> OnDivergence:
        """``"raise"``, ``"warn"`` or ``"record"``: what a divergent recompute does (see the class)."""
        return self._session.on_divergence

    @on_divergence.setter
    def on_divergence(self, value: OnDivergence) -> None:
        _check_on_divergence(value)
        self._session.on_divergence = value

    # -- context manager
    def __enter__(self) -> ReplayAudit:
        if self._stack is not None:
            raise RuntimeError("ReplayAudit is not reentrant; use a new instance for a nested block")
        stack = contextlib.ExitStack()
        try:
            if self.probe_fla:
                with contextlib.suppress(ImportError):
                    self._session.probe = stack.enter_context(probe_tensor_cache())
            stack.enter_context(self._patched_checkpoint())
        except BaseException:
            stack.close()
            self._session.probe = None
            raise
        self._stack = stack
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack, self._stack = self._stack, None
        try:
            stack.__exit__(exc_type, exc, tb)
        finally:
            self._session.probe = None
        return False

    @contextlib.contextmanager
    def _patched_checkpoint(self) -> Iterator[None]:
        """Route every non-reentrant checkpoint call through :meth:`context_fn` inside the block."""
        import torch.utils.checkpoint as cp

        targets = [cp]
        composable = sys.modules.get("torch.distributed._composable.checkpoint_activation")
        if composable is not None and hasattr(composable, "_checkpoint_without_reentrant_generator"):
            targets.append(composable)
        originals = [t._checkpoint_without_reentrant_generator for t in targets]
        audit = self

        def make(original):
            def audited_generator(
                fn, preserve_rng_state=True, context_fn=cp.noop_context_fn, determinism_check=None,
                debug=False, early_stop=True, *args, **kwargs,
            ):
                if determinism_check is None:
                    determinism_check = cp._DEFAULT_DETERMINISM_MODE
                if not getattr(context_fn, "_replay_audit", False) and not debug:
                    inner = None if context_fn is cp.noop_context_fn else context_fn
                    context_fn = audit.context_fn(inner, _label_from=fn)
                return original(
                    fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args, **kwargs
                )

            return audited_generator

        for t, original in zip(targets, originals):
            t._checkpoint_without_reentrant_generator = make(original)
        try:
            yield
        finally:
            for t, original in zip(targets, originals):
                t._checkpoint_without_reentrant_generator = original

    # -- context_fn
    def context_fn(
        self,
        inner: Callable[[], tuple[Any, Any]] | None = None,
        *,
        label: str | None = None,
        _label_from: Any = None,
    ) -> Callable[[], tuple[TorchDispatchMode, TorchDispatchMode]]:
        """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

        Args:
            inner: the ``context_fn`` to wrap (e.g. ``sac_context_fn(policy)`` or
                ``functools.partial(create_selective_checkpoint_contexts, policy)``); ``None`` for full AC.
            label: name for every region checkpointed with this ``context_fn`` (default: module path).

        Returns:
            A callable returning ``(forward_mode, recompute_mode)``, two ``TorchDispatchMode`` s that
            record the ops and enter ``inner``'s contexts beneath themselves.
        """

        def audited_context_fn():
            fwd_ctx, rec_ctx = inner() if inner is not None else (None, None)
            region = Region(-1, label)
            return (
                PassRecorder(self._session, region, "forward", fwd_ctx, _label_from),
                PassRecorder(self._session, region, "recompute", rec_ctx, _label_from),
            )

        audited_context_fn._replay_audit = True  # type: ignore[attr-defined]
        return audited_context_fn

    # -- results
    @property
    def regions(self) -> list[RegionReport]:
        """One :class:`RegionReport` per checkpointed region whose forward ran, in forward order."""
        return [self._report(r) for r in self._session.regions]

    @property
    def divergent(self) -> list[RegionReport]:
        """The regions whose recompute diverged from their forward."""
        return [r for r in self.regions if r.verdict == "divergent"]

    @property
    def recompute_counts(self) -> list[int]:
        """How many times each region (in :attr:`regions` order) was recomputed: 1 per backward normally, 0 when
        never recomputed, more when a schedule reruns a region's backward (zero-bubble schedules split it into an
        input and a weight pass; under full AC each pass recomputes)."""
        return [len(r.recomputes) for r in self._session.regions]

    @property
    def ok(self) -> bool:
        """No region diverged (regions that were not recomputed do not count against it)."""
        return not self.divergent

    def _report(self, region: Region) -> RegionReport:
        return region_report(region)

    def summary(self, *, messages: bool = True) -> str:
        """A plain-text table of every region's verdict and FLA cache telemetry (+ divergence messages)."""
        return summary_table(self.regions, messages=messages)
