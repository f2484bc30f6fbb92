"""``fla-ac-isolation check``: one training step of YOUR model under :class:`~fla_ac_isolation.ReplayAudit`, which
FLA-backed classes it holds (exposed, covered, leaking) and the one-line fix.

The check itself is :mod:`fla_ac_isolation.harness.check_runner`
(:class:`~fla_ac_isolation.harness.check_runner.CheckSpec`,
:func:`~fla_ac_isolation.harness.check_runner.run_check`; the contract of ``--model`` is there); this module parses the
flags into its spec and prints the result, or its JSON (``--json``).

Example::

    fla-ac-isolation check --config qwen3_next
    fla-ac-isolation check --model examples/check_model.py:fla_gated_deltanet --json
    fla-ac-isolation check --model my_project.train:model_and_batch --policy torchtitan

Exit codes: 0 when every checkpointed region is aligned and no mixer leaks across packed documents; 1 when a
region diverged, the step failed under AC or a mixer leaks (the verdict line names the leaking classes); 2 for
bad input (flags, a callable that cannot be loaded or returns something else than ``(model, batch)``, a batch
without packed offsets, a step that fails without AC too, a model without a layer list), printed on stderr and,
with ``--json``, as ``{"error": ..., "exit_code": 2}`` on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from fla_ac_isolation.harness.check_runner import CheckInputError, CheckResult, CheckSpec, CheckStep, run_check

__all__ = ["HELP", "add_arguments", "render", "run", "spec_from_arguments"]

HELP = "one training step of your model under ReplayAudit: exposed, leaking or covered FLA classes, and the fix"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check`` options to ``parser``; their defaults are the spec's (``CheckSpec``'s fields)."""
    from fla_ac_isolation.harness.cli.console import add_policy_arguments

    default = {f.name: f.default for f in dataclasses.fields(CheckSpec)}
    default["freq"] = 1
    parser.description = (
        "Run one training step of your model (or of a tiny transformers / flash-linear-attention model) with every "
        "layer checkpointed under a SAC policy, inside ReplayAudit, and print whether each checkpointed layer's "
        "recompute ran the ops of its forward, which FLA-backed classes the model holds (exposed to FLA's cache "
        "fault, covered, or leaking across packed documents) and the one-line fix."
    )
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="module:callable or path/to/file.py:callable returning (model, batch): the "
                                        "model without AC and one packed batch, a dict of model(**batch)'s keywords")
    source.add_argument("--config", help="a tiny model instead: a transformers or FLA model_type (qwen3_next, "
                                         "gated_deltanet) or config class name (Qwen3NextConfig)")
    add_policy_arguments(parser, default)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=default["device"],
                        help="cpu: FLA's kernels served by fla_ac_isolation.harness.reference_kernels; cuda: FLA's own")
    parser.add_argument("--seed", type=int, default=default["seed"], help="the tiny model's weights and batch")
    parser.add_argument("--no-verify-fix", action="store_true", help="do not rerun the step with the fix applied")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def spec_from_arguments(args: argparse.Namespace) -> CheckSpec:
    """The :class:`~fla_ac_isolation.harness.check_runner.CheckSpec` of parsed ``args``, validated.

    Raises:
        CheckInputError: the spec's message for the first rule the arguments break (``--freq`` other than 1).
    """
    if args.freq != 1:
        raise CheckInputError("check checkpoints every layer: --freq must be 1")
    return CheckSpec(model=args.model, config=args.config, ac=args.ac, policy=args.policy, device=args.device,
                     seed=args.seed, verify_fix=not args.no_verify_fix).validate()


def _step_lines(title: str, step: CheckStep) -> list[str]:
    bad = sum(r.verdict == "divergent" for r in step.regions)
    head = f"{title}: {len(step.regions) - bad} of {len(step.regions)} checkpointed region(s) aligned"
    lines = [head + (f", {bad} DIVERGENT" if bad else "")]
    width = max((len(r.label) for r in step.regions), default=0)
    for r in step.regions:
        line = f"  {r.label:<{width}}  {r.verdict}"
        if r.verdict == "divergent":
            line += f" at op #{r.first_diff}" + (f" in {r.where}" if r.where else "")
            line += f": recompute ran {r.recompute_op}, forward ran {r.forward_op}"
            if r.fla_helpers:
                line += f" (FLA cache: {', '.join(r.fla_helpers)})"
        lines.append(line)
    if step.error is not None:
        lines.append(f"  the step failed: {step.error}")
    return lines


def render(result: CheckResult) -> str:
    """The plain-text report of ``result`` (foreign text is printed as it is: no markup is interpreted)."""
    spec = result.spec
    what = f"--config {spec.config}" if spec.config else f"--model {spec.model}"
    ac = "full AC" if spec.ac == "full" else f"SAC policy {spec.policy}"
    kernels = "FLA served by reference_kernels" if spec.device == "cpu" else "FLA's kernels"
    lines = [f"fla-ac-isolation check: {result.model} ({what}) | {ac} | {spec.device} ({kernels})", ""]
    lines.append("FLA-backed classes:" if result.mixers else "FLA-backed classes: none this package knows")
    for m in result.mixers:
        paths = ", ".join(m.paths[:3]) + (", ..." if len(m.paths) > 3 else "")
        extra = f"; offsets {', '.join(m.offsets)}" if m.offsets else ""
        lines.append(f"  {m.status:<8} {m.name} ({m.framework}) x{len(m.paths)}: {paths}{extra}")
        if m.why:
            lines.append(f"           {m.why}: documents are not kept apart")
    lines += ["", *_step_lines("as given", result.as_given)]
    if result.fixed is not None:
        lines += ["", *_step_lines(f"with {' then '.join(result.fix_applied)}", result.fixed)]
    if result.fixes:
        lines += ["", "Fix:", *(f"  {fix}" for fix in result.fixes)]
    verdict = "OK" if result.exit_code == 0 else ("LEAKING" if result.as_given.aligned else "DIVERGENT")
    leaking = ", ".join(m.name for m in result.leaking)
    if leaking:
        verdict += f" (exit 1): packed documents mix in {leaking}" if result.as_given.aligned else (
            f" (exit 1), and packed documents mix in {leaking}")
    else:
        verdict += f" (exit {result.exit_code})"
    lines += ["", f"verdict: {verdict}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the check for parsed ``args``; print the report (or JSON); return the exit code (2: bad input)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    try:
        result = run_check(spec_from_arguments(args))
    except CheckInputError as err:
        print(f"fla-ac-isolation check: error: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(err), "exit_code": 2}, indent=1))
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else render(result))
    return result.exit_code
