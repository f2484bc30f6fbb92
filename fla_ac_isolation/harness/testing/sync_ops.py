"""Find host synchronisations without a GPU: the aten ops that would synchronise on CUDA (``.item()``,
``nonzero``, boolean indexing, ``repeat_interleave`` without ``output_size``, ``equal``). Test support only.
Host-device copies are not visible on a CPU; the GPU test with ``host_sync_sites`` remains the measurement."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNC_OPS", "SyncOpCounter"]

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "repeat_interleave", "equal", "is_nonzero")
"""Op names (overload packets) that synchronise on CUDA whatever their arguments (``repeat_interleave``:
without ``output_size``). ``index`` / ``index_put_`` are flagged only with a boolean index."""

_SKIPPED_FRAMES = (f"{__name__.replace('.', '/')}.py", "/torch/", "triton/runtime/interpreter.py")


def _site() -> str | None:
    """``file:line`` of the first frame outside torch and this module; ``None`` inside Triton's interpreter."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "triton/runtime/interpreter.py" in filename:
            return None
        if not any(part in filename for part in _SKIPPED_FRAMES):
            return f"{filename.split('site-packages/')[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class SyncOpCounter(TorchDispatchMode):
    """Dispatch mode recording, in order, ``(op name, site)`` for each op that would synchronise on CUDA.

    Args:
        host: tensors that live on the host in the real run (e.g. ``cu_seqlens_cpu``); ops on them only (or on
            their results) are not flagged.
        is_host: alternatively, a predicate naming host tensors.

    Attributes:
        flagged: ``[(op name, "file:line")]`` in dispatch order.
    """

    def __init__(self, host: Iterable[torch.Tensor] = (), is_host: Callable[[torch.Tensor], bool] | None = None):
        super().__init__()
        self._host_ids = {id(t) for t in host}
        self._keep = list(host)  # keep the named objects alive so that their ids stay theirs
        self._is_host = is_host
        self.flagged: list[tuple[str, str]] = []

    def _host(self, t: torch.Tensor) -> bool:
        return id(t) in self._host_ids or (self._is_host is not None and self._is_host(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if tensors and all(self._host(t) for t in tensors):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self._host_ids.add(id(t))
                    self._keep.append(t)
            return out
        name = func.overloadpacket.__name__
        syncs = (
            (name in SYNC_OPS and not (name == "repeat_interleave" and kwargs.get("output_size") is not None))
            or (name in ("index", "index_put_", "index_put") and _has_bool_index(args))
        )
        if syncs:
            site = _site()
            if site is not None:
                self.flagged.append((name, site))
        return out

    def sites(self) -> list[str]:
        """The ``file:line`` of every flagged op, in order."""
        return [site for _, site in self.flagged]
