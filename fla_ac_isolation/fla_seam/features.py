"""What the installed FLA (fla-core 0.5.2 or 0.6) supports, asked here instead of testing versions elsewhere: where
it keeps its conv and L2 norm, the features that need 0.6 (:data:`FEATURES`, probed on FLA's API, never on a version
number). Imports FLA only on first call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from fla_ac_isolation.fla_seam import install
from fla_ac_isolation.fla_seam.versions import fla_version

__all__ = [
    "FEATURES",
    "FlaFeature",
    "FlaFeatureError",
    "conv_chunk_parameter",
    "gdn_entry_point",
    "kda_entry_point",
    "module",
    "module_path",
    "require",
    "supports",
]


class FlaFeatureError(RuntimeError):
    """A feature of this package needs a newer FLA than the one installed (the message names both)."""


# ------------------------------------------------------------------------------------------ module paths
def _is_real_module(path: str) -> bool:
    """Whether the installed FLA defines module ``path`` (imports its parent package)."""
    try:
        return importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:
        return False


_MODULES = {
    "0.6": {"conv": "fla.modules.causal_conv1d.ops", "conv_ops": "fla.modules.causal_conv1d.ops",
            "conv_cp": "fla.modules.causal_conv1d.cp", "l2norm": "fla.modules.norm.l2norm"},
    "0.5": {"conv": "fla.modules.conv.causal_conv1d", "conv_ops": "fla.modules.conv.triton.ops",
            "conv_cp": "fla.modules.conv.cp.ops", "l2norm": "fla.modules.l2norm"},
}


@functools.cache
def _module_layout() -> str:
    return "0.6" if _is_real_module("fla.modules.causal_conv1d") else "0.5"


def module_path(role: str) -> str:
    """The path of the installed FLA's module for ``role``: ``"conv"`` (the public ``causal_conv1d``), ``"conv_ops"``
    (its Triton forward/backward), ``"conv_cp"`` (``causal_conv1d_cp``) or ``"l2norm"`` (``l2norm_fwd``/``_bwd``).

    Raises:
        ValueError: unknown ``role``.
    """
    paths = _MODULES[_module_layout()]
    if role not in paths:
        raise ValueError(f"role must be one of {tuple(paths)}, got {role!r}")
    return paths[role]


def module(role: str):
    """The module :func:`module_path` names, imported."""
    return importlib.import_module(module_path(role))


# The entry points are imported by an import statement on every call: torch.compile traces one without a graph
# break (it breaks on module()'s cached layout probe), and the object is the one bound in FLA's package now
# (what the harness's CPU serving replaces).
def gdn_entry_point() -> Callable:
    """FLA's public ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, imported."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def kda_entry_point() -> Callable:
    """FLA's public ``fla.ops.kda.chunk_kda`` (fla-core 0.6), imported."""
    from fla.ops.kda import chunk_kda

    return chunk_kda


@functools.cache
def conv_chunk_parameter() -> str:
    """The name of the chunk-size parameter of FLA's conv forward/backward: ``"chunk_size"`` (0.6), ``"BT"`` (0.5.2).

    Raises:
        RuntimeError: the conv's forward has neither (a release this package does not know).
    """
    fwd = module("conv_ops").causal_conv1d_fwd
    parameters = inspect.signature(inspect.unwrap(fwd)).parameters
    for name in ("chunk_size", "BT"):
        if name in parameters:
            return name
    raise RuntimeError(f"FLA's causal_conv1d_fwd ({module_path('conv_ops')}) has no chunk_size or BT parameter "
                       f"(fla-core {fla_version()}): this package knows fla-core 0.5.2 and 0.6")


# ------------------------------------------------------------------------------------------ features
def _has_parameter(module: str, function: str, parameter: str) -> bool:
    fn = getattr(importlib.import_module(module), function)
    return parameter in inspect.signature(inspect.unwrap(fn)).parameters


@dataclass(frozen=True)
class FlaFeature:
    """A feature of this package that needs something of FLA that fla-core 0.5.2 lacks.

    Attributes:
        key: the name :func:`supports` and :func:`require` take.
        name: what the user loses without it, in prose.
        since: the first fla-core release that has it.
        api: what of FLA it needs, as FLA spells it.
        probe: ``() -> bool``, whether the installed FLA has :attr:`api` (imports FLA).
    """

    key: str
    name: str
    since: str
    api: str
    probe: Callable[[], bool]


FEATURES: tuple[FlaFeature, ...] = (
    FlaFeature(
        "cp", "context parallelism (CPConfig, CPSeqlens, CP kernels on a CPU)", "0.6.0",
        "fla.ops.cp.context.get_cp_cu_seqlens(layout=) and its layout-aware FLACPContext",
        lambda: _has_parameter("fla.ops.cp.context", "get_cp_cu_seqlens", "layout"),
    ),
    FlaFeature(
        "gdn_chunk_indices",
        "the chunk schedule handed to FLA's gated delta rule (no host sync; CUDA graphs)", "0.6.0",
        "fla.ops.gated_delta_rule.chunk_gated_delta_rule(chunk_indices=)",
        # read on FLA's autograd Function, which reference_kernels() never replaces (it serves the function)
        lambda: "chunk_indices" in inspect.signature(importlib.import_module(
            "fla.ops.gated_delta_rule.chunk").ChunkGatedDeltaRuleFunction.forward).parameters,
    ),
    FlaFeature(
        "ssd_kernels",
        "the Mamba2 SSD on FLA's simple GLA kernels (ops.ssd backend='fla': our launches of its chunk kernels)",
        "0.6.0", "fla-core 0.6's simple GLA chunk kernels (fla.modules.causal_conv1d layout); with 0.5.2's the "
        "launches give wrong numbers (measured under Triton's interpreter)",
        lambda: _module_layout() == "0.6",
    ),
)
"""The features that need fla-core 0.6 (fla-core 0.5.2 lacks what :attr:`FlaFeature.api` names)."""

_BY_KEY = {feature.key: feature for feature in FEATURES}


def _feature(key: str) -> FlaFeature:
    if key not in _BY_KEY:
        raise ValueError(f"feature must be one of {tuple(_BY_KEY)}, got {key!r}")
    return _BY_KEY[key]


@functools.cache
def supports(key: str) -> bool:
    """Whether the installed FLA has what feature ``key`` (one of :data:`FEATURES`) needs; imports FLA.

    Raises:
        ValueError: unknown ``key``.
        ImportError: FLA does not import (:func:`import_problem` says why when it knows).
    """
    feature = _feature(key)
    install.explain_import()
    return bool(feature.probe())


def require(key: str, *, where: str) -> None:
    """Raise :class:`FlaFeatureError` unless the installed FLA supports feature ``key``.

    Args:
        key: one of :data:`FEATURES`.
        where: the call or argument that asked for it, as the user wrote it (``"CPConfig(layout='zigzag')"``).

    Raises:
        FlaFeatureError: naming ``where``, the feature, the installed fla-core version and the one needed.
        ValueError: unknown ``key``.
    """
    if supports(key):
        return
    feature = _feature(key)
    raise FlaFeatureError(
        f"{where} needs fla-core >= {feature.since} ({feature.name}: {feature.api}); installed: fla-core "
        f"{fla_version()}. Install 'fla-core>={feature.since},<0.7' (pip install -U fla-ac-isolation brings it)"
    )

