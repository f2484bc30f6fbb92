"""FLA's Hopper guard (FLA #640): the gated ``chunk_bwd_dqkwg`` backward refused on Hopper GPUs with Triton in
``[3.4, 3.7.1)``; ``check`` reports the refusal as the environment, the GPU tests skip where it is active."""

from __future__ import annotations

import os
import traceback

__all__ = ["HOPPER_GDN_REMEDY", "hopper_gdn_guard_active", "is_hopper_gdn_refusal"]

HOPPER_GDN_REMEDY = "install triton >= 3.7.1 (pip install 'triton>=3.7.1'), or tilelang (pip install tilelang)"
"""What lifts FLA's #640 refusal, as FLA's own message says (``fla/ops/common/chunk_o.py``, FLA 0.5.2 and 0.6)."""

_GUARD_FILE = os.path.join("fla", "ops", "common", "chunk_o.py")


def hopper_gdn_guard_active() -> bool:
    """Whether FLA refuses the gated backward here (FLA #640), from the flags of ``fla.ops.common.chunk_o``."""
    import fla.ops.common.chunk_o as chunk_o

    return bool(
        getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
        and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
        and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    )


def is_hopper_gdn_refusal(error: BaseException) -> bool:
    """Whether ``error`` is FLA's #640 refusal: a ``RuntimeError`` naming ``#640`` and ``Hopper``, raised in
    ``fla/ops/common/chunk_o.py``, with the guard active here. Never raises."""
    if not isinstance(error, RuntimeError) or "#640" not in str(error) or "Hopper" not in str(error):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or not frames[-1].filename.endswith(_GUARD_FILE):
        return False
    try:
        return hopper_gdn_guard_active()
    except Exception:  # FLA's kernels do not import here: not FLA's guard
        return False
