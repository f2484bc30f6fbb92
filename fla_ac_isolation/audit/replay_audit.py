""":class:`ReplayAudit`, the public entry point: patches torch's non-reentrant checkpoint while active."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fla_ac_isolation.audit.labels import RegionNamer
from fla_ac_isolation.audit.recorder import PassRecorder
from fla_ac_isolation.audit.records import Region, UnauditedRegion, ignored_ops
from fla_ac_isolation.audit.report import RegionReport, region_report, summary_table
from fla_ac_isolation.audit.session import AuditSession, OnDivergence
from fla_ac_isolation.audit.torch_checkpoint import intercept_checkpoints
from fla_ac_isolation.fla_seam.cache import probe_tensor_cache

__all__ = ["ReplayAudit", "UnauditedCheckpointWarning"]


class UnauditedCheckpointWarning(UserWarning):
    """A checkpointed region the audit cannot look into ran (reentrant, or torch's debug mode)."""


_ON_DIVERGENCE = ("raise", "warn", "record")


def _check_on_divergence(value: object) -> None:
    if value not in _ON_DIVERGENCE:
        raise ValueError(f"on_divergence must be one of {_ON_DIVERGENCE}, got {value!r}")


class ReplayAudit:
    """Record and compare the forward and recompute op sequences of every checkpointed region.

    Use it around one training step (``with ReplayAudit(model) as audit:``), or build a ``context_fn`` for
    checkpoints made elsewhere (:meth:`context_fn`). Reentrant and debug-mode checkpoints are not looked into:
    each warns (:class:`UnauditedCheckpointWarning`) and makes :attr:`verdict` ``"blind"``.

    Args:
        model: optional root module for region labels (module paths inside it).
        on_divergence: ``"raise"`` (default): raise from ``backward()`` at the first divergent op, before it runs
            (before SAC replays a wrong tensor); ``"warn"``: one warning per divergent recompute; ``"record"``:
            silent (read :attr:`regions`, :meth:`summary`).
        probe_fla: run FLA's cache probe while active (per-region telemetry and attribution).
        region_tag: called when each region's forward starts; a returned string prefixes the label
            (``"stage 1 / mb 0: layers.2"``; see :class:`~fla_ac_isolation.parallel.StageRegionTags`).

    Raises:
        UnsupportedTorchCheckpointError: on entering, for checkpoint internals the audit does not know.
        ValueError: unknown ``on_divergence``.
        TypeError: ``model`` not an ``nn.Module``; ``region_tag`` not callable, or returning neither a str
            nor ``None``.
        ReplayDivergenceError: (``"raise"``) from backward, at the first divergent op of a recompute.
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
        """``"raise"``, ``"warn"`` or ``"record"``."""
        return self._session.on_divergence

    @on_divergence.setter
    def on_divergence(self, value: OnDivergence) -> None:
        _check_on_divergence(value)
        self._session.on_divergence = value

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
        import torch.utils.checkpoint as cp

        def non_reentrant(fn: Any, context_fn: Callable[[], Any], debug: bool) -> Callable[[], Any]:
            if getattr(context_fn, "_replay_audit", False):
                return context_fn
            if debug:  # torch's debug mode refuses any context_fn
                self._unaudited(fn, "debug checkpoint: not audited",
                                "torch's checkpoint debug mode (debug=True or set_checkpoint_debug_enabled) takes "
                                "no context_fn")
                return context_fn
            return self.context_fn(None if context_fn is cp.noop_context_fn else context_fn, _label_from=fn)

        def reentrant(run_function: Any) -> None:
            self._unaudited(run_function, "reentrant checkpoint: not audited",
                            "use_reentrant=True recomputes inside autograd with no context_fn; checkpoint with "
                            "use_reentrant=False to audit it")

        with intercept_checkpoints(non_reentrant, reentrant):
            yield

    def _unaudited(self, fn: Any, reason: str, why: str) -> None:
        session = self._session
        index = len(session.unaudited)
        label = session.namer.label_for(fn, index)
        if label.startswith(f"region #{index}"):
            label = f"unaudited {label}"
        session.unaudited.append(UnauditedRegion(session.namer.tagged(label), reason))
        warnings.warn(f"ReplayAudit: {label}: {reason} ({why})",
                      UnauditedCheckpointWarning, stacklevel=2)

    def context_fn(
        self,
        inner: Callable[[], tuple[Any, Any]] | None = None,
        *,
        label: str | None = None,
        _label_from: Any = None,
    ) -> Callable[[], tuple[TorchDispatchMode, TorchDispatchMode]]:
        """A ``context_fn`` for ``checkpoint(..., use_reentrant=False)`` made outside the ``with`` block.

        Args:
            inner: the ``context_fn`` to wrap (e.g. ``sac_context_fn(policy)``); ``None`` for full AC.
            label: name for every region checkpointed with it (default: the module path).

        Returns:
            A callable returning ``(forward_mode, recompute_mode)``, recording modes over ``inner``'s contexts.
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

    @property
    def regions(self) -> list[RegionReport]:
        """One :class:`RegionReport` per checkpointed region whose forward ran, in forward order."""
        return [region_report(r) for r in self._session.regions]

    @property
    def divergent(self) -> list[RegionReport]:
        """The regions whose recompute diverged from their forward."""
        return [r for r in self.regions if r.verdict == "divergent"]

    @property
    def recompute_counts(self) -> list[int]:
        """Recomputes per region (:attr:`regions` order): 0 when never recomputed, more when a backward reruns."""
        return [len(r.recomputes) for r in self._session.regions]

    @property
    def ok(self) -> bool:
        """No region diverged; read :attr:`verdict` to know whether anything was judged."""
        return not self.divergent

    @property
    def unaudited(self) -> list[UnauditedRegion]:
        """Checkpointed regions the audit could not look into, in the order they ran (each warned)."""
        return list(self._session.unaudited)

    @property
    def verdict(self) -> str:
        """``"divergent"``; ``"blind"``: nothing recomputed and compared, or some region unaudited
        (:attr:`why_blind`); else ``"aligned"``."""
        if self.divergent:
            return "divergent"
        return "blind" if self.why_blind is not None else "aligned"

    @property
    def why_blind(self) -> str | None:
        """Why the verdict is ``"blind"``, in one line; ``None`` otherwise (or when divergent and fully seen)."""
        reasons = []
        if not any(r.verdict == "aligned" or r.verdict == "divergent" for r in self.regions):
            reasons.append("no checkpointed region ran" if not self._session.regions
                           else f"none of the {len(self._session.regions)} recorded region(s) was recomputed")
        unaudited = self._session.unaudited
        if unaudited:
            kinds = sorted({u.reason for u in unaudited})
            names = ", ".join(dict.fromkeys(u.label for u in unaudited))
            reasons.append(f"{len(unaudited)} checkpointed region run(s) not audited ({'; '.join(kinds)}): {names}")
        return "; ".join(reasons) or None

    def summary(self, *, messages: bool = True) -> str:
        """A plain-text table of every region's verdict and FLA cache telemetry (+ divergence messages)."""
        return summary_table(self.regions, messages=messages, unaudited=self.unaudited)
