"""The ops take one layer call's offsets as one object: ``seqlens=`` what ``.local()`` returned gives exactly the
result of FLA's loose keywords (``cu_seqlens=``, ``cu_seqlens_cpu=``, ``chunk_indices=``, ``chunk_offsets=``) built
from it, hands FLA's helpers the schedule it carries (no ``prepare_chunk_indices``), and is refused beside them."""

import pytest
import torch

from fla_ac_isolation import LayerLocalSeqlens, LocalSeqlens, ops
from fla_ac_isolation.fla_seam.cache import probe_tensor_cache

pytestmark = pytest.mark.usefixtures("single_thread")

LENS = [5, 70, 1, 33]  # one document spans two 64-token chunks
T = sum(LENS)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _calls(local: LocalSeqlens):
    """Each op's positional inputs and the loose keywords equal to ``local`` (what FLA's signatures take)."""
    q, k, v = _randn(1, T, 2, 8, seed=1), _randn(1, T, 2, 8, seed=2), _randn(1, T, 4, 6, seed=3)
    beta = _randn(1, T, 4, seed=4).sigmoid()
    conv = dict(cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu, chunk_indices=local.chunk_indices)
    return {
        "causal_conv1d": ((_randn(1, T, 12, seed=5), _randn(12, 4, seed=6), _randn(12, seed=7)), conv),
        "chunk_gated_delta_rule": ((q, k, v, -_randn(1, T, 4, seed=8).abs(), beta), conv),
        "ssd": ((_randn(1, T, 4, 6, seed=9), _randn(1, T, 4, seed=10), -_randn(4, seed=11).abs(),
                 _randn(1, T, 2, 5, seed=12), _randn(1, T, 2, 5, seed=13)),
                {**conv, "chunk_offsets": local.chunk_offsets}),
        "chunk_kda": ((q, k, _randn(1, T, 2, 6, seed=14), -_randn(1, T, 2, 8, seed=15).abs(), beta[..., :2]),
                      dict(cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu)),
    }


@pytest.mark.parametrize("op", ["causal_conv1d", "chunk_gated_delta_rule", "ssd", "chunk_kda"])
def test_seqlens_gives_the_loose_keywords_result_bit_for_bit(op):
    seqlens = LayerLocalSeqlens.from_seq_lens(LENS)
    local = seqlens.local()
    args, _ = _calls(local)[op]
    _, loose = _calls(seqlens.local())[op]  # another call's fresh offsets: FLA's cache holds nothing of the first
    fn = getattr(ops, op)
    with probe_tensor_cache() as probe:
        got = fn(*args, seqlens=local, backend="reference")
    with probe_tensor_cache() as loose_probe:
        want = fn(*args, **loose, backend="reference")
    assert torch.equal(got, want)
    assert probe.by_helper() == loose_probe.by_helper()  # FLA's helpers asked the same questions
    if op == "chunk_kda":  # takes no chunk_indices (FLA's chunk_kda builds its schedule from cu_seqlens)
        assert probe.by_helper()["prepare_chunk_indices"]["miss"] == 1
    else:  # the schedule .local() carries reached the op: FLA's helper never built one
        assert "prepare_chunk_indices" not in probe.by_helper()
    if op == "ssd":  # its first row per document came along too
        assert "prepare_chunk_offsets" not in probe.by_helper()


def test_without_a_schedule_the_helper_builds_one_so_the_probe_above_can_fail():
    """Control for the test above: the same conv given only ``cu_seqlens`` makes FLA's helper build the schedule."""
    local = LayerLocalSeqlens.from_seq_lens(LENS).local()
    args, _ = _calls(local)["causal_conv1d"]
    with probe_tensor_cache() as probe:
        ops.causal_conv1d(*args, cu_seqlens=local.cu_seqlens, backend="reference")
    assert probe.by_helper()["prepare_chunk_indices"]["miss"] == 1


@pytest.mark.parametrize("op", ["causal_conv1d", "chunk_gated_delta_rule", "ssd", "chunk_kda"])
def test_seqlens_beside_a_loose_keyword_is_refused_naming_it(op):
    local = LayerLocalSeqlens.from_seq_lens(LENS).local()
    args, _ = _calls(local)[op]
    with pytest.raises(ValueError) as info:
        getattr(ops, op)(*args, seqlens=local, cu_seqlens_cpu=local.cu_seqlens_cpu, backend="reference")
    assert str(info.value) == (f"{op}: seqlens carries the offsets; got cu_seqlens_cpu beside it (give one or the "
                               "other)")


def test_the_batch_object_instead_of_its_local_offsets_is_refused_with_the_call_to_make():
    seqlens = LayerLocalSeqlens.from_seq_lens(LENS)
    args, _ = _calls(seqlens.local())["chunk_gated_delta_rule"]
    with pytest.raises(TypeError) as info:
        ops.chunk_gated_delta_rule(*args, seqlens=seqlens, backend="reference")
    assert str(info.value) == ("chunk_gated_delta_rule: seqlens must be a fla_ac_isolation.LocalSeqlens, what "
                               ".local() returns, got LayerLocalSeqlens (call .local() on it inside the layer)")


@pytest.mark.parametrize("op", ["ssd", "chunk_kda"])
def test_ops_without_a_cp_path_refuse_offsets_carrying_a_cp_context(op):
    local = LayerLocalSeqlens.from_seq_lens(LENS).local()._replace(cp_context=object())
    args, _ = _calls(local)[op]
    with pytest.raises(ValueError) as info:
        getattr(ops, op)(*args, seqlens=local, backend="reference")
    assert str(info.value) == (f"{op} takes no context-parallel offsets: seqlens carries a cp_context (under CP pass "
                               "the whole batch's offsets, .local(whole_batch=True), to a head-parallel call)")
