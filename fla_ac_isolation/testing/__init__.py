"""Test support: shims and switches for test runs; library code never imports this package.

It may patch FLA and Triton internals (that is its job); the library touches FLA only through
:mod:`fla_ac_isolation.fla_seam`.

* :mod:`~fla_ac_isolation.testing.autotune` - FLA's Triton autotuners cut to their first config.
* :mod:`~fla_ac_isolation.testing.triton_interpret` - shims that let FLA's Triton kernels run on a CPU
  under ``TRITON_INTERPRET=1`` (first autotune config only; loop variables with a no-op ``.to()``).
* :mod:`~fla_ac_isolation.testing.gpu` - GPU-harness switches, e.g. lifting FLA's Hopper/Triton guard
  for a test run, announced on stdout.
* :mod:`~fla_ac_isolation.testing.reference_kernels` - FLA's kernels served by reference ops to foreign code
  (OLMo-core, transformers, torchtitan) wherever it looks them up, restored on exit.
* :mod:`~fla_ac_isolation.testing.olmo_core` - OLMo-core on a CPU: packed documents on its torch attention
  backend, and ``cpu_stand_ins()`` (that plus the reference kernels).

Submodules are imported explicitly (``from fla_ac_isolation.testing.triton_interpret import ...``) so that
importing this package touches neither Triton nor FLA.
"""
