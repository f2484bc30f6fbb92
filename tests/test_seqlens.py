"""LayerLocalSeqlens: validation of every rule, constructors, and freshness of .local()."""

import pytest
import torch

from fla_ac_isolation import LayerLocalSeqlens


def cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# ------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"cu_seqlens": [0, 3, 5]}, TypeError, r"cu_seqlens must be a torch.Tensor", id="list"),
        pytest.param({"cu_seqlens": cu(0.0, 3.0, dtype=torch.float32)}, TypeError, r"cu_seqlens must be int32 or int64.*float32", id="float"),
        pytest.param({"cu_seqlens": cu(0, 1, dtype=torch.int16)}, TypeError, r"cu_seqlens must be int32 or int64", id="int16"),
        pytest.param({"cu_seqlens": cu(0, 3, 5).reshape(1, 3)}, ValueError, r"cu_seqlens must be 1-D", id="2d"),
        pytest.param({"cu_seqlens": cu(0)}, ValueError, r"cu_seqlens must be 1-D with N \+ 1 >= 2", id="single-offset"),
        pytest.param({"cu_seqlens": cu(1, 3, 5)}, ValueError, r"cu_seqlens must start at 0, got 1", id="not-zero-start"),
        pytest.param({"cu_seqlens": cu(0, 5, 3, 9)}, ValueError, r"non-decreasing, but cu_seqlens\[2\]=3 < cu_seqlens\[1\]=5", id="decreasing"),
        pytest.param({"cu_seqlens": cu(0, 3, 5), "num_tokens": 6}, ValueError, r"cu_seqlens\[-1\] must equal the packed token count num_tokens=6 \(hidden_states.shape\[1\] when packed\), got 5; a batch padded after its documents: count the padding as one more document \(append 6 to cu_seqlens\) and mask it out of the loss$", id="token-count"),
        pytest.param({"cu_seqlens": cu(0, 3, 5), "device": "meta"}, ValueError, r"cu_seqlens must be on the activations' device meta", id="device"),
        pytest.param({"cu_seqlens": cu(0, 3, 5), "cu_seqlens_cpu": [0, 3, 5]}, TypeError, r"cu_seqlens_cpu must be a torch.Tensor", id="cpu-not-tensor"),
        pytest.param({"cu_seqlens": cu(0, 3, 5), "cu_seqlens_cpu": cu(0, 3, 5, dtype=torch.float64)}, TypeError, r"cu_seqlens_cpu must be int32 or int64", id="cpu-float"),
        pytest.param({"cu_seqlens": cu(0, 3, 5), "cu_seqlens_cpu": cu(0, 3)}, ValueError, r"cu_seqlens_cpu must have the shape of cu_seqlens \(3,\), got \(2,\)", id="cpu-shape"),
        pytest.param({"cu_seqlens": cu(0, 3, 5), "cu_seqlens_cpu": cu(0, 2, 5)}, ValueError, r"cu_seqlens_cpu must hold the same values as cu_seqlens, but cu_seqlens_cpu\[1\]=2 != cu_seqlens\[1\]=3", id="cpu-values"),
        pytest.param({"cu_seqlens": cu(0, 3, 5), "cu_seqlens_cpu": cu(0, 3, 5).to("meta")}, ValueError, r"cu_seqlens_cpu must be a CPU tensor, got device meta", id="cpu-device"),
        pytest.param({"cu_seqlens": cu(0, 3, 9), "max_seqlen": 5}, ValueError, r"max_seqlen=5 is smaller than the longest document \(6 tokens\)", id="max-small"),
        pytest.param({"cu_seqlens": cu(0, 3, 9), "max_seqlen": 6.0}, TypeError, r"max_seqlen must be an int, got float", id="max-float"),
        pytest.param({"cu_seqlens": cu(0, 3, 9).to("meta")}, ValueError, r"cu_seqlens is a meta tensor, which holds no values", id="meta"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        LayerLocalSeqlens(**kwargs)


def test_valid_offsets_with_zero_length_documents():
    s = LayerLocalSeqlens(cu(0, 5, 5, 22, 23, 64), num_tokens=64)
    assert (s.num_seqs, s.num_tokens, s.max_seqlen) == (5, 64, 41)
    assert s.seq_lens() == [5, 0, 17, 1, 41]
    # no host offsets were given: the copy validation read is handed out, a fresh object each call
    assert s.local().cu_seqlens_cpu.tolist() == [0, 5, 5, 22, 23, 64]
    assert s.local().cu_seqlens_cpu is not s.local().cu_seqlens_cpu


def test_max_seqlen_upper_bound_is_accepted_and_kept():
    assert LayerLocalSeqlens(cu(0, 3, 9), max_seqlen=16).local().max_seqlen == 16


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_from_seq_lens_matches_cumulative_sum(dtype):
    lens = [5, 0, 17, 1, 41]
    s = LayerLocalSeqlens.from_seq_lens(lens, dtype=dtype)
    expected = torch.cumsum(torch.tensor([0, *lens]), 0).to(dtype)
    local = s.local()
    assert local.cu_seqlens.dtype == dtype
    assert torch.equal(local.cu_seqlens, expected)
    assert torch.equal(local.cu_seqlens_cpu, expected)
    assert local.max_seqlen == 41


@pytest.mark.parametrize(
    ("lens", "error", "match"),
    [([], ValueError, "at least one"), ([3, -1], ValueError, r"seq_lens\[1\] must be >= 0"), ([2.5], TypeError, r"seq_lens\[0\] must be an int")],
)
def test_from_seq_lens_rejects_bad_lengths(lens, error, match):
    with pytest.raises(error, match=match):
        LayerLocalSeqlens.from_seq_lens(lens)


def test_from_position_ids_starts_a_document_at_every_zero():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    s = LayerLocalSeqlens.from_position_ids(pos)
    assert s.local().cu_seqlens.tolist() == [0, 3, 4, 8]
    assert s.seq_lens() == [3, 1, 4]


@pytest.mark.parametrize(
    ("pos", "error", "match"),
    [
        (torch.tensor([[0, 1], [0, 1]]), ValueError, "batch size 1"),
        (torch.tensor([1, 2, 0]), ValueError, "must start at 0"),
        (torch.tensor([0.0, 1.0]), TypeError, "integer tensor"),
        (torch.tensor([], dtype=torch.long), ValueError, r"T > 0"),
    ],
)
def test_from_position_ids_rejects_bad_input(pos, error, match):
    with pytest.raises(error, match=match):
        LayerLocalSeqlens.from_position_ids(pos)


def test_check_tokens_names_both_counts():
    s = LayerLocalSeqlens.from_seq_lens([4, 4])
    s.check_tokens(8)
    with pytest.raises(ValueError, match=r"hidden_states has 7 packed tokens but cu_seqlens\[-1\] = 8"):
        s.check_tokens(7)


# --------------------------------------------------------------------------------------- freshness
def test_local_returns_new_objects_with_equal_values():
    s = LayerLocalSeqlens.from_seq_lens([3, 0, 4])
    a, b = s.local(), s.local()
    assert a.cu_seqlens is not b.cu_seqlens and a.cu_seqlens_cpu is not b.cu_seqlens_cpu
    assert a.cu_seqlens.data_ptr() != b.cu_seqlens.data_ptr()  # not a view either
    assert torch.equal(a.cu_seqlens, b.cu_seqlens) and torch.equal(a.cu_seqlens_cpu, b.cu_seqlens_cpu)


def test_local_is_invisible_to_dispatch_modes():
    """Hidden from TorchDispatchMode, so a SAC policy can never save and replay the copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    s = LayerLocalSeqlens.from_seq_lens([3, 4])
    with Record():
        s.local()
        torch.ones(2).add(1)  # the mode works: this one is seen
    assert seen == [torch.ops.aten.ones.default, torch.ops.aten.add.Tensor]


def _all_ops_saved(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize(
    "policy_name", ["save-clone-alias-copies", "save-everything", "full-ac"]
)
def test_local_stays_fresh_in_recompute_under_any_policy(policy_name):
    from torch.utils.checkpoint import checkpoint

    from fla_ac_isolation.policies import any_of, sac_context_fn, save_all_copies, save_ops

    aten = torch.ops.aten
    policy = {
        "save-clone-alias-copies": any_of(
            save_all_copies(), save_ops([aten.clone.default, aten.alias.default, aten.detach.default, aten.view])
        ),
        "save-everything": _all_ops_saved,
        "full-ac": None,
    }[policy_name]
    s = LayerLocalSeqlens.from_seq_lens([3, 4])
    received = []  # keep objects alive so ids cannot be reused

    def region(x):
        local = s.local()
        received.append(local.cu_seqlens)
        return x * local.cu_seqlens.to(x.dtype).sum()

    x = torch.randn(3, requires_grad=True)
    kwargs = {"use_reentrant": False}
    if policy is not None:
        kwargs["context_fn"] = sac_context_fn(policy)
    y = checkpoint(region, x, **kwargs)
    y.sum().backward()
    assert len(received) == 2, "forward and recompute each call .local() once"
    assert received[0] is not received[1]
    assert torch.equal(received[0], received[1])
    assert torch.equal(x.grad, torch.full((3,), 10.0))  # d/dx x * (0 + 3 + 7)


def test_shared_seqlens_hands_out_one_object_for_the_unsafe_mode():
    from fla_ac_isolation.harness.modes import SharedSeqlens

    s = SharedSeqlens.from_seq_lens([3, 4])
    assert isinstance(s, LayerLocalSeqlens)
    assert s.local().cu_seqlens is s.local().cu_seqlens
    assert s.local().cu_seqlens_cpu is s.local().cu_seqlens_cpu
    assert s.local().cu_seqlens.tolist() == [0, 3, 7]


# ------------------------------------------------------------------------------ FLA chunk schedule
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "lens", [[5, 0, 17, 1, 41], [64], [65], [0, 128, 0], [1] * 7, [200, 63, 64, 129]], ids=str
)
def test_chunk_indices_equal_fla_prepare_chunk_indices(lens, dtype):
    """The precomputed schedule is FLA's own (independent oracle: fla.ops.utils.index on fresh tensors)."""
    from fla.ops.utils.index import prepare_chunk_indices

    s = LayerLocalSeqlens.from_seq_lens(lens, dtype=dtype)
    fla_rows = prepare_chunk_indices(s.local().cu_seqlens, 64, cu_seqlens_cpu=s.local().cu_seqlens_cpu)
    ours = s.local().chunk_indices
    assert ours.dtype == dtype and ours.shape == fla_rows.shape
    assert torch.equal(ours, fla_rows.to(dtype))


def test_chunk_indices_are_fresh_per_call_and_leave_fla_cache_untouched():
    from fla_ac_isolation.fla_seam.cache import probe_tensor_cache

    with probe_tensor_cache() as probe:
        s = LayerLocalSeqlens(cu(0, 70, 70, 200))
        a, b = s.local(), s.local()
    assert probe.events == []  # built without FLA's identity-memoised helpers
    assert a.chunk_indices is not b.chunk_indices
    assert a.chunk_indices.data_ptr() != b.chunk_indices.data_ptr()
    assert a.chunk_indices.tolist() == [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2]]


def test_chunk_indices_can_be_turned_off_and_shared_path_has_none():
    from fla_ac_isolation.harness.modes import SharedSeqlens

    assert LayerLocalSeqlens(cu(0, 3, 5), chunk_indices=False).local().chunk_indices is None
    assert LayerLocalSeqlens.from_seq_lens([3, 2], chunk_indices=False).local().chunk_indices is None
    assert SharedSeqlens.from_seq_lens([3, 2]).local().chunk_indices is None  # as models pass offsets today
    assert SharedSeqlens.from_seq_lens([3, 2], chunk_indices=True).local().chunk_indices.tolist() == [[0, 0], [1, 0]]
    assert "chunk_indices=off" in repr(LayerLocalSeqlens(cu(0, 3), chunk_indices=False))
    with pytest.raises(TypeError, match="chunk_indices must be a bool"):
        LayerLocalSeqlens(cu(0, 3), chunk_indices=64)


def test_chunk_indices_for_rejects_a_bad_chunk_size():
    from fla_ac_isolation.fla_seam.layout import chunk_indices_for

    assert chunk_indices_for([0, 3, 3, 9], chunk_size=4).tolist() == [[0, 0], [2, 0], [2, 1]]
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        chunk_indices_for([0, 3], chunk_size=0)


def test_from_seq_lens_given_a_tensor_suggests_tolist():
    with pytest.raises(TypeError, match=r"seq_lens\[0\] must be an int, got Tensor \(pass a tensor as seq_lens.tolist\(\)\)"):
        LayerLocalSeqlens.from_seq_lens(torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="cu_seqlens is a meta tensor"):
        LayerLocalSeqlens.from_seq_lens([3, 4], device="meta")


# ------------------------------------------------------------------- ownership, sizes, bad builders
def _clones_during(build):
    """Run ``build()`` under a dispatch mode; return its result and the number of ``aten.clone`` it ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    clones = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default:
                clones.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        out = build()
    return out, len(clones)


@pytest.mark.parametrize("with_host", [True, False], ids=["with-cu_seqlens_cpu", "device-offsets-only"])
def test_mutating_the_callers_offsets_after_construction_changes_nothing(with_host):
    offsets = cu(0, 3, 7, 7, 12)
    host = offsets.clone()
    s, clones = _clones_during(lambda: LayerLocalSeqlens(offsets, cu_seqlens_cpu=host if with_host else None))
    assert clones == (2 if with_host else 1), "one snapshot clone of each caller tensor"
    offsets[1], offsets[-1], host[1] = 1, 99, 1  # the caller reuses its buffers for the next batch
    for local in (s.local(), s.local()):
        assert local.cu_seqlens.tolist() == [0, 3, 7, 7, 12]
        assert local.cu_seqlens_cpu.tolist() == [0, 3, 7, 7, 12]
        assert local.chunk_indices.tolist() == [[0, 0], [1, 0], [3, 0]]
    assert s.seq_lens() == [3, 4, 0, 5] and s.num_tokens == 12


def test_shared_seqlens_keeps_its_own_snapshot_too():
    from fla_ac_isolation.harness.modes import SharedSeqlens

    offsets = cu(0, 3, 7)
    s = SharedSeqlens(offsets)
    offsets[1] = 5
    assert s.local().cu_seqlens.tolist() == [0, 3, 7]
    assert s.local().cu_seqlens is s.local().cu_seqlens, "still one object for every layer (the unsafe path)"


def test_int32_offsets_that_would_overflow_are_refused_naming_seq_lens():
    with pytest.raises(ValueError, match=r"seq_lens add up to 2147483648 tokens, more than torch\.int32 offsets can "
                                         r"hold \(2147483647\); pass dtype=torch\.int64"):
        LayerLocalSeqlens.from_seq_lens([2**31])
    with pytest.raises(ValueError, match=r"seq_lens add up to 2147483648 tokens"):
        LayerLocalSeqlens.from_seq_lens([2**30, 2**30])
    s = LayerLocalSeqlens.from_seq_lens([2**31], dtype=torch.int64, chunk_indices=False)
    assert s.local().cu_seqlens.tolist() == [0, 2**31]


def test_host_offsets_that_equal_the_device_offsets_only_after_an_int32_wrap_are_refused():
    """int64 offsets beyond int32 and an int32 host copy that wrapped: compared as int64, they differ."""
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu\[1\]=5 != cu_seqlens\[1\]=4294967301"):
        LayerLocalSeqlens(cu(0, 2**32 + 5, dtype=torch.int64), cu_seqlens_cpu=cu(0, 5))


@pytest.mark.parametrize(
    ("num_tokens", "error", "match"),
    [
        (5.0, TypeError, r"num_tokens must be an int \(the packed token count, hidden_states.shape\[1\]\), got float"),
        (True, TypeError, r"num_tokens must be an int .*got bool"),
        (torch.tensor(5), TypeError, r"num_tokens must be an int .*got Tensor"),
        (-1, ValueError, r"num_tokens must be >= 0, got -1"),
        (4, ValueError, r"cu_seqlens\[-1\] must equal the packed token count num_tokens=4 .*got 5"),
    ],
)
def test_num_tokens_is_checked_naming_it(num_tokens, error, match):
    with pytest.raises(error, match=match):
        LayerLocalSeqlens(cu(0, 3, 5), num_tokens=num_tokens)


def test_a_bad_last_offset_is_refused_before_the_chunk_schedule_is_allocated(monkeypatch):
    """One bad value ([0, 5, 2**33] for 10 tokens) would make a 2**27-row schedule (4.6 GB peak measured)."""
    import fla_ac_isolation.seqlens as seqlens_module

    def never(*args, **kwargs):
        raise AssertionError("the chunk schedule was built before the offsets were checked")

    monkeypatch.setattr(seqlens_module, "chunk_indices_for", never)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the packed token count num_tokens=10 "):
        LayerLocalSeqlens(cu(0, 5, 2**33, dtype=torch.int64), num_tokens=10)


def test_chunk_indices_for_refuses_decreasing_offsets_before_allocating():
    from fla_ac_isolation.fla_seam.layout import chunk_indices_for

    # the positive step alone would be 2**27 chunks: refused from the [N] counts, not met in repeat_interleave
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing, but offsets\[2\]=5 < offsets\[1\]=8589934592"):
        chunk_indices_for([0, 2**33, 5])
    with pytest.raises(ValueError, match=r"offsets must be 1-D with N \+ 1 >= 1 entries, got shape \(1, 2\)"):
        chunk_indices_for(torch.tensor([[0, 3]]))
    assert chunk_indices_for([0]).shape == (0, 2)


@pytest.mark.parametrize(
    ("pos", "match"),
    [
        ([0, 1, 2, 1, 2], r"position_ids\[3\]=1 follows position_ids\[2\]=2 \(expected 0 or 3\)"),
        ([0, 1, 5, 6], r"position_ids\[2\]=5 follows position_ids\[1\]=1 \(expected 0 or 2\)"),
        ([0, -1, 0], r"position_ids\[1\]=-1 follows position_ids\[0\]=0 \(expected 0 or 1\)"),
        ([[0, 1, 0, 2]], r"position_ids\[0\]\[3\]=2 follows position_ids\[0\]\[2\]=0 \(expected 0 or 1\)"),
        ([-1, 0], r"position_ids must start at 0 \(a document start\), got position_ids\[0\]=-1"),
    ],
    ids=["restart-at-1", "jump", "negative", "2d", "negative-start"],
)
def test_from_position_ids_refuses_positions_that_do_not_count_up_by_one(pos, match):
    rule = r"position_ids must restart at 0 and count up by 1 within a document, but "
    with pytest.raises(ValueError, match=(rule + match) if "follows" in match else match):
        LayerLocalSeqlens.from_position_ids(torch.tensor(pos))


def test_from_position_ids_refuses_a_meta_tensor():
    with pytest.raises(ValueError, match="position_ids is a meta tensor, which holds no values"):
        LayerLocalSeqlens.from_position_ids(torch.zeros(5, dtype=torch.long, device="meta"))


@pytest.mark.parametrize(
    ("seq_lens", "error", "match"),
    [
        (None, TypeError, r"seq_lens must be a sequence of document lengths \(ints\), got NoneType"),
        ("34", TypeError, r"seq_lens must be a sequence of document lengths \(ints\), got str"),
        (5, TypeError, r"seq_lens must be a sequence of document lengths \(ints\), got int"),
        ([3.0, 4], TypeError, r"seq_lens\[0\] must be an int, got float"),
        ([3, True], TypeError, r"seq_lens\[1\] must be an int, got bool"),
    ],
    ids=["none", "str", "int", "float", "bool"],
)
def test_from_seq_lens_refuses_what_is_not_a_list_of_lengths(seq_lens, error, match):
    with pytest.raises(error, match=match):
        LayerLocalSeqlens.from_seq_lens(seq_lens)


def test_from_seq_lens_accepts_numpy_integer_lengths_and_refuses_numpy_floats():
    np = pytest.importorskip("numpy")

    for lens in (np.array([3, 0, 4]), [np.int64(3), np.int32(0), np.uint8(4)]):
        s = LayerLocalSeqlens.from_seq_lens(lens)
        assert s.local().cu_seqlens.tolist() == [0, 3, 3, 7] and s.seq_lens() == [3, 0, 4]
        assert all(type(n) is int for n in s.seq_lens())
    with pytest.raises(TypeError, match=r"seq_lens\[0\] must be an int, got float64"):
        LayerLocalSeqlens.from_seq_lens(np.array([3.0, 4.0]))


def test_from_seq_lens_refuses_a_device_this_process_cannot_use():
    if torch.cuda.is_available():
        bad, match = f"cuda:{torch.cuda.device_count()}", r"CUDA device\(s\) are visible"
    else:
        bad, match = "cuda", r"device='cuda' but CUDA is not available here \(torch.cuda.is_available\(\) is False\)"
    with pytest.raises(ValueError, match=match):
        LayerLocalSeqlens.from_seq_lens([3, 4], device=bad)
    with pytest.raises(ValueError, match=r"device must be a torch.device or a device string such as 'cuda:0', got 'gpu'"):
        LayerLocalSeqlens.from_seq_lens([3, 4], device="gpu")
