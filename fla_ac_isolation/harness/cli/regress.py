"""``fla-ac-isolation regress``: the EP regression (:mod:`fla_ac_isolation.harness.regression`) from the command
line, e.g. ``regress --model qwen3_5_moe --ep 2``, ``regress --cp 2 --layout zigzag``, ``regress --pp 2``, or under
``torchrun ... -m fla_ac_isolation.harness.cli regress``.

Exit codes: 0 when ``isolated`` and ``global-disable`` match ``no-ac``; 1 otherwise; 2 for invalid arguments
(before any rank starts). A failing rank fails its mode only; the table, JSON and plot are still written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from fla_ac_isolation.families import FAMILY_NAMES
from fla_ac_isolation.harness.cli.console import (
    add_model_argument,
    add_policy_arguments,
    console,
    escape,
    given_policy,
    split_modes,
)
from fla_ac_isolation.harness.extras import require
from fla_ac_isolation.harness.modes import ALL_MODES
from fla_ac_isolation.harness.regression.schedule import SCHEDULES
from fla_ac_isolation.ops import BACKENDS
from fla_ac_isolation.parallel import LAYOUTS

__all__ = ["HELP", "add_arguments", "run", "spec_from_arguments"]

HELP = "the EP (and CP, PP) regression: train a tiny model in every mode and compare with no AC"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``regress`` options to ``parser``; their defaults are the spec's."""
    from fla_ac_isolation.harness.regression.spec import RegressionSpec

    default = {f.name: f.default for f in dataclasses.fields(RegressionSpec)}
    parser.description = (
        "Train a tiny MoE model of a family a few AdamW steps under expert parallelism (torchtitan's MoE and "
        "all-to-all dispatcher) in four modes - no-ac (reference), shared (unsafe: one cu_seqlens object for "
        "every layer), isolated (LayerLocalSeqlens), global-disable (FLA's cache off) - and compare losses and "
        "gradients. Exit 0 when isolated and global-disable match no-ac. With --cp N: FLA's context parallelism "
        "over N ranks, a one-rank run without CP (no-ac-cp1) as a second reference, and the unsafe field mode "
        "(each layer builds FLA's CP context from the one shared cu_seqlens). With --pp N: the decoder split into "
        "pipeline stages run by torch.distributed.pipelining over microbatches, no-ac under the same schedule, and "
        "a one-rank run without PP (no-ac-pp1) as a second reference."
    )
    parser.formatter_class = _HelpFormatter
    add_model_argument(parser, FAMILY_NAMES, "regress", default["model"], "a built-in tiny family")
    parser.add_argument("--ep", type=int, default=default["ep"],
                        help="expert-parallel degree (default 2 = number of ranks; with --cp: 1, or equal to --cp; "
                             "with --pp: 1, or the data-parallel ranks of each stage)")
    parser.add_argument("--cp", type=int, default=default["cp"],
                        help="context-parallel degree = number of ranks (FLA's CP; 1 = none); adds the 'field' mode "
                             "and a one-rank run without CP as a second reference; the 128-token batch is padded "
                             "with an ignored document to a multiple of the layout's parts (N, zigzag 2N)")
    parser.add_argument("--layout", choices=LAYOUTS, default=default["cp_layout"], help="FLA's CP layout (with --cp)")
    parser.add_argument("--pp", type=int, default=default["pp"],
                        help="pipeline-parallel degree (stages over N ranks per data-parallel rank, torch's "
                             "pipelining; 1 = none); ranks = pp x ep; adds a one-rank run without PP as a second "
                             "reference")
    parser.add_argument("--microbatches", type=int, default=default["microbatches"],
                        help="microbatches per step with --pp (default 2 x pp; documents are not split, every "
                             "microbatch is padded to one token count)")
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default=default["schedule"],
                        help="pipeline schedule with --pp (the zero-bubble ones only with --ac full)")
    parser.add_argument("--steps", type=int, default=default["steps"],
                        help="AdamW steps per mode (default 3; 2 with --cp or --pp)")
    add_policy_arguments(parser, default)
    parser.add_argument("--backend", choices=BACKENDS, default=default["backend"],
                        help="mixer backend (auto: FLA kernels on CUDA and for --cp on a CPU, else the reference)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=default["device"],
                        help="auto: cuda when one GPU per rank is visible, else cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=default["dtype"],
                        help="auto: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--hidden-size", type=int, default=default["hidden_size"],
                        help="model width (default 128 on cpu, 64 on cpu with --cp, 512 on cuda)")
    parser.add_argument("--layers", type=int, default=default["num_layers"], help="decoder blocks")
    parser.add_argument("--experts", type=int, default=default["num_experts"], help="routed experts per MoE")
    parser.add_argument("--top-k", type=int, default=default["top_k"], help="experts per token")
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of " + ", ".join(ALL_MODES) + " (default: all; field only "
                             "with --cp; no-ac always runs)")
    parser.add_argument("--seed", type=int, default=default["seed"], help="weights and data")
    parser.add_argument("--lr", type=float, default=default["lr"], help="AdamW learning rate")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance of 'matches' (default 0 = bit for bit on cpu/float32, 1e-2 otherwise)")
    parser.add_argument("--no-early-stop", action="store_true", help="disable torch's checkpoint early stop")
    parser.add_argument("--timeout", type=float, default=default["timeout_s"],
                        help="seconds per mode before it is stopped")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of loss per step per mode")
    parser.add_argument("--verbose", action="store_true",
                        help="also print FLA cache hits/misses per mode and failure tracebacks")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_output_path(path: str, flag: str) -> None:
    """Refuse, before any work, an output path that could not be written at the end of the run.

    Raises:
        ValueError: naming ``flag``: ``path`` is a folder, its folder is missing or not a folder, or it is not
            writable.
    """
    import tempfile

    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise ValueError(f"{flag} {path}: is a folder; give a file path")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    try:  # a real write (permission bits do not tell for root, read-only mounts, /sys, ...)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable ({type(err).__name__})") from None
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ValueError(f"{flag} {path}: the file is not writable")


def _check_paths(args: argparse.Namespace) -> None:
    """The command's own checks: the ``--json`` and ``--plot`` paths."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_output_path(path, flag)


def spec_from_arguments(args: argparse.Namespace):
    """The validated :class:`~fla_ac_isolation.harness.regression.RegressionSpec` of parsed ``args`` (flags left
    unset stay unset, for the spec to resolve).

    Raises:
        ValueError: the spec's message for the first rule the arguments break; ``--policy`` given with
            ``--ac full`` (:func:`~fla_ac_isolation.harness.cli.console.given_policy`).
    """
    from fla_ac_isolation.harness.regression.spec import RegressionSpec

    return RegressionSpec(
        model=args.model, ep=args.ep, cp=args.cp, cp_layout=args.layout, pp=args.pp, microbatches=args.microbatches,
        schedule=args.schedule, steps=args.steps, ac=args.ac, policy=given_policy(args),
        freq=args.freq, backend=args.backend, device=args.device, dtype=args.dtype,
        hidden_size=args.hidden_size, num_layers=args.layers, num_experts=args.experts, top_k=args.top_k,
        seed=args.seed, lr=args.lr, modes=None if args.modes is None else split_modes(args.modes),
        timeout_s=args.timeout, early_stop=not args.no_early_stop,
    ).validate()


def _error(out, err: ValueError) -> int:
    out.print(f"[red]fla-ac-isolation regress: error:[/red] {escape(str(err))}")
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the regression for parsed ``args``; print the report (rank 0), JSON first; return the exit code."""
    out = console("fla-ac-isolation regress")
    from fla_ac_isolation.harness.regression.report import check_rtol

    try:
        spec = spec_from_arguments(args)
        check_rtol(args.rtol)
        _check_paths(args)
    except ValueError as err:
        return _error(out, err)
    require("torchtitan", "ep", "fla-ac-isolation regress")
    if args.plot:
        require("matplotlib", "cli", "fla-ac-isolation regress --plot")
    from fla_ac_isolation.harness.cli import regress_render
    from fla_ac_isolation.harness.regression import report
    from fla_ac_isolation.harness.regression.run import run_regression
    from fla_ac_isolation.harness.regression.torchrun import under_torchrun

    is_rank0 = not under_torchrun() or os.environ.get("RANK") == "0"
    if is_rank0 and spec.kernels == "interpreter":
        out.print("note: CPU run under context parallelism: every rank runs FLA's kernels under Triton's interpreter "
                  "(TRITON_INTERPRET=1) with the seam's interpreter backend, "
                  "fla_ac_isolation.harness.fla_seam.interpreter")
    progress = None
    if is_rank0 and not args.no_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=out, transient=True)
    modes = spec.ordered_modes
    total = len(modes) * spec.steps

    if progress is None:
        result = run_regression(spec)
    else:
        with progress:
            task = progress.add_task(f"starting {spec.world} rank(s)", total=total)

            def on_step(mode: str, step: int) -> None:
                done = modes.index(mode) * spec.steps + step + 1
                progress.update(task, completed=done, description=f"{mode} step {step + 1}/{spec.steps}")

            result = run_regression(spec, on_step=on_step)
    code = report.exit_code(result, args.rtol)
    if is_rank0:
        if args.json:
            regress_render.write_json(result, args.json, args.rtol)
        regress_render.print_report(result, rtol=args.rtol, verbose=args.verbose, console=out)
        if args.plot:
            regress_render.write_plot(result, args.plot, args.rtol)
        for path in (args.json, args.plot):
            if path:
                out.print(f"wrote {escape(path)}")
    return code
