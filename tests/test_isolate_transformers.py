"""isolate_seqlens and swap_mixers on transformers 5.24's own Qwen3.5-MoE under SAC, packed, on CPU.

The model is ``Qwen3_5MoeForCausalLM`` (tiny: 3 GatedDeltaNet layers + 1 attention layer, 4 experts), the batch
comes from transformers' ``DataCollatorWithFlattening`` (one ``cu_seq_lens_q`` object for every layer), AC is
``gradient_checkpointing_enable`` with SAC saving every ``_to_copy`` (FLA's int32 miss path casts with it).
FLA's kernel call is served on CPU by :func:`fla_ac_isolation.harness.reference_kernels.reference_kernels`,
through transformers' own kernel wrapper (closure cell), so FLA's cache behaves as with the kernel.

The two fixes are compared each with its OWN no-AC run: transformers' torch conv (``causal_conv1d_fn`` without
the causal-conv1d package) is never told where documents end, so it leaks 3 tokens across each boundary; our
mixers restart it at every document. ``isolate_seqlens`` keeps transformers' conv (and that leak);
``swap_mixers`` replaces it. Their no-AC losses therefore differ.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import MODEL_FAMILIES, divergent, max_grad_diff, packed_batch, set_checkpointing, train_step

from fla_ac_isolation import ReplayAudit, isolate_seqlens, swap_mixers
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
from fla_ac_isolation.fla_seam.features import supports
from fla_ac_isolation.policies import save_all_copies

pytestmark = pytest.mark.usefixtures("single_thread", "served")

GDN_PATHS = [f"model.layers.{i}.linear_attn" for i in range(3)]


@pytest.fixture(scope="module")
def served():
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    with reference_kernels() as served:
        yield served


@pytest.fixture(scope="module")
def qwen():
    return MODEL_FAMILIES["qwen3_5_moe"].model()


def _step(model, checkpointed: bool):
    set_checkpointing(model, save_all_copies() if checkpointed else None)
    clear_tensor_cache()
    with ReplayAudit(model, on_divergence="record") as audit:
        result = train_step(model, packed_batch())
    return result, audit


def _assert_equal_to(result, reference):
    assert result.error is None, result.error
    assert torch.equal(result.loss, reference.loss)
    assert max_grad_diff(result, reference) == 0.0


@pytest.fixture(scope="module")
def no_ac(qwen, served):
    return _step(copy.deepcopy(qwen), checkpointed=False)[0]


def test_as_shipped_sac_fails_in_the_moe_router(qwen, no_ac):
    result, audit = _step(copy.deepcopy(qwen), checkpointed=True)

    assert no_ac.error is None, no_ac.error
    assert isinstance(result.error, NotImplementedError)
    assert str(result.error) == "\"histogram_cpu\" not implemented for 'Int'"  # an FLA int tensor in histc
    assert divergent(audit) == [("model.layers.0", ["prepare_chunk_indices", "prepare_chunk_offsets"])]


@pytest.mark.parametrize("order", ["isolate-after-checkpointing", "isolate-before-checkpointing"])
def test_isolate_seqlens_matches_no_ac_bit_for_bit(qwen, no_ac, served, order):
    model = copy.deepcopy(qwen)
    if order == "isolate-before-checkpointing":
        assert isolate_seqlens(model).paths == GDN_PATHS
    set_checkpointing(model, save_all_copies())
    if order == "isolate-after-checkpointing":
        assert isolate_seqlens(model).paths == GDN_PATHS
    calls = len(served.calls)
    result, audit = _step(model, checkpointed=True)

    assert audit.ok and len(audit.regions) == 4
    _assert_equal_to(result, no_ac)
    kernel = [c for c in served.calls[calls:] if c.kernel == "chunk_gated_delta_rule"]
    assert len(kernel) == 6  # 3 forwards + 3 recomputes, each with its own offsets and host offsets
    assert len({id(c.cu_seqlens) for c in kernel}) == 6
    # transformers hands FLA's GDN only the keywords of the function it bound at import: fla-core 0.6's names
    # chunk_indices; 0.5.2's does not (FLA then builds the schedule from the fresh cu_seqlens), unless the model
    # module was imported while reference_kernels() served it (the stand-in names it): all calls alike either way
    assert all(c.cu_seqlens_cpu is not None for c in kernel)
    scheduled = {c.chunk_indices is not None for c in kernel}
    assert scheduled == {True} if supports("gdn_chunk_indices") else len(scheduled) == 1


def test_swap_mixers_matches_its_own_no_ac_and_keeps_documents_apart_unlike_transformers_conv(qwen, no_ac):
    model = copy.deepcopy(qwen)
    assert swap_mixers(model) == GDN_PATHS
    swapped_no_ac, _ = _step(model, checkpointed=False)
    result, audit = _step(model, checkpointed=True)

    assert audit.ok
    _assert_equal_to(result, swapped_no_ac)
    # transformers' conv reads 3 tokens of the previous document at each boundary; ours does not
    assert abs(swapped_no_ac.loss.item() - no_ac.loss.item()) > 1e-5
