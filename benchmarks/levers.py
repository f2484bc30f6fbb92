"""The recompute's levers, as benchmark modes: what each checkpoints, saves and runs (``bench_recompute``).

A *mode* is one way to run a layer (or a stack of layers) over a training step: no AC; torch's full AC;
torchtitan 0.3's op-level SAC (``policies.torchtitan_selective``) with this library's isolation
(``LayerLocalSeqlens``); and that SAC plus one or more levers that make the recompute cheaper:

* ``save-core`` - the mixers' FLA core as a saveable custom operator (``saveable=True``), saved with
  ``policies.save_fla_ops(("gated_delta_rule", "ssd"))``; ``save-core+conv`` saves the causal conv too;
* ``save-small`` - :func:`save_small_outputs`: the outputs of pointwise ops and reductions whose floating-point
  inputs are all small (at most ``SMALL_WIDTH`` elements per token: the gates ``g``/``beta``, Mamba2's ``dt``,
  the norms' statistics), so the recompute does not relaunch them. An experiment of this benchmark, not a
  library policy (it saves by size, so it may save small tensors of other layers too);
* graphed (every mode, ``bench_recompute``): the whole step replayed from a CUDA graph
  (:mod:`benchmarks.graph_step`) with graph-safe metadata (``StaticSeqlens``).

Every mode uses isolated offsets (``LayerLocalSeqlens``): the shared object is the fault this library fixes,
not a policy to measure. The dtype-copy lever (Mamba2's ``v = dt * x`` and ``D`` skip promoting inside the
kernel instead of materialising float32 copies, bit for bit the same numbers) is in the library and every
mode; compare with the main-branch tables of ``docs/benchmarks.md`` for its effect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["CORE_OPS", "MODES", "SMALL_WIDTH", "Mode", "save_small_outputs"]

CORE_OPS = ("gated_delta_rule", "ssd")  # save_fla_ops names of the GDN and Mamba2 cores
SMALL_WIDTH = 64  # elements per token: the widest "small" tensor (Mamba2's dt has H = 64 heads at hidden 2048)

_aten = torch.ops.aten
_SMALL_OPS = frozenset(
    op for op in (
        _aten.exp, _aten.neg, _aten.mul, _aten.add, _aten.sub, _aten.div, _aten.softplus, _aten.sigmoid, _aten.rsqrt,
        _aten.clamp, _aten.clamp_min, _aten.silu, _aten.pow, _aten.reciprocal, _aten.sqrt, _aten._to_copy,
    )
)
"""Out-of-place pointwise ops. Not ``mean``: torch's composite ``rms_norm`` adds ``eps`` to its output in place
(``.add_``), and SAC refuses a saved tensor that was mutated afterwards."""


def save_small_outputs(num_tokens: int, width: int = SMALL_WIDTH):
    """A SAC policy: MUST_SAVE the pointwise ops of :data:`_SMALL_OPS` whose tensor arguments are all
    floating point with at most ``num_tokens * width`` elements; PREFER_RECOMPUTE everything else.

    Saving an op's output never changes a number (the recompute would compute the same), so this is correct
    under any composition (``policies.any_of``); it trades ``4 * width`` bytes per token and saved tensor for
    the launches of the small ops in the recompute.
    """
    limit = num_tokens * width

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op.overloadpacket in _SMALL_OPS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and all(t.is_floating_point() and t.numel() <= limit for t in tensors):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.__name__ = f"save_small_outputs({width}/token)"
    return policy


@dataclass(frozen=True)
class Mode:
    """One benchmark mode: ``checkpoint`` ``None`` (no AC) | ``"full"`` | ``"selective"``; ``saveable`` mixers;
    the FLA operations it saves (``save_fla_ops`` names); whether it saves the small outputs; whether its eager
    steps take the padded static metadata (graphed steps always do)."""

    name: str
    checkpoint: str | None
    saveable: bool = False
    saved: tuple[str, ...] = ()
    small: bool = False
    static: bool = False  # eager steps with the graphs' padded metadata (StaticSeqlens): the padding's own cost

    def policy(self, num_tokens: int):
        """The SAC policy of a selective mode (``None`` otherwise): torchtitan's, plus the mode's levers."""
        if self.checkpoint != "selective":
            return None
        from fla_ac_isolation.policies import any_of, save_fla_ops, torchtitan_selective

        members = []
        if self.saved:
            members.append(save_fla_ops(self.saved))
        if self.small:
            members.append(save_small_outputs(num_tokens))
        return any_of(*members, torchtitan_selective()) if members else torchtitan_selective()

    def wrap(self, module: torch.nn.Module, num_tokens: int) -> torch.nn.Module:
        """``module`` in torch's non-reentrant checkpoint wrapper as the mode says (itself for no AC), without
        saving and restoring the RNG state (``preserve_rng_state=False``: these layers draw no random numbers)."""
        if self.checkpoint is None:
            return module
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        from fla_ac_isolation.policies import sac_context_fn

        # No layer here draws random numbers, so there is no RNG state to restore in the recompute; and torch
        # has refused to read the CUDA RNG state while capturing a graph (pytorch #162504).
        kwargs = {"preserve_rng_state": False}
        if self.checkpoint == "selective":
            kwargs["context_fn"] = sac_context_fn(self.policy(num_tokens))
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("no-ac", None),
    Mode("full-ac", "full"),
    Mode("sac", "selective"),
    Mode("sac+static", "selective", static=True),
    Mode("sac+save-core", "selective", saveable=True, saved=CORE_OPS),
    Mode("sac+save-core+conv", "selective", saveable=True, saved=(*CORE_OPS, "causal_conv1d")),
    Mode("sac+save-small", "selective", small=True),
    Mode("sac+save-core+small", "selective", saveable=True, saved=CORE_OPS, small=True),
)}
"""The modes by name; ``sac`` is torchtitan's policy with isolation (the library's ``isolated`` mode)."""
