"""The harness: what exists to regress, check, audit, diagnose and benchmark the library (the regression, the
``fla-ac-isolation`` command and its library calls, the modes, the FLA seam's test side, test support). The library
never imports it."""
