"""Environment facts that decide whether and how the FLA cache fault can appear (``fla-ac-isolation doctor``)."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

__all__ = ["environment_report", "sac_replay_semantics"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
    from fla_ac_isolation import fla_cache

    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fla (fla-core)": _version("fla-core") if _version("fla-core") != "not installed" else _version(
            "flash-linear-attention"
        ),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "torchtitan": _version("torchtitan"),
        "device": (
            f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
            if torch.cuda.is_available()
            else "cpu (no CUDA device)"
        ),
        "SAC replay semantics": sac_replay_semantics(),
    }
    try:
        report["FLA tensor cache"] = "enabled" if fla_cache.cache_enabled() else "DISABLED (global)"
        report["FLA tensor cache size"] = str(fla_cache.cache_size())
        report["FLA cached helpers"] = str(len(fla_cache.cached_helpers()))
    except ImportError as e:  # fla missing or broken
        report["FLA tensor cache"] = f"unavailable ({e})"
    return report
