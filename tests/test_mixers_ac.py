"""Every mixer under selective activation checkpointing, with one LayerLocalSeqlens shared by all layers.

The stack is 4 residual blocks ``x + mixer(x, seqlens)``, each checkpointed under a SAC policy. Each mixer
calls ``seqlens.local()`` inside its forward, so its recompute makes the same FLA cache lookups as its
forward: loss and every gradient must be bit-equal to the run without AC.

Each (dtype, policy) case is one under which the unsafe path (one ``cu_seqlens`` object for every layer,
:class:`~fla_ac_isolation.harness.modes.SharedSeqlens`) fails, and its control asserts exactly how, so the case can
tell shared from isolated:

* bf16, ``save_all_copies``: layer 0's recompute skips FLA's int32 -> int64 ``_to_copy`` casts and a later
  saved cast of the layer (bf16 -> fp32) is replayed with FLA's int tensor: ``Autograd not support dtype:
  Int``.
* fp32, every ``cumsum`` saved: in fp32 the mixers make no ``_to_copy`` after FLA's helpers, and
  ``save_all_copies`` leaves the shared path bit-exact (that fp32 case proved nothing and was dropped);
  FLA's miss path runs an int64 ``cumsum`` that the recompute's hit skips, so the layer's own float
  ``cumsum`` (the gate's cumulative decay) is replayed with it: ``Autograd not support dtype: Long``.
  The KDA family has no float ``cumsum`` of its own (FLA's ``chunk_kda`` cumulates the decay inside its
  kernel, FLA's naive reference recurs token by token; saving ``cumsum`` leaves its shared path bit-exact), so
  its fp32 case saves every ``sub``: FLA's miss path subtracts the int32 offsets (the document lengths), the
  recompute's hit skips that, and the layer's own float ``sub`` (the recurrence's ``v_t - S^T k_t``) is
  replayed with them: ``Autograd not support dtype: Int``.
"""

import pytest
import torch
from helpers import HIDDEN, PACKED_LENS, Block, SharedOutcome, loss_and_grads
from torch import nn

from fla_ac_isolation.harness.modes import SharedSeqlens
from fla_ac_isolation.harness.transformers_kernels import transformers_version
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies, save_ops
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 4
CASES = {  # case id: (dtype, policy builder, how the shared path fails)
    "bf16-save-all-copies": (torch.bfloat16, save_all_copies,
                             SharedOutcome(RuntimeError, "Autograd not support dtype: Int")),
    "fp32-save-cumsum": (torch.float32, lambda: save_ops([torch.ops.aten.cumsum.default]),
                         SharedOutcome(RuntimeError, "Autograd not support dtype: Long")),
}
#: The KDA family's fp32 case (module docstring): every ``sub`` saved instead of every ``cumsum``.
KDA_FP32 = (torch.float32, lambda: save_ops([torch.ops.aten.sub.Tensor]),
            SharedOutcome(RuntimeError, "Autograd not support dtype: Int"))


def _case(family, case: str):
    """``CASES[case]`` for ``family``; the KDA family's fp32 case saves ``stack`` (:data:`KDA_FP32`)."""
    return KDA_FP32 if case.startswith("fp32") and family.family.name == "kimi_linear" else CASES[case]


def _stack(family, dtype):
    return nn.ModuleList(Block(family.build(layer_idx=i, seed=10 + i)) for i in range(LAYERS)).to(dtype)


def _run(family, dtype, seqlens_cls, policy=None):
    """Loss, input gradient and parameter gradients of the stack; checkpointed under ``policy`` if given."""
    layers = _stack(family, dtype)
    if policy is not None:
        checkpoint_layers(layers, mode="selective", policy=policy)
    x = torch.randn(1, sum(PACKED_LENS) + 30, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    seqlens = seqlens_cls.from_seq_lens([*PACKED_LENS, 30])
    return loss_and_grads(layers, x, seqlens)


@pytest.mark.parametrize("case", list(CASES))
def test_selective_ac_with_shared_layer_local_seqlens_is_bit_exact(core_family, case):
    dtype, policy, _ = _case(core_family, case)
    loss_ref, dx_ref, grads_ref = _run(core_family, dtype, LayerLocalSeqlens)
    loss_ac, dx_ac, grads_ac = _run(core_family, dtype, LayerLocalSeqlens, policy())
    assert torch.equal(loss_ac, loss_ref)
    assert torch.equal(dx_ac, dx_ref)
    assert grads_ac.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        assert torch.equal(grads_ac[name], grad), name


@pytest.mark.parametrize("case", list(CASES))
def test_same_stack_with_one_shared_cu_seqlens_object_fails_as_predicted(core_family, case):
    """Control: the unsafe path under the same policy fails exactly as ``CASES`` says (module docstring)."""
    dtype, policy, outcome = _case(core_family, case)
    with pytest.raises(outcome.error) as err:
        _run(core_family, dtype, SharedSeqlens, policy())
    outcome.check(err.value)


def test_the_fp32_case_fails_when_local_returns_the_shared_tensors(core_family, monkeypatch):
    """Mutation check: with ``.local()`` handing out its stored objects (the precomputed schedule kept, which
    hides the fault from ``save_all_copies`` in the GDN families), the fp32 case no longer matches no-AC."""
    from fla_ac_isolation.local_seqlens import LocalSeqlens

    def shared_local(self):
        return LocalSeqlens(self._cu_seqlens, self._cu_seqlens_cpu, self.max_seqlen, self._chunk_indices)

    monkeypatch.setattr(LayerLocalSeqlens, "local", shared_local)
    dtype, policy, outcome = _case(core_family, "fp32-save-cumsum")
    with pytest.raises(outcome.error) as err:
        _run(core_family, dtype, LayerLocalSeqlens, policy())
    outcome.check(err.value)


#: Under bf16 ``save_all_copies`` with FLA's chunk schedule precomputed and one shared object: where the
#: recompute first leaves its forward in layer 0 (op index, forward op), and how the step ends.
PRECOMPUTED_SCHEDULE = {
    "qwen3_5_moe": (95, None),  # the shifted replay lands on ops whose values agree: same numbers
    "qwen3_8": (95, None),
    # the SSD takes the schedule too now, and looks up only prepare_chunk_offsets (a shared object here hands
    # no chunk_offsets): the same shift as in the GDN families, landing on agreeing values under this policy
    # (transformers >= 5.25 clamps dt to config.time_step_limit, (0, inf) here: no clamp op, one op earlier)
    "nemotron_h": (74 if transformers_version() < (5, 25) else 73, None),
    # chunk_kda's own lookup (op 93: the drop-in runs transformers' own forget gate, one op fewer than 0.4's copy)
    "kimi_linear": (93, SharedOutcome(RuntimeError, "Autograd not support dtype: Int")),
}


def test_a_precomputed_schedule_does_not_make_a_shared_cu_seqlens_safe(core_family):
    """The FAQ's claim: with one shared object *and* FLA's chunk schedule precomputed, layer 0's recompute
    still runs other ops than its forward (``prepare_chunk_offsets``, which the gated delta rule and the SSD
    without ``chunk_offsets`` still look up by identity, and KDA's ``prepare_chunk_indices``: FLA's chunk_kda takes
    no schedule). The audit flags it in every family; under this policy the shifted replay happens to land on ops
    whose values agree for the GDN and Mamba2 stacks (the numbers are asserted equal), which is luck, not safety:
    other policies turn the same shift into errors (``CASES``); the KDA stack fails (asserted exactly)."""
    from fla_ac_isolation.audit import ReplayAudit

    def shared_with_schedule(lens):
        return SharedSeqlens.from_seq_lens(lens, chunk_indices=True)

    first_diff, outcome = PRECOMPUTED_SCHEDULE[core_family.name]
    seqlens_cls = type("SharedWithSchedule", (), {"from_seq_lens": staticmethod(shared_with_schedule)})
    error = None
    with ReplayAudit(on_divergence="record") as audit:
        try:
            loss, _, grads = _run(core_family, torch.bfloat16, seqlens_cls, save_all_copies())
        except RuntimeError as err:
            error = err
    bad = audit.divergent[0]
    assert (bad.label, bad.first_diff, bad.forward_op) == (
        "region #0 (Block)", first_diff, "aten.slice.Tensor -> [6] int32 cpu"
    ), audit.summary()
    if outcome is not None:
        outcome.check(error)
    else:
        assert error is None, error
        loss_ref, _, grads_ref = _run(core_family, torch.bfloat16, LayerLocalSeqlens)
        assert torch.equal(loss, loss_ref) and all(torch.equal(grads[n], g) for n, g in grads_ref.items())
