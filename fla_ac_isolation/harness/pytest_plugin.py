"""The pytest plugin (entry point ``fla_ac_isolation.harness.pytest_plugin``): :func:`assert_ac_safe` (fixture
``fla_ac_check``), :func:`assert_regression_safe` (fixture ``fla_ac_regression``) and FLA's kernels served on a
CPU (fixture ``fla_reference_kernels``) in your own tests (docs/pytest-plugin.md). Loading it imports only
pytest."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["assert_ac_safe", "assert_regression_safe", "fla_ac_check", "fla_ac_regression", "fla_reference_kernels"]

def _check_target(model: Any, batch: Any) -> tuple[str | Callable, bool]:
    """``(CheckSpec.model, whether it was given as objects, a module or a callable, not as a string)``."""
    from torch import nn

    if isinstance(model, str):
        if batch is not None:
            raise TypeError("batch must be None when model is a 'module:callable' string (the callable returns it)")
        return model, False
    if isinstance(model, nn.Module):
        if not isinstance(batch, dict):
            raise TypeError(f"batch must be a dict of model(**batch)'s keyword arguments when model is an nn.Module, "
                            f"got {type(batch).__name__}")
        given = model

        def factory() -> tuple[nn.Module, dict]:  # a fresh copy per call: the check checkpoints it in place
            return copy.deepcopy(given), batch
        return factory, True
    if callable(model):
        if batch is not None:
            raise TypeError("batch must be None when model is a callable (it returns (model, batch))")
        return model, True
    raise TypeError(f"model must be an nn.Module (with batch), a callable returning (model, batch), or "
                    f"'module:callable', got {type(model).__name__}")


def assert_ac_safe(model: Any, batch: dict | None = None, **spec: Any) -> Any:
    """Run ``model`` and ``batch`` through the check; fail the calling test with its report unless it passes.

    Args:
        model: an ``nn.Module`` WITHOUT activation checkpointing (a deep copy is checked); or a callable returning
            ``(model, batch)`` (called again to verify the fix); or ``"module:callable"`` /
            ``"path/to/file.py:callable"``.
        batch: ONE packed batch, the keyword arguments of ``model(**batch)`` (which returns the loss), holding its
            offsets (``cu_seqlens``, ``cu_seq_lens_q``, ...).
        **spec: other fields of :class:`~fla_ac_isolation.harness.check.runner.CheckSpec` (``ac``, ``policy``,
            ``device``, ``verify_fix``); ``policy`` only with ``ac="selective"`` (the default): with
            ``ac="full"`` the check refuses it (full AC saves no op), before the model runs.

    Returns:
        The :class:`~fla_ac_isolation.harness.check.runner.CheckResult` of a passing check.

    Warns:
        UserWarning: under ``ac="full"`` a region diverged with the gradients of no AC (it passes; SAC would not).

    Raises:
        pytest.fail.Exception: a region diverged, the step failed under AC, a mixer leaks, or the check refused
            the input or judged nothing. It derives from ``BaseException``: catch it with
            ``pytest.raises(pytest.fail.Exception)``.
        TypeError: ``model`` / ``batch`` of another kind than above.
    """
    from fla_ac_isolation.harness.check import CheckInputError, CheckSpec, run_check
    from fla_ac_isolation.harness.cli.check import render

    target, owned = _check_target(model, batch)
    refused = None
    try:
        result = run_check(CheckSpec(model=target, **spec))
    except CheckInputError as err:
        refused = str(err)  # failed below, outside this handler: the report shows no chained traceback
    if refused is not None:
        pytest.fail(f"fla-ac-isolation check refused the model: {refused}", pytrace=False)
    report = render(result)
    if owned:  # the check ran the objects given here, not a module:callable the reader could run
        report = report.replace(f"(--model {result.spec.model_name})", "(given to assert_ac_safe)", 1)
    if result.exit_code != 0:
        pytest.fail(report, pytrace=False)
    if result.harmless_under_full_ac:  # passes, but the same model under SAC would not: say so in the test output
        import warnings

        warnings.warn(f"fla-ac-isolation check passed under full AC only: {report}", UserWarning, stacklevel=2)
    return result


def _regression_lines(result: Any, found: dict) -> list[str]:
    from fla_ac_isolation.harness.regression.report import REQUIRED

    spec = result.spec
    lines = [f"fla-ac-isolation regress: {spec.model} with mixer {spec.mixer} | EP={spec.ep} | "
             f"{'full AC' if spec.ac == 'full' else 'SAC policy ' + spec.policy_name} | {spec.device}, {spec.dtype}"]
    width = max(len(name) for name in found)
    for name, verdict in found.items():
        role = " (required)" if name in REQUIRED else " (unsafe)" if name != "no-ac" else ""
        lines.append(f"  {name:>{width}}: {verdict.text}{role}")
    return lines


def assert_regression_safe(mixer: Callable | str, *, require_fault: bool = True, **spec: Any) -> dict:
    """Run the EP regression with ``mixer`` in the linear-attention slots; fail the calling test unless it passes.

    Args:
        mixer: your mixer class or factory (module level: the rank processes import it), or
            ``"module:qualname"`` / ``"path/to/file.py:qualname"``; the contract is
            :mod:`fla_ac_isolation.harness.regression.user_mixer`'s.
        require_fault: also fail when the unsafe ``shared`` path neither failed nor diverged (it showed nothing).
        **spec: other fields of :class:`~fla_ac_isolation.harness.regression.RegressionSpec` (``mixer_config``,
            ``policy``: your SAC policy, module level, ...); defaults: EP=2, ``qwen3_5_moe``, 3 steps.

    Returns:
        The verdicts, ``{mode: Verdict}``, of a passing run.

    Raises:
        pytest.fail.Exception: naming every mode's verdict, when ``no-ac`` failed, a required mode did not match
            it, or (``require_fault``) the shared path reproduced nothing.
        ValueError: an invalid spec, e.g. a mixer the ranks cannot import.
    """
    from fla_ac_isolation.harness.regression import RegressionSpec, run_regression, verdicts
    from fla_ac_isolation.harness.regression.report import exit_code, fault_reproduced

    result = run_regression(RegressionSpec(mixer=mixer, **spec))
    found = verdicts(result)
    lines = _regression_lines(result, found)
    if exit_code(result) != 0:
        pytest.fail("\n".join([*lines, "verdict: FAILED (a required mode does not match no-ac)"]), pytrace=False)
    if require_fault and "shared" in found and not fault_reproduced(result):
        pytest.fail("\n".join([*lines, "verdict: NOT JUDGED: the unsafe shared path ran clean, so the mixer's FLA "
                                       "calls never met FLA's cache with shared offsets (does it hand FLA "
                                       "seqlens.local()'s cu_seqlens?)"]), pytrace=False)
    return found


@pytest.fixture
def fla_ac_check() -> Callable[..., Any]:
    """:func:`assert_ac_safe` as a fixture: ``fla_ac_check(model, batch, policy=...)``."""
    return assert_ac_safe


@pytest.fixture
def fla_ac_regression() -> Callable[..., dict]:
    """:func:`assert_regression_safe` as a fixture: ``fla_ac_regression(MyMixer, ep=2)``."""
    return assert_regression_safe


@pytest.fixture
def fla_reference_kernels() -> Iterator[Any]:
    """The test runs inside :func:`~fla_ac_isolation.harness.reference_kernels.reference_kernels`: FLA's gated
    delta rule, causal conv, KDA, SwiGLU and RMS norms served by pure-torch stand-ins (a CPU test of code that
    calls ``fla.ops``; backward included). Yields its
    :class:`~fla_ac_isolation.harness.reference_kernels.ServedKernels` (``.calls``: each kernel call and the
    offsets objects it received)."""
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    with reference_kernels() as served:
        yield served
