"""Bad input reaches a clear error that names the argument, raised before any computation; and the drop-ins read
the offsets under every name FLA, transformers and we give them, refusing any other (issue 37).

What the replaced class itself refuses at construction (a missing config field, a bad ``layer_idx``) it still
refuses: a drop-in is constructed by the replaced class's own ``__init__``."""

import pytest
import torch
from helpers import HIDDEN, PACKED_LENS, nemotron_h_config, qwen3_5_moe_config

from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

T = sum(PACKED_LENS)
CU = [0, 5, 5, 22, 23, 64]  # PACKED_LENS' offsets


@pytest.fixture
def mixer(core_family):
    return core_family.build()


def _cu(values=CU):
    return torch.tensor(values, dtype=torch.int32)


def test_wrong_hidden_size(mixer):
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, hidden_size=64\], got shape \(1, 8, 65\)"):
        mixer(torch.randn(1, 8, HIDDEN + 1))


def test_wrong_rank(mixer):
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, hidden_size=64\], got shape \(8, 64\)"):
        mixer(torch.randn(8, HIDDEN))


def test_integer_hidden_states(mixer):
    with pytest.raises(TypeError, match=r"hidden_states must be a floating-point tensor, got dtype torch\.int64"):
        mixer(torch.ones(1, 8, HIDDEN, dtype=torch.long))


def test_token_count_not_matching_the_offsets(mixer):
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    with pytest.raises(ValueError, match=r"hidden_states has 63 packed tokens but cu_seqlens\[-1\] = 64"):
        mixer(torch.randn(1, T - 1, HIDDEN), seqlens)
    for name in ("cu_seqlens", "cu_seq_lens_q"):
        with pytest.raises(ValueError, match=rf"{name} is not valid packed-sequence offsets: cu_seqlens\[-1\] must "
                                             r"equal the packed token count num_tokens=70"):
            mixer(torch.randn(1, 70, HIDDEN), **{name: _cu([0, 5, 64])})


def test_batch_above_one_with_offsets(mixer):
    with pytest.raises(ValueError, match=r"packed input \(seqlens given\) must have batch size 1, got hidden_states "
                                         r"of shape \(2, 4, 64\)"):
        mixer(torch.randn(2, 4, HIDDEN), LayerLocalSeqlens.from_seq_lens([4, 4]))


def test_float_and_decreasing_offsets(mixer):
    with pytest.raises(TypeError, match=r"cu_seq_lens_q is not valid packed-sequence offsets: .*int32 or int64"):
        mixer(torch.randn(1, T, HIDDEN), cu_seq_lens_q=torch.tensor([0.0, 5.0, 64.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens is not valid .*non-decreasing"):
        mixer(torch.randn(1, T, HIDDEN), cu_seqlens=_cu([0, 30, 20, 64]))


def test_seqlens_of_the_wrong_type(mixer):
    with pytest.raises(TypeError, match=r"seqlens must be a fla_ac_isolation\.PackedSeqlens \(LayerLocalSeqlens, "
                                        r"CPSeqlens or StaticSeqlens\), got Tensor; pass offsets tensors as "
                                        r"cu_seqlens= \(FLA's name\) or cu_seq_lens_q="):
        mixer(torch.randn(1, T, HIDDEN), seqlens=_cu())


def test_two_offsets_that_disagree_are_refused_naming_both(mixer):
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    name = type(mixer).__name__
    with pytest.raises(ValueError) as info:
        mixer(torch.randn(1, T, HIDDEN), seqlens, cu_seq_lens_q=_cu([0, 5, T]))
    assert str(info.value) == (
        f"{name} got seqlens (5 documents of [5, 0, 17, 1, 41] tokens) and cu_seq_lens_q (2 documents of [5, 59] "
        "tokens), which describe different documents: pass one of them")
    with pytest.raises(ValueError, match=r"got cu_seqlens \(5 documents .*\) and cu_seq_lens_q \(2 documents"):
        mixer(torch.randn(1, T, HIDDEN), cu_seqlens=_cu(), cu_seq_lens_q=_cu([0, 5, T]))
    with pytest.raises(ValueError, match=r"got cu_seq_lens_k \(2 documents of \[5, 59\] tokens\) unlike its offsets"):
        mixer(torch.randn(1, T, HIDDEN), cu_seq_lens_q=_cu(), cu_seq_lens_k=_cu([0, 5, T]))


@pytest.mark.parametrize("keyword", ["cu_seq_lens", "cu_seqlens_q", "cu_doc_lens_q"])
def test_an_offsets_like_keyword_the_mixer_does_not_read_is_refused(mixer, keyword):
    """0.4's drop-ins ran such a call as one sequence (the keyword fell into **kwargs): documents mixed."""
    with pytest.raises(ValueError) as info:
        mixer(torch.randn(1, T, HIDDEN), **{keyword: _cu()})
    assert str(info.value) == (
        f"{type(mixer).__name__} got the offsets-like keyword(s) ['{keyword}'], which it does not read: it takes "
        "packed offsets from ['seqlens', 'cu_seqlens', 'cu_seq_lens_q', 'seq_idx', 'cu_doc_lens'] only, so these "
        "documents would run as one sequence (they mix); pass the offsets under one of those names")


def test_a_companion_without_its_offsets_is_refused(mixer):
    with pytest.raises(ValueError, match="got cu_seqlens_cpu without cu_seqlens: pass cu_seqlens"):
        mixer(torch.randn(1, T, HIDDEN), cu_seqlens_cpu=_cu())
    with pytest.raises(ValueError, match="got cu_seq_lens_k without cu_seq_lens_q: pass cu_seq_lens_q"):
        mixer(torch.randn(1, T, HIDDEN), cu_seq_lens_k=_cu())


def test_seq_idx_must_count_documents_up_from_zero(mixer):
    """(A skipped index is an empty document: [[0, 2, 2]] is [1, 0, 2] tokens.)"""
    with pytest.raises(ValueError, match="seq_idx is not valid packed-sequence offsets: seq_idx must start at 0 and "
                                         "never decrease from token to token"):
        mixer(torch.randn(1, 4, HIDDEN), seq_idx=torch.tensor([[0, 1, 1, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_idx must be a \[1, T\] integer tensor"):
        mixer(torch.randn(1, 4, HIDDEN), seq_idx=torch.zeros(4, dtype=torch.int32))


def test_seqlens_given_twice_is_refused(mixer):
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    with pytest.raises(TypeError, match="got seqlens both positionally and as a keyword"):
        mixer(torch.randn(1, T, HIDDEN), seqlens, seqlens=seqlens)


def test_attention_mask_of_the_wrong_shape(mixer):
    with pytest.raises(ValueError, match=r"attention_mask must be None or a 2-D \[B, T\] padding mask"):
        mixer(torch.randn(1, 4, HIDDEN), attention_mask=torch.ones(1, 1, 4, 4))


def test_transformers_keywords_are_accepted(mixer):
    x = torch.randn(1, 6, HIDDEN)
    with torch.no_grad():
        plain = mixer(x)
        with_kwargs = mixer(x, position_ids=torch.arange(6)[None], use_cache=False, output_attentions=False)
    assert torch.equal(plain, with_kwargs)


def test_unknown_backend(core_family):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'fla', 'reference'\), got 'triton'"):
        core_family.build(backend="triton")


def test_fla_backend_on_cpu_without_interpreter(core_family, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mixer = core_family.build(backend="fla")
    with pytest.raises(ValueError, match="backend='fla' needs CUDA tensors"):
        mixer(torch.randn(1, 4, HIDDEN))


def test_value_heads_not_multiple_of_key_heads():
    from fla_ac_isolation.mixers import Qwen3_5MoeGatedDeltaNet

    config = qwen3_5_moe_config()
    config.linear_num_value_heads = 3
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads"):
        Qwen3_5MoeGatedDeltaNet(config, 0)


def test_unsupported_conv_activation_is_refused_at_construction_and_at_swap():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer as Shipped

    from fla_ac_isolation.mixers import NemotronHMamba2Mixer

    config = nemotron_h_config()
    config.mamba_hidden_act = "gelu"
    message = "the Mamba2 activation must be 'silu' (the conv activation FLA offers), got 'gelu'"
    with pytest.raises(ValueError) as info:
        NemotronHMamba2Mixer(config, 0)
    assert str(info.value) == message
    shipped = Shipped(config, 0)
    with pytest.raises(ValueError) as info:
        NemotronHMamba2Mixer.adopt(shipped)
    assert str(info.value) == message and type(shipped) is Shipped  # left as it was


def test_the_replaced_class_refuses_its_own_bad_config_as_before():
    """Construction is transformers' own: a config of another model fails there, not in our code."""
    from fla_ac_isolation.mixers import Qwen3_5MoeGatedDeltaNet

    with pytest.raises(AttributeError, match="linear_num_value_heads"):
        Qwen3_5MoeGatedDeltaNet(nemotron_h_config(), 0)


def test_offsets_on_another_device_than_activations(mixer):
    """CPU offsets, ``meta`` activations: a second device type on any machine (meta tensors hold shapes only)."""
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    activations = torch.empty(1, T, HIDDEN, device="meta")
    with pytest.raises(ValueError, match=r"seqlens is on cpu but hidden_states is on meta; build the offsets on the "
                                         r"activations' device"):
        mixer(activations, seqlens)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q is not valid packed-sequence offsets: cu_seqlens must be "
                                         r"on the activations' device meta, got cpu"):
        mixer(activations, cu_seq_lens_q=seqlens.local().cu_seqlens)


def test_a_bad_last_offset_is_refused_before_its_chunk_schedule(mixer, monkeypatch):
    """[0, 5, 2**33] for 10 tokens: checked against hidden_states before a 2**27-row schedule is built."""
    import fla_ac_isolation.seqlens as seqlens_module

    def never(*args, **kwargs):
        raise AssertionError("the chunk schedule was built before the token count was checked")

    monkeypatch.setattr(seqlens_module, "chunk_indices_for", never)
    bad = torch.tensor([0, 5, 2**33], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q is not valid packed-sequence offsets: cu_seqlens\[-1\] must "
                                         r"equal the packed token count num_tokens=10 .*got 8589934592"):
        mixer(torch.randn(1, 10, HIDDEN), cu_seq_lens_q=bad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=["fp64", "bf16", "fp16"])
def test_hidden_states_of_another_dtype_than_the_weights(mixer, dtype):
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    with pytest.raises(TypeError, match=rf"hidden_states has dtype {dtype} but this mixer's weights are "
                                        r"torch\.float32: cast one to the other"):
        mixer(torch.randn(1, T, HIDDEN).to(dtype), seqlens)


def test_under_autocast_a_bf16_input_into_fp32_weights_runs_as_in_transformers(mixer):
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    x = torch.randn(1, T, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        from_bf16 = mixer(x.bfloat16(), seqlens)
        from_fp32 = mixer(x, seqlens)
    assert from_bf16.shape == (1, T, HIDDEN) and from_bf16.dtype == torch.bfloat16  # autocast's matmul dtype
    assert torch.equal(from_bf16, from_fp32), "autocast casts the input to bf16 for the first matmul either way"


def test_no_tokens_without_offsets_is_refused_and_packed_zero_length_documents_work(mixer):
    with pytest.raises(ValueError, match=r"hidden_states has no tokens \(shape \(2, 0, 64\)\) and no offsets"):
        mixer(torch.randn(2, 0, HIDDEN))
    out = mixer(torch.randn(1, 0, HIDDEN), LayerLocalSeqlens.from_seq_lens([0, 0]))
    assert out.shape == (1, 0, HIDDEN) and out.dtype == torch.float32


def test_kda_has_no_saveable_operators():
    from helpers import FAMILIES

    with pytest.raises(NotImplementedError, match="saveable=True is not implemented for KimiLinearDeltaAttention"):
        FAMILIES["kimi_linear"].build(saveable=True)
