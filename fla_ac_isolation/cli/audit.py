"""``fla-ac-isolation audit``: one training step of a model under :class:`~fla_ac_isolation.ReplayAudit`.

For each requested mode (default ``shared`` and ``isolated``; ``global-disable`` too on request) it builds
the model from the same seed, checkpoints its blocks (full AC or a SAC policy), runs one forward and
backward on one packed batch in a single process (no expert parallelism: the audit is about the
recompute of each block, which EP does not change), and prints every checkpointed region's verdict with
its FLA cache hits/misses per pass, then the explanation of each divergence.

Models: the families of :data:`fla_ac_isolation.families.FAMILIES` (``qwen3_5_moe``, ``qwen3_8``,
``nemotron_h``; tiny decoders from :mod:`fla_ac_isolation.regression.model`, batch of step 0 of the
2-rank regression data; they need the ``ep`` extra) and ``fault-stack`` (:mod:`fla_ac_isolation.fault_stack`,
FLA's index helpers without kernels). Modes: those of :mod:`fla_ac_isolation.modes` that checkpoint.

Example::

    fla-ac-isolation audit --model qwen3_5_moe --ac selective --policy save-all-copies
    fla-ac-isolation audit --model fault-stack --ac full --modes shared,isolated,global-disable

Exit codes: 0 when every region of ``isolated`` and ``global-disable`` is aligned; 1 otherwise; 2 for
invalid arguments. The unsafe ``shared`` mode never changes the exit code (it is expected to diverge).
A mode that raises (building its model, or its step) is reported as failed with the first line of the
error, printed as it is, and the other modes still run and print.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.cli.console import add_policy_arguments, parse_modes
from fla_ac_isolation.extras import MissingExtraError, require
from fla_ac_isolation.failures import first_line
from fla_ac_isolation.families import FAMILY_NAMES
from fla_ac_isolation.modes import MODES, Mode, get_mode
from fla_ac_isolation.ops import BACKENDS
from fla_ac_isolation.policies import POLICIES

__all__ = ["AUDIT_MODES", "HELP", "AuditRun", "add_arguments", "audit_step", "run"]

HELP = "one training step of a tiny model under ReplayAudit: which recompute diverged, at which op, and why"

AUDIT_MODES: tuple[str, ...] = tuple(name for name, mode in MODES.items() if mode.checkpointed)
"""The modes an audit can run: those that checkpoint (``no-ac`` has no recompute to compare)."""
FAULT_STACK = "fault-stack"
MODELS: tuple[str, ...] = (*FAMILY_NAMES, FAULT_STACK)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``audit`` options to ``parser``."""
    parser.description = (
        "Run one training step of a tiny model under ReplayAudit in the unsafe 'shared' mode (one cu_seqlens "
        "object for every layer) and in 'isolated' mode (LayerLocalSeqlens), and print, per checkpointed "
        "block, whether its recompute ran the same ops as its forward, the first differing op otherwise, and "
        "FLA's index-helper cache hits/misses per pass."
    )
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--model", choices=MODELS, default="qwen3_5_moe",
                        help="model family, or the FLA-helper fault stack")
    add_policy_arguments(parser)
    parser.add_argument("--modes", default="shared,isolated",
                        help="comma-separated subset of " + ", ".join(AUDIT_MODES))
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="mixer backend of the families (auto: FLA kernels on CUDA, reference on CPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if present")
    parser.add_argument("--hidden-size", type=int, default=128, help="family model width")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per MoE")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-early-stop", action="store_true", help="disable torch's checkpoint early stop")
    parser.add_argument("--quiet", action="store_true", help="print the verdict tables only, no explanations")


@dataclass
class AuditRun:
    """One audited step: the mode, the audit (with its region reports) and the step's error, if any."""

    mode: str
    audit: ReplayAudit
    error: str | None

    @property
    def aligned(self) -> bool:
        return self.audit.ok and bool(self.audit.regions)


def _policy(args: argparse.Namespace):
    return POLICIES[args.policy]() if args.ac == "selective" else None


def _fault_stack_step(mode: Mode, args: argparse.Namespace) -> AuditRun:
    from fla_ac_isolation.fault_stack import run_stack

    with ReplayAudit(on_divergence="record") as audit:
        res = run_stack(mode.name, _policy(args), num_layers=args.layers, freq=args.freq,
                        early_stop=not args.no_early_stop, seed=args.seed)
    return AuditRun(mode.name, audit, res.error)


def _family_step(mode: Mode, args: argparse.Namespace) -> AuditRun:
    """One step of a regression family's tiny decoder on one process (no expert parallelism)."""
    import torch
    import torch.nn.functional as F

    require("torchtitan", "ep", f"fla-ac-isolation audit --model {args.model}")
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
    from fla_ac_isolation.policies import checkpoint_layers
    from fla_ac_isolation.regression.data import global_batch
    from fla_ac_isolation.regression.expert_parallel import ensure_torch_compat, setup_torchtitan
    from fla_ac_isolation.regression.model import ModelSize, build_model

    device = torch.device(args.device)
    ensure_torch_compat()
    setup_torchtitan(device.type)
    size = ModelSize(args.hidden_size, args.layers, args.experts, args.top_k)
    torch.manual_seed(args.seed)
    model = build_model(args.model, size, backend=args.backend, ep_enabled=False).to(device)
    checkpoint_layers(model, mode=args.ac, policy=_policy(args), freq=args.freq, early_stop=not args.no_early_stop)
    model.train()
    batch = global_batch(0, 2, seed=args.seed, vocab_size=size.vocab_size)
    seqlens = mode.from_seq_lens(list(batch.seq_lens), device=device)
    input_ids, labels = batch.input_ids.to(device), batch.labels.to(device)
    clear_tensor_cache()
    error = None
    with ReplayAudit(model, on_divergence="record") as audit, mode.cache_context(), \
            torch.utils.checkpoint.set_checkpoint_early_stop(not args.no_early_stop):
        try:
            logits = model(input_ids, seqlens)
            loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
            (loss / batch.num_targets_global).backward()
        except Exception as err:
            error = first_line(err)
    return AuditRun(mode.name, audit, error)


def audit_step(mode: str, args: argparse.Namespace) -> AuditRun:
    """Run one audited step of ``args.model`` in ``mode`` (one of :data:`AUDIT_MODES`).

    Raises:
        ValueError: unknown mode or model.
    """
    if mode not in AUDIT_MODES:
        raise ValueError(f"mode must be one of {AUDIT_MODES}, got {mode!r}")
    if args.model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {args.model!r}")
    step = _fault_stack_step if args.model == FAULT_STACK else _family_step
    return step(get_mode(mode), args)


def _validate(args: argparse.Namespace) -> list[str]:
    import torch

    modes = parse_modes(args.modes, AUDIT_MODES)
    for name in ("layers", "hidden_size", "experts", "top_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    return modes


def run(args: argparse.Namespace) -> int:
    """Run the audit for parsed ``args``; print each mode's region verdicts; return the exit code."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
    try:
        modes = _validate(args)
    except ValueError as err:
        print(f"fla-ac-isolation audit: error: {err}", file=sys.stderr)
        return 2
    what = "full AC" if args.ac == "full" else f"SAC policy {args.policy}"
    code = 0
    for mode in modes:
        try:
            result = audit_step(mode, args)
        except MissingExtraError:
            raise  # exit code 2 with the pip install that brings it (cli.main)
        except Exception as err:  # the other modes still run and print
            print(f"== {args.model} | {mode} | {what} | freq {args.freq}: FAILED: {first_line(err)}\n")
            if mode != "shared":
                code = 1
            continue
        audit = result.audit
        n_bad = len(audit.divergent)
        verdict = f"{n_bad} divergent region(s)" if n_bad else ("aligned" if audit.regions else "no region ran")
        print(f"== {args.model} | {mode} | {what} | freq {args.freq}: {verdict}")
        print(audit.summary(messages=not args.quiet))
        if result.error:
            print(f"the step failed: {result.error}")
        print()
        if mode != "shared" and not result.aligned:
            code = 1
    return code
