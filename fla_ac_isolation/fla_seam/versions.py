"""Version facts about the installed FLA: its version, the range this package is tested with, its guards.

* :func:`fla_version` - the installed fla-core (or flash-linear-attention) version, or ``None``.
* :data:`TESTED` - the fla-core range the project's tests run (also the install requirement).
* :func:`hopper_gdn_guard_active` - whether FLA 0.5.2+ refuses the gated ``chunk_bwd_dqkwg`` backward
  (gated delta rule, simple GLA) on this machine: Hopper GPUs with Triton >= 3.4 and < 3.7.1 (FLA issue
  #640, ``fla/ops/common/chunk_o.py``). Test harnesses may lift it (:mod:`fla_ac_isolation.testing.gpu`);
  library code never does.

Nothing here imports FLA at import time.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["TESTED", "fla_version", "hopper_gdn_guard_active"]

TESTED = ">=0.6,<0.7"
"""fla-core versions this package is tested with (``pyproject.toml`` pins the same range)."""


def fla_version() -> str | None:
    """Version of the installed ``fla-core`` (or ``flash-linear-attention``) distribution, or ``None``."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def hopper_gdn_guard_active() -> bool:
    """Whether FLA refuses the gated backward here (Hopper GPU, Triton in ``[3.4, 3.7.1)``; FLA #640).

    Reads the flags FLA computes at import in ``fla.ops.common.chunk_o`` (imports FLA's kernels).
    """
    import fla.ops.common.chunk_o as chunk_o

    return bool(
        getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
        and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
        and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    )
