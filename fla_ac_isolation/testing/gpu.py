"""GPU test-harness switches. Test support only: library code never imports this module.

FLA >= 0.5.2 refuses the gated ``chunk_bwd_dqkwg`` kernel (used by the backward of the gated delta rule
and of simple GLA) on Hopper GPUs with Triton >= 3.4 and < 3.7.1, because those Triton versions were
reported to miscompile it (FLA issue #640). The check, in ``fla/ops/common/chunk_o.py``, reads that
module's ``TRITON_ABOVE_3_7_1`` flag. The device image pairs an H200 with Triton 3.6, so a GPU test run
may lift the guard to measure the kernels against the reference backend: exactly what a parity test is
for. :func:`lift_hopper_gdn_guard` does that for the duration of a block and says so on stdout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["gpu_test_harness", "lift_hopper_gdn_guard"]


@contextlib.contextmanager
def lift_hopper_gdn_guard() -> Iterator[bool]:
    """Set ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` inside the block, printing that it did.

    Yields ``True`` when the guard was active (and is now lifted), ``False`` when there was nothing to
    lift (not Hopper, or Triton outside the refused range). The flag is restored on exit.
    """
    import fla.ops.common.chunk_o as chunk_o

    guarded = bool(
        getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
        and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
        and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    )
    previous = getattr(chunk_o, "TRITON_ABOVE_3_7_1", None)
    if guarded:
        import triton

        print(
            "[fla_ac_isolation.testing] lifting FLA's Hopper guard for Triton "
            f"{triton.__version__} < 3.7.1 (FLA issue #640): setting "
            "fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True for this test run only",
            flush=True,
        )
        chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield guarded
    finally:
        if guarded:
            chunk_o.TRITON_ABOVE_3_7_1 = previous


@contextlib.contextmanager
def gpu_test_harness() -> Iterator[bool]:
    """What a GPU test rank enters: :func:`lift_hopper_gdn_guard` plus first-config-only autotuning.

    Used as the regression harness's ``rank_setup`` on the device, where compiling every autotune
    config of every FLA kernel would take minutes per rank. Yields what :func:`lift_hopper_gdn_guard` does.
    """
    from fla_ac_isolation.testing.autotune import first_autotune_config

    with lift_hopper_gdn_guard() as lifted, first_autotune_config():
        yield lifted
