"""``fla-ac-isolation check``: one training step of YOUR model under :class:`~fla_ac_isolation.ReplayAudit`, which
FLA-backed classes it holds (exposed, covered, leaking) and the one-line fix.

The check itself is :mod:`fla_ac_isolation.harness.check.runner`
(:class:`~fla_ac_isolation.harness.check.runner.CheckSpec`,
:func:`~fla_ac_isolation.harness.check.runner.run_check`; the contract of ``--model`` is there); this module parses the
flags into its spec and prints the result, or its JSON (``--json``).

``--model`` names the model to run, as in ``audit`` and ``regress``: a built-in tiny model (a transformers or
FLA ``model_type``, as ``--config`` took it; ``--config`` still works, deprecated), or your own,
``module:callable`` (imported from the working directory) or ``path/to/file.py:callable``. ``--policy`` takes a
named policy or your own SAC policy function the same two ways; it is the policy of ``--ac selective`` and
refused with ``--ac full`` (which saves no op: the policy would be ignored).

Example::

    fla-ac-isolation check --model qwen3_next
    fla-ac-isolation check --model examples/check_model.py:fla_gated_deltanet --json
    fla-ac-isolation check --model my_project.train:model_and_batch --policy my_project.train:sac_policy

Exit codes: 0 when every checkpointed region is aligned and no mixer leaks across packed documents, or, under
``--ac full``, when a region's recompute ran other ops but the step's gradients equal those of the step without
AC (full AC replays nothing by index; the report says what SAC would do with the same model); 1 when a
region diverged (under SAC, or with other gradients: ``DIVERGENT``), the step failed under AC but not without
it (``FAILED under AC``) or a mixer leaks (the verdict line names the leaking classes); 2 for bad input
(flags, a callable that cannot be loaded or returns something else than ``(model, batch)``, a batch without
packed offsets, a step that fails without AC too, or in its forward when the model checkpoints itself, a step
that judged nothing: no region recomputed, no packed offsets reaching FLA, no FLA seen at all; a model without
a layer list), printed on stderr and,
with ``--json``, as ``{"error": ..., "exit_code": 2}`` on stdout; 3 when FLA refuses this environment (its #640
guard: the gated backward on a Hopper GPU with Triton < 3.7.1), the message naming what to install, printed and
with ``--json`` shown the same way (``"exit_code": 3``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from fla_ac_isolation.harness.check import (
    CheckEnvironmentError,
    CheckInputError,
    CheckResult,
    CheckSpec,
    CheckStep,
    autotune_notice,
    run_check,
)
from fla_ac_isolation.harness.environment import resolve_device

__all__ = ["HELP", "add_arguments", "render", "run", "spec_from_arguments"]

FULL_AC_NOTE = ("under full AC nothing is replayed by index: torch recomputes every op and keeps only what the "
                "recompute returns, so a recompute that runs other ops "
                "still gives these gradients: {grads}. Under SAC (--ac selective) the same recompute would hand "
                "the ops after {first} other ops' saved outputs (wrong gradients, or an error): fix it before "
                "you use SAC")

OBSERVED = {"fresh offsets": "every call handed FLA offsets of its own (observed in the step)",
            "shared offsets": "its calls handed FLA the same offsets objects (observed in the step)"}

HELP = "one training step of your model under ReplayAudit: exposed, leaking or covered FLA classes, and the fix"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check`` options to ``parser``; their defaults are the spec's (``CheckSpec``'s fields)."""
    from fla_ac_isolation.harness.cli.console import add_policy_arguments

    default = {f.name: f.default for f in dataclasses.fields(CheckSpec)}  # no --freq: every layer is checkpointed
    parser.description = (
        "Run one training step of your model (or of a tiny transformers / flash-linear-attention model) with every "
        "layer checkpointed under a SAC policy, inside ReplayAudit, and print whether each checkpointed layer's "
        "recompute ran the ops of its forward, which FLA-backed classes the model holds (exposed to FLA's cache "
        "fault, covered, or leaking across packed documents) and the one-line fix."
    )
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.epilog = ("exit codes: 0 every region aligned (under --ac full: or divergent with the gradients of no AC) "
                     "and nothing leaks; 1 a region diverged, the step failed under AC, or a mixer leaks; 2 bad input "
                     "or nothing judged; 3 FLA refuses this environment (its #640 guard)")
    parser.add_argument("--model", required=True,
                        help="the model to run: a built-in tiny model (a family: qwen3_5_moe, qwen3_8, "
                             "nemotron_h, kimi_linear; a transformers or FLA model_type: qwen3_next, "
                             "gated_deltanet; or a config class name: Qwen3NextConfig), or "
                             "your own, module:callable (from the working directory) or "
                             "path/to/file.py:callable returning (model, batch): the model (without AC, "
                             "or checkpointing itself) and one packed batch, a dict of model(**batch)'s "
                             "keywords")
    add_policy_arguments(parser, default)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=default["device"],
                        help="cpu: FLA's kernels served by fla_ac_isolation.harness.reference_kernels; cuda: FLA's own")
    parser.add_argument("--seed", type=int, default=default["seed"], help="the tiny model's weights and batch")
    parser.add_argument("--no-verify-fix", action="store_true", help="do not rerun the step with the fix applied")
    parser.add_argument("--first-config", action="store_true",
                        help="on CUDA: FLA's Triton autotuners keep their first config (no minutes of autotuning on "
                             "first use; untuned kernels, the same verdict)")
    parser.add_argument("--autocast", choices=("bf16", "fp16"), default=default["autocast"],
                        help="run each step's forward and backward inside torch.autocast(device, dtype), as a "
                             "training loop that wraps its whole step does")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def spec_from_arguments(args: argparse.Namespace) -> CheckSpec:
    """The :class:`~fla_ac_isolation.harness.check.runner.CheckSpec` of parsed ``args``, validated.

    Raises:
        CheckInputError: the spec's message for the first rule the arguments break (``--policy`` with
            ``--ac full``: :data:`~fla_ac_isolation.harness.cli.console.FULL_AC_POLICY`).
    """
    from fla_ac_isolation.harness.cli.console import given_policy
    from fla_ac_isolation.harness.foreign_models import tiny_names

    model, config = args.model, None
    if model is not None and ":" not in model:
        names = tiny_names()
        if model not in names:
            raise CheckInputError(f"--model must be a built-in tiny model (one of {sorted(names)}) or your own, "
                                  f"'module:callable' or 'path/to/file.py:callable', got {model!r}")
        model, config = None, model
    policy = given_policy(args, CheckInputError)  # None: the default policy (--ac selective); refused with full
    return CheckSpec(model=model, config=config, ac=args.ac, policy=policy, device=args.device,
                     seed=args.seed, verify_fix=not args.no_verify_fix,
                     first_config=args.first_config, autocast=args.autocast).validate()


def _step_lines(title: str, step: CheckStep) -> list[str]:
    bad = sum(r.verdict == "divergent" for r in step.regions)
    good = sum(r.verdict == "aligned" for r in step.regions)
    unjudged = len(step.regions) - bad - good  # not recomputed: the step failed before their backward
    head = f"{title}: {good} of {len(step.regions)} checkpointed region(s) aligned"
    lines = [head + (f", {bad} DIVERGENT" if bad else "") + (f", {unjudged} not recomputed" if unjudged else "")]
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


def _verdict_word(result: CheckResult, harmless: bool) -> str:
    step = result.as_given
    if harmless:
        return "OK under full AC" if result.exit_code == 0 else "LEAKING"
    if result.exit_code == 0:
        return "OK"
    if step.divergent:
        return "DIVERGENT"
    if step.error is not None:
        return "FAILED under AC"  # it ran without AC (or its forward ran): no region diverged, the step failed
    return "LEAKING" if step.aligned else "NOT JUDGED"


def render(result: CheckResult) -> str:
    """The plain-text report of ``result`` (foreign text is printed as it is: no markup is interpreted)."""
    spec = result.spec
    what = f"--model {spec.config}" if spec.config else f"--model {spec.model_name}"
    if result.self_checkpointed:
        ac = "its own checkpointing"
    else:
        ac = "full AC" if spec.ac == "full" else f"SAC policy {spec.policy_name}"
    kernels = "FLA served by reference_kernels" if spec.device == "cpu" else "FLA's kernels"
    amp = f" | autocast {spec.autocast}" if spec.autocast else ""
    lines = [f"fla-ac-isolation check: {result.model} ({what}) | {ac} | {spec.device} ({kernels}){amp}", ""]
    if result.self_checkpointed:
        lines += ["the model checkpoints itself: audited as it is (its own policy; --ac and --policy not applied)"]
        if result.not_checkpointed:
            lines.append(f"  not checkpointed by the model: {', '.join(result.not_checkpointed)} (they run without "
                         f"AC: not audited)")
        lines.append("")
    if result.twice:
        nested = ", ".join(f"outer {n.outer} holds inner {' and '.join(n.inner)}" for n in result.twice)
        lines += [f"checkpointed twice (a checkpoint inside a checkpoint): {nested}; each level is audited and "
                  f"recomputes (below, the outer region is listed first)", ""]
    lines.append("FLA-backed classes:" if result.mixers else "FLA-backed classes: none this package knows")
    for m in result.mixers:
        paths = ", ".join(m.paths[:3]) + (", ..." if len(m.paths) > 3 else "")
        extra = f"; offsets {', '.join(m.offsets)}" if m.offsets else ""
        if m.observed:
            extra += "; " + OBSERVED[m.observed]
        lines.append(f"  {m.status:<8} {m.name} ({m.framework}) x{len(m.paths)}: {paths}{extra}")
        if m.why:
            lines.append(f"           {m.why}: documents are not kept apart")
    lines += ["", *_step_lines("as given", result.as_given)]
    if result.fixed is not None:
        lines += ["", *_step_lines(f"with {' then '.join(result.fix_applied)}", result.fixed)]
    harmless = result.harmless_under_full_ac
    if harmless:
        first = ", ".join(f"#{r.first_diff} in {r.label}" for r in result.as_given.regions if r.verdict == "divergent")
        lines += ["", FULL_AC_NOTE.format(grads="bit-equal to the step without AC (compared)", first=first)]
    elif spec.ac == "full" and not result.self_checkpointed and not result.as_given.aligned \
            and result.as_given.grad_diff is not None:
        lines += ["", f"under full AC the gradients differ from the step without AC by up to "
                      f"{result.as_given.grad_diff:.3g}: the divergent recompute computed other values"]
    if result.fixes:
        lines += ["", "Fix (before you use SAC):" if harmless else "Fix:", *(f"  {fix}" for fix in result.fixes)]
    verdict = _verdict_word(result, harmless)
    leaking = ", ".join(m.name for m in result.leaking)
    if leaking:
        verdict += f" (exit 1): packed documents mix in {leaking}" if result.as_given.aligned or harmless else (
            f" (exit 1), and packed documents mix in {leaking}")
    else:
        verdict += f" (exit {result.exit_code})"
        if harmless:
            verdict += ": the gradients are right, but SAC would misalign (see above)"
    lines += ["", f"verdict: {verdict}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the check for parsed ``args``; print the report (or JSON); return the exit code (2: bad input, 3: FLA
    refuses this environment)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    try:
        spec = spec_from_arguments(args)
        notice = autotune_notice(resolve_device(spec.device), spec.first_config)
        if notice:
            print(f"fla-ac-isolation check: {notice}", file=sys.stderr, flush=True)
        result = run_check(spec)
    except (CheckInputError, CheckEnvironmentError) as err:
        code = 3 if isinstance(err, CheckEnvironmentError) else 2
        print(f"fla-ac-isolation check: error: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(err), "exit_code": code}, indent=1))
        return code
    print(json.dumps(result.to_dict(), indent=1) if args.json else render(result))
    return result.exit_code
