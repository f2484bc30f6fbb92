"""The one environment report (``doctor``, the regression, the benchmarks) as plain data: versions, device, FLA's
cache state, SAC replay semantics, missing torch features, FLA-backed classes; and :func:`resolve_device`."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass

import torch

from fla_ac_isolation.fla_seam import cache
from fla_ac_isolation.fla_seam import features as fla_features
from fla_ac_isolation.fla_seam import install as fla_install
from fla_ac_isolation.fla_seam import versions as fla_versions
from fla_ac_isolation.foreign_classes import (
    FLA_BACKED_MIXERS,
    LEAKING_MIXERS,
    LeakingMixer,
    PackageLeak,
    UpstreamMixer,
    drop_in_name,
    fla_layer_mixer,
    leak_remedy,
    remedy,
)
from fla_ac_isolation.harness.tested_versions import CI_PASSED, newer_than_tested

__all__ = [
    "DISTRIBUTIONS",
    "AuditProbe",
    "ForeignClassStatus",
    "TorchFeature",
    "audit_self_probe",
    "environment_report",
    "feature_report",
    "fla_backed_classes",
    "missing_torch_features",
    "resolve_device",
    "sac_replay_semantics",
    "torch_features",
    "versions",
]

DISTRIBUTIONS: tuple[str, ...] = (
    "fla-core", "flash-linear-attention", "triton", "transformers", "torchtitan", "ai2-olmo-core",
)
"""The distributions whose versions every report carries (besides torch)."""


@dataclass(frozen=True)
class TorchFeature:
    """A feature of this package (or of a library it drives) that needs something of torch.

    Attributes:
        name: what the user loses without it.
        needs: the torch attribute it needs, ``"module:attribute"``.
        seen_in: the torch versions it was seen in and missing from.
        workaround: what this package does when it is missing (``None``: the feature is unavailable).
    """

    name: str
    needs: str
    seen_in: str
    workaround: str | None = None

    @property
    def available(self) -> bool:
        """The installed torch has :attr:`needs`."""
        module, _, attribute = self.needs.partition(":")
        try:
            return hasattr(importlib.import_module(module), attribute)
        except ImportError:
            return False

    def short(self) -> str:
        """What is needed and by what, briefly."""
        module, _, attribute = self.needs.partition(":")
        return f"{module}.{attribute} ({self.name.split(' (')[0]})"

    def reason(self) -> str:
        """One line naming the installed torch, what it lacks and where that was seen."""
        module, _, attribute = self.needs.partition(":")
        return f"torch {torch.__version__} lacks {module}.{attribute}, which {self.name} needs ({self.seen_in})"


TORCH_FEATURES: tuple[TorchFeature, ...] = (
    TorchFeature(
        "torchtitan 0.3's Qwen3.5 model (torchtitan.models.qwen3_5; examples/torchtitan_qwen3_5.py)",
        "torch.distributed.fsdp:DataParallelMeshDims",
        "present in torch 2.13, missing in 2.11",
    ),
    TorchFeature(
        "torchtitan 0.3's EP token dispatcher",
        "torch.compiler:_is_non_strict_tracing",
        "present in torch 2.13, missing in 2.11",
        workaround="the regression defines it (returning False) in its rank processes and says so in its notes",
    ),
)
"""Every torch feature gap this package knows of."""


def torch_features() -> tuple[TorchFeature, ...]:
    """Every known feature with what it needs (:data:`TORCH_FEATURES`)."""
    return TORCH_FEATURES


def missing_torch_features() -> list[TorchFeature]:
    """The known features the installed torch lacks."""
    return [f for f in TORCH_FEATURES if not f.available]


def sac_replay_semantics() -> str:
    """How this torch's SAC replays saved outputs: ``"(op, index)"`` (torch >= 2.13) or ``"per-op FIFO"``."""
    import inspect

    from torch.utils.checkpoint import _CachedTorchDispatchMode

    source = inspect.getsource(_CachedTorchDispatchMode.__torch_dispatch__)
    return "(op, index)" if "func_counter" in source else "per-op FIFO"


@dataclass(frozen=True)
class AuditProbe:
    """What :func:`audit_self_probe` saw.

    Attributes:
        sees: the non-reentrant checkpoint was recorded and aligned, and the reentrant one reported.
        regions: regions recorded for the non-reentrant checkpoint (expected 1).
        forward_ops: ops recorded in its forward (expected 2).
        verdict: that region's verdict (expected ``"aligned"``).
        reentrant_reported: unaudited regions reported for the reentrant checkpoint (expected 1).
        error: the error entering the audit raised (unknown torch), else ``None``.
    """

    sees: bool
    regions: int
    forward_ops: int
    verdict: str | None
    reentrant_reported: int
    error: str | None = None

    def line(self) -> str:
        """``"yes (...)"`` or ``"NO: <what was not seen>"``, for ``doctor``."""
        if self.error is not None:
            return f"NO: {self.error}"
        if self.sees:
            return ("yes (non-reentrant recorded: 1 region, 2 ops, recompute compared; reentrant reported, not "
                    "audited)")
        missed = []
        if (self.regions, self.forward_ops, self.verdict) != (1, 2, "aligned"):
            missed.append(f"a non-reentrant checkpoint of 2 ops gave {self.regions} region(s), {self.forward_ops} "
                          f"forward op(s), verdict {self.verdict} (expected 1, 2, aligned)")
        if self.reentrant_reported != 1:
            missed.append(f"a reentrant checkpoint was reported {self.reentrant_reported} time(s) (expected 1)")
        return f"NO: on torch {torch.__version__}, " + "; ".join(missed)


def audit_self_probe() -> AuditProbe:
    """Checkpoint ``(x * 2).sin()`` under a ``ReplayAudit``, non-reentrant and reentrant, and say what the audit
    saw. Never raises for what it finds (:attr:`AuditProbe.error`)."""
    import warnings

    from torch.utils.checkpoint import checkpoint

    from fla_ac_isolation.audit import ReplayAudit, UnauditedCheckpointWarning, UnsupportedTorchCheckpointError

    def two_ops(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin()

    x = torch.ones(4, requires_grad=True)
    try:
        with ReplayAudit(on_divergence="record", probe_fla=False) as audit:
            checkpoint(two_ops, x, use_reentrant=False).sum().backward()
            regions = audit.regions
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnauditedCheckpointWarning)
                checkpoint(two_ops, x, use_reentrant=True).sum().backward()
    except UnsupportedTorchCheckpointError as err:
        return AuditProbe(False, 0, 0, None, 0, str(err))
    forward_ops = regions[0].forward_ops if regions else 0
    verdict = regions[0].verdict if regions else None
    reported = len(audit.unaudited)
    sees = (len(regions), forward_ops, verdict, reported) == (1, 2, "aligned", 1)
    return AuditProbe(sees, len(regions), forward_ops, verdict, reported)


def versions() -> dict[str, str]:
    """``{"torch": ..., distribution: version}`` for the installed ones of :data:`DISTRIBUTIONS`."""
    out = {"torch": torch.__version__}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def resolve_device(device: str, ranks: int = 1) -> str:
    """``"cpu"`` or ``"cuda"`` for ``device``, for ``ranks`` processes with one GPU each (``"auto"``: ``"cuda"``
    when at least ``ranks`` CUDA devices are visible).

    Raises:
        ValueError: ``device`` is not ``"auto"``, ``"cpu"`` or ``"cuda"``; or it is ``"cuda"`` and fewer than
            ``ranks`` CUDA devices are visible.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        return "cuda" if visible >= ranks else "cpu"
    if device == "cuda" and visible < ranks:
        raise ValueError(f"device 'cuda' needs {ranks} CUDA devices (one per rank), found {visible}")
    return device


def _device() -> str:
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return "cpu (no CUDA device)"


_VERSION_ROWS = {
    "torch": "torch", "fla (fla-core)": "fla-core",
    "flash-linear-attention (fla.layers, fla.models)": "flash-linear-attention", "triton": "triton",
    "transformers": "transformers", "torchtitan": "torchtitan", "OLMo-core (ai2-olmo-core)": "ai2-olmo-core",
}
"""The report's version rows, by the distribution each shows."""


def environment_report() -> dict[str, str]:
    """The whole report as ``{label: text}``."""
    installed = versions()
    shown = {
        "python": platform.python_version(),
        "torch": installed["torch"],
        "fla (fla-core)": f"{fla_versions.fla_version() or 'not installed'} (tested: {fla_versions.tested_range()})",
        "flash-linear-attention (fla.layers, fla.models)": installed.get("flash-linear-attention", "not installed"),
        "triton": installed.get("triton", "not installed"),
        "transformers": installed.get("transformers", "not installed"),
        "torchtitan": installed.get("torchtitan", "not installed"),
        "OLMo-core (ai2-olmo-core)": installed.get("ai2-olmo-core", "not installed"),
        "device": _device(),
        "SAC replay semantics": sac_replay_semantics(),
        "audit sees checkpoints": audit_self_probe().line(),
    }
    newer = newer_than_tested(installed)
    for label, dist in _VERSION_ROWS.items():
        if dist in newer:
            shown[label] += f" NEWER than CI has passed with ({newer[dist]}): untested"
    shown["CI has passed with"] = (
        "; ".join(f"{name} {version}" for name, version in CI_PASSED.items())
        + (f" (newer here, untested: {', '.join(newer)})" if newer else " (nothing installed here is newer)"))
    for feature in TORCH_FEATURES:
        if not feature.available:
            shown[f"missing: {feature.name}"] = feature.reason() + (
                f"; {feature.workaround}" if feature.workaround else "")
    if not missing_torch_features():
        shown["torch features"] = (f"the {len(TORCH_FEATURES)} this package knows to check, all present: "
                                   + "; ".join(f.short() for f in TORCH_FEATURES))
    for leak, names in _package_leaks().items():
        shown[leak.package] = "importable" if not leak.applies() else (
            f"not importable: {len(names)} classes with a conv that needs it mix packed documents ({', '.join(names)}; "
            "listed below)")
    try:
        shown["FLA tensor cache"] = "enabled" if cache.cache_enabled() else "DISABLED (global)"
        shown["FLA tensor cache size"] = str(cache.cache_size())
        shown["FLA cached helpers"] = str(len(cache.cached_helpers()))
    except ImportError as e:  # fla missing or broken
        shown["FLA tensor cache"] = f"unavailable ({e})"
    shown.update(feature_report())  # what this FLA supports of the features that need fla-core 0.6
    return shown


def feature_report() -> dict[str, str]:
    """``{feature name: "yes" | "no (needs ...)"}`` per :data:`~fla_ac_isolation.fla_seam.features.FEATURES`;
    ``{"FLA features": "unavailable (...)"}`` when FLA does not import."""
    try:
        fla_install.explain_import()
        return {
            f"FLA feature: {f.name}": "yes" if fla_features.supports(f.key) else
            f"no (needs fla-core >= {f.since}: {f.api}; installed {fla_versions.fla_version()})"
            for f in fla_features.FEATURES
        }
    except ImportError as e:
        return {"FLA features": f"unavailable ({e})"}


@dataclass(frozen=True)
class ForeignClassStatus:
    """One FLA-backed class (or group of classes) of another library, as ``doctor`` lists it.

    Attributes:
        framework: its library in prose.
        name: the class name (or, for FLA's rule, how many classes).
        installed: its module can be found in this environment.
        status: ``"covered by isolate_seqlens"``, ``"leaking"``, or ``"leaking here"`` (a package it needs to keep
            documents apart cannot be imported), with what to do.
    """

    framework: str
    name: str
    installed: bool
    status: str


def _installed(module: str) -> bool:
    package = module.rpartition(".")[0] if module.startswith("transformers.models.") else module.split(".")[0]
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _package_leaks() -> dict[PackageLeak, list[str]]:
    """Each package whose absence makes named classes leak, with those classes."""
    out: dict[PackageLeak, list[str]] = {}
    for entry in FLA_BACKED_MIXERS:
        if entry.leaks_without is not None:
            out.setdefault(entry.leaks_without, []).append(entry.name)
    return out


def _status(entry: UpstreamMixer | LeakingMixer) -> str:
    if isinstance(entry, LeakingMixer):
        return f"leaking (documents are not kept apart): {remedy(entry)}"
    swap = "; swap_mixers has a drop-in" if drop_in_name(entry) else ""
    covered = f"covered by isolate_seqlens ({', '.join(entry.offsets)}){swap}"
    why = entry.leak()
    if why is None:
        return covered
    offsets = ", ".join(entry.offsets)
    return (f"leaking here (documents are not kept apart): {why}: {leak_remedy(entry)}; the AC fault: covered by "
            f"isolate_seqlens ({offsets})")


def fla_backed_classes() -> list[ForeignClassStatus]:
    """Every FLA-backed class of :mod:`fla_ac_isolation.foreign_classes`, with whether it is installed here."""
    out = [ForeignClassStatus(e.framework, e.name, _installed(e.module), _status(e))
           for e in (*FLA_BACKED_MIXERS, *LEAKING_MIXERS)]
    try:
        from fla_ac_isolation.harness.fla_seam.models import fla_layer_and_model_classes, fla_layer_exports

        classes = fla_layer_and_model_classes()
    except ImportError:
        return [*out, ForeignClassStatus("flash-linear-attention", "fla.layers / fla.models", False, "not installed")]
    sources: dict = {}
    verdicts = [fla_layer_mixer(c, sources) for c in classes]
    takes = [v for v in verdicts if isinstance(v, UpstreamMixer)]
    leaking = {v.name: v for v in verdicts if isinstance(v, LeakingMixer)}
    exported = set(fla_layer_exports())
    named = sum(v.name in exported for v in takes)
    out.append(ForeignClassStatus(
        "flash-linear-attention",
        f"{len(takes)} classes of fla.layers / fla.models reading cu_seqlens ({named} of the {len(exported)} classes "
        f"fla.layers exports, and {len(takes) - named} others: unexported layers, helpers, blocks, feed-forwards)",
        True, "covered by isolate_seqlens (cu_seqlens; found by the FLA rule)"))
    return out + [ForeignClassStatus("flash-linear-attention", name, True, _status(v))
                  for name, v in sorted(leaking.items())]
