"""ReplayAudit under FSDP2: FSDP's own unshard ops in a checkpointed forward are not the region's divergence.

FSDP2 (``fully_shard``) on a module inside a checkpointed region unshards its parameters in the forward, inside
``record_function("FSDP::pre_forward")`` (``aten.empty``, ``copy_``, ``as_strided``, ``view`` here), and skips
that in the recompute (its pre-backward hook has unsharded already). Without care the audit reported every
such region DIVERGENT at op #0. One gloo rank on CPU (``gloo_world_of_one``): FSDP's hooks, class renaming and
DTensor parameters are all there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard

from fla_ac_isolation import ReplayAudit
from fla_ac_isolation.harness.environment import sac_replay_semantics
from fla_ac_isolation.policies import sac_context_fn, save_all_copies

pytestmark = pytest.mark.usefixtures("single_thread")


class Block(nn.Module):
    """``relu(linear(x))``; ``flip=True``: ``x * 2`` on the first call, ``x + x`` after (state, on purpose)."""

    def __init__(self, flip: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.flip = flip
        self.calls = 0

    def forward(self, x):
        h = self.lin(x)
        if self.flip:
            self.calls += 1
            h = h * 2 if self.calls == 1 else h + h
        return h.relu()


def _sharded(mesh, flip: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(flip))
    for i in range(2):
        model[i] = checkpoint_wrapper(model[i], context_fn=sac_context_fn(save_all_copies()))
        fully_shard(model[i]._checkpoint_wrapped_module, mesh=mesh)  # unshard inside the checkpointed forward
    fully_shard(model, mesh=mesh)
    return model


def test_fsdp_unshard_ops_are_not_recorded_and_sharded_regions_are_aligned(gloo_world_of_one):
    model = _sharded(gloo_world_of_one)
    with ReplayAudit(model, on_divergence="record") as audit:
        model(torch.randn(3, 8)).sum().backward()

    assert audit.ok
    assert [(r.label, r.verdict, r.forward_ops) for r in audit.regions] == [("0", "aligned", 3), ("1", "aligned", 3)]


def test_a_real_divergence_in_a_sharded_region_is_still_reported_at_its_own_op(gloo_world_of_one):
    model = _sharded(gloo_world_of_one, flip=True)
    # torch >= 2.13 replays by (op, index) and checks each recomputed op against storage: the forward ran no add.
    # torch 2.11's per-op FIFO replay looks up only saved ops; save_all_copies saves neither mul nor add, so the
    # recompute's add is simply recomputed. The audit reports the divergence either way.
    fifo = sac_replay_semantics() == "per-op FIFO"
    sac_check = r"aten\.add\.Tensor encountered during backward but not found in storage"
    raised = contextlib.nullcontext() if fifo else pytest.raises(RuntimeError, match=sac_check)
    with ReplayAudit(model, on_divergence="record") as audit, raised:
        model(torch.randn(3, 8)).sum().backward()

    (report,) = audit.divergent
    assert (report.label, report.first_diff) == ("1", 2)  # t, addmm, then mul in forward, add in recompute
    assert report.forward_op == "aten.mul.Tensor -> [3, 8] float32 cpu"
    if fifo:
        assert report.recompute_error is None
        assert report.recompute_op.startswith("aten.add.Tensor -> [3, 8] float32 cpu")
    else:
        assert report.recompute_error.startswith("RuntimeError: aten.add.Tensor encountered during backward")
