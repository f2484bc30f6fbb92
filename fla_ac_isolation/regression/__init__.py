"""The EP regression: tiny MoE decoders trained a few steps under AC with real torchtitan expert parallelism.

``fla-ac-isolation regress`` (:mod:`.cli`) runs it; the pieces:

* :mod:`.model` - tiny decoders per family (``qwen3_5_moe``, ``qwen3_8``, ``nemotron_h``) built from the
  transformers config classes, with this package's mixers and torchtitan's MoE;
* :mod:`.expert_parallel` - torchtitan's MoE, its EP sharding, and the environment it needs;
* :mod:`.data` - deterministic packed batches, different per rank;
* :mod:`.harness` - launches the ranks and trains each mode (``no-ac``, ``shared``, ``isolated``,
  ``global-disable``);
* :mod:`.report` - verdicts, the table, JSON and the loss plot.

Example::

    from fla_ac_isolation.regression import RegressionSpec, run_regression, verdicts
    result = run_regression(RegressionSpec(model="qwen3_5_moe", ep=2, steps=3))
    verdicts(result)["isolated"].ok   # True: bit-exact with no-AC on the CPU reference backend
"""

from fla_ac_isolation.regression.harness import MODES, ModeResult, RegressionResult, RegressionSpec, run_regression

__all__ = ["MODES", "ModeResult", "RegressionResult", "RegressionSpec", "run_regression", "verdicts"]


def __getattr__(name: str):
    if name == "verdicts":
        from fla_ac_isolation.regression.report import verdicts

        return verdicts
    raise AttributeError(f"module 'fla_ac_isolation.regression' has no attribute {name!r}")
