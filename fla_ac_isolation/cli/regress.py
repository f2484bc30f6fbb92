"""``fla-ac-isolation regress``: the EP regression (:mod:`fla_ac_isolation.regression`) from the command line.

Example (the README's main job; about a minute on a 2-core CPU machine)::

    fla-ac-isolation regress --model qwen3_5_moe --ep 2 --steps 3
    fla-ac-isolation regress --model nemotron_h --ac full --json out.json --plot out.png
    torchrun --nproc-per-node 2 -m fla_ac_isolation.cli regress --device cuda --ep 2   # ranks from torchrun
    fla-ac-isolation regress --cp 2                       # context parallelism (FLA's CP), experts replicated
    fla-ac-isolation regress --cp 2 --ep 2 --layout zigzag   # CP 2 x EP 2 on the same 2 ranks

On a CPU, ``--cp`` runs FLA's CP kernels under Triton's interpreter: every rank gets
``TRITON_INTERPRET=1`` and enters the test shims of :mod:`fla_ac_isolation.testing.cp_shims` (named by
their module path, as ``RegressionSpec.rank_setup``; FLA's CP refuses non-CUDA devices otherwise), and
the command says so.

Exit codes: 0 when ``isolated`` and ``global-disable`` match ``no-ac``; 1 when one of them (or
``no-ac``) does not; 2 for invalid arguments, refused before any rank starts (``--timeout <= 0``,
``--rtol < 0``, a ``--json``/``--plot`` path whose folder does not exist or is not writable, an invalid
spec). The unsafe ``shared`` mode never changes the exit code. A rank that raises or dies fails its mode
only: the table, the JSON document and the plot are still written, the failure named in them.
"""

from __future__ import annotations

import argparse
import math
import os

from fla_ac_isolation.cli.console import add_policy_arguments, console, escape, parse_modes
from fla_ac_isolation.extras import require
from fla_ac_isolation.families import FAMILY_NAMES
from fla_ac_isolation.modes import ALL_MODES, CP_MODES, MODE_NAMES
from fla_ac_isolation.ops import BACKENDS
from fla_ac_isolation.parallel import LAYOUTS

__all__ = ["CPU_CP_RANK_SETUP", "HELP", "add_arguments", "run"]

HELP = "the EP (and CP) regression: train a tiny model in every mode and compare with no AC"

CPU_CP_RANK_SETUP = "fla_ac_isolation.testing.cp_shims:cpu_cp_harness"
"""``rank_setup`` of a CPU regression under context parallelism: FLA's CP kernels under the interpreter."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except ``None``/flags (their help says what happens)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``regress`` options to ``parser``."""
    parser.description = (
        "Train a tiny MoE model of a family a few AdamW steps under expert parallelism (torchtitan's MoE and "
        "all-to-all dispatcher) in four modes - no-ac (reference), shared (unsafe: one cu_seqlens object for "
        "every layer), isolated (LayerLocalSeqlens), global-disable (FLA's cache off) - and compare losses and "
        "gradients. Exit 0 when isolated and global-disable match no-ac. With --cp N: FLA's context parallelism "
        "over N ranks, a one-rank run without CP (no-ac-cp1) as a second reference, and the unsafe field mode "
        "(each layer builds FLA's CP context from the one shared cu_seqlens)."
    )
    parser.formatter_class = _HelpFormatter
    parser.add_argument("--model", choices=FAMILY_NAMES, default="qwen3_5_moe", help="model family")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree (default 2 = number of ranks; with --cp: 1, or equal to --cp)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree = number of ranks (FLA's CP; 1 = none); adds the 'field' mode "
                             "and a one-rank run without CP as a second reference; the 128-token batch is padded "
                             "with an ignored document to a multiple of the layout's parts (N, zigzag 2N)")
    parser.add_argument("--layout", choices=LAYOUTS, default="contiguous", help="FLA's CP layout (with --cp)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps per mode (default 3; 2 with --cp)")
    add_policy_arguments(parser)
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="mixer backend (auto: FLA kernels on CUDA, reference on CPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when at least --ep GPUs are visible, else cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="model width (default 128 on cpu, 64 on cpu with --cp, 512 on cuda)")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per MoE")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of " + ", ".join(ALL_MODES) + " (default: all; field only "
                             "with --cp; no-ac always runs)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance of 'matches' (default 0 = bit for bit on cpu/float32, 1e-2 otherwise)")
    parser.add_argument("--no-early-stop", action="store_true", help="disable torch's checkpoint early stop")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mode before it is stopped")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of loss per step per mode")
    parser.add_argument("--verbose", action="store_true",
                        help="also print FLA cache hits/misses per mode and failure tracebacks")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_output_path(path: str, flag: str) -> None:
    """Refuse, before any work, an output path that could not be written at the end of the run.

    Raises:
        ValueError: naming ``flag``: ``path`` is a folder, its folder does not exist or is not a folder,
            or the folder (or an existing file at ``path``) is not writable.
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


def check_arguments(args: argparse.Namespace) -> None:
    """The checks that need no import and no process: ``--timeout``, ``--rtol``, ``--json``, ``--plot``.

    Raises:
        ValueError: naming the flag and what it must be.
    """
    if not 0 < args.timeout < math.inf:
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if args.rtol is not None and not 0 <= args.rtol < math.inf:
        raise ValueError(f"--rtol must be a finite number >= 0, got {args.rtol}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_output_path(path, flag)


def _spec(args: argparse.Namespace):
    import torch

    from fla_ac_isolation.regression.spec import RegressionSpec

    cp = args.cp
    ep = args.ep if args.ep is not None else (2 if cp == 1 else 1)
    ranks = cp if cp > 1 else ep
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    default_hidden = 512 if device == "cuda" else 64 if cp > 1 else 128
    hidden = args.hidden_size if args.hidden_size is not None else default_hidden
    if args.modes and cp == 1 and any(m.strip() in CP_MODES for m in args.modes.split(",")):
        raise ValueError(f"--modes {args.modes!r}: {', '.join(CP_MODES)} exists only with --cp N > 1")
    modes = tuple(parse_modes(args.modes, tuple(ALL_MODES) if cp > 1 else MODE_NAMES)) if args.modes else None
    cpu_cp = {}
    if cp > 1 and device == "cpu":  # FLA's CP kernels under Triton's interpreter, with the test shims
        from fla_ac_isolation.regression.model import RECIPES

        backend = "fla" if args.backend == "auto" and RECIPES[args.model].fla_cp else args.backend
        if backend == "fla":  # Nemotron-H's head-parallel Mamba2 runs the reference ops without it
            cpu_cp = {"backend": backend, "env": (("TRITON_INTERPRET", "1"),), "rank_setup": CPU_CP_RANK_SETUP}
    return RegressionSpec(**{
        "model": args.model, "ep": ep, "cp": cp, "cp_layout": args.layout,
        "steps": args.steps if args.steps is not None else (2 if cp > 1 else 3),
        "ac": args.ac, "policy": args.policy, "freq": args.freq,
        "backend": args.backend, "device": device, "dtype": dtype, "hidden_size": hidden,
        "num_layers": args.layers, "num_experts": args.experts, "top_k": args.top_k, "seed": args.seed,
        "lr": args.lr, "modes": modes, "timeout_s": args.timeout, "early_stop": not args.no_early_stop, **cpu_cp,
    }).validate()


def run(args: argparse.Namespace) -> int:
    """Run the regression for parsed ``args``; print the report (rank 0); return the exit code.

    Invalid arguments return 2 before any import or process; the JSON document is written before the
    table is printed, so that nothing the run measured is lost.
    """
    out = console("fla-ac-isolation regress")
    try:
        check_arguments(args)
    except ValueError as err:
        out.print(f"[red]fla-ac-isolation regress: error:[/red] {escape(str(err))}")
        return 2
    require("torchtitan", "ep", "fla-ac-isolation regress")
    if args.plot:
        require("matplotlib", "cli", "fla-ac-isolation regress --plot")
    from fla_ac_isolation.regression import report
    from fla_ac_isolation.regression.run import run_regression
    from fla_ac_isolation.regression.torchrun import under_torchrun

    try:
        spec = _spec(args)
    except ValueError as err:
        out.print(f"[red]fla-ac-isolation regress: error:[/red] {escape(str(err))}")
        return 2
    is_rank0 = not under_torchrun() or os.environ.get("RANK") == "0"
    if is_rank0 and spec.rank_setup == CPU_CP_RANK_SETUP:
        out.print("note: CPU run under context parallelism: every rank runs FLA's kernels under Triton's interpreter "
                  f"(TRITON_INTERPRET=1) with the test shims of {CPU_CP_RANK_SETUP}")
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
            report.write_json(result, args.json, args.rtol)
        report.print_report(result, rtol=args.rtol, verbose=args.verbose, console=out)
        if args.plot:
            report.write_plot(result, args.plot, args.rtol)
        for path in (args.json, args.plot):
            if path:
                out.print(f"wrote {escape(path)}")
    return code
