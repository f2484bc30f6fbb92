"""GPU test-harness switches (test support only): lifting FLA's Hopper guard on the gated ``chunk_bwd_dqkwg``
kernel (FLA issue #640) for a parity run, and recording host synchronisations."""

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
    """Record the host synchronisations of the block (``torch.cuda.set_sync_debug_mode("warn")``): the yielded
    list gets one ``"file:line"`` per synchronising call on exit. Needs a CUDA build of torch."""
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
    """Set ``chunk_o.TRITON_ABOVE_3_7_1 = True`` in the block, saying so; yield whether the guard was active."""
    import fla.ops.common.chunk_o as chunk_o

    from fla_ac_isolation.harness.fla_seam.hopper_guard import hopper_gdn_guard_active

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
    """What a GPU test rank enters: :func:`lift_hopper_gdn_guard` plus first-config-only autotuning; pass it as
    ``RegressionSpec(rank_setup=gpu_test_harness)``. Yields what :func:`lift_hopper_gdn_guard` does."""
    from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config

    with lift_hopper_gdn_guard() as lifted, first_autotune_config():
        yield lifted
