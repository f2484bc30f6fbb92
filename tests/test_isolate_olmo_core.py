"""isolate_seqlens on OLMo-core 3.0's own hybrid ``Transformer`` under its own activation checkpointing, on CPU.

The model is built from OLMo-core's ``TransformerConfig.qwen3_5_like`` (its hybrid recipe), tiny: one
``GatedDeltaNet`` block and one attention block (``OLMO_PATTERN``; FLA's cache holds 4 entries, so with one or
more GDN blocks only the first diverges, and one shows it), 134 packed tokens in documents of 70, 23 and 41.
AC is OLMo-core's ``apply_activation_checkpointing``; the step is its train module's (bf16 autocast around
the forward only). FLA's kernels and packed attention run on CPU stand-ins
(:func:`fla_ac_isolation.harness.testing.olmo_core.cpu_stand_ins`): the reference ops call FLA's own identity-cached
index helpers with the kernels' arguments, so FLA's cache behaves as on a GPU.

Cases kept (the research ran every mode x {fp32, bf16} x {GDN, KDA, GDN, attn}: 50-96 s; these take a few):

* each OLMo-core AC mode (``full``, ``selected_blocks``, ``selected_modules``, ``selected_ops``) x {fp32, bf16}:
  as shipped, the first GDN block's recompute diverges (the audit names it and FLA's ``prepare_chunk_*``),
  gradients still equal (latent); isolated, every region aligned and the step equals no AC bit for bit;
* OLMo-core's ``selected_ops`` policy plus every ``_to_copy`` (the field's D2H rule, widened): fp32 latent,
  bf16 raises ``Autograd not support dtype: Int``; isolated: bit-equal in both;
* isolation before AC, and ``remove()`` bringing the failure back;
* partial isolation (``modules=`` on block 0 of two GDN blocks): warned, and the failure moves to block 1;
* KimiDeltaAttention (standalone mixer, short documents: its reference is a per-token loop);
* FSDP2 (OLMo-core's ``apply_fsdp``, mixers sharded too: class ``FSDPGatedDeltaNet``) on one gloo rank;
* ``torch.compile`` of the blocks (dynamo, ``aot_eager``), torch's determinism check on.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    INT_REPLAY,
    OLMO_AC_MODES,
    divergent,
    max_grad_diff,
    olmo_apply_ac,
    olmo_batch,
    olmo_hybrid,
)
from helpers import olmo_step as step

from fla_ac_isolation import ReplayAudit, isolate_seqlens
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
from fla_ac_isolation.isolate import PartialIsolationWarning

pytest.importorskip("olmo_core")
pytestmark = pytest.mark.usefixtures("single_thread", "stand_ins")

FLA_HELPERS = ["prepare_chunk_indices", "prepare_chunk_offsets"]
COMPILE_DOC_LENS = (20, 9, 13)  # fewer chunks: fewer frames for dynamo to compile


@pytest.fixture(scope="module")
def stand_ins():
    from fla_ac_isolation.harness.testing.olmo_core import cpu_stand_ins

    with cpu_stand_ins() as served:
        yield served


@pytest.fixture(scope="module")
def hybrid():
    """One built GDN + attention model; each test deep-copies it (AC and hooks change a model in place)."""
    return olmo_hybrid()


@pytest.fixture(scope="module")
def no_ac(hybrid, stand_ins):
    """The no-AC step, per precision: ``{False: fp32 Step, True: bf16 Step}``."""
    return {bf16: step(copy.deepcopy(hybrid), olmo_batch(), bf16) for bf16 in (False, True)}


def _audited_step(model, bf16):
    with ReplayAudit(model, on_divergence="record") as audit:
        result = step(model, olmo_batch(), bf16)
    return result, audit


def _assert_equal_to(result, reference):
    assert result.error is None, result.error
    assert torch.equal(result.loss, reference.loss)
    assert result.grads.keys() == reference.grads.keys()
    assert max_grad_diff(result, reference) == 0.0


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", OLMO_AC_MODES)
def test_each_ac_mode_diverges_as_shipped_and_matches_no_ac_after_isolate_seqlens(hybrid, no_ac, mode, bf16):
    shipped = copy.deepcopy(hybrid)
    olmo_apply_ac(shipped, mode)
    shipped_result, shipped_audit = _audited_step(shipped, bf16)

    isolated = copy.deepcopy(hybrid)
    olmo_apply_ac(isolated, mode)
    handle = isolate_seqlens(isolated)
    result, audit = _audited_step(isolated, bf16)

    region = "blocks.0.attention" if mode == "selected_modules" else "blocks.0"  # selected_modules wraps the mixer
    assert divergent(shipped_audit) == [(region, FLA_HELPERS)]
    _assert_equal_to(shipped_result, no_ac[bf16])  # latent: nothing this policy saves is shifted
    assert handle.paths == ["blocks.0._checkpoint_wrapped_module.attention" if mode != "selected_modules"
                            else "blocks.0.attention._checkpoint_wrapped_module"]
    assert audit.ok and len(audit.regions) == 2  # both blocks (or both sequence mixers) checkpointed
    _assert_equal_to(result, no_ac[bf16])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_olmo_policy_saving_every_to_copy_fails_in_bf16_as_shipped_and_isolate_seqlens_fixes_it(hybrid, no_ac, bf16):
    shipped = copy.deepcopy(hybrid)
    olmo_apply_ac(shipped, "selected_ops+to_copy")
    shipped_result, shipped_audit = _audited_step(shipped, bf16)

    isolated = copy.deepcopy(hybrid)
    olmo_apply_ac(isolated, "selected_ops+to_copy")
    isolate_seqlens(isolated)
    result, audit = _audited_step(isolated, bf16)

    if bf16:  # the autocast casts are _to_copy too: FLA's int32 casts shift them
        assert isinstance(shipped_result.error, RuntimeError) and str(shipped_result.error) == INT_REPLAY
        assert divergent(shipped_audit) == [("blocks.0", ["prepare_chunk_indices"])]  # stopped by the error
    else:
        assert divergent(shipped_audit) == [("blocks.0", FLA_HELPERS)]
        _assert_equal_to(shipped_result, no_ac[bf16])
    assert audit.ok
    _assert_equal_to(result, no_ac[bf16])


def test_isolating_before_ac_then_removing_brings_the_failure_back(hybrid, no_ac):
    model = copy.deepcopy(hybrid)
    handle = isolate_seqlens(model)  # before OLMo-core wraps its blocks: the hook stays on the mixer
    olmo_apply_ac(model, "selected_ops+to_copy")
    assert handle.paths == ["blocks.0.attention"]
    _assert_equal_to(step(model, olmo_batch(), bf16=True), no_ac[True])

    handle.remove()
    failed = step(model, olmo_batch(), bf16=True)
    assert isinstance(failed.error, RuntimeError) and str(failed.error) == INT_REPLAY

    isolate_seqlens(model)
    _assert_equal_to(step(model, olmo_batch(), bf16=True), no_ac[True])


def test_isolating_one_of_two_gdn_blocks_warns_and_the_failure_moves_to_the_next(stand_ins):
    model = olmo_hybrid(("gdn", "gdn", "attn"))
    olmo_apply_ac(model, "selected_ops+to_copy")
    shipped, shipped_audit = _audited_step(copy.deepcopy(model), bf16=True)
    with pytest.warns(PartialIsolationWarning, match=r"blocks.1._checkpoint_wrapped_module.attention"):
        isolate_seqlens(model, modules=["blocks.0._checkpoint_wrapped_module.attention"])
    partial, partial_audit = _audited_step(model, bf16=True)

    assert str(shipped.error) == INT_REPLAY and [r for r, _ in divergent(shipped_audit)] == ["blocks.0"]
    # block 1 now misses in its forward (block 0 no longer fills the cache) and hits in its recompute
    assert str(partial.error) == INT_REPLAY and [r for r, _ in divergent(partial_audit)] == ["blocks.1"]


def test_kimi_delta_attention_is_isolated_too(stand_ins):
    """OLMo-core's KDA mixer alone, checkpointed under SAC saving every _to_copy (short documents: its
    reference is FLA's per-token naive recurrence)."""
    from torch.utils.checkpoint import checkpoint

    from fla_ac_isolation.policies import sac_context_fn, save_all_copies

    torch.manual_seed(0)
    kda = olmo_hybrid(("kda",)).blocks["0"].attention
    cu = torch.tensor([0, 7, 12, 20], dtype=torch.int32)
    x = torch.randn(1, 20, 64)

    def run(checkpointed: bool):
        clear_tensor_cache()
        kda.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_()
        with ReplayAudit(on_divergence="record") as audit:
            out = checkpoint(kda, h, cu_doc_lens=cu, use_reentrant=False, context_fn=sac_context_fn(save_all_copies())) \
                if checkpointed else kda(h, cu_doc_lens=cu)
            out.float().pow(2).mean().backward()
        return out.detach(), h.grad, [p.grad.clone() for p in kda.parameters()], audit

    reference = run(checkpointed=False)
    shipped = run(checkpointed=True)
    handle = isolate_seqlens(kda)
    isolated = run(checkpointed=True)

    assert handle.paths == [""]
    assert [d.helper for d in shipped[3].divergent[0].fla] == FLA_HELPERS  # one region: misses, then hits
    assert isolated[3].ok and len(isolated[3].regions) == 1
    assert torch.equal(isolated[0], reference[0]) and torch.equal(isolated[1], reference[1])
    assert all(torch.equal(a, b) for a, b in zip(isolated[2], reference[2]))


def test_fsdp2_sharded_mixers_are_found_and_the_audit_sees_only_fla(hybrid, no_ac, gloo_world_of_one):
    """OLMo-core's apply_fsdp after its AC (mixers sharded too): fully_shard renames GatedDeltaNet to
    FSDPGatedDeltaNet, and its unshard ops run in the checkpointed forward only; the audit leaves them out."""

    def sharded(isolate: bool):
        model = copy.deepcopy(hybrid)
        olmo_apply_ac(model, "selected_ops+to_copy")
        for block in model.blocks.values():
            from torch.distributed.fsdp import fully_shard

            fully_shard(block._checkpoint_wrapped_module.attention, mesh=gloo_world_of_one)
        model.apply_fsdp(dp_mesh=gloo_world_of_one)
        return model, (isolate_seqlens(model) if isolate else None)

    shipped, _ = sharded(isolate=False)
    shipped_result, shipped_audit = _audited_step(shipped, bf16=True)
    model, handle = sharded(isolate=True)
    result, audit = _audited_step(model, bf16=True)

    assert type(model.get_submodule(handle.paths[0])).__name__ == "FSDPGatedDeltaNet"
    assert handle.paths == ["blocks.0._checkpoint_wrapped_module.attention"]
    assert str(shipped_result.error) == INT_REPLAY
    assert divergent(shipped_audit) == [("blocks.0", ["prepare_chunk_indices"])]  # not every block at op #0
    assert audit.ok and len(audit.regions) == 2
    _assert_equal_to(result, no_ac[True])  # the sharded, isolated step equals the unsharded no-AC step


def test_compiled_blocks_inside_checkpoints_raise_nothing_and_match_no_ac(hybrid):
    """Each block's module compiled (dynamo, ``eager`` backend; the GPU test runs inductor) inside OLMo-core's
    checkpoint wrapper, torch's determinism check on ("default"): the hook is traced into the compiled frame,
    and its copy runs between graphs (``torch.compiler.disable``), so the forward and the recompute each hand
    FLA a new object. (Compiling the wrappers instead, OLMo-core's ``apply_compile`` order, compiles nothing
    on this CPU: dynamo refuses to trace the checkpoint of an FLA block, "HOP: Unsafe side effect", and runs
    it eagerly.) The ``eager`` backend runs the captured ops unchanged, so no AC in eager is the reference."""
    import torch._dynamo

    def compiled(isolate: bool):
        torch._dynamo.reset()
        model = copy.deepcopy(hybrid)
        olmo_apply_ac(model, "full")
        for block in model.blocks.values():
            block._checkpoint_wrapped_module.compile(fullgraph=False, backend="eager")
        handle = isolate_seqlens(model) if isolate else None  # after compile: the hooks are found all the same
        return model, handle

    batch = olmo_batch(lens=COMPILE_DOC_LENS)
    reference = step(copy.deepcopy(hybrid), batch)
    shipped, _ = compiled(isolate=False)
    with ReplayAudit(shipped, on_divergence="record") as shipped_audit:
        shipped_result = step(shipped, batch)
    model, handle = compiled(isolate=True)
    with ReplayAudit(model, on_divergence="record") as audit:
        result = step(model, batch)

    assert shipped_result.error is None, shipped_result.error
    assert divergent(shipped_audit) == [("blocks.0", FLA_HELPERS)]  # compiled too, the recompute hits FLA's cache
    assert handle.paths == ["blocks.0._checkpoint_wrapped_module.attention"]
    assert audit.ok and len(audit.regions) == 2
    _assert_equal_to(result, reference)  # no CheckpointError raised, equal to no AC bit for bit
