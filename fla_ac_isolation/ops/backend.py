"""The backend choice of :mod:`fla_ac_isolation.ops` and its checks (also run by the mixers at construction and by
:func:`~fla_ac_isolation.swap_mixers` before it swaps anything).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

__all__ = ["BACKENDS", "Backend", "check_backend", "check_cp_backend", "check_fla_device", "check_saveable",
           "resolve_backend"]

Backend = Literal["auto", "fla", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "fla", "reference")
"""The accepted values of every ``backend`` argument."""


def check_backend(backend: str) -> str:
    """Return ``backend`` if it is one of :data:`BACKENDS`.

    Raises:
        ValueError: naming ``backend`` and the accepted values.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(backend: str, tensor: torch.Tensor) -> Literal["fla", "reference"]:
    """The concrete backend for ``tensor``: ``auto`` picks ``fla`` on CUDA, ``reference`` elsewhere.

    Raises:
        ValueError: unknown ``backend``.
    """
    check_backend(backend)
    if backend == "auto":
        return "fla" if tensor.device.type == "cuda" else "reference"
    return backend  # type: ignore[return-value]


def check_fla_device(tensor: torch.Tensor) -> None:
    """Refuse CPU tensors on the ``fla`` backend unless Triton's interpreter runs the kernels.

    Raises:
        ValueError: ``tensor`` is on the CPU and ``TRITON_INTERPRET`` is not ``1``.
    """
    if tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            "backend='fla' needs CUDA tensors (FLA's Triton kernels have no CPU backend); got CPU tensors. "
            "Use backend='reference' (or 'auto') on CPU, or TRITON_INTERPRET=1 for kernel tests."
        )


def check_saveable(saveable: bool) -> bool:
    """Return ``saveable`` if it is a bool.

    Raises:
        TypeError: naming ``saveable`` and what was given.
    """
    if not isinstance(saveable, bool):
        raise TypeError(f"saveable must be True or False, got {saveable!r}")
    return saveable


def check_cp_backend(cp_context: object | None, backend: str, tensor: torch.Tensor, saveable: bool = False) -> None:
    """Refuse context parallelism on a backend without CP kernels, or through the custom operators.

    Raises:
        NotImplementedError: ``cp_context`` with ``backend`` resolving to ``reference`` for ``tensor``, or with
            ``saveable=True``.
    """
    if cp_context is None:
        return
    if saveable:
        raise NotImplementedError(
            "saveable=True cannot run context parallelism: FLA's CP kernels are not wrapped as custom operators; "
            "use saveable=False with cp_context"
        )
    if resolve_backend(backend, tensor) != "reference":
        return
    chosen = f"backend={backend!r}" + (f" (which picks 'reference' for {tensor.device.type} tensors)"
                                       if backend == "auto" else "")
    raise NotImplementedError(
        f"context parallelism needs FLA's CP kernels, but {chosen} has none: the reference backend computes "
        "whole sequences only; use backend='fla' (CUDA, or a CPU under TRITON_INTERPRET=1 with the harness's "
        "interpreter backend fla_ac_isolation/harness/fla_seam/interpreter.py)"
    )
