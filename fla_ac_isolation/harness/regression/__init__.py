"""The EP regression: tiny MoE decoders trained a few steps under AC with real torchtitan expert parallelism.

``fla-ac-isolation regress`` (:mod:`fla_ac_isolation.harness.cli.regress`) runs it and renders what it returns; this
package returns data only (results and verdicts) and imports neither the command nor rich. The pieces:

* :mod:`.spec` - what to run (:class:`RegressionSpec`: every default and every rule of a run, the ranks'
  layout as a :class:`~fla_ac_isolation.parallel.ParallelMesh`) and what comes back (:class:`ModeResult`,
  :class:`RegressionResult`);
* :mod:`.run` - :func:`run_regression`, the entry point;
* :mod:`.launch` - worker processes, one launch per mode, and how failures are collected;
* :mod:`.torchrun` - the same under ``torchrun``;
* :mod:`.train` - what one rank does in one mode (model, steps, gradient reduction and comparison);
* :mod:`.model` - tiny decoders per family (:data:`fla_ac_isolation.families.FAMILIES`) built from the
  transformers config classes, with this package's mixers and torchtitan's MoE;
* :mod:`.expert_parallel` - torchtitan's MoE, its EP sharding, and the environment it needs;
* :mod:`.data` - deterministic packed batches, different per rank;
* :mod:`.report` - verdicts, the exit code, the run as one JSON-ready document; :mod:`.cp_report` - the
  judgement against the run without CP.

The modes are those of :mod:`fla_ac_isolation.harness.modes`. Needs the ``ep`` extra (torchtitan, transformers).

Example::

    from fla_ac_isolation.harness.regression import RegressionSpec, run_regression, verdicts
    result = run_regression(RegressionSpec(model="qwen3_5_moe", ep=2, steps=3))
    verdicts(result)["isolated"].ok   # True: bit-exact with no-AC on the CPU reference backend
"""

from fla_ac_isolation.harness.regression.report import verdicts
from fla_ac_isolation.harness.regression.run import run_regression
from fla_ac_isolation.harness.regression.spec import ModeResult, RegressionResult, RegressionSpec

__all__ = ["ModeResult", "RegressionResult", "RegressionSpec", "run_regression", "verdicts"]
