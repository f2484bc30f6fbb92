"""``fla-ac-isolation doctor``: the environment facts that decide whether and how the FLA cache fault can appear."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform

import torch

from fla_ac_isolation.cli.console import console, escape
from fla_ac_isolation.fla_seam import cache, versions

__all__ = ["HELP", "add_arguments", "environment_report", "run", "sac_replay_semantics"]

HELP = "versions, device, FLA cache state and torch's SAC replay semantics"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``doctor`` subcommand takes no options."""
    parser.description = "Print versions, device, FLA cache state and torch's SAC replay semantics."


def run(args: argparse.Namespace) -> int:
    """Print :func:`environment_report` as a table; return 0."""
    out = console("fla-ac-isolation doctor")
    from rich.table import Table

    table = Table(title="fla-ac-isolation doctor", show_header=False)
    for key, value in environment_report().items():
        table.add_row(escape(key), escape(value))  # versions and device names are foreign text
    out.print(table)
    return 0


def sac_replay_semantics() -> str:
    """How this torch's selective AC hands saved outputs back during a recompute.

    Returns ``"(op, index)"`` when saved outputs are looked up by op and invocation index (torch >= 2.13)
    or ``"per-op FIFO"`` when each op has a queue that the recompute pops (torch 2.11/2.12). Both shift
    when a recompute skips or adds an op.
    """
    import inspect

    from torch.utils.checkpoint import _CachedTorchDispatchMode

    # torch >= 2.13 keys the replay by an invocation counter; 2.11/2.12 pop a per-op queue.
    source = inspect.getsource(_CachedTorchDispatchMode.__torch_dispatch__)
    return "(op, index)" if "func_counter" in source else "per-op FIFO"


def environment_report() -> dict[str, str]:
    """Versions, device and FLA cache state, as ``{label: value}``."""
    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fla (fla-core)": f"{versions.fla_version() or 'not installed'} (tested: {versions.TESTED})",
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "torchtitan": _version("torchtitan"),
        "OLMo-core (ai2-olmo-core)": _version("ai2-olmo-core"),
        "device": (
            f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
            if torch.cuda.is_available()
            else "cpu (no CUDA device)"
        ),
        "SAC replay semantics": sac_replay_semantics(),
    }
    try:
        report["FLA tensor cache"] = "enabled" if cache.cache_enabled() else "DISABLED (global)"
        report["FLA tensor cache size"] = str(cache.cache_size())
        report["FLA cached helpers"] = str(len(cache.cached_helpers()))
    except ImportError as e:  # fla missing or broken
        report["FLA tensor cache"] = f"unavailable ({e})"
    return report
