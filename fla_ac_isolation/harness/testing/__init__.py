"""Test support: switches and stand-ins for test runs and benchmarks; library code never names this package.

It may patch FLA and Triton internals (that is its job); the library touches FLA only through
:mod:`fla_ac_isolation.fla_seam`. Running FLA's kernels on a CPU under Triton's interpreter is not test
support but a backend of the seam (:mod:`fla_ac_isolation.harness.fla_seam.interpreter`), which tests use too.

* :mod:`~fla_ac_isolation.harness.testing.gpu` - GPU-harness switches, e.g. lifting FLA's Hopper/Triton guard
  for a test run, announced on stdout; host-sync recording.
* :mod:`~fla_ac_isolation.harness.testing.sync_ops` - the same question on a CPU: the ops of a step that would
  synchronise the host on CUDA (``.item()``, ``nonzero``, ``repeat_interleave`` without ``output_size``, ...).
* :mod:`~fla_ac_isolation.harness.testing.olmo_core` - OLMo-core on a CPU: packed documents on its torch attention
  backend, and ``cpu_stand_ins()`` (that plus :func:`fla_ac_isolation.harness.reference_kernels.reference_kernels`, the
  library's FLA kernels on a CPU).

Submodules are imported explicitly (``from fla_ac_isolation.harness.testing.gpu import ...``) so that importing this
package touches neither Triton nor FLA.
"""
