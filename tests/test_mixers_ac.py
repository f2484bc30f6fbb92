"""Every mixer under selective activation checkpointing, with one LayerLocalSeqlens shared by all layers.

The stack is 4 residual blocks ``x + mixer(x, seqlens)``, each checkpointed with the field policy that
saves every ``_to_copy`` (``policies.save_all_copies``). Each mixer calls ``seqlens.local()`` inside its
forward, so its recompute makes the same FLA cache lookups as its forward: loss and every gradient must
be bit-equal to the run without AC.
"""

import pytest
import torch
from helpers import HIDDEN, PACKED_LENS, loss_and_grads
from torch import nn

from fla_ac_isolation.modes import SharedSeqlens
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 4


class Block(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        return x + self.mixer(x, seqlens)


def _stack(family, dtype):
    return nn.ModuleList(Block(family.build(layer_idx=i, seed=10 + i)) for i in range(LAYERS)).to(dtype)


def _run(family, dtype, seqlens_cls, checkpointed):
    layers = _stack(family, dtype)
    if checkpointed:
        checkpoint_layers(layers, mode="selective", policy=save_all_copies())
    x = torch.randn(1, sum(PACKED_LENS) + 30, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    seqlens = seqlens_cls.from_seq_lens([*PACKED_LENS, 30])
    return loss_and_grads(layers, x, seqlens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_selective_ac_with_shared_layer_local_seqlens_is_bit_exact(core_family, dtype):
    loss_ref, dx_ref, grads_ref = _run(core_family, dtype, LayerLocalSeqlens, checkpointed=False)
    loss_ac, dx_ac, grads_ac = _run(core_family, dtype, LayerLocalSeqlens, checkpointed=True)
    assert torch.equal(loss_ac, loss_ref)
    assert torch.equal(dx_ac, dx_ref)
    assert grads_ac.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        assert torch.equal(grads_ac[name], grad), name


def test_same_stack_with_one_shared_cu_seqlens_object_breaks_in_bf16(core_family):
    """Control: the unsafe path (every layer gets the same cu_seqlens object) under the same policy.

    Layer 0 misses FLA's cache in its forward and hits in its recompute, so the recompute skips the
    helpers' int32 -> int64 ``_to_copy`` and SAC's replay, shifted by one, hands an FLA integer index
    tensor to a later saved ``_to_copy`` of the layer (a bf16 -> fp32 cast). In fp32 the mixers make no
    ``_to_copy`` after the helpers and the shared path happens to match under this one policy.
    """
    with pytest.raises(RuntimeError, match="Autograd not support dtype"):
        _run(core_family, torch.bfloat16, SharedSeqlens, checkpointed=True)


def test_a_precomputed_schedule_does_not_make_a_shared_cu_seqlens_safe(core_family):
    """The FAQ's claim: with one shared object *and* FLA's chunk schedule precomputed, layer 0's recompute
    still runs other ops than its forward (the gated delta rule's ``prepare_chunk_offsets`` and the SSD's
    ``prepare_chunk_indices`` are still looked up by identity). The audit flags it even where the numbers
    happen to agree under this policy."""
    from fla_ac_isolation.audit import ReplayAudit

    def shared_with_schedule(lens):
        return SharedSeqlens.from_seq_lens(lens, chunk_indices=True)

    seqlens_cls = type("SharedWithSchedule", (), {"from_seq_lens": staticmethod(shared_with_schedule)})
    with ReplayAudit(on_divergence="record") as audit:
        try:
            _run(core_family, torch.bfloat16, seqlens_cls, checkpointed=True)
        except RuntimeError as err:  # nemotron_h: the shifted replay still reaches an int tensor
            assert "Autograd not support dtype" in str(err)
    assert [r.label for r in audit.divergent][:1] == ["region #0 (Block)"], audit.summary()
