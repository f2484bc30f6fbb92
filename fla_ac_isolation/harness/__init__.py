"""The harness: what exists to regress, check, audit-run, diagnose and benchmark the library.

The library (the rest of :mod:`fla_ac_isolation`: ``LayerLocalSeqlens``, ``isolate_seqlens``, ``swap_mixers``, the
mixers, ``ops``, the SAC policies, ``ReplayAudit``, the CP/PP helpers, the FLA seam) never imports this package
(``tests/test_layout.py`` checks it over every module's imports). The harness imports the library.

* :mod:`~fla_ac_isolation.harness.regression` - the EP/CP/PP regression: spec -> ranks -> results and verdicts.
* :mod:`~fla_ac_isolation.harness.cli` - the ``fla-ac-isolation`` command (``doctor``, ``regress``, ``audit``,
  ``check``) over the library calls below.
* :mod:`~fla_ac_isolation.harness.audit_runner`, :mod:`~fla_ac_isolation.harness.check_runner` - ``audit`` and
  ``check`` as library calls returning data.
* :mod:`~fla_ac_isolation.harness.environment` - doctor's environment report.
* :mod:`~fla_ac_isolation.harness.modes` - the modes every check runs, and the unsafe ``SharedSeqlens``.
* :mod:`~fla_ac_isolation.harness.fault_stack` - the smallest reproduction of the fault.
* :mod:`~fla_ac_isolation.harness.foreign_models` - tiny transformers / flash-linear-attention models.
* :mod:`~fla_ac_isolation.harness.fla_seam` - the harness's side of the FLA seam: FLA's kernels served by pure
  torch on a CPU, Triton's interpreter backend, FLA's model zoo.
* ``testing`` - test support (named by tests only).
* :mod:`~fla_ac_isolation.harness.failures`, :mod:`~fla_ac_isolation.harness.extras` - error text for reports,
  the optional dependencies.
"""
