"""The KDA drop-ins' own facts, beyond the shared mixer tests (``test_mixers_*`` run them for every mixer case):
the gate variants of each transformers class, dtypes transformers forces, and what they refuse.

transformers runs its torch path here (the ``hf_torch_path`` fixture). Tolerances as ``test_mixers_parity.py``:
output 1e-5, gradients 5e-5 times ``max(1, |grad|)`` (transformers' chunked torch KDA against our recurrence).
"""

import pytest
import torch
from helpers import FAMILIES, HIDDEN, PACKED_LENS, bailing_hybrid_config, glm5_next_config, kimi_linear_config

from fla_ac_isolation.mixers import BailingHybridDeltaAttention, Glm5NextTextLinearAttention, KimiLinearDeltaAttention
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

KDA = ["kimi_linear", "glm5_next", "bailing_hybrid"]
TOL, GRAD_TOL = 1e-5, 5e-5


def _forward_backward(mixer, x):
    x = x.detach().clone().requires_grad_()
    out = mixer(x)
    (out * torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mixer.named_parameters()}


@pytest.mark.parametrize(
    ("ours", "name", "config"),
    [
        (Glm5NextTextLinearAttention, "glm5_next", lambda: glm5_next_config(linear_lower_bound=None)),
        (BailingHybridDeltaAttention, "bailing_hybrid", lambda: bailing_hybrid_config(kda_safe_gate=False)),
    ],
    ids=["glm5_next-softplus", "bailing_hybrid-softplus"],
)
def test_the_other_gate_matches_transformers(ours, name, config, hf_torch_path):
    """GLM-5-next without ``linear_lower_bound`` and Bailing with ``kda_safe_gate=False`` fall back to the
    softplus gate, as transformers' classes do (the bounded gates are the mixer cases' defaults)."""
    torch.manual_seed(3)
    mine = ours(config(), 0)
    theirs = FAMILIES[name].upstream.resolve()(config(), 0)
    theirs.load_state_dict(mine.state_dict())
    x = torch.randn(2, 70, HIDDEN, generator=torch.Generator().manual_seed(4))
    (out, dx, grads), (out_t, dx_t, grads_t) = _forward_backward(mine, x), _forward_backward(theirs, x)
    assert (out - out_t).abs().max().item() <= TOL
    assert (dx - dx_t).abs().max().item() <= GRAD_TOL
    for name, grad in grads.items():
        assert (grad - grads_t[name]).abs().max().item() <= GRAD_TOL * max(1.0, grads_t[name].abs().max().item())


@pytest.mark.parametrize("name", KDA)
def test_parameter_dtypes_are_those_transformers_forces(name):
    """Kimi: ``A_log`` in the default dtype; GLM-5-next and Bailing: ``A_log`` and ``conv1d`` in float32 even
    under a bfloat16 default dtype; ``dt_bias`` float32 in all three."""
    family = FAMILIES[name]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ours, theirs = family.build(), family.build_hf()
    finally:
        torch.set_default_dtype(previous)
    dtypes = {k: v.dtype for k, v in theirs.state_dict().items()}
    assert {k: v.dtype for k, v in ours.state_dict().items()} == dtypes
    assert dtypes["forget_gate.dt_bias"] == torch.float32
    forced = torch.bfloat16 if name == "kimi_linear" else torch.float32
    assert dtypes["forget_gate.A_log"] == dtypes["conv1d.weight"] == forced


def test_init_follows_transformers_init_weights():
    """``A = exp(A_log)`` in [1, 16] (GLM-5-next with a lower bound: ``A_log = 0``); ``softplus(dt_bias)`` in
    [1e-3, 1e-1], as transformers' ``_init_weights`` (FLA's initialisation) draws them."""
    torch.manual_seed(0)
    kimi = KimiLinearDeltaAttention(kimi_linear_config(), 0).forget_gate
    assert kimi.A_log.exp().min().item() >= 1.0 and kimi.A_log.exp().max().item() <= 16.0
    dt = torch.nn.functional.softplus(kimi.dt_bias)
    assert dt.min().item() >= 1e-3 * (1 - 1e-5) and dt.max().item() <= 1e-1 * (1 + 1e-5)
    assert torch.equal(Glm5NextTextLinearAttention(glm5_next_config(), 0).forget_gate.A_log, torch.zeros(4))


def test_the_drop_ins_are_transformers_classes_with_our_forward():
    """Each drop-in subclasses the class it replaces: same parameters, names, order and values from one seed."""
    for ours, name, config in ((KimiLinearDeltaAttention, "kimi_linear", kimi_linear_config),
                               (Glm5NextTextLinearAttention, "glm5_next", glm5_next_config),
                               (BailingHybridDeltaAttention, "bailing_hybrid", bailing_hybrid_config)):
        replaced = FAMILIES[name].upstream.resolve()
        assert issubclass(ours, replaced) and ours.replaced is replaced
        torch.manual_seed(0)
        mine = ours(config(), 0)
        torch.manual_seed(0)
        theirs = replaced(config(), 0)
        assert [(k, v.shape, v.dtype) for k, v in mine.state_dict().items()] == [
            (k, v.shape, v.dtype) for k, v in theirs.state_dict().items()]


# ------------------------------------------------------------------------------------------------ refusals
def test_a_conv_activation_fla_does_not_offer_is_refused():
    config = kimi_linear_config()
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match=r"hidden_act must be 'silu' \(the conv activation FLA offers\), got 'gelu'"):
        KimiLinearDeltaAttention(config, 0)


def test_context_parallel_seqlens_are_refused():
    """No CP path: a CPSeqlens is refused before any computation; an FLA without CP (0.5.2) refuses to build one."""
    from fla_ac_isolation.fla_seam.features import FlaFeatureError, supports
    from fla_ac_isolation.fla_seam.versions import fla_version
    from fla_ac_isolation.parallel import CPConfig, CPSeqlens

    mixer = FAMILIES["kimi_linear"].build()
    cp = CPConfig(world_size=2, rank=0, conv_kernel_size=4)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    if not supports("cp"):  # FLA 0.5.2: the offsets cannot be built, so no mixer ever sees them
        with pytest.raises(FlaFeatureError) as info:
            CPSeqlens(cu, cu_seqlens_cpu=cu, cp=cp)
        assert str(info.value).startswith("CPSeqlens(cp=CPConfig(layout='contiguous')) needs fla-core >= 0.6.0 "
                                          "(context parallelism")
        assert str(info.value).endswith(f"installed: fla-core {fla_version()}. Install 'fla-core>=0.6.0,<0.7' "
                                        f"(pip install -U fla-ac-isolation brings it)")
        return
    seqlens = CPSeqlens(cu, cu_seqlens_cpu=cu, cp=cp)
    with pytest.raises(NotImplementedError) as info:
        mixer(torch.randn(1, 4, HIDDEN), seqlens)
    assert str(info.value) == ("KimiLinearDeltaAttention has no context-parallel path: pass a LayerLocalSeqlens, not a "
                               "CPSeqlens (whole sequences on every rank)")


@pytest.mark.parametrize("name", KDA)
def test_cuda_free_reference_runs_a_zero_length_document_between_others(name):
    mixer = FAMILIES[name].build(seed=5)
    x = torch.randn(1, sum(PACKED_LENS), HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = mixer(x, LayerLocalSeqlens.from_seq_lens(PACKED_LENS))
    assert out.shape == x.shape and torch.isfinite(out).all()
