"""Graph-safe metadata (``fla_ac_isolation.graphs.StaticSeqlens``) on a CPU: the padded layout, the in-place
fill, fresh copies, the checks, and the mixers' numbers (reference backend) with and without padding.

FLA's kernels with padded metadata are compared under Triton's interpreter in ``test_recompute_interpret.py``;
replays of CUDA graphs in ``test_graphs_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import FAMILIES, HIDDEN, Block, loss_and_grads

from fla_ac_isolation import LayerLocalSeqlens, PackedSeqlens, ReplayAudit
from fla_ac_isolation.fla_seam.layout import chunk_indices_for, chunk_offsets_for
from fla_ac_isolation.graphs import StaticSeqlens, max_chunks_for, padded_metadata
from fla_ac_isolation.local_seqlens import LocalSeqlens
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies


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
        static.fill(_offsets(lens))
        cu, rows, starts = padded_metadata(_offsets(lens).tolist(), 200, 6)
        assert [static.cu_seqlens.data_ptr(), static.chunk_indices.data_ptr(),
                static.chunk_offsets.data_ptr()] == addresses
        assert torch.equal(static.cu_seqlens, cu.int()) and torch.equal(static.chunk_indices, rows.int())
        assert torch.equal(static.chunk_offsets, starts.int())
        assert static.seq_lens() == lens and static.num_seqs == len(lens)
        assert torch.equal(static.cu_seqlens_cpu, cu.int())
    assert static.generation == 3


def test_local_hands_each_call_fresh_copies_of_the_buffers():
    static = StaticSeqlens(200, 6, device="cpu")
    static.fill(_offsets([70, 0, 130]))
    a, b = static.local(), static.local()
    for name in ("cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "chunk_offsets"):
        first, second = getattr(a, name), getattr(b, name)
        assert first is not second and first.data_ptr() != second.data_ptr()
        assert torch.equal(first, second)
    assert a.cu_seqlens.data_ptr() != static.cu_seqlens.data_ptr()
    assert torch.equal(a.cu_seqlens, static.cu_seqlens) and a.max_seqlen == 200 and a.cp_context is None


def test_the_static_seqlens_is_what_the_layers_take_and_hands_out_nothing_before_a_fill():
    static = StaticSeqlens(200, 6, device="cpu")
    assert isinstance(static, PackedSeqlens) and static.cp is None
    for call in (static.local, static.seq_lens, lambda: static.num_seqs):
        with pytest.raises(RuntimeError) as info:
            call()
        assert str(info.value) == (
            "StaticSeqlens(num_tokens=200, max_docs=6, max_chunks=9, device=cpu, dtype=torch.int32, generation=0) "
            "holds no batch yet: call fill(cu_seqlens) before handing it to a layer"
        )
    static.fill(_offsets([100, 100]))
    assert (static.num_tokens, static.max_seqlen, static.device, static.dtype) == (200, 200, torch.device("cpu"),
                                                                                    torch.int32)
    static.check_tokens(200)
    with pytest.raises(ValueError) as info:
        static.check_tokens(199, name="x")
    assert str(info.value) == (
        "x has 199 packed tokens but the static buffers hold batches of num_tokens=200: every batch of one "
        "StaticSeqlens has its token count"
    )


def test_without_static_the_schedule_comes_with_its_chunk_offsets():
    local = LayerLocalSeqlens(_offsets([70, 0, 130])).local()
    assert torch.equal(local.chunk_offsets, chunk_offsets_for(_offsets([70, 0, 130])).int())
    assert LayerLocalSeqlens(_offsets([70]), chunk_indices=False).local().chunk_offsets is None


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((_offsets([10] * 7),), ValueError, "the batch has 7 documents but the static buffers hold at most max_docs=6: build the StaticSeqlens with a larger max_docs, or run this batch without them (eager)"),
        ((_offsets([10, 10]),), ValueError, "cu_seqlens[-1] must equal the static num_tokens=200, got 20"),
        ((_offsets([200]).to("meta"),), ValueError, "cu_seqlens must be host offsets or live on the static buffers' device cpu, got meta"),
        (([0, 200],), TypeError, "cu_seqlens must be a torch.Tensor of int32/int64 offsets, got list"),
        ((torch.tensor([0, 150, 100, 200], dtype=torch.int32),), ValueError, "cu_seqlens must be non-decreasing, but cu_seqlens[2]=100 < cu_seqlens[1]=150"),
        ((_offsets([200, 0]), _offsets([199, 1])), ValueError, "cu_seqlens_cpu must hold the same values as cu_seqlens, but cu_seqlens_cpu[1]=199 != cu_seqlens[1]=200"),
    ],
    ids=["documents", "tokens", "device", "type", "decreasing", "host-copy"],
)
def test_bad_batches_are_refused_by_fill_and_leave_the_buffers_as_they_were(args, error, message):
    """``fill`` validates as LayerLocalSeqlens does (offsets.py's checks), and writes nothing it refused."""
    static = StaticSeqlens(200, 6, device="cpu")
    static.fill(_offsets([70, 130]))
    before = [t.clone() for t in (static.cu_seqlens, static.chunk_indices, static.chunk_offsets, static.cu_seqlens_cpu)]
    with pytest.raises(error) as info:
        static.fill(*args)
    assert str(info.value) == message
    assert static.generation == 1 and static.seq_lens() == [70, 130]
    after = (static.cu_seqlens, static.chunk_indices, static.chunk_offsets, static.cu_seqlens_cpu)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


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

    def filled(lens):
        static.fill(_offsets(lens))
        return static

    for lens in LAYOUTS:
        loss_s, dx_s, grads_s = run(lambda lens=lens: filled(lens))
        loss_p, dx_p, grads_p = run(lambda lens=lens: LayerLocalSeqlens(_offsets(lens)))
        assert torch.equal(loss_s, loss_p) and torch.equal(dx_s, dx_p), lens
        assert all(torch.equal(grads_s[n], g) for n, g in grads_p.items()), lens


class _SharedStatic(StaticSeqlens):
    """The unsafe control: the static buffers themselves, one object for every call (no fresh copy)."""

    __slots__ = ()

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        return LocalSeqlens(self.cu_seqlens, self.cu_seqlens_cpu, self.num_tokens, self.chunk_indices, None,
                            self.chunk_offsets)


def test_static_offsets_keep_forward_and_recompute_alike_and_shared_ones_do_not(single_thread):
    """ReplayAudit under SAC (two checkpointed GDN blocks, reference backend): fresh copies of the static
    buffers make every recompute run the forward's ops; handing every call the buffers themselves makes the
    first region's recompute hit FLA's cache where its forward missed (prepare_chunk_offsets)."""
    x = torch.randn(1, 64, HIDDEN, generator=torch.Generator().manual_seed(0))

    def audit(cls):
        static = cls(64, 6, device="cpu")
        static.fill(_offsets(LAYOUTS[0]))
        layers = torch.nn.ModuleList(Block(FAMILIES["qwen3_5_moe"].build(i, seed=i, backend="reference"))
                                     for i in range(2))
        checkpoint_layers(layers, mode="selective", policy=save_all_copies())
        with ReplayAudit(on_divergence="record") as result:
            loss_and_grads(layers, x, static)
        return result

    fresh, shared = audit(StaticSeqlens), audit(_SharedStatic)
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
