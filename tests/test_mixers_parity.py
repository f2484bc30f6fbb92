"""Our mixers against transformers' own classes: same parameters, same numbers on unpacked input.

transformers is forced onto its torch path by the ``hf_torch_path`` fixture (conftest): with FLA
importable it would call FLA's Triton kernels, which have no CPU backend.
"""

import pytest
import torch
from helpers import HIDDEN, qwen3_8_config

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-5
GRAD_TOL = 5e-5


def _forward_backward(mixer, x):
    x = x.detach().clone().requires_grad_()
    out = mixer(x)
    weight = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
    (out * weight).sum().backward()
    grads = {name: p.grad for name, p in mixer.named_parameters()}
    return out.detach(), x.grad, grads


def test_state_dict_keys_and_shapes_match_transformers(family):
    ours, theirs = family.build(), family.build_hf()
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()
    ]


def test_state_dict_loads_exactly_both_ways(family):
    ours, theirs = family.build(seed=1), family.build_hf()
    theirs.load_state_dict(ours.state_dict())
    for key, value in theirs.state_dict().items():
        assert torch.equal(value, ours.state_dict()[key]), key

    fresh = family.build(seed=2)
    fresh.load_state_dict(theirs.state_dict())
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, theirs.state_dict()[key]), key


@pytest.mark.parametrize("batch,tokens", [(2, 70), (1, 5)], ids=["B2-T70-two-chunks", "B1-T5"])
def test_unpacked_forward_and_grads_match_transformers_torch_path(family, hf_torch_path, batch, tokens):
    ours = family.build(seed=3)
    theirs = family.build_hf()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(batch, tokens, HIDDEN, generator=torch.Generator().manual_seed(4))

    out_ours, dx_ours, grads_ours = _forward_backward(ours, x)
    out_theirs, dx_theirs, grads_theirs = _forward_backward(theirs, x)

    assert (out_ours - out_theirs).abs().max().item() <= TOL
    # Gradients: transformers' chunked torch GDN forms decays as differences of cumulative sums and is itself
    # ~1e-5 off float64 on the decay gradients (dt_bias, A_log, in_proj_a); ours is ~1e-7 off (next test).
    assert (dx_ours - dx_theirs).abs().max().item() <= GRAD_TOL
    for name, grad in grads_ours.items():
        err = (grad - grads_theirs[name]).abs().max().item()
        scale = max(1.0, grads_theirs[name].abs().max().item())
        assert err <= GRAD_TOL * scale, (name, err)


def test_float32_grads_are_within_1e_5_of_float64(core_family):
    ours = core_family.build(seed=3)
    exact = core_family.build(seed=3).double()
    x = torch.randn(2, 70, HIDDEN, generator=torch.Generator().manual_seed(4))
    out32, dx32, grads32 = _forward_backward(ours, x)
    out64, dx64, grads64 = _forward_backward(exact, x.double())
    assert (out32.double() - out64).abs().max().item() <= TOL
    assert (dx32.double() - dx64).abs().max().item() <= TOL
    for name, grad in grads32.items():
        scale = max(1.0, grads64[name].abs().max().item())
        assert (grad.double() - grads64[name]).abs().max().item() <= TOL * scale, name


def test_padding_mask_zeroes_tokens_as_transformers_does(family, hf_torch_path):
    ours = family.build(seed=5)
    theirs = family.build_hf()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding in the second row
    with torch.no_grad():
        diff = (ours(x, attention_mask=mask) - theirs(x, attention_mask=mask)).abs().max().item()
    assert diff <= TOL


def test_qwen3_8_output_gate_follows_config():
    from fla_ac_isolation.mixers import Qwen3_8FlashNextGatedDeltaNet

    assert Qwen3_8FlashNextGatedDeltaNet(qwen3_8_config("sigmoid"), 0).norm.activation == "sigmoid"
    assert Qwen3_8FlashNextGatedDeltaNet(qwen3_8_config(None), 0).norm.activation == "silu"  # hidden_act

    torch.manual_seed(0)
    sigmoid = Qwen3_8FlashNextGatedDeltaNet(qwen3_8_config("sigmoid"), 0)
    silu = Qwen3_8FlashNextGatedDeltaNet(qwen3_8_config("silu"), 0)
    silu.load_state_dict(sigmoid.state_dict())
    x = torch.randn(1, 8, HIDDEN)
    with torch.no_grad():
        assert not torch.allclose(sigmoid(x), silu(x))


def test_transformers_attributes_are_mirrored(family):
    ours, theirs = family.build(), family.build_hf()
    for name in ("hidden_size", "layer_idx", "layer_type", "conv_kernel_size", "activation", "conv_dim"):
        if family.name != "bailing_hybrid" or name != "layer_type":  # Bailing's class keeps no layer_type
            assert getattr(ours, name) == getattr(theirs, name), name
    if family.family.name == "kimi_linear":  # the KDA classes
        for name in ("num_heads", "head_dim", "qkv_dim"):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.o_norm.activation == theirs.o_norm.activation == "sigmoid"
        assert ours.o_norm.variance_epsilon == theirs.o_norm.variance_epsilon
    elif family.name == "nemotron_h":
        for name in ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "chunk_size",
                     "time_step_limit", "use_conv_bias"):
            assert getattr(ours, name) == getattr(theirs, name), name
    else:
        for name in ("num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                     "layer_norm_epsilon"):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.norm.activation == theirs.norm.activation
