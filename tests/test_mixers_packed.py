"""Packed documents stay apart: a packed forward equals running each document alone.

Includes the case transformers gets wrong on CPU today: its Nemotron-H torch path lets state flow from
one packed document into the next.
"""

import pytest
import torch
from helpers import FAMILIES, HIDDEN, PACKED_LENS, split_documents

from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-5


def _packed_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, sum(PACKED_LENS), HIDDEN, generator=torch.Generator().manual_seed(seed))


def _per_document(mixer, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([mixer(doc) for doc in split_documents(x, PACKED_LENS)], dim=1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_packed_forward_equals_per_document(family, dtype):
    mixer = family.build(seed=1)
    x = _packed_input()
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS, dtype=dtype)
    with torch.no_grad():
        packed, alone = mixer(x, seqlens), _per_document(mixer, x)
    assert (packed - alone).abs().max().item() <= TOL


def test_packed_gradients_equal_per_document(family):
    mixer = family.build(seed=2)
    x = _packed_input(1)
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)

    def grads(run):
        mixer.zero_grad()
        xr = x.clone().requires_grad_()
        (run(xr) * torch.cos(torch.arange(x.numel()).reshape(x.shape))).sum().backward()
        return xr.grad, {n: p.grad.clone() for n, p in mixer.named_parameters()}

    dx_packed, g_packed = grads(lambda xr: mixer(xr, seqlens))
    dx_alone, g_alone = grads(lambda xr: _per_document(mixer, xr))
    assert (dx_packed - dx_alone).abs().max().item() <= TOL
    for name, grad in g_packed.items():
        scale = max(1.0, g_alone[name].abs().max().item())
        assert (grad - g_alone[name]).abs().max().item() <= TOL * scale, name


def _offsets_calls(seqlens: LayerLocalSeqlens) -> dict[str, dict]:
    """Every way a caller hands a drop-in the same packed offsets: ours, FLA's, transformers' (both forms)."""
    local = seqlens.local()
    seq_idx = torch.repeat_interleave(torch.arange(len(PACKED_LENS)), torch.tensor(PACKED_LENS))[None].int()
    return {
        "seqlens": {"seqlens": seqlens},
        "cu_seqlens (FLA)": {"cu_seqlens": local.cu_seqlens, "cu_seqlens_cpu": local.cu_seqlens_cpu},
        "cu_seq_lens_q (transformers)": {"cu_seq_lens_q": local.cu_seqlens, "cu_seq_lens_k": local.cu_seqlens,
                                         "max_length_q": max(PACKED_LENS)},
        "seq_idx (transformers)": {"seq_idx": seq_idx},
        "seqlens and cu_seq_lens_q": {"seqlens": seqlens, "cu_seq_lens_q": local.cu_seqlens},
    }


def test_every_offsets_keyword_keeps_documents_apart_and_no_keyword_mixes_them(family):
    """Issue 37: 0.4's drop-ins took cu_seqlens= (FLA's keyword) into **kwargs and ran the row as one sequence (0.88
    off the right output in a user's model). Each keyword now gives the seqlens= output bit for bit; the control
    without offsets is that one sequence, which differs from the documents run alone."""
    mixer = family.build(seed=3)
    x = _packed_input(2)
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    with torch.no_grad():
        outputs = {name: mixer(x, **kw) for name, kw in _offsets_calls(seqlens).items()}
        one_sequence, alone = mixer(x), _per_document(mixer, x)
    for name, out in outputs.items():
        assert torch.equal(out, outputs["seqlens"]), name
    assert (outputs["seqlens"] - alone).abs().max().item() <= TOL
    assert (one_sequence - alone).abs().max().item() > 1e-3


def test_each_forward_localises_its_offsets_once(family):
    class CountingSeqlens(LayerLocalSeqlens):
        __slots__ = ("calls",)

        def local(self):
            self.calls += 1
            return super().local()

    seqlens = CountingSeqlens.from_seq_lens(PACKED_LENS)
    seqlens.calls = 0
    mixer = family.build()
    x = _packed_input()
    mixer(x, seqlens)
    mixer(x, seqlens)
    assert seqlens.calls == 2


def test_batch_rows_are_independent_documents(family):
    mixer = family.build(seed=4)
    x = torch.randn(3, 20, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        batched = mixer(x)
        rows = torch.cat([mixer(x[i:i + 1]) for i in range(3)])
    assert (batched - rows).abs().max().item() <= TOL


def test_transformers_nemotron_h_leaks_state_across_packed_documents(hf_torch_path):
    """transformers' torch path ignores cu_seq_lens_q: documents after the first see earlier ones."""
    family = FAMILIES["nemotron_h"]
    ours = family.build(seed=6)
    theirs = family.build_hf()
    theirs.load_state_dict(ours.state_dict())
    x = _packed_input(3)
    cu = LayerLocalSeqlens.from_seq_lens(PACKED_LENS).local().cu_seqlens
    with torch.no_grad():
        theirs_packed = theirs(x, cu_seq_lens_q=cu, max_length_q=max(PACKED_LENS))
        theirs_alone = _per_document(theirs, x)
        ours_packed = ours(x, cu_seq_lens_q=cu, max_length_q=max(PACKED_LENS))
    assert (theirs_packed - theirs_alone).abs().max().item() > 1e-3
    assert (ours_packed - theirs_alone).abs().max().item() <= TOL


def test_zero_token_batch_gives_empty_output(family):
    mixer = family.build()
    seqlens = LayerLocalSeqlens(torch.tensor([0, 0], dtype=torch.int32))
    out = mixer(torch.zeros(1, 0, HIDDEN), seqlens)
    assert out.shape == (1, 0, HIDDEN)


def test_precomputed_chunk_indices_reach_the_ops_and_change_nothing(family):
    """With LayerLocalSeqlens' schedule the conv, the gated delta rule and Mamba2's SSD (which takes the
    schedule and its chunk offsets, ``fla_seam.simple_gla``) all skip prepare_chunk_indices (only KDA, on FLA's
    chunk_kda, takes no schedule and still asks for it); outputs are bit-equal to the run where every op
    computes the schedule itself."""
    from fla_ac_isolation.fla_seam.cache import probe_tensor_cache

    kda = family.family.name == "kimi_linear"
    mixer = family.build(seed=4)
    x = _packed_input(3)
    with torch.no_grad(), probe_tensor_cache() as probe:
        with_schedule = mixer(x, LayerLocalSeqlens.from_seq_lens(PACKED_LENS))
    asked = probe.by_helper().get("prepare_chunk_indices", {"miss": 0, "hit": 0})
    expected_lookups = 1 if kda else 0  # KDA's own lookup: FLA's chunk_kda takes no schedule
    assert asked["miss"] + asked["hit"] == expected_lookups, probe.by_helper()
    with torch.no_grad(), probe_tensor_cache() as probe:
        without = mixer(x, LayerLocalSeqlens.from_seq_lens(PACKED_LENS, chunk_indices=False))
    # conv misses, then the gated delta rule / SSD hits the conv's entry; KDA asks by keyword as FLA's chunk_kda
    # does, which FLA's cache does not match with the conv's positional entry: a second miss
    expected = {"miss": 2, "hit": 0, "bypass": 0} if kda else {"miss": 1, "hit": 1, "bypass": 0}
    assert probe.by_helper()["prepare_chunk_indices"] == expected
    assert torch.equal(with_schedule, without)
