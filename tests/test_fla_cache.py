"""fla_cache: the global switch, cache size, and the hit/miss probe against FLA's real helpers."""

import fla.utils
import pytest
import torch
from fla.ops.utils.index import prepare_chunk_indices, prepare_lens, prepare_position_ids

from fla_ac_isolation.fla_seam.cache import (
    cache_enabled,
    cache_size,
    clear_tensor_cache,
    probe_tensor_cache,
    tensor_cache_disabled,
    tensor_cache_size,
)


def offsets():
    return torch.tensor([0, 5, 5, 22], dtype=torch.int32)


def test_tensor_cache_disabled_restores_prior_value_also_on_error():
    assert cache_enabled()
    with pytest.raises(KeyError), tensor_cache_disabled():
        assert fla.utils.FLA_DISABLE_TENSOR_CACHE is True and not cache_enabled()
        raise KeyError("boom")
    assert fla.utils.FLA_DISABLE_TENSOR_CACHE is False and cache_enabled()
    fla.utils.FLA_DISABLE_TENSOR_CACHE = True  # a user who disabled it globally keeps it disabled
    try:
        with tensor_cache_disabled():
            pass
        assert fla.utils.FLA_DISABLE_TENSOR_CACHE is True
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = False


def test_probe_reports_miss_then_hit_then_bypass_in_call_order():
    clear_tensor_cache()
    cu = offsets()
    with probe_tensor_cache() as probe:
        a = prepare_chunk_indices(cu, 4)
        b = prepare_chunk_indices(cu, 4)
        with tensor_cache_disabled():
            prepare_lens(cu)
    assert a is b
    assert [(e.helper, e.outcome) for e in probe.events] == [
        ("prepare_chunk_indices", "miss"),
        ("prepare_lens", "miss"),  # called by prepare_chunk_indices on its miss
        ("prepare_chunk_indices", "hit"),
        ("prepare_lens", "bypass"),
    ]
    assert (probe.hits, probe.misses, probe.bypasses) == (1, 2, 1)
    assert probe.by_helper()["prepare_chunk_indices"] == {"hit": 1, "miss": 1, "bypass": 0}


def test_probe_keeps_cache_contents_and_nests():
    clear_tensor_cache()
    cu = offsets()
    first = prepare_position_ids(cu)
    with probe_tensor_cache() as outer:
        with probe_tensor_cache() as inner:
            assert prepare_position_ids(cu) is first  # contents carried into the probe
        prepare_position_ids(torch.tensor([0, 3]))
    assert prepare_position_ids(cu) is first  # ... and back out of it
    assert [e.outcome for e in inner.events] == ["hit"]
    assert [e.helper for e in outer.events][:1] == ["prepare_position_ids"] and outer.misses == 2


def test_fresh_objects_miss_where_a_shared_one_hits():
    from fla_ac_isolation import LayerLocalSeqlens

    clear_tensor_cache()
    seqlens = LayerLocalSeqlens.from_seq_lens([5, 0, 17])
    shared = seqlens.local().cu_seqlens
    with probe_tensor_cache() as probe:
        for _ in range(3):
            prepare_chunk_indices(shared, 4)
    assert [e.outcome for e in probe.events if e.helper == "prepare_chunk_indices"] == ["miss", "hit", "hit"]
    with probe_tensor_cache() as probe:
        for _ in range(3):
            prepare_chunk_indices(seqlens.local().cu_seqlens, 4)
    assert [e.outcome for e in probe.events if e.helper == "prepare_chunk_indices"] == ["miss"] * 3


def test_tensor_cache_size_evicts_and_restores():
    assert cache_size() == 4
    cu1, cu2 = offsets(), offsets()
    with tensor_cache_size(1):
        assert cache_size() == 1
        x = prepare_lens(cu1)
        prepare_lens(cu2)  # evicts cu1
        assert prepare_lens(cu1) is not x
    assert cache_size() == 4
    with pytest.raises(ValueError, match="size must be an int >= 1"), tensor_cache_size(0):
        pass
    with probe_tensor_cache(), pytest.raises(RuntimeError, match="outside probe_tensor_cache"), tensor_cache_size(2):
        pass


def test_probe_under_torch_compile_records_hits_and_leaves_the_helpers_compiled():
    # torch >= 2.14's dynamo traced the probing deque's lookup and replayed its side effects with code that
    # loads `collections` from fla.ops.utils.index's globals: NameError. The probe's bookkeeping now runs
    # eagerly; the helpers' own ops must still land in dynamo's graphs (a probe that ran them eagerly would hide
    # them from an audit of a compiled region).
    graphs: list[set] = []

    def recording_backend(gm, example_inputs):
        graphs.append({node.target for node in gm.graph.nodes if node.op in ("call_function", "call_method")})
        return gm.forward

    def step(cu):
        return prepare_position_ids(cu) * 2

    compiled = torch.compile(step, backend=recording_backend)
    torch._dynamo.reset()
    clear_tensor_cache()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with probe_tensor_cache() as probe:
        first, second = compiled(cu), compiled(cu)
        with tensor_cache_disabled():
            third = compiled(cu)
    assert [(e.helper, e.outcome) for e in probe.events] == [
        ("prepare_position_ids", "miss"),
        ("prepare_lens", "miss"),
        ("prepare_position_ids", "hit"),
        ("prepare_position_ids", "bypass"),
        ("prepare_lens", "bypass"),
    ]
    for out in (first, second, third):
        assert out.tolist() == [0, 2, 4, 0, 2, 4, 6]
    # prepare_lens's diff and prepare_position_ids's cumsum ran inside compiled graphs
    assert any(torch.diff in g for g in graphs) and any("cumsum" in g for g in graphs)


def test_the_probe_records_which_offsets_object_each_call_was_given_on_a_hit_a_miss_and_a_bypass():
    """``arguments=True``: every event holds the call's tensors (a hit: the entry it matched), so a reader tells a
    shared offsets object (one object in every call) from fresh ones; without it events hold none."""
    clear_tensor_cache()
    shared, other = offsets(), offsets()
    with probe_tensor_cache(arguments=True) as probe:
        prepare_chunk_indices(shared, 4)
        prepare_chunk_indices(other, 4)
        prepare_chunk_indices(shared, 4)  # a hit on the first entry, with another entry after it in the queue
        with tensor_cache_disabled():
            prepare_lens(other)
    got = [(e.helper, e.outcome, [a is shared for a in e.arguments], [a is other for a in e.arguments])
           for e in probe.events]
    assert got == [
        ("prepare_chunk_indices", "miss", [True], [False]),
        ("prepare_lens", "miss", [True], [False]),
        ("prepare_chunk_indices", "miss", [False], [True]),
        ("prepare_lens", "miss", [False], [True]),
        ("prepare_chunk_indices", "hit", [True], [False]),
        ("prepare_lens", "bypass", [False], [True]),
    ]
    with probe_tensor_cache() as plain:
        prepare_chunk_indices(shared, 4)
        prepare_chunk_indices(offsets(), 4)
    assert [(e.outcome, e.arguments) for e in plain.events] == [("hit", ()), ("miss", ()), ("miss", ())]
