"""Trim Triton autotuning to each kernel's first config. Test and benchmark support only.

Autotuning compiles and times every config of every FLA kernel on first use: minutes on a fresh GPU
machine, and impossible under Triton's interpreter (no driver to time with). Inside
:func:`first_autotune_config` every ``triton.runtime.autotuner.Autotuner`` (FLA's ``CachedAutotuner``
subclasses it) keeps only its first config. Results stay exact (any config computes the same thing);
speed may not be the tuned one, so a benchmark that uses this says so, and compares modes that all run
the same configs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["first_autotune_config"]


@contextlib.contextmanager
def first_autotune_config() -> Iterator[None]:
    """Make every Triton autotuner use only its first config inside the block (restored on exit)."""
    import triton.runtime.autotuner as autotuner

    original_run = autotuner.Autotuner.run

    def run_first_config(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return original_run(self, *args, **kwargs)

    autotuner.Autotuner.run = run_first_config
    try:
        yield
    finally:
        autotuner.Autotuner.run = original_run
