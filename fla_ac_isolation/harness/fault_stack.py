"""A tiny stack of layers that reproduces the FLA cache fault with FLA's real index helpers, on CPU (for
``audit --model fault-stack``, tests and examples; not a model to train). :func:`run_stack` runs one step in a mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
from fla_ac_isolation.fla_seam.layout import prepare_chunk_indices, prepare_position_ids
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.modes import get_mode
from fla_ac_isolation.policies import Policy, checkpoint_layers
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = ["HelperLayer", "HelperStack", "StackResult", "run_stack"]


class HelperLayer(nn.Module):
    """One layer: FLA helpers on ``cu_seqlens``, then ops a SAC policy may save. ``x``: ``[T, D]`` float32."""

    def __init__(self, dim: int, chunk_size: int = 4) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, seqlens: LayerLocalSeqlens | torch.Tensor) -> torch.Tensor:
        # a raw tensor is what models pass today; SharedSeqlens.local() hands out the same object too
        cu = seqlens.local().cu_seqlens if isinstance(seqlens, LayerLocalSeqlens) else seqlens
        pos = prepare_position_ids(cu)  # [T] position inside each document
        chunks = prepare_chunk_indices(cu, self.chunk_size)  # [NC, 2] (document, chunk)
        # integer work on the metadata (an integer `sub` and casts, as kernels' wrappers do)
        prev = pos - 1  # [T] integer sub
        decay = (prev.to(x.dtype) + 2.0).reciprocal()[:, None]  # [T, 1] float from ints (a _to_copy)
        decay = decay * (1.0 + chunks[:, 1].sum().to(x.dtype) / x.shape[0])  # uses the chunk metadata
        h = self.proj(x)
        a = h - h.mean(-1, keepdim=True)  # four float subs of one shape: a shifted replay hands
        b = x - self.gate(x)  # one of them another's value, silently
        c = torch.tanh(a) - torch.sigmoid(b)
        d = c - a * decay
        return x + 0.5 * torch.tanh(d) + 0.1 * b


class HelperStack(nn.Module):
    """``num_layers`` :class:`HelperLayer` s and an uncheckpointed head; with ``evict_with`` the head evicts FLA's
    cache entry between forward and recompute (last layer: hit, then miss)."""

    def __init__(self, num_layers: int = 4, dim: int = 16, chunk_size: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HelperLayer(dim, chunk_size) for _ in range(num_layers))
        self.chunk_size = chunk_size

    def forward(self, x, seqlens, evict_with: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, seqlens)
        if evict_with is not None:
            prepare_position_ids(evict_with)
            prepare_chunk_indices(evict_with, self.chunk_size)
        return x


@dataclass
class StackResult:
    """Outcome of one :func:`run_stack` call."""

    mode: str
    loss: float | None
    grads: dict[str, torch.Tensor] | None
    error: str | None

    def max_grad_diff(self, other: StackResult) -> float:
        """Largest absolute gradient difference to ``other`` (inf when either failed)."""
        if self.grads is None or other.grads is None:
            return float("inf")
        return max((self.grads[k] - other.grads[k]).abs().max().item() for k in self.grads)


def run_stack(
    mode: str,
    policy: Policy | None,
    *,
    seq_lens: tuple[int, ...] = (5, 0, 9, 1, 7),
    dtype: torch.dtype = torch.int32,
    num_layers: int = 4,
    freq: int = 1,
    early_stop: bool = True,
    evict: bool = False,
    seed: int = 0,
) -> StackResult:
    """Build the stack with ``seed``, run one forward + backward in ``mode`` (``policy=None``: full AC) and return
    loss and grads; a backward error is returned in ``error`` (first line)."""
    run_mode = get_mode(mode)
    torch.manual_seed(seed)
    model = HelperStack(num_layers=num_layers)
    x = torch.randn(sum(seq_lens), model.layers[0].proj.in_features)
    if run_mode.checkpointed:
        checkpoint_layers(
            model, mode="selective" if policy is not None else "full", policy=policy, freq=freq,
            early_stop=early_stop,
        )
    seqlens = run_mode.from_seq_lens(list(seq_lens), dtype=dtype, with_cpu=False)
    evict_with = LayerLocalSeqlens.from_seq_lens([3, 3], dtype=dtype).local().cu_seqlens if evict else None
    clear_tensor_cache()
    try:
        with run_mode.cache_context(), torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            out = model(x, seqlens, evict_with=evict_with)
            loss = (out.float() ** 2).mean()
            loss.backward()
    except Exception as e:
        return StackResult(mode, None, None, first_line(e))
    # named_parameters() keeps checkpoint_wrapper's prefix; drop it so every mode uses the same names
    grads = {
        name.replace("._checkpoint_wrapped_module", ""): p.grad.detach().clone()
        for name, p in model.named_parameters()
    }
    return StackResult(mode, loss.item(), grads, None)
