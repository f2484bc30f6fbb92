"""The harness's side of the seam to FLA: what touches FLA only to run checks, never to make a model safe.

With :mod:`fla_ac_isolation.fla_seam` (the library's seam) these are the only modules that import ``fla``; the
library's seam never imports them.

* :mod:`~fla_ac_isolation.harness.fla_seam.interpreter` - the interpreter backend: FLA's real kernels, CP ones
  included, on a CPU under Triton's interpreter (what the CPU CP regression's ranks enter).
* :mod:`~fla_ac_isolation.harness.fla_seam.serving` - FLA's entry points served by pure-torch stand-ins
  (:mod:`~fla_ac_isolation.harness.fla_seam.served_ops`) wherever foreign code looked them up: transformers, FLA's
  own layers and models, OLMo-core and torchtitan on a CPU (public as
  :mod:`fla_ac_isolation.harness.reference_kernels`).
* :mod:`~fla_ac_isolation.harness.fla_seam.models` - flash-linear-attention's model zoo: config classes, causal
  LMs, layer classes (doctor's report, the tiny models).

Importing any of them imports nothing from FLA: each reaches FLA inside the function that needs it.
"""
