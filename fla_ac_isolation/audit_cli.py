"""``fla-ac-isolation audit``: one training step of a model under :class:`~fla_ac_isolation.ReplayAudit`.

For each requested mode (default ``shared`` and ``isolated``; ``global-disable`` too on request) it builds
the model from the same seed, checkpoints its blocks (full AC or a SAC policy), runs one forward and
backward on one packed batch in a single process (no expert parallelism: the audit is about the
recompute of each block, which EP does not change), and prints every checkpointed region's verdict with
its FLA cache hits/misses per pass, then the explanation of each divergence.

Models: the regression families (``qwen3_5_moe``, ``qwen3_8``, ``nemotron_h``; tiny decoders from
:mod:`fla_ac_isolation.regression.model`, batch of step 0 of the 2-rank regression data) and
``fault-stack`` (:mod:`fla_ac_isolation.testing.fault_stack`, FLA's index helpers without kernels).

Example::

    fla-ac-isolation audit --model qwen3_5_moe --ac selective --policy save-all-copies
    fla-ac-isolation audit --model fault-stack --ac full --modes shared,isolated,global-disable

Exit codes: 0 when every region of ``isolated`` and ``global-disable`` is aligned; 1 otherwise; 2 for
invalid arguments. The unsafe ``shared`` mode never changes the exit code (it is expected to diverge).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass

__all__ = ["AuditRun", "add_arguments", "audit_step", "run"]

AUDIT_MODES = ("shared", "isolated", "global-disable")
FAULT_STACK = "fault-stack"


def _families() -> tuple[str, ...]:
    try:
        from fla_ac_isolation.regression.model import FAMILIES
    except ImportError:  # regression extras (torchtitan) missing: the fault stack still works
        return ()
    return tuple(sorted(FAMILIES))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``audit`` options to ``parser``."""
    from fla_ac_isolation.policies import POLICIES

    parser.description = (
        "Run one training step of a tiny model under ReplayAudit in the unsafe 'shared' mode (one cu_seqlens "
        "object for every layer) and in 'isolated' mode (LayerLocalSeqlens), and print, per checkpointed "
        "block, whether its recompute ran the same ops as its forward, the first differing op otherwise, and "
        "FLA's index-helper cache hits/misses per pass."
    )
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--model", choices=(*_families(), FAULT_STACK), default="qwen3_5_moe",
                        help="model family, or the FLA-helper fault stack")
    parser.add_argument("--ac", choices=("full", "selective"), default="selective", help="activation checkpointing")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="save-all-copies",
                        help="SAC policy (with --ac selective)")
    parser.add_argument("--freq", type=int, choices=(1, 2, 4), default=1, help="checkpoint every N-th block")
    parser.add_argument("--modes", default="shared,isolated",
                        help="comma-separated subset of " + ", ".join(AUDIT_MODES))
    parser.add_argument("--backend", choices=("auto", "fla", "reference"), default="auto",
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
    audit: object  # ReplayAudit
    error: str | None

    @property
    def aligned(self) -> bool:
        return self.audit.ok and bool(self.audit.regions)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _policy(ac: str, policy: str):
    if ac == "full":
        return None
    from fla_ac_isolation.policies import POLICIES

    return POLICIES[policy]()


def _fault_stack_step(mode: str, args: argparse.Namespace) -> AuditRun:
    from fla_ac_isolation.audit import ReplayAudit
    from fla_ac_isolation.testing.fault_stack import run_stack

    with ReplayAudit(on_divergence="record") as audit:
        res = run_stack(mode, _policy(args.ac, args.policy), num_layers=args.layers, freq=args.freq,
                        early_stop=not args.no_early_stop, seed=args.seed)
    return AuditRun(mode, audit, res.error)


def _family_step(mode: str, args: argparse.Namespace) -> AuditRun:
    """One step of a regression family on one process; the hook for new families is ``FAMILIES``."""
    import torch
    import torch.nn.functional as F

    from fla_ac_isolation.audit import ReplayAudit
    from fla_ac_isolation.fla_cache import clear_tensor_cache, tensor_cache_disabled
    from fla_ac_isolation.policies import checkpoint_layers
    from fla_ac_isolation.regression.data import global_batch
    from fla_ac_isolation.regression.expert_parallel import ensure_torch_compat, setup_torchtitan
    from fla_ac_isolation.regression.model import ModelSize, build_model
    from fla_ac_isolation.seqlens import LayerLocalSeqlens, SharedSeqlens

    device = torch.device(args.device)
    ensure_torch_compat()
    setup_torchtitan(device.type)
    size = ModelSize(args.hidden_size, args.layers, args.experts, args.top_k)
    torch.manual_seed(args.seed)
    model = build_model(args.model, size, backend=args.backend, ep_enabled=False).to(device)
    policy = _policy(args.ac, args.policy)
    checkpoint_layers(model, mode="selective" if policy is not None else "full", policy=policy, freq=args.freq,
                      early_stop=not args.no_early_stop)
    model.train()
    batch = global_batch(0, 2, seed=args.seed, vocab_size=size.vocab_size)
    seqlens_cls = LayerLocalSeqlens if mode == "isolated" else SharedSeqlens
    seqlens = seqlens_cls.from_seq_lens(list(batch.seq_lens), device=device)
    input_ids, labels = batch.input_ids.to(device), batch.labels.to(device)
    clear_tensor_cache()
    disable = tensor_cache_disabled() if mode == "global-disable" else contextlib.nullcontext()
    error = None
    with ReplayAudit(model, on_divergence="record") as audit, disable, \
            torch.utils.checkpoint.set_checkpoint_early_stop(not args.no_early_stop):
        try:
            logits = model(input_ids, seqlens)
            loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
            (loss / batch.num_targets_global).backward()
        except Exception as err:  # noqa: BLE001 - reported next to the audit's verdicts
            error = _first_line(err)
    return AuditRun(mode, audit, error)


def audit_step(mode: str, args: argparse.Namespace) -> AuditRun:
    """Run one audited step of ``args.model`` in ``mode`` (``shared`` | ``isolated`` | ``global-disable``).

    Raises:
        ValueError: unknown mode or model.
    """
    if mode not in AUDIT_MODES:
        raise ValueError(f"mode must be one of {AUDIT_MODES}, got {mode!r}")
    if args.model == FAULT_STACK:
        return _fault_stack_step(mode, args)
    if args.model not in _families():
        raise ValueError(f"model must be one of {(*_families(), FAULT_STACK)}, got {args.model!r}")
    return _family_step(mode, args)


def _validate(args: argparse.Namespace) -> list[str]:
    import torch

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in AUDIT_MODES]
    if bad or not modes:
        raise ValueError(f"--modes must be a non-empty subset of {', '.join(AUDIT_MODES)}, got {args.modes!r}")
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
        result = audit_step(mode, args)
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
