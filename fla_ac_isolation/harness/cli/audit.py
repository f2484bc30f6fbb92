"""``fla-ac-isolation audit``: :mod:`fla_ac_isolation.harness.audit_runner` from the command line, printing every
region's verdict and FLA cache counts as each mode finishes, e.g. ``audit --model fault-stack --ac full``.

Exit codes: 0 when every region of ``isolated`` and ``global-disable`` is aligned; 1 otherwise; 2 for invalid
arguments, or when nothing was judged (only ``shared`` asked for, or no mode that decides ran a checkpointed
region: the reason and any missing module's install are printed). A failing mode is reported and the others
still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from fla_ac_isolation.harness.audit_runner import AUDIT_MODELS, AUDIT_MODES, AuditRun, AuditSpec, run_audit
from fla_ac_isolation.harness.cli.console import add_model_argument, add_policy_arguments, given_policy, split_modes
from fla_ac_isolation.harness.extras import install_hint, missing_modules
from fla_ac_isolation.ops import BACKENDS

__all__ = ["HELP", "add_arguments", "run", "spec_from_arguments"]

HELP = "one training step of a tiny model under ReplayAudit: which recompute diverged, at which op, and why"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``audit`` options to ``parser``; their defaults are the spec's."""
    default = {f.name: f.default for f in dataclasses.fields(AuditSpec)}
    parser.description = (
        "Run one training step of a tiny model under ReplayAudit in the unsafe 'shared' mode (one cu_seqlens "
        "object for every layer) and in 'isolated' mode (LayerLocalSeqlens), and print, per checkpointed "
        "block, whether its recompute ran the same ops as its forward, the first differing op otherwise, and "
        "FLA's index-helper cache hits/misses per pass."
    )
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.epilog = ("exit codes: 0 every region of the modes that decide (isolated, global-disable) aligned; 1 one "
                     "diverged or failed; 2 invalid arguments, or nothing judged (no mode that decides ran a "
                     "checkpointed region)")
    add_model_argument(parser, AUDIT_MODELS, "audit", default["model"],
                       "a built-in tiny family, or the FLA-helper fault stack")
    add_policy_arguments(parser, default)
    parser.add_argument("--modes", default=",".join(default["modes"]),
                        help="comma-separated subset of " + ", ".join(AUDIT_MODES))
    parser.add_argument("--backend", choices=BACKENDS, default=default["backend"],
                        help="mixer backend of the families (auto: FLA kernels on CUDA, reference on CPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=default["device"],
                        help="auto: cuda when a GPU is visible, else cpu")
    parser.add_argument("--hidden-size", type=int, default=default["hidden_size"], help="family model width")
    parser.add_argument("--layers", type=int, default=default["num_layers"], help="decoder blocks")
    parser.add_argument("--experts", type=int, default=default["num_experts"], help="routed experts per MoE")
    parser.add_argument("--top-k", type=int, default=default["top_k"], help="experts per token")
    parser.add_argument("--seed", type=int, default=default["seed"])
    parser.add_argument("--no-early-stop", action="store_true", help="disable torch's checkpoint early stop")
    parser.add_argument("--quiet", action="store_true", help="print the verdict tables only, no explanations")


def spec_from_arguments(args: argparse.Namespace) -> AuditSpec:
    """The validated :class:`~fla_ac_isolation.harness.audit_runner.AuditSpec` of parsed ``args``.

    Raises:
        ValueError: the spec's message for the first rule the arguments break; ``--policy`` given with
            ``--ac full`` (:func:`~fla_ac_isolation.harness.cli.console.given_policy`).
    """
    return AuditSpec(
        model=args.model, modes=split_modes(args.modes), ac=args.ac, policy=given_policy(args), freq=args.freq,
        backend=args.backend, device=args.device, hidden_size=args.hidden_size, num_layers=args.layers,
        num_experts=args.experts, top_k=args.top_k, seed=args.seed, early_stop=not args.no_early_stop,
    ).validate()


def _print_run(spec: AuditSpec, run: AuditRun, quiet: bool) -> None:
    what = "full AC" if spec.ac == "full" else f"SAC policy {spec.policy_name}"
    head = f"== {spec.model} | {run.mode} | {what} | freq {spec.freq}"
    if run.failure is not None:
        print(f"{head}: FAILED: {run.failure}\n")
        return
    audit = run.audit
    n_bad = len(audit.divergent)
    verdict = f"{n_bad} divergent region(s)" if n_bad else ("aligned" if audit.regions else "no region ran")
    print(f"{head}: {verdict}")
    print(audit.summary(messages=not quiet))
    if run.error:
        print(f"the step failed: {run.error}")
    print()


def run(args: argparse.Namespace) -> int:
    """Run the audit for parsed ``args``, printing each mode as it finishes; return the exit code."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    try:
        spec = spec_from_arguments(args)
    except ValueError as err:
        print(f"fla-ac-isolation audit: error: {err}", file=sys.stderr)
        return 2
    result = run_audit(spec, on_run=lambda r: _print_run(spec, r, args.quiet))
    if result.unjudged is not None:
        print(f"fla-ac-isolation audit: could not judge: {result.unjudged}", file=sys.stderr)
        for name in missing_modules(result.unjudged):
            print(f"  missing module {name}: {install_hint(name)}", file=sys.stderr)
    return result.exit_code
