"""GPU test-harness switches. Test support only: library code never imports this module.

FLA >= 0.5.2 refuses the gated ``chunk_bwd_dqkwg`` kernel (used by the backward of the gated delta rule
and of simple GLA) on Hopper GPUs with Triton >= 3.4 and < 3.7.1, because those Triton versions were
reported to miscompile it (FLA issue #640). The check, in ``fla/ops/common/chunk_o.py``, reads that
module's ``TRITON_ABOVE_3_7_1`` flag. The device image pairs an H200 with Triton 3.6, so a GPU test run
may lift the guard to measure the kernels against the reference backend: exactly what a parity test is
for. :func:`lift_hopper_gdn_guard` does that for the duration of a block and says so on stdout.
:func:`host_sync_sites` records where a block synchronises the host (benchmarks and GPU tests).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

__all__ = ["SYNC_WARNING", "gpu_test_harness", "host_sync_sites", "lift_hopper_gdn_guard"]

SYNC_WARNING = "called a synchronizing CUDA operation"
"""The text of torch's warning for one host synchronisation under ``set_sync_debug_mode("warn")``."""


@contextlib.contextmanager
def host_sync_sites() -> Iterator[list[str]]:
    """Record the host synchronisations of the block: the yielded list is filled on exit.

    One ``"file:line"`` entry (the Python line that triggered it, ``site-packages/`` stripped) per
    synchronising CUDA call, counted with ``torch.cuda.set_sync_debug_mode("warn")``. Only warnings with
    :data:`SYNC_WARNING` count: torch also emits a one-time "Synchronization debug mode is a prototype
    feature" notice, which is not a sync. Needs a CUDA build of torch.
    """
    sites: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites.extend(
        f"{w.filename.split('site-packages/')[-1]}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)
    )


@contextlib.contextmanager
def lift_hopper_gdn_guard() -> Iterator[bool]:
    """Set ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` inside the block, printing that it did.

    Yields ``True`` when the guard was active (and is now lifted), ``False`` when there was nothing to
    lift (not Hopper, or Triton outside the refused range). The flag is restored on exit.
    """
    import fla.ops.common.chunk_o as chunk_o

    from fla_ac_isolation.fla_seam.versions import hopper_gdn_guard_active

    guarded = hopper_gdn_guard_active()
    previous = getattr(chunk_o, "TRITON_ABOVE_3_7_1", None)
    if guarded:
        import triton

        print(
            "[fla_ac_isolation.harness.testing] lifting FLA's Hopper guard for Triton "
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
    """What a GPU test rank enters: :func:`lift_hopper_gdn_guard` plus first-config-only autotuning
    (:func:`fla_ac_isolation.harness.fla_seam.interpreter.first_autotune_config`).

    Passed to the regression as ``RegressionSpec(rank_setup=gpu_test_harness)`` (a module-level function,
    so that it pickles into the rank processes) on the device, where compiling every autotune config of
    every FLA kernel would take minutes per rank. Yields what :func:`lift_hopper_gdn_guard` does.
    """
    from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config

    with lift_hopper_gdn_guard() as lifted, first_autotune_config():
        yield lifted
