"""Graph-safe metadata (``StaticSeqlens``, ``LayerLocalSeqlens(static=)``) on a CPU: the padded layout, the
in-place fill, fresh copies, the checks, and the mixers' numbers (reference backend) with and without padding.

FLA's kernels with padded metadata are compared under Triton's interpreter in ``test_recompute_interpret.py``;
replays of CUDA graphs in ``test_graphs_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import FAMILIES, HIDDEN, Block, loss_and_grads

from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit, StaticSeqlens
from fla_ac_isolation.fla_seam.layout import chunk_indices_for, chunk_offsets_for
from fla_ac_isolation.local_seqlens import LocalSeqlens
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies
from fla_ac_isolation.static_seqlens import max_chunks_for, padded_metadata


def _offsets(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


# ------------------------------------------------------------------------------------------ layout
def test_chunk_offsets_for_equals_flas_prepare_chunk_offsets():
    from fla.ops.utils.index import prepare_chunk_offsets

    for lens in ([5, 0, 17, 1, 41], [64], [65, 63, 0, 128, 1], [0]):
        cu = _offsets(lens).long()
        assert torch.equal(chunk_offsets_for(cu), prepare_chunk_offsets(cu, 64))


def test_padded_metadata_appends_empty_documents_and_rows_that_point_at_the_last_one():
    cu, rows, starts = padded_metadata([0, 70, 70, 140], num_tokens=140, max_docs=5)
    assert cu.tolist() == [0, 70, 70, 140, 140, 140, 140]                # 5 + 1 documents, the tail empty
    real = chunk_indices_for([0, 70, 70, 140])
    assert rows.shape == (max_chunks_for(140, 5), 2) == ((140 + 63 * 5) // 64, 2)
    assert torch.equal(rows[: len(real)], real)
    assert rows[len(real):].tolist() == [[5, 0]] * (rows.shape[0] - len(real))  # document 5: empty
    assert starts.tolist() == [0, 2, 2, 4, 4, 4, 4]                       # 2 + 0 + 2 chunks, then none


def test_max_chunks_bounds_every_packing_and_is_reached():
    rng = random.Random(0)
    tokens, max_docs = 1000, 12
    for _ in range(300):
        docs = rng.randint(1, max_docs)
        cuts = sorted(rng.randint(0, tokens) for _ in range(docs - 1))
        offsets = [0, *cuts, tokens]
        assert chunk_indices_for(offsets).shape[0] <= max_chunks_for(tokens, max_docs)
    # 11 documents of 65 tokens then one of 285: each document ends in a partial chunk
    lens = [65] * 11 + [tokens - 65 * 11]
    assert chunk_indices_for(_offsets(lens)).shape[0] == max_chunks_for(tokens, max_docs) == 27


# ---------------------------------------------------------------------------------------- the fill
def test_a_batch_is_written_into_the_same_buffers_in_place():
    static = StaticSeqlens(200, 6, device="cpu")
    addresses = [static.cu_seqlens.data_ptr(), static.chunk_indices.data_ptr(), static.chunk_offsets.data_ptr()]
    for lens in ([200], [70, 0, 130], [1, 1, 1, 1, 1, 195]):
        seqlens = LayerLocalSeqlens(_offsets(lens), static=static)
        cu, rows, starts = padded_metadata(_offsets(lens).tolist(), 200, 6)
        assert [static.cu_seqlens.data_ptr(), static.chunk_indices.data_ptr(),
                static.chunk_offsets.data_ptr()] == addresses
        assert torch.equal(static.cu_seqlens, cu.int()) and torch.equal(static.chunk_indices, rows.int())
        assert torch.equal(static.chunk_offsets, starts.int())
        assert static.seq_lens()[: len(lens)] == lens and seqlens.num_seqs == len(lens)
    assert static.generation == 3


def test_local_hands_each_call_fresh_copies_of_the_buffers():
    static = StaticSeqlens(200, 6, device="cpu")
    seqlens = LayerLocalSeqlens(_offsets([70, 0, 130]), static=static)
    a, b = seqlens.local(), seqlens.local()
    for name in ("cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "chunk_offsets"):
        first, second = getattr(a, name), getattr(b, name)
        assert first is not second and first.data_ptr() != second.data_ptr()
        assert torch.equal(first, second)
    assert a.cu_seqlens.data_ptr() != static.cu_seqlens.data_ptr()
    assert torch.equal(a.cu_seqlens, static.cu_seqlens) and a.max_seqlen == 200 and a.cp_context is None


def test_a_later_batch_makes_the_earlier_object_refuse_to_hand_out_its_offsets():
    static = StaticSeqlens(200, 6, device="cpu")
    first = LayerLocalSeqlens(_offsets([200]), static=static)
    LayerLocalSeqlens(_offsets([100, 100]), static=static)
    with pytest.raises(RuntimeError, match=r"wrote batch 1 into .* which now holds batch 2"):
        first.local()


def test_without_static_the_schedule_comes_with_its_chunk_offsets():
    local = LayerLocalSeqlens(_offsets([70, 0, 130])).local()
    assert torch.equal(local.chunk_offsets, chunk_offsets_for(_offsets([70, 0, 130])).int())
    assert LayerLocalSeqlens(_offsets([70]), chunk_indices=False).local().chunk_offsets is None


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lens": [10] * 7}, ValueError, "has 7 documents but the static buffers hold at most max_docs=6"),
        ({"lens": [10, 10]}, ValueError, "must equal the static num_tokens=200, got 20"),
        ({"chunk_indices": False}, ValueError, "static= always hands out the padded chunk schedule"),
        ({"static": "buffers"}, TypeError, r"static must be a StaticSeqlens, got str"),
        ({"device": "meta"}, ValueError, r"device=meta differs from the static buffers' device cpu"),
    ],
)
def test_bad_static_input_is_refused_at_construction(kwargs, error, message):
    static = StaticSeqlens(200, 6, device="cpu")
    lens = kwargs.pop("lens", [200])
    kwargs.setdefault("static", static)
    with pytest.raises(error, match=message):
        LayerLocalSeqlens(_offsets(lens), **kwargs)
    assert static.generation == 0  # nothing was written


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 4), ValueError, "num_tokens must be at least 1, got 0"),
        ((100, 0), ValueError, "max_docs must be at least 1, got 0"),
        ((100.0, 4), TypeError, "num_tokens must be an int, got float"),
        ((100, True), TypeError, "max_docs must be an int, got bool"),
    ],
)
def test_bad_static_sizes_are_refused(args, error, message):
    with pytest.raises(error, match=message):
        StaticSeqlens(*args, device="cpu")


def test_static_int64_and_the_dtype_check():
    assert StaticSeqlens(100, 2, device="cpu", dtype=torch.int64).cu_seqlens.dtype == torch.int64
    with pytest.raises(TypeError, match=r"dtype must be torch\.int32 or torch\.int64, got torch\.float32"):
        StaticSeqlens(100, 2, device="cpu", dtype=torch.float32)


# ------------------------------------------------------------------------------- mixers (reference)
LAYOUTS = [[5, 0, 17, 1, 41], [64], [1, 1, 1, 1, 30, 30], [0, 64, 0]]  # 64 tokens each


@pytest.mark.parametrize("name", ["qwen3_5_moe", "nemotron_h"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["no-ac", "sac"])
@pytest.mark.parametrize("saveable", [False, True], ids=["plain", "saveable"])
def test_mixers_give_the_same_numbers_with_padded_metadata(name, checkpointed, saveable, single_thread):
    """Reference backend (plain and as custom operators), float64: padded static metadata vs ordinary offsets,
    bit for bit, for every layout written into the same buffers (zero-length documents, one document, the
    bound itself)."""
    static = StaticSeqlens(64, 6, device="cpu")
    x = torch.randn(1, 64, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def run(seqlens_for):
        mixer = FAMILIES[name].build(0, seed=0, backend="reference", saveable=saveable)
        layers = torch.nn.ModuleList([Block(mixer)]).double()
        if checkpointed:
            checkpoint_layers(layers, mode="selective", policy=save_all_copies())
        return loss_and_grads(layers, x, seqlens_for())

    for lens in LAYOUTS:
        loss_s, dx_s, grads_s = run(lambda lens=lens: LayerLocalSeqlens(_offsets(lens), static=static))
        loss_p, dx_p, grads_p = run(lambda lens=lens: LayerLocalSeqlens(_offsets(lens)))
        assert torch.equal(loss_s, loss_p) and torch.equal(dx_s, dx_p), lens
        assert all(torch.equal(grads_s[n], g) for n, g in grads_p.items()), lens


class _SharedStatic(LayerLocalSeqlens):
    """The unsafe control: the static buffers themselves, one object for every call (no fresh copy)."""

    __slots__ = ()

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        s = self._static
        return LocalSeqlens(s.cu_seqlens, s.cu_seqlens_cpu, s.num_tokens, s.chunk_indices, None, s.chunk_offsets)


def test_static_offsets_keep_forward_and_recompute_alike_and_shared_ones_do_not(single_thread):
    """ReplayAudit under SAC (two checkpointed GDN blocks, reference backend): fresh copies of the static
    buffers make every recompute run the forward's ops; handing every call the buffers themselves makes the
    first region's recompute hit FLA's cache where its forward missed (prepare_chunk_offsets)."""
    x = torch.randn(1, 64, HIDDEN, generator=torch.Generator().manual_seed(0))

    def audit(cls):
        static = StaticSeqlens(64, 6, device="cpu")
        layers = torch.nn.ModuleList(Block(FAMILIES["qwen3_5_moe"].build(i, seed=i, backend="reference"))
                                     for i in range(2))
        checkpoint_layers(layers, mode="selective", policy=save_all_copies())
        with ReplayAudit(on_divergence="record") as result:
            loss_and_grads(layers, x, cls(_offsets(LAYOUTS[0]), static=static))
        return result

    fresh, shared = audit(LayerLocalSeqlens), audit(_SharedStatic)
    assert fresh.ok and len(fresh.regions) == 2, fresh.summary()
    assert all(r.forward_cache == r.recompute_cache for r in fresh.regions), fresh.summary()
    assert [r.verdict for r in shared.regions] == ["divergent", "aligned"], shared.summary()
    assert [(d.helper, d.forward, d.recompute) for d in shared.divergent[0].fla] == [
        ("prepare_chunk_offsets", "miss", "hit")], shared.summary()


def test_the_graphs_page_recipes_compile():
    """docs/graphs.md's code needs CUDA (the GPU tests run it); here it must at least be valid Python."""
    import re
    from pathlib import Path

    page = Path(__file__).parent.parent / "docs" / "graphs.md"
    recipes = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(recipes) == 2
    for block in recipes:
        compile(block, str(page), "exec")
