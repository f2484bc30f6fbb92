"""swap_mixers on OLMo-core 3.0's NemotronMamba2Mixer: our packed-correct Mamba2 behind OLMo-core's interface.

OLMo-core's Mamba2 mixer is a pure-torch SSD that (a) drops ``cu_doc_lens``, so state flows across packed
documents, and (b) is not causal across its own chunks: the inter-chunk state sum runs over the wrong axis
(``olmo_core/nn/attention/recurrent.py:779``), so outputs before the last ``chunk_size``-token chunk change
when later tokens are added. It makes no FLA call, so ``isolate_seqlens`` has nothing to do there; the swap
fixes both, on the same tensors. Mixer ``chunk_size=16`` here, float64 for the exactness tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import max_grad_diff, olmo_apply_ac, olmo_batch, olmo_hybrid, olmo_step
from torch import nn

from fla_ac_isolation import ReplayAudit, restore_mixers, swap_mixers

pytest.importorskip("olmo_core")
from fla_ac_isolation.mixers import OlmoNemotronMamba2Mixer

pytestmark = pytest.mark.usefixtures("single_thread")

DOCS = ((0, 20), (20, 29), (29, 48))  # token ranges of 3 packed documents; the first spans two OLMo chunks


@pytest.fixture(scope="module")
def olmo_mixer():
    """OLMo-core's own NemotronMamba2Mixer (chunk_size 16), initialised by OLMo-core, float64."""
    from olmo_core.config import DType
    from olmo_core.nn.attention.recurrent import NemotronMamba2Config
    from olmo_core.nn.transformer.init import InitMethod

    torch.manual_seed(0)
    config = NemotronMamba2Config(ssm_state_size=16, conv_kernel=4, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                                  chunk_size=16, dtype=DType.float32)
    mixer = config.build(64, layer_idx=0, n_layers=2)
    mixer.init_weights(init_method=InitMethod.normal, d_model=64, block_idx=0, num_blocks=2, std=0.2)
    with torch.no_grad():  # constants after init: perturb so every term matters
        mixer.norm.weight.add_(0.3 * torch.randn_like(mixer.norm.weight))
        mixer.D.add_(0.2 * torch.randn_like(mixer.D))
    return mixer.double()


@pytest.fixture(scope="module")
def swapped(olmo_mixer):
    holder = nn.ModuleDict({"mixer": copy.deepcopy(olmo_mixer)})
    assert swap_mixers(holder) == ["mixer"]
    return holder["mixer"]


def _x(tokens: int = 48) -> torch.Tensor:
    return torch.randn(1, tokens, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _prefix_change(mixer, length: int) -> float:
    """How much the output of the first ``length`` tokens changes when the rest of the 48 are added."""
    x = _x()
    return (mixer(x[:, :length]) - mixer(x)[:, :length]).abs().max().item()


def _packed_vs_alone(mixer) -> float:
    x = _x()
    cu = torch.tensor([0, 20, 29, 48], dtype=torch.int32)
    packed = mixer(x, cu_doc_lens=cu, max_doc_len=20)
    alone = torch.cat([mixer(x[:, a:b]) for a, b in DOCS], dim=1)
    return (packed - alone).abs().max().item()


def test_olmo_mamba2_is_not_causal_beyond_one_chunk_and_the_swapped_mixer_is(olmo_mixer, swapped):
    assert _prefix_change(olmo_mixer, 16) == 0.0  # within its first chunk it is causal
    assert _prefix_change(olmo_mixer, 17) > 0.03  # measured 0.070: token 17 sees tokens 18..48
    assert _prefix_change(olmo_mixer, 40) > 0.1  # measured 0.199
    assert all(_prefix_change(swapped, n) < 1e-12 for n in (16, 17, 40))


def test_olmo_mamba2_mixes_packed_documents_and_the_swapped_mixer_keeps_them_apart(olmo_mixer, swapped):
    assert _packed_vs_alone(olmo_mixer) > 1.0  # measured 5.6: cu_doc_lens is dropped
    assert _packed_vs_alone(swapped) < 1e-12


def test_swap_shares_olmo_cores_tensors_keeps_its_state_dict_order_and_agrees_within_one_chunk(olmo_mixer, swapped):
    x = _x(16)
    assert type(swapped) is OlmoNemotronMamba2Mixer
    assert list(swapped.state_dict()) == list(olmo_mixer.state_dict())  # names, order
    assert {n: tuple(p.shape) for n, p in swapped.named_parameters()} == \
        {n: tuple(p.shape) for n, p in olmo_mixer.named_parameters()}
    assert (swapped(x) - olmo_mixer(x)).abs().max().item() < 1e-5  # where OLMo-core is right; 5.1e-7 measured


def test_swap_in_olmo_cores_transformer_shares_parameters_and_init_weights_stays_olmo_cores():
    model = olmo_hybrid(("mamba", "attn"))
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    reference = copy.deepcopy(model)

    assert swap_mixers(model) == ["blocks.0.attention"]
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    for m in (model, reference):  # OLMo-core's own initialisation, through the replaced module
        torch.manual_seed(3)
        m.init_weights(device=torch.device("cpu"), max_seq_len=256)
    assert all(torch.equal(p, reference.get_parameter(n)) for n, p in model.named_parameters())
    assert isinstance(model.blocks["0"].attention, type(reference.blocks["0"].attention))  # a subclass of OLMo's

    assert restore_mixers(model) == ["blocks.0.attention"]
    assert type(model.blocks["0"].attention).__name__ == "NemotronMamba2Mixer"
    assert all(p is params[n] for n, p in model.named_parameters())


def test_a_drop_in_built_directly_is_olmo_cores_mixer_with_our_forward(olmo_mixer):
    """Built with OLMo-core's own keyword arguments, initialised by OLMo-core's own code (same draws, same seed)."""
    from olmo_core.nn.attention.recurrent import NemotronMamba2Mixer

    kwargs = dict(d_model=64, layer_idx=0, ssm_state_size=16, conv_kernel=4, mamba_num_heads=4, mamba_head_dim=16,
                  n_groups=2, chunk_size=16, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
                  use_conv_bias=True, use_bias=False, layer_norm_epsilon=1e-5, dtype=torch.float32)
    torch.manual_seed(5)
    ours = OlmoNemotronMamba2Mixer(**kwargs)
    torch.manual_seed(5)
    theirs = NemotronMamba2Mixer(**kwargs)
    assert isinstance(ours, NemotronMamba2Mixer) and list(ours.state_dict()) == list(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))


def test_swapped_hybrid_transformer_keeps_documents_apart_and_matches_no_ac_under_sac():
    from fla_ac_isolation.harness.testing.olmo_core import packed_attention_on_torch_backend

    shipped = olmo_hybrid(("mamba", "attn"))
    model = copy.deepcopy(shipped)
    swap_mixers(model)
    with packed_attention_on_torch_backend():
        leak = _logits_packed_vs_alone(shipped)
        kept = _logits_packed_vs_alone(model)
        no_ac = olmo_step(model, olmo_batch(), bf16=True)
        olmo_apply_ac(model, "selected_ops+to_copy")
        with ReplayAudit(model, on_divergence="record") as audit:
            sac = olmo_step(model, olmo_batch(), bf16=True)

    assert leak > 0.1 and kept < 1e-4  # fp32 logits; the attention block keeps documents apart in both
    assert sac.error is None, sac.error
    assert audit.ok and len(audit.regions) == 2
    assert torch.equal(sac.loss, no_ac.loss) and max_grad_diff(sac, no_ac) == 0.0


def _logits_packed_vs_alone(model) -> float:
    batch = olmo_batch()
    lens = batch["doc_lens"][0].tolist()
    with torch.no_grad():
        packed = model(batch["input_ids"], doc_lens=batch["doc_lens"], max_doc_lens=batch["max_doc_lens"])[0]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        alone = torch.cat([model(batch["input_ids"][:, s:s + n])[0] for s, n in zip(starts, lens)])
    return (packed - alone).abs().max().item()


def test_packed_rows_of_a_batch_are_flattened_as_olmo_core_spans_cu_doc_lens_over_them(swapped):
    """OLMo-core's offsets span the flattened batch (B * T tokens); the swapped mixer flattens the rows."""
    x = _x()
    cu = torch.tensor([0, 20, 29, 48], dtype=torch.int32)
    rows = swapped(x.reshape(2, 24, 64), cu_doc_lens=cu, max_doc_len=20)
    assert rows.shape == (2, 24, 64)
    assert torch.equal(rows.reshape(1, 48, 64), swapped(x, cu_doc_lens=cu, max_doc_len=20))
