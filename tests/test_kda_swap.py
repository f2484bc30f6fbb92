"""swap_mixers on transformers' Kimi Delta Attention models (Kimi-Linear, GLM-5-next, Bailing hybrid), on CPU.

Tiny random models (``helpers.kda_models``): Kimi-Linear and Bailing with 3 KDA layers and one MLA layer,
GLM-5-next with 4 KDA layers (its indexed attention is not packing-safe at this size, outside FLA). Packed
batches from transformers' ``DataCollatorWithFlattening``, documents of 70, 23 and 41 tokens.

Which code ran for the shipped (unswapped) models:

* transformers' KDA mixers call FLA's ``chunk_kda`` through its kernel wrapper, which keeps only FLA's own
  parameter names: ``cu_seq_lens_q`` never arrives. FLA's kernel has no CPU backend, so
  :func:`helpers.kda_models.shipped_kda_on_cpu` keeps the wrapper and serves the call with our reference
  (same maths, same index lookups) while recording the keywords that reached it.
* For the unpacked parity the upstream models run transformers' own torch KDA (``__wrapped__``, what
  transformers runs without FLA): an implementation of KDA independent of ours (chunked, WY form).

Tolerances (float32): our token-by-token KDA and transformers' chunked torch KDA round differently; on one
unpacked document of 70 tokens the outputs differ by at most 2.4e-7 / 1.4e-6 / 4.3e-7 here (Kimi, GLM-5-next
whose last hidden state reaches 3.5, Bailing; the reach report measured 2.1e-7 / 7.2e-7 / 3.0e-7 against
transformers with FLA's naive KDA): bound 1e-5. Packed against each document alone, the swapped models differ
by at most 7.2e-7 (GLM-5-next): bound 1e-5. The shipped models leak: documents
2 and 3 differ from themselves run alone by 0.093 / 0.137 (Kimi), 1.17 / 0.95 (GLM-5-next), 0.33 / 0.59
(Bailing) in float32, and by as much in bfloat16: the floor asserted is 0.05, about half the smallest.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from helpers import (
    KDA_MODELS,
    kda_loss,
    kda_output,
    kda_packed_batch,
    per_document_gap,
    set_checkpointing,
)
from helpers import shipped_kda_on_cpu as shipped_on_cpu

from fla_ac_isolation import restore_mixers, swap_mixers
from fla_ac_isolation.harness.modes import SharedSeqlens
from fla_ac_isolation.harness.transformers_kernels import torch_function
from fla_ac_isolation.policies import save_all_copies

pytestmark = pytest.mark.usefixtures("single_thread")

NAMES = list(KDA_MODELS)
TOL = 1e-5
LEAK_FLOOR = 0.05
#: What transformers' wrapper hands FLA's chunk_kda from every KDA mixer: no cu_seqlens (reach report, q1).
SHIPPED_KEYWORDS = {("beta", "g", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")}


@contextlib.contextmanager
def transformers_torch_kda(case):
    """transformers' own torch KDA (its ``chunk_kimi_delta_attention`` fallback) in place of FLA's kernel."""
    modeling = case.modeling
    saved = modeling.chunk_kimi_delta_attention
    modeling.chunk_kimi_delta_attention = torch_function(saved)
    try:
        yield
    finally:
        modeling.chunk_kimi_delta_attention = saved


def _step(model, case, batch):
    model.zero_grad(set_to_none=True)
    loss = kda_loss(model, case, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _no_ac_and_sac(model, case):
    """(no-AC step, bf16 SAC ``save_all_copies`` step) on the same packed batch, decoder layers checkpointed."""
    set_checkpointing(model, None)
    reference = _step(model, case, kda_packed_batch())
    set_checkpointing(model, save_all_copies())
    try:
        return reference, _step(model, case, kda_packed_batch())
    finally:
        set_checkpointing(model, None)


def _assert_bit_equal(got, want):
    (loss, grads), (loss_ref, grads_ref) = got, want
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        assert torch.equal(grads[name], grad), name


# ------------------------------------------------------------------------------------------ swap and keys
@pytest.mark.parametrize("name", NAMES)
def test_swap_replaces_every_kda_mixer_and_keeps_parameters_and_keys(name):
    case = KDA_MODELS[name]
    model = case.model()
    params = dict(model.named_parameters())
    keys = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]

    assert swap_mixers(model) == list(case.paths)

    for path in case.paths:
        assert type(model.get_submodule(path)) is case.ours
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()] == keys


@pytest.mark.parametrize("name", NAMES)
def test_upstream_state_dict_loads_strictly_into_the_swapped_model(name):
    case = KDA_MODELS[name]
    source = case.model(seed=0)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    doc = {"input_ids": kda_packed_batch()["input_ids"][:, :70]}
    with transformers_torch_kda(case), torch.no_grad():
        expected = kda_output(source, case, doc)

    target = case.model(seed=1)
    swap_mixers(target)
    buffer.seek(0)
    result = target.load_state_dict(torch.load(buffer, weights_only=True), strict=True)

    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(kda_output(target, case, doc), expected, rtol=0, atol=TOL)


@pytest.mark.parametrize("name", NAMES)
def test_restore_mixers_puts_the_transformers_classes_back(name):
    case = KDA_MODELS[name]
    model = case.model()
    params = dict(model.named_parameters())
    batch = kda_packed_batch()
    with shipped_on_cpu(case), torch.no_grad():
        expected = kda_output(model, case, batch)
    swap_mixers(model)

    assert restore_mixers(model) == list(case.paths)

    assert all(type(model.get_submodule(p)).__qualname__ == case.upstream.name for p in case.paths)
    assert all(p is params[n] for n, p in model.named_parameters())
    with shipped_on_cpu(case), torch.no_grad():
        assert torch.equal(kda_output(model, case, batch), expected)


# --------------------------------------------------------------------------------- numbers and documents
@pytest.mark.parametrize("name", NAMES)
def test_swapped_model_matches_transformers_on_one_unpacked_document(name):
    case = KDA_MODELS[name]
    model = case.model()
    doc = {"input_ids": kda_packed_batch()["input_ids"][:, :70]}  # two 64-token chunks
    with transformers_torch_kda(case), torch.no_grad():
        expected = kda_output(model, case, doc)
    swap_mixers(model)
    with torch.no_grad():
        got = kda_output(model, case, doc)
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_swapped_packed_batch_equals_each_document_alone(name):
    case = KDA_MODELS[name]
    model = case.model()
    swap_mixers(model)
    assert max(per_document_gap(model, case, kda_packed_batch())) <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_shipped_model_hands_chunk_kda_no_offsets_and_leaks_across_documents(name):
    case = KDA_MODELS[name]
    model = case.model()
    with shipped_on_cpu(case) as calls:
        first, second, third = per_document_gap(model, case, kda_packed_batch())
    assert set(calls.keywords) == SHIPPED_KEYWORDS
    assert first <= TOL  # the first document has nothing before it
    assert second > LEAK_FLOOR and third > LEAK_FLOOR


# ----------------------------------------------------------------------------------- under selective AC
@pytest.mark.parametrize("name", NAMES)
def test_bf16_sac_swapped_equals_no_ac_bit_for_bit_while_the_shipped_model_leaks(name):
    """bf16, SAC saving every ``_to_copy``: the swapped model equals its run without AC bit for bit. The shipped
    model also equals its own run without AC (no offsets reach FLA, so FLA's cache has nothing to misalign), but
    its packed documents are not kept apart: that is its failure, asserted with the measured floor."""
    case = KDA_MODELS[name]
    swapped = case.model().to(torch.bfloat16)
    swap_mixers(swapped)
    reference, sac = _no_ac_and_sac(swapped, case)
    _assert_bit_equal(sac, reference)

    shipped = case.model().to(torch.bfloat16)
    with shipped_on_cpu(case):
        reference, sac = _no_ac_and_sac(shipped, case)
        gaps = per_document_gap(shipped, case, kda_packed_batch())
    _assert_bit_equal(sac, reference)
    assert gaps[0] == 0.0 and min(gaps[1:]) > LEAK_FLOOR, gaps


@pytest.mark.parametrize("name", NAMES)
def test_a_drop_in_handing_fla_the_shared_offsets_fails_under_bf16_sac(name, monkeypatch):
    """Mutation: the drop-in without its isolation, i.e. handing FLA transformers' one ``cu_seq_lens_q`` object
    (as every layer gets it), inherits FLA's cache fault: the recompute of the first KDA layer skips FLA's
    int32 -> int64 casts and a later saved cast is replayed with FLA's int tensor."""
    import fla_ac_isolation.mixers.offsets_keywords as offsets_keywords

    case = KDA_MODELS[name]
    model = case.model().to(torch.bfloat16)
    swap_mixers(model)
    # the drop-ins' offsets come from SharedSeqlens (the harness's unsafe mode): .local() hands out one object
    monkeypatch.setattr(offsets_keywords, "LayerLocalSeqlens", SharedSeqlens)
    with pytest.raises(RuntimeError, match="Autograd not support dtype: Int"):
        _no_ac_and_sac(model, case)
