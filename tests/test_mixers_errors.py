"""Bad input reaches a clear error that names the argument, raised before any computation."""

import pytest
import torch
from helpers import FAMILIES, HIDDEN, PACKED_LENS, nemotron_h_config, qwen3_5_moe_config, qwen3_8_config

from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

T = sum(PACKED_LENS)


@pytest.fixture
def mixer(core_family):
    return core_family.build()


def test_wrong_hidden_size(mixer):
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, hidden_size=64\]"):
        mixer(torch.randn(1, 8, HIDDEN + 1))


def test_wrong_rank(mixer):
    with pytest.raises(ValueError, match="hidden_states must be"):
        mixer(torch.randn(8, HIDDEN))


def test_integer_hidden_states(mixer):
    with pytest.raises(TypeError, match="hidden_states must be a floating-point tensor"):
        mixer(torch.ones(1, 8, HIDDEN, dtype=torch.long))


def test_token_count_not_matching_cu_seqlens(mixer):
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    with pytest.raises(ValueError, match=r"hidden_states has 63 packed tokens but cu_seqlens\[-1\] = 64"):
        mixer(torch.randn(1, T - 1, HIDDEN), seqlens)


def test_token_count_not_matching_cu_seq_lens_q(mixer):
    cu = torch.tensor([0, 5, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        mixer(torch.randn(1, 70, HIDDEN), cu_seq_lens_q=cu)


def test_batch_above_one_with_cu_seqlens(mixer):
    seqlens = LayerLocalSeqlens.from_seq_lens([4, 4])
    with pytest.raises(ValueError, match="must have batch size 1"):
        mixer(torch.randn(2, 4, HIDDEN), seqlens)


def test_float_cu_seqlens(mixer):
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        LayerLocalSeqlens(torch.tensor([0.0, 5.0, 64.0]))
    with pytest.raises(TypeError, match=r"cu_seq_lens_q is not valid packed-sequence offsets: .*int32 or int64"):
        mixer(torch.randn(1, T, HIDDEN), cu_seq_lens_q=torch.tensor([0.0, 5.0, 64.0]))


def test_decreasing_cu_seq_lens_q(mixer):
    with pytest.raises(ValueError, match=r"cu_seq_lens_q is not valid .*non-decreasing"):
        mixer(torch.randn(1, T, HIDDEN), cu_seq_lens_q=torch.tensor([0, 30, 20, 64], dtype=torch.int32))


def test_seqlens_of_the_wrong_type(mixer):
    with pytest.raises(TypeError, match=r"seqlens must be a fla_ac_isolation\.LayerLocalSeqlens"):
        mixer(torch.randn(1, T, HIDDEN), torch.tensor([0, T], dtype=torch.int32))


def test_seqlens_and_cu_seq_lens_q_disagreeing(mixer):
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    with pytest.raises(ValueError, match="cu_seq_lens_q has 3 offsets but seqlens describes 5 documents"):
        mixer(torch.randn(1, T, HIDDEN), seqlens, cu_seq_lens_q=torch.tensor([0, 5, T], dtype=torch.int32))


@pytest.mark.parametrize("name", ["cache", "cache_params", "past_key_values"])
def test_cache_is_not_implemented(mixer, name):
    with pytest.raises(NotImplementedError, match=f"{name} is not supported"):
        mixer(torch.randn(1, 4, HIDDEN), **{name: object()})


def test_seq_idx_without_offsets(mixer):
    with pytest.raises(ValueError, match="seq_idx is not supported"):
        mixer(torch.randn(1, 4, HIDDEN), seq_idx=torch.zeros(1, 4, dtype=torch.int32))


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


def test_unsupported_output_gate():
    from fla_ac_isolation.mixers import Qwen3_8FlashNextGatedDeltaNet

    config = qwen3_8_config()
    config.output_gate_type = "gelu"
    with pytest.raises(ValueError, match="output_gate_type must be 'silu' or 'sigmoid', got 'gelu'"):
        Qwen3_8FlashNextGatedDeltaNet(config, 0)


def test_unsupported_conv_activation():
    from fla_ac_isolation.mixers import NemotronHMamba2Mixer

    config = nemotron_h_config()
    config.mamba_hidden_act = "gelu"
    with pytest.raises(ValueError, match="mamba_hidden_act must be 'silu'"):
        NemotronHMamba2Mixer(config, 0)


def test_missing_config_field():
    from fla_ac_isolation.mixers import Qwen3_5MoeGatedDeltaNet

    with pytest.raises(ValueError, match="has no field 'linear_num_value_heads'"):
        Qwen3_5MoeGatedDeltaNet(nemotron_h_config(), 0)


def test_offsets_on_another_device_than_activations(mixer):
    """CPU offsets, ``meta`` activations: a second device type on any machine (meta tensors hold shapes only)."""
    seqlens = LayerLocalSeqlens.from_seq_lens(PACKED_LENS)
    activations = torch.empty(1, T, HIDDEN, device="meta")
    with pytest.raises(ValueError, match=r"cu_seqlens is on cpu but hidden_states is on meta; build the "
                                         r"LayerLocalSeqlens on the activations' device"):
        mixer(activations, seqlens)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q is not valid packed-sequence offsets: cu_seqlens must be "
                                         r"on the activations' device meta, got cpu"):
        mixer(activations, cu_seq_lens_q=seqlens.local().cu_seqlens)


def test_cu_seq_lens_q_with_a_bad_last_offset_is_refused_before_its_chunk_schedule(mixer, monkeypatch):
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


@pytest.mark.parametrize("layer_idx", ["0", 1.0, True], ids=["str", "float", "bool"])
def test_layer_idx_of_the_wrong_type(core_family, layer_idx):
    import fla_ac_isolation.mixers as mixers

    with pytest.raises(TypeError, match=rf"layer_idx must be an int \(this layer's index in the decoder\) or None, "
                                        rf"got {layer_idx!r}"):
        getattr(mixers, core_family.ours)(core_family.config(), layer_idx)


def test_every_family_rejects_bad_hidden_size():
    for family in FAMILIES.values():
        with pytest.raises(ValueError, match="hidden_states must be"):
            family.build()(torch.randn(1, 4, 3))


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_8", "nemotron_h"])
def test_layer_idx_outside_the_configs_layer_types(name):
    """A config of a shallower model: a ValueError naming layer_idx, not a bare IndexError."""
    from helpers import FAMILIES

    import fla_ac_isolation.mixers as mixers

    family = FAMILIES[name]
    config = family.config()
    layers = len(config.layer_types)
    with pytest.raises(ValueError, match=rf"layer_idx={layers} is outside config.layer_types \({layers} layers\)"):
        getattr(mixers, family.ours)(config, layers)
    assert getattr(mixers, family.ours)(config, layers - 1).layer_type == config.layer_types[-1]


def test_qwen3_8_config_without_gate_fields():
    from types import SimpleNamespace

    from fla_ac_isolation.mixers import Qwen3_8FlashNextGatedDeltaNet

    fields = {k: v for k, v in qwen3_8_config().to_dict().items() if k != "hidden_act"}
    config = SimpleNamespace(**{**fields, "output_gate_type": None})
    with pytest.raises(ValueError, match="has no field 'hidden_act'"):
        Qwen3_8FlashNextGatedDeltaNet(config, 0)
