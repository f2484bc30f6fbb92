"""What the interpreter case scripts (``interpret_cases.py``, ``interpret_kda_cases.py``) share: FLA's kernels
against the reference backend, forward and backward on copies of the same inputs.

Imported by those scripts, which run as ``python tests/<script>.py`` (so this folder is on ``sys.path``); it
imports only torch, so it can be imported after the script has set ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["compare", "scaled_error"]


def scaled_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max(1, max |want|)``: sums over many tokens (e.g. the gradient of ``A``) are large."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def compare(run_fla: Callable[..., torch.Tensor], run_reference: Callable[..., torch.Tensor],
            inputs: dict[str, torch.Tensor]) -> dict:
    """Forward and backward both ways on copies of ``inputs`` (one fixed cosine weighting of the output); the
    :func:`scaled_error` of the output and of every input gradient, and the seconds both took."""

    def run(fn):
        leaves = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in inputs.items()}
        out = fn(**leaves)
        weight = torch.cos(torch.arange(out.numel(), dtype=torch.float32)).reshape(out.shape)
        (out * weight).sum().backward()
        return out.detach(), {n: t.grad for n, t in leaves.items() if t.grad is not None}

    start = time.time()
    out_fla, grads_fla = run(run_fla)
    out_ref, grads_ref = run(run_reference)
    return {
        "output": scaled_error(out_fla, out_ref),
        "grads": {n: scaled_error(grads_fla[n], grads_ref[n]) for n in grads_ref},
        "seconds": round(time.time() - start, 2),
    }
