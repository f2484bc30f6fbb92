"""Test support: nothing here is imported by library code.

* :mod:`~fla_ac_isolation.testing.fault_stack` - a tiny layer stack reproducing the FLA cache fault on CPU
  with FLA's real index helpers.
* :mod:`~fla_ac_isolation.testing.triton_interpret` - shims that let FLA's Triton kernels run on a CPU
  under ``TRITON_INTERPRET=1`` (first autotune config only; loop variables with a no-op ``.to()``).
* :mod:`~fla_ac_isolation.testing.gpu` - GPU-harness switches, e.g. lifting FLA's Hopper/Triton guard
  for a test run, announced on stdout.

Submodules are imported explicitly (``from fla_ac_isolation.testing.triton_interpret import ...``) so that
importing this package touches neither Triton nor FLA.
"""
