"""The EP regression: tiny MoE decoders trained a few steps under AC with torchtitan's expert parallelism
(needs the ``ep`` extra). Returns data only; ``fla-ac-isolation regress`` renders it (docs/regression.md)."""

from fla_ac_isolation.harness.regression.report import verdicts
from fla_ac_isolation.harness.regression.run import run_regression
from fla_ac_isolation.harness.regression.spec import ModeResult, RegressionResult, RegressionSpec

__all__ = ["ModeResult", "RegressionResult", "RegressionSpec", "run_regression", "verdicts"]
