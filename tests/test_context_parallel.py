"""Context parallelism without a process group or a kernel: CPConfig, batch sharding in FLA's layouts,
CPSeqlens metadata and freshness, the bad-input errors, the modes, and the regression's
CP spec, data, CLI and verdicts. Kernels on two gloo ranks: ``test_context_parallel_gloo.py``.

Independent references: FLA's own ``get_cp_cu_seqlens`` (metadata, with ``world_size``/``rank``), and
document boundaries worked out here from the global offsets (sharding).
"""

import argparse
import dataclasses
import random

import pytest
import torch
from fla.ops.cp.context import get_cp_cu_seqlens
from helpers import FAMILIES
from torch.utils._python_dispatch import TorchDispatchMode

from fla_ac_isolation import LayerLocalSeqlens, PackedSeqlens
from fla_ac_isolation.fla_seam.cache import probe_tensor_cache
from fla_ac_isolation.harness.modes import MODE_NAMES, FieldCPSeqlens, SharedCPSeqlens, SharedSeqlens, get_mode
from fla_ac_isolation.parallel import CPConfig, CPSeqlens, cp_token_index, shard_packed_batch, unshard

FLA_CP_METADATA = get_cp_cu_seqlens.__wrapped__  # FLA's function behind build_cp_context, without its cache


def cp(layout="contiguous", world_size=2, rank=0, conv_kernel_size=4):
    return CPConfig(layout=layout, world_size=world_size, rank=rank, conv_kernel_size=conv_kernel_size)


def offsets(lens):
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


# ------------------------------------------------------------------------------------------ CPConfig
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"layout": "ring", "world_size": 2, "rank": 0}, ValueError, "CPConfig.layout must be one of ('contiguous', 'zigzag'), got 'ring'"),
        ({}, ValueError, "CPConfig needs the CP process group (group=...) or, for metadata only, world_size= and rank=; got group=None, world_size=None, rank=None"),
        ({"world_size": 2, "rank": 2}, ValueError, "CPConfig.rank must be in [0, world_size=2), got 2"),
        ({"world_size": 0, "rank": 0}, ValueError, "CPConfig.world_size must be >= 1, got 0"),
        ({"world_size": 2.0, "rank": 0}, TypeError, "CPConfig.world_size must be an int, got float"),
        ({"world_size": 2, "rank": 0, "conv_kernel_size": 0}, ValueError, "CPConfig.conv_kernel_size must be >= 1, got 0"),
        ({"group": object(), "world_size": 2, "rank": 0}, ValueError, "CPConfig.group is given but torch.distributed is not initialised in this process"),
    ],
)
def test_cp_config_errors_name_the_field(kwargs, error, message):
    with pytest.raises(error) as info:
        CPConfig(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("config", "tokens", "message"),
    [
        (cp("contiguous", 4), 130, "cu_seqlens[-1] = 130 packed tokens cannot be split by the contiguous CP layout over 4 ranks: it needs a positive multiple of world_size = 4; pad the batch to 132 tokens (e.g. with a document whose labels are all ignored)"),
        (cp("zigzag", 4), 132, "cu_seqlens[-1] = 132 packed tokens cannot be split by the zigzag CP layout over 4 ranks: it needs a positive multiple of 2 * world_size = 8; pad the batch to 136 tokens (e.g. with a document whose labels are all ignored)"),
        (cp("zigzag", 4), 6, "cu_seqlens[-1] = 6 packed tokens cannot be split by the zigzag CP layout over 4 ranks: it needs a positive multiple of 2 * world_size = 8; pad the batch to 8 tokens (e.g. with a document whose labels are all ignored)"),
        (cp("zigzag", 4), 16, "each CP interval of the zigzag layout holds 2 tokens (cu_seqlens[-1] = 16 over 8 intervals), fewer than conv_kernel_size - 1 = 3: FLA's CP conv takes its history from the previous interval only; use fewer ranks or a longer batch"),
    ],
)
def test_token_counts_that_do_not_split_are_refused_with_the_padding_to_use(config, tokens, message):
    with pytest.raises(ValueError) as info:
        config.check_num_tokens(tokens)
    assert str(info.value) == message


@pytest.mark.parametrize("tokens", [32.0, True, "32", torch.tensor(32.0)], ids=["float", "bool", "str", "float-tensor"])
def test_token_counts_that_are_not_integers_are_refused(tokens):
    with pytest.raises(TypeError, match=r"^num_tokens must be an int \(a packed token count\), got "):
        cp_token_index(tokens, cp("contiguous", 1))
    with pytest.raises(TypeError, match=r"^cu_seqlens\[-1\] must be an int \(a packed token count\), got "):
        cp("contiguous", 1).check_num_tokens(tokens)
    assert cp_token_index(torch.tensor(16), cp("zigzag", 2, 1)).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # 0-d int tensor


# ------------------------------------------------------------------------------------------ sharding
def test_token_index_follows_flas_layouts():
    assert cp_token_index(16, cp("contiguous", 2, 1)).tolist() == list(range(8, 16))
    assert cp_token_index(16, cp("zigzag", 2, 0, None)).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_token_index(16, cp("zigzag", 2, 1, None)).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def _expected_local_offsets(lens, world_size, rank, layout):
    """Rank-local document boundaries worked out here: a cut wherever the document id changes between
    consecutive local tokens, and between the two zigzag parts."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    index = cp_token_index(doc.numel(), cp(layout, world_size, rank, None))
    local = doc[index].tolist()
    part = len(local) // (2 if layout == "zigzag" else 1)
    cuts = [i for i in range(1, len(local)) if local[i] != local[i - 1] or i == part]
    return [0, *cuts, len(local)]


def _random_lens(rng, total):
    lens, left = [], total
    while left:
        n = min(left, rng.choice([0, 1, 2, 3, rng.randint(1, total)]))
        lens.append(n)
        left -= n
    lens.insert(rng.randrange(len(lens) + 1), 0)  # a zero-length document anywhere, also first or last
    return lens


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_local_offsets_are_flas_and_match_the_documents_each_rank_holds(layout):
    rng = random.Random(len(layout))
    for world_size in (1, 2, 3, 4):
        parts = world_size * (2 if layout == "zigzag" else 1)
        for _ in range(15):
            lens = _random_lens(rng, parts * rng.randint(1, 24))
            for rank in range(world_size):
                shard = shard_packed_batch({}, offsets(lens), cp(layout, world_size, rank, None))
                theirs = FLA_CP_METADATA(torch.tensor(offsets(lens)), cu_seqlens_cpu=torch.tensor(offsets(lens)),
                                         world_size=world_size, rank=rank, layout=layout)
                assert shard.cu_seqlens.tolist() == theirs.cu_seqlens_cpu.tolist()
                assert shard.cu_seqlens.tolist() == _expected_local_offsets(lens, world_size, rank, layout), (lens, rank)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_then_unshard_is_the_identity_and_positions_continue_across_ranks(layout):
    lens = [5, 0, 27, 0]
    ids = torch.arange(32)[None] * 10
    hidden = torch.randn(1, 32, 3)
    shards = [shard_packed_batch({"ids": ids, "hidden": hidden}, offsets(lens), cp(layout, 4, r, None)) for r in range(4)]
    assert torch.equal(unshard([s.tensors["ids"] for s in shards], layout), ids)
    assert torch.equal(unshard([s.tensors["hidden"] for s in shards], layout), hidden)
    positions = unshard([s.position_ids for s in shards], layout)
    assert positions.tolist() == [[0, 1, 2, 3, 4, *range(27)]], "a document continues its count on the next rank"
    assert all(s.num_tokens == 32 and s.tensors["ids"].shape == (1, 8) for s in shards)


def test_unshard_is_differentiable():
    parts = [torch.randn(1, 6, 3, requires_grad=True) for _ in range(2)]
    (unshard(parts, "zigzag") * torch.arange(12.0)[None, :, None]).sum().backward()
    assert parts[0].grad[0, :, 0].tolist() == [0, 1, 2, 9, 10, 11]
    assert parts[1].grad[0, :, 0].tolist() == [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: shard_packed_batch({"ids": torch.zeros(1, 6)}, [0, 8], cp()), ValueError, "tensors['ids'] must have cu_seqlens_cpu[-1] = 8 entries along dim 1, got shape (1, 6)"),
        (lambda: shard_packed_batch({"ids": [1, 2]}, [0, 8], cp()), TypeError, "tensors['ids'] must be a torch.Tensor, got list"),
        (lambda: shard_packed_batch({}, [0, 9, 8], cp()), ValueError, "cu_seqlens_cpu must be 1-D, non-decreasing offsets starting at 0 (N + 1 >= 2 entries), got [0, 9, 8]"),
        (lambda: shard_packed_batch({}, [0, 8], "zigzag"), TypeError, "cp must be a fla_ac_isolation.parallel.CPConfig, got str"),
        (lambda: shard_packed_batch({}, [0, 130], cp("contiguous", 4)), ValueError, "cu_seqlens[-1] = 130 packed tokens cannot be split by the contiguous CP layout over 4 ranks: it needs a positive multiple of world_size = 4; pad the batch to 132 tokens (e.g. with a document whose labels are all ignored)"),
        (lambda: unshard([torch.zeros(1, 3), torch.zeros(1, 3)], "zigzag"), ValueError, "zigzag shards hold two equal parts, got 3 tokens per shard"),
        (lambda: unshard([torch.zeros(1, 4), torch.zeros(1, 2)]), ValueError, "every shard must hold the same number of tokens along dim 1, got [4, 2]"),
        (lambda: shard_packed_batch({}, [0.0, 2.5, 8.0], cp()), TypeError, "cu_seqlens_cpu must hold integer offsets, got dtype torch.float32"),
        (lambda: shard_packed_batch({}, torch.tensor([False, True]), cp()), TypeError, "cu_seqlens_cpu must hold integer offsets, got dtype torch.bool"),
        (lambda: shard_packed_batch({}, None, cp()), TypeError, "cu_seqlens_cpu must be a list or host tensor of ints, got NoneType"),
        (lambda: shard_packed_batch([torch.zeros(1, 8)], [0, 8], cp()), TypeError, "tensors must be a mapping of names to packed tensors, e.g. {'input_ids': ids}, got list"),
        (lambda: shard_packed_batch({"ids": torch.zeros(1, 8)}, [0, 8], cp(), dim=1.0), TypeError, "dim must be an int (the token dimension), got float"),
        (lambda: shard_packed_batch({"ids": torch.zeros(1, 8)}, [0, 8], cp(), dim=-3), ValueError, "tensors['ids'] must have cu_seqlens_cpu[-1] = 8 entries along dim -3, got shape (1, 8)"),
        (lambda: shard_packed_batch({"ids": torch.zeros(1, 8)}, [0, 2**40], cp()), ValueError, "tensors['ids'] must have cu_seqlens_cpu[-1] = 1099511627776 entries along dim 1, got shape (1, 8)"),
        (lambda: unshard(torch.zeros(2, 1, 4)), TypeError, "shards must be a list of tensors, one per CP rank, got Tensor"),
        (lambda: unshard([[0, 1], [2, 3]]), TypeError, "shards[0] must be a torch.Tensor, got list"),
        (lambda: unshard([torch.zeros(1, 4), torch.zeros(4)]), ValueError, "shards[1] has no dim 1 (the token dimension), got shape (4,)"),
        (lambda: unshard([torch.zeros(1, 4)], dim=True), TypeError, "dim must be an int (the token dimension), got bool"),
    ],
    ids=["length", "tensor-type", "offsets", "cp-type", "split", "zigzag-odd", "uneven", "float-offsets", "bool-offsets",
         "no-offsets", "tensors-list", "dim-float", "dim-out-of-range", "offsets-beyond-tensors", "shards-tensor",
         "shard-type", "shard-without-dim", "unshard-dim-bool"],
)
def test_sharding_errors(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


# ---------------------------------------------------------------------------------------- CPSeqlens
LENS = [10, 0, 20, 70, 28]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("rank", [0, 1])
def test_cp_context_is_flas_own(layout, rank):
    s = CPSeqlens.from_seq_lens(LENS, cp=cp(layout, 2, rank))
    host = torch.tensor(offsets(LENS))
    theirs = FLA_CP_METADATA(host, cu_seqlens_cpu=host, world_size=2, rank=rank, conv1d_kernel_size=4, layout=layout)
    ours = s.local().cp_context
    assert type(ours) is type(theirs)
    for field in dataclasses.fields(theirs):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), field.name
    assert s.local().max_seqlen == max(torch.diff(theirs.cu_seqlens_cpu).tolist())
    assert s.cp.layout == layout and s.num_tokens == 128


def test_cp_seqlens_is_a_sibling_that_describes_the_whole_batch():
    s = CPSeqlens.from_seq_lens(LENS, dtype=torch.int64, cp=cp("zigzag", 2, 1))
    assert isinstance(s, PackedSeqlens) and not isinstance(s, LayerLocalSeqlens)
    assert (s.num_seqs, s.num_tokens, s.max_seqlen, s.seq_lens()) == (5, 128, 70, LENS)
    assert (s.device, s.dtype) == (torch.device("cpu"), torch.int64)
    assert s.local(whole_batch=True).cu_seqlens.dtype == torch.int64, "the whole batch keeps its dtype"
    assert s.local().cu_seqlens.dtype == torch.int32, "FLA's rank-local offsets are int32"
    assert repr(s) == ("CPSeqlens(num_seqs=5, num_tokens=128, max_seqlen=70, device=cpu, layout='zigzag', rank=1/2, "
                       "local_tokens=64)")
    assert LayerLocalSeqlens.from_seq_lens(LENS).cp is None


def test_local_hands_each_layer_a_fresh_context_holding_its_fresh_offsets():
    s = CPSeqlens.from_seq_lens(LENS, cp=cp("zigzag"))
    a, b = s.local(), s.local()
    assert a.cp_context is not b.cp_context
    assert a.cp_context.cu_seqlens is a.cu_seqlens and a.cp_context.cu_seqlens_cpu is a.cu_seqlens_cpu
    tensors = [a.cu_seqlens, a.cu_seqlens_cpu, a.chunk_indices]
    assert all(x is not y for x in tensors for y in [b.cu_seqlens, b.cu_seqlens_cpu, b.chunk_indices])
    assert a.cu_seqlens.dtype == torch.int32 and a.cu_seqlens.tolist() == [0, 10, 30, 32, 36, 64]
    assert a.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [3, 0], [4, 0]], "the RANK-LOCAL chunk schedule"
    assert a.cp_context.is_first_by_part == b.cp_context.is_first_by_part == (True, False)


def test_cp_metadata_is_built_without_dispatch_ops_or_fla_cache_entries():
    """Construction (once per batch) and .local() (per layer) run no op a SAC policy or the audit could see,
    and never consult FLA's identity cache (FLA's function is called undecorated)."""
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    s = CPSeqlens.from_seq_lens(LENS, cp=cp("zigzag"))
    with probe_tensor_cache() as probe:
        s = CPSeqlens.from_seq_lens(LENS, cp=cp("zigzag"))
        with Record():
            s.local(), s.local()
    assert seen == [] and probe.events == []


def test_whole_batch_gives_fresh_global_offsets_without_a_context():
    s = CPSeqlens.from_seq_lens(LENS, cp=cp())
    whole = s.local(whole_batch=True)
    assert whole.cp_context is None and whole.cu_seqlens.tolist() == offsets(LENS)
    assert whole.cu_seqlens is not s.local(whole_batch=True).cu_seqlens
    assert whole.max_seqlen == 70


def test_check_tokens_expects_this_ranks_share():
    s = CPSeqlens.from_seq_lens(LENS, cp=cp("zigzag", 2, 1))
    s.check_tokens(64)
    with pytest.raises(ValueError) as info:
        s.check_tokens(128)
    assert str(info.value) == (
        "hidden_states has 128 packed tokens but CP rank 1 of 2 holds 64 of the cu_seqlens[-1] = 128 tokens "
        "(zigzag layout): shard the batch with fla_ac_isolation.parallel.shard_packed_batch"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"cp": "zigzag"}, TypeError, "cp must be a fla_ac_isolation.parallel.CPConfig, got str"),
        ({}, TypeError, "CPSeqlens.__init__() missing 1 required keyword-only argument: 'cp'"),
        ({"cp": cp("zigzag", 4)}, ValueError, "cu_seqlens[-1] = 130 packed tokens cannot be split by the zigzag CP layout over 4 ranks: it needs a positive multiple of 2 * world_size = 8; pad the batch to 136 tokens (e.g. with a document whose labels are all ignored)"),
        ({"cp": cp("contiguous", 2), "meta": True}, ValueError, "CPSeqlens needs the host offsets cu_seqlens_cpu when cu_seqlens is on meta: FLA's CP metadata is computed on the host, and reading device offsets there is a device-to-host sync; pass cu_seqlens_cpu= (or build with CPSeqlens.from_seq_lens)"),
        ({"cp": cp("contiguous", 2), "num_tokens": 65}, ValueError, "cu_seqlens[-1] must equal num_tokens=65, got 130: under CP, both count the WHOLE packed batch of all 2 CP ranks, not this rank's hidden_states.shape[1]"),
        ({"cp": cp("contiguous", 2), "num_tokens": 65.0}, TypeError, "num_tokens must be an int (the packed token count, hidden_states.shape[1]), got float"),
        ({"cp": cp("contiguous", 2), "max_seqlen": 50}, ValueError, "max_seqlen=50 is smaller than the longest document (80 tokens)"),
    ],
)
def test_cp_bad_input_is_refused_at_construction(kwargs, error, message):
    cu = torch.tensor(offsets([50, 80]), dtype=torch.int32)
    if kwargs.pop("meta", False):
        cu = cu.to("meta")
    with pytest.raises(error) as info:
        CPSeqlens(cu, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("keyword", ["cp", "static"])
def test_layer_local_seqlens_takes_neither_cp_nor_static(keyword):
    """0.5 made CP and CUDA graphs siblings (CPSeqlens, graphs.StaticSeqlens), not arguments."""
    with pytest.raises(TypeError) as info:
        LayerLocalSeqlens(torch.tensor(offsets([50, 78])), **{keyword: cp()})
    assert str(info.value) == f"LayerLocalSeqlens.__init__() got an unexpected keyword argument '{keyword}'"


def test_a_rank_with_fewer_tokens_than_the_conv_history_is_refused():
    """FLA's contiguous CP conv reads its history from the previous rank only and does not check this."""
    with pytest.raises(ValueError) as info:
        CPSeqlens.from_seq_lens([4, 4], cp=cp("contiguous", 4))
    assert str(info.value) == (
        "each CP interval of the contiguous layout holds 2 tokens (cu_seqlens[-1] = 8 over 4 intervals), fewer than "
        "conv_kernel_size - 1 = 3: FLA's CP conv takes its history from the previous interval only; use fewer "
        "ranks or a longer batch"
    )


# ------------------------------------------------------------------------------ mixers and backends
def _local_hidden(tokens=64, hidden=64):
    return torch.randn(1, tokens, hidden)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_the_reference_backend_refuses_cp(backend):
    mixer = FAMILIES["qwen3_5_moe"].build(backend=backend)
    with pytest.raises(NotImplementedError) as info:
        mixer(_local_hidden(), CPSeqlens.from_seq_lens(LENS, cp=cp()))
    chosen = "backend='reference'" if backend == "reference" else "backend='auto' (which picks 'reference' for cpu tensors)"
    assert str(info.value) == (
        f"context parallelism needs FLA's CP kernels, but {chosen} has none: the reference backend computes whole "
        "sequences only; use backend='fla' (CUDA, or a CPU under TRITON_INTERPRET=1 with the harness's interpreter "
        "backend fla_ac_isolation/harness/fla_seam/interpreter.py)"
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (cp(conv_kernel_size=2), "CPConfig.conv_kernel_size must be at least this layer's conv width (4), got 2: FLA's CP conv needs it, and every rank must hold conv_kernel_size - 1 tokens of history"),
        (cp(), "seqlens was built with CPConfig(world_size=..., rank=...) and no group: that describes the layout only; FLA's CP kernels need the CP process group (CPConfig(group=...))"),
    ],
)
def test_gdn_mixer_checks_the_cp_config_before_any_kernel(config, message):
    mixer = FAMILIES["qwen3_8"].build(backend="fla")
    with pytest.raises(ValueError) as info:
        mixer(_local_hidden(), CPSeqlens.from_seq_lens(LENS, cp=config))
    assert str(info.value) == message


def test_mamba2_head_parallel_needs_heads_divisible_by_the_cp_degree():
    from fla_ac_isolation.parallel.mamba2_cp import head_shard

    mixer = FAMILIES["nemotron_h"].build()  # 4 heads, 2 B/C groups
    with pytest.raises(ValueError) as info:
        head_shard(mixer, cp(world_size=3))
    assert str(info.value) == (
        "head-parallel context parallelism needs mamba_num_heads (4) divisible by the CP degree (3): each rank "
        "runs whole sequences for mamba_num_heads / W heads"
    )
    channels, heads, groups = head_shard(mixer, cp(world_size=2, rank=1))
    assert heads.tolist() == [2, 3] and groups == 1
    # x of heads 2, 3 (16 channels each), B then C of group 1 (16 each), then dt of heads 2, 3
    assert channels[1].tolist() == [*range(32, 64), *range(80, 96), *range(112, 128), 128 + 2, 128 + 3]


def test_mamba2_head_parallel_needs_the_process_group():
    mixer = FAMILIES["nemotron_h"].build()
    with pytest.raises(ValueError) as info:
        mixer(_local_hidden(), CPSeqlens.from_seq_lens(LENS, cp=cp()))
    assert str(info.value) == (
        "seqlens was built with CPConfig(world_size=..., rank=...) and no group: head-parallel context parallelism "
        "needs the CP process group for its all-to-alls (CPConfig(group=...))"
    )


# ---------------------------------------------------------------------------------------------- modes
def test_shared_mode_hands_every_layer_one_context_and_field_needs_cp():
    shared = SharedCPSeqlens.from_seq_lens(LENS, cp=cp())
    assert shared.local().cp_context is shared.local().cp_context
    assert shared.local().cu_seqlens is shared.local().cu_seqlens
    assert shared.local(whole_batch=True).cu_seqlens is shared.local(whole_batch=True).cu_seqlens
    assert shared.local(whole_batch=True).cu_seqlens.tolist() == offsets(LENS)
    assert shared.local().chunk_indices is None, "models sharing one object do not precompute FLA's schedule"
    with pytest.raises(ValueError) as info:
        FieldCPSeqlens.from_seq_lens(LENS, cp=cp())
    assert str(info.value) == (
        "mode 'field' builds FLA's CP context inside each layer and needs CPConfig(group=...): FLA's "
        "build_cp_context takes the CP process group"
    )
    with pytest.raises(ValueError) as info:
        get_mode("field").from_seq_lens(LENS)
    assert str(info.value) == (
        "mode 'field' builds FLA's CP context inside each layer: it is meaningful only under context parallelism "
        "(cp=CPConfig(group=...))"
    )
    assert {name: get_mode(name).cp_seqlens_class for name in (*MODE_NAMES, "field")} == {
        "no-ac": SharedCPSeqlens, "shared": SharedCPSeqlens, "isolated": CPSeqlens, "global-disable": SharedCPSeqlens,
        "field": FieldCPSeqlens}
    assert type(get_mode("isolated").from_seq_lens(LENS, cp=cp())) is CPSeqlens
    assert type(get_mode("shared").from_seq_lens(LENS)) is SharedSeqlens
    assert get_mode("field").checkpointed
    assert MODE_NAMES == ("no-ac", "shared", "isolated", "global-disable"), "the four modes of every check"


# ------------------------------------------------------------------------------- the regression's CP
def test_cp_batch_is_one_global_batch_laid_out_for_the_layout():
    from fla_ac_isolation.harness.regression.data import cp_batch

    assert cp_batch(0, layout="contiguous").seq_lens == (10, 0, 30, 88)
    assert cp_batch(0, layout="zigzag").seq_lens == cp_batch(1, layout="contiguous").seq_lens == (10, 0, 20, 70, 28)
    padded = cp_batch(0, multiple=12)
    assert padded.seq_lens == (10, 0, 30, 88, 4) and padded.num_tokens == 132
    assert padded.labels[0, -4:].tolist() == [-100] * 4, "the padding document carries no loss"
    assert padded.num_targets_global == 9 + 29 + 87
    assert torch.equal(padded.labels[0, :9], padded.input_ids[0, 1:10]), "next-token labels, shifted before sharding"


def test_a_short_qwen_decoder_still_ends_with_attention():
    from fla_ac_isolation.harness.regression.model import _qwen_layer_types

    assert _qwen_layer_types(2) == ["linear_attention", "full_attention"]
    assert _qwen_layer_types(4) == ["linear_attention"] * 3 + ["full_attention"]
    assert _qwen_layer_types(1) == ["linear_attention"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cp": 2, "ep": 4, "backend": "fla"}, "ep (4) must be 1 or equal cp (2): the EP ranks are borrowed from the 2 CP ranks (one process per CP rank)"),
        ({"cp": 2, "ep": 1, "backend": "reference"}, "backend must be 'fla' for context parallelism with qwen3_5_moe: its mixers need FLA's CP kernels, and backend='reference' on cpu runs the reference backend, which has none"),
        ({"cp": 2, "cp_layout": "ring", "backend": "fla"}, "cp_layout must be one of ('contiguous', 'zigzag'), got 'ring'"),
        ({"modes": ("isolated", "field")}, "modes must be a non-empty subset of ('no-ac', 'shared', 'isolated', 'global-disable') (field needs cp > 1), got ('isolated', 'field')"),
        ({"cp": 0}, "cp must be an int >= 1, got 0"),
    ],
)
def test_regression_spec_cp_errors(change, message):
    from fla_ac_isolation.harness.regression.spec import RegressionSpec

    with pytest.raises(ValueError) as info:
        RegressionSpec(**change).validate()
    assert str(info.value) == message


def test_regression_modes_under_cp():
    from fla_ac_isolation.harness.regression.spec import RegressionSpec

    assert RegressionSpec(cp=2, backend="fla").ordered_modes == (
        "no-ac-cp1", "no-ac", "shared", "isolated", "global-disable", "field")
    assert RegressionSpec(model="nemotron_h", cp=2).ordered_modes == (
        "no-ac-cp1", "no-ac", "shared", "isolated", "global-disable"), "its head-parallel Mamba2 builds no CP context"
    assert RegressionSpec().ordered_modes == ("no-ac", "shared", "isolated", "global-disable")
    assert RegressionSpec(cp=2, ep=2, backend="fla").world == RegressionSpec(cp=2, ep=1, backend="fla").world == 2


def _cli_spec(*argv):
    from fla_ac_isolation.harness.cli import regress

    parser = argparse.ArgumentParser()
    regress.add_arguments(parser)
    return regress.spec_from_arguments(parser.parse_args(list(argv)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults")
def test_cli_cp_on_cpu_runs_flas_kernels_under_the_interpreter_backend():
    from fla_ac_isolation.harness.regression.spec import RegressionSpec

    spec = _cli_spec("--cp", "2")
    assert (spec.cp, spec.ep, spec.cp_layout, spec.steps, spec.hidden_size) == (2, 1, "contiguous", 2, 64)
    assert spec.backend == "fla" and spec.kernels == "interpreter" and spec.rank_env == (("TRITON_INTERPRET", "1"),)
    assert spec.rank_setup is None and spec.env == ()
    assert spec == RegressionSpec(cp=2), "the Python API resolves the same run as the command"
    assert _cli_spec("--cp", "2", "--ep", "2", "--layout", "zigzag").ep == 2
    nemotron = _cli_spec("--cp", "2", "--model", "nemotron_h")
    assert (nemotron.backend, nemotron.kernels, nemotron.rank_env) == ("auto", "native", ()), \
        "head-parallel: reference ops"
    assert _cli_spec().ep == 2 and _cli_spec().cp == 1


def test_launcher_spawns_ranks_with_the_environment_of_the_spec():
    import os

    from fla_ac_isolation.harness.regression.processes import environment_variables, mp_context

    assert mp_context("cpu", (("TRITON_INTERPRET", "1"),)).get_start_method() == "spawn"
    assert mp_context("cpu").get_start_method() == "forkserver"
    before = os.environ.get("FLA_AC_TEST_VARIABLE")
    with environment_variables((("FLA_AC_TEST_VARIABLE", "1"),)):
        assert os.environ["FLA_AC_TEST_VARIABLE"] == "1"
    assert os.environ.get("FLA_AC_TEST_VARIABLE") == before


def _cp_result(no_ac_cp1_diff: float, cp1_error: str | None = None):
    from fla_ac_isolation.harness.regression.spec import ModeResult, RegressionResult, RegressionSpec

    base = {"losses": [2.0, 1.5], "grad_norms": [1.0, 0.9], "idle_experts": [0, 0]}
    cp1 = ModeResult("no-ac-cp1", **base, grad_diffs=[None, None], ref_grad_max=[None, None], error=cp1_error)
    vs_cp1 = {"cp1_grad_diffs": [no_ac_cp1_diff, 0.5], "cp1_ref_grad_max": [2.0, 2.0]}  # step 1 is not judged
    no_ac = ModeResult("no-ac", **base, grad_diffs=[None, None], ref_grad_max=[None, None], **vs_cp1)
    isolated = ModeResult("isolated", **base, grad_diffs=[0.0, 0.0], ref_grad_max=[1.0, 1.0], **vs_cp1)
    field = ModeResult("field", error="rank 1: RuntimeError: Autograd not support dtype: Long")
    return RegressionResult(RegressionSpec(cp=2, steps=2, backend="fla"),
                            {m.mode: m for m in (cp1, no_ac, isolated, field)})


def test_cp_verdicts_judge_against_the_run_without_cp():
    from fla_ac_isolation.harness.regression import report

    ok = _cp_result(2e-6)
    found = report.verdicts(ok)
    assert found["no-ac-cp1"].text == "reference (one rank, no CP, no AC)"
    assert found["no-ac"].text == "reference; vs CP=1 1.0e-06 <= 0.0001"
    assert found["isolated"].text == "matches (bit for bit); vs CP=1 1.0e-06 <= 0.0001"
    assert report.fault_reproduced(ok, mode="field") is True
    assert report.exit_code(ok) == 0, "the unsafe field mode never changes the exit code"

    off = _cp_result(1e-3)
    assert report.verdicts(off)["isolated"].text == "DIVERGED from CP=1 by 5.00e-04 (grad)"
    assert report.exit_code(off) == 1

    no_reference = _cp_result(2e-6, cp1_error="RuntimeError: boom")
    assert report.verdicts(no_reference)["no-ac"].text == "no reference (no-ac-cp1 failed)"
    assert report.exit_code(no_reference) == 1
