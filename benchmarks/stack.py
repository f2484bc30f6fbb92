"""A 4-block hybrid stack for ``bench_recompute``: what a user checkpoints, not one layer.

Blocks, each pre-norm residual (``x + f(RMSNorm(x))``), at model width ``hidden``:

1. GDN (Qwen3.5-MoE's ``GatedDeltaNet`` mixer, the benchmark's widths: ``harness.layer_widths.layer_fields``);
2. GDN;
3. Mamba2 (Nemotron-H's mixer);
4. a SwiGLU MLP of width ``4 * hidden`` (the dense block between mixers; an MoE's experts have the same
   per-token matmuls, without the all-to-all a single GPU does not have).

:func:`build_stack` makes one, with the mixers ``saveable`` or not; :func:`apply_mode` wraps every block in the
mode's checkpoint (``levers.Mode.wrap``). The stack takes ``(x [1, T, D], seqlens)`` like a mixer, so the
layer benchmark's step and graph code runs it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.layer_step import build_layer

__all__ = ["KINDS", "MLPBlock", "MixerBlock", "Stack", "apply_mode", "build_stack"]

KINDS = ("gdn", "gdn", "mamba2", "mlp")


class MixerBlock(nn.Module):
    """``x + mixer(RMSNorm(x), seqlens)``."""

    def __init__(self, mixer: nn.Module, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.mixer = mixer

    def forward(self, x: torch.Tensor, seqlens) -> torch.Tensor:
        return x + self.mixer(self.norm(x), seqlens)


class MLPBlock(nn.Module):
    """``x + down(silu(gate(h)) * up(h))`` with ``h = RMSNorm(x)``; ``seqlens`` is ignored."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate = nn.Linear(hidden, width, bias=False)
        self.up = nn.Linear(hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, seqlens=None) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Stack(nn.Module):
    """The blocks of :data:`KINDS` in order; ``forward(x, seqlens)`` hands every block the same ``seqlens``
    (each mixer takes its own fresh offsets from it, inside its checkpointed region)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, seqlens) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, seqlens)
        return x


def build_stack(hidden: int, dtype: torch.dtype, device: str, backend: str = "fla", saveable: bool = False,
                seed: int = 0) -> Stack:
    """The stack of :data:`KINDS` at width ``hidden`` (same weights for the same ``seed``, saveable or not)."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for kind in KINDS:
        if kind == "mlp":
            blocks.append(MLPBlock(hidden, 4 * hidden))
        else:
            blocks.append(MixerBlock(build_layer(kind, hidden, torch.float32, "cpu", backend, saveable), hidden))
    return Stack(blocks).to(device=device, dtype=dtype)


def apply_mode(stack: Stack, mode, num_tokens: int) -> Stack:
    """Wrap every block of ``stack`` in ``mode``'s checkpoint (``levers.Mode.wrap``), in place; returns it."""
    for i, block in enumerate(stack.blocks):
        stack.blocks[i] = mode.wrap(block, num_tokens)
    return stack
