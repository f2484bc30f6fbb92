"""``check`` as a library call (:func:`run_check`): one audited training step of the user's own model, which
FLA-backed classes it holds, and the verified fix. The modules, in the order of a check: :mod:`.spec` (what to
check, its errors), :mod:`.load` (the model and batch), :mod:`.step` (the steps without and with AC),
:mod:`.callers` (your own code's FLA calls), :mod:`.findings` (what was found, as data), :mod:`.fix` (the fix
applied), :mod:`.runner` (the order and the one rule of what was judged).
"""

from fla_ac_isolation.harness.check.findings import CheckResult, CheckStep, MixerFinding, RegionVerdict, survey
from fla_ac_isolation.harness.check.fix import OWN_CODE_FIX
from fla_ac_isolation.harness.check.load import load_model
from fla_ac_isolation.harness.check.runner import run_check
from fla_ac_isolation.harness.check.spec import (
    CheckEnvironmentError,
    CheckInputError,
    CheckSpec,
    load_callable,
    resolve_policy,
)
from fla_ac_isolation.harness.check.step import autotune_notice

__all__ = ["OWN_CODE_FIX", "CheckEnvironmentError", "CheckInputError", "CheckResult", "CheckSpec", "CheckStep",
           "MixerFinding", "RegionVerdict", "autotune_notice", "load_callable", "load_model", "resolve_policy",
           "run_check", "survey"]
