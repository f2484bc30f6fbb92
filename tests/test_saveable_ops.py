"""The reference backend's custom operators (``ops(..., saveable=True)``): schemas, fake kernels, gradients, errors.

``torch.library.opcheck`` runs each operator (forward and backward) against its fake kernel (shapes,
strides, dtypes), its schema and its autograd registration, and traces it with AOTAutograd. The FLA
operators get the same fake-versus-real comparison under Triton's interpreter (``test_saveable_interpret``).
"""

import pytest
import torch
from helpers import FAMILIES

from fla_ac_isolation import ops
from fla_ac_isolation.ops import reference, saveable
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

LENS = [5, 0, 17, 1, 41, 70]
T = sum(LENS)
fla_ac = torch.ops.fla_ac_isolation


def _leaf(*shape, scale=1.0, seed=0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).requires_grad_()


def _cases():
    """``{name: (forward overload, args)}`` with packed documents; x is a strided view, as in the mixers."""
    local = LayerLocalSeqlens.from_seq_lens(LENS).local()
    varlen = (local.cu_seqlens, local.cu_seqlens_cpu)
    wide = torch.randn(1, T, 40, generator=torch.Generator().manual_seed(1))
    x = wide[..., 8:32].requires_grad_(False)
    qkv = _leaf(1, T, 96, seed=2)
    q, k, v = (t.reshape(1, T, -1, n) for t, n in zip(qkv.detach().split([32, 32, 32], -1), (16, 16, 8)))
    return {
        "causal_conv1d": (fla_ac.causal_conv1d_reference.default,
                          (x.clone().requires_grad_(), _leaf(24, 4, seed=3), _leaf(24, seed=4), "silu", *varlen,
                           local.chunk_indices)),
        "causal_conv1d_no_bias": (fla_ac.causal_conv1d_reference.default,
                                  (x.clone().requires_grad_(), _leaf(24, 4, seed=3), None, None, *varlen, None)),
        # dense but not contiguous ([B, D, T] storage): fake kernels must still promise contiguous outputs
        "causal_conv1d_transposed_x": (fla_ac.causal_conv1d_reference.default,
                                       (_leaf(1, 24, T, seed=8).detach().transpose(1, 2).requires_grad_(),
                                        _leaf(24, 4, seed=3), None, "silu", *varlen, None)),
        "gated_delta_rule": (fla_ac.gated_delta_rule_reference.default,
                             (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
                              -torch.rand(1, T, 4).requires_grad_(), torch.rand(1, T, 4).requires_grad_(), 0.25,
                              True, *varlen, local.chunk_indices)),
        "ssd": (fla_ac.ssd_scan_reference.default,
                (_leaf(1, T, 4, 16, scale=0.5, seed=5), (-torch.rand(1, T, 4)).requires_grad_(),
                 _leaf(1, T, 2, 16, seed=6), _leaf(1, T, 2, 16, seed=7), *varlen, local.chunk_indices,
                 local.chunk_offsets)),
    }


PLAIN = {
    "causal_conv1d_reference": lambda x, w, b, act, cu, cu_cpu, ci: reference.causal_conv1d(
        x, w, b, activation=act, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=ci),
    "gated_delta_rule_reference": lambda q, k, v, g, beta, scale, l2, cu, cu_cpu, ci: reference.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
        chunk_indices=ci),
    "ssd_scan_reference": lambda x, a, b, c, cu, cu_cpu, ci, co: reference.ssd_scan(
        x, a, b, c, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=ci, chunk_offsets=co),
}
BACKWARD = {
    "causal_conv1d_reference": fla_ac.causal_conv1d_reference_backward.default,
    "gated_delta_rule_reference": fla_ac.gated_delta_rule_reference_backward.default,
    "ssd_scan_reference": fla_ac.ssd_scan_reference_backward.default,
}


@pytest.mark.parametrize("case", list(_cases()))
def test_forward_operators_pass_opcheck(case):
    op, args = _cases()[case]
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("case", list(_cases()))
def test_backward_operators_pass_opcheck_and_equal_autograd_of_the_reference(case):
    """The backward operator is called with what the forward's autograd node saved; its gradients are
    those of plain autograd through the reference function (the same ops, so bit for bit)."""
    op, args = _cases()[case]
    name = op._schema.name.split("::")[1]
    out = PLAIN[name](*args)  # the plain reference function, differentiated by autograd
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    expected = torch.autograd.grad(out, tensors, grad_out)
    backward = BACKWARD[name]
    if name == "causal_conv1d_reference":
        x, w, b, act, cu, cu_cpu, ci = args
        back_args = (grad_out, x.detach(), w.detach(), None if b is None else b.detach(), act, cu, cu_cpu, ci)
    elif name == "gated_delta_rule_reference":
        q, k, v, g, beta, scale, l2, cu, cu_cpu, ci = args
        back_args = (grad_out, *(t.detach() for t in (q, k, v, g, beta)), scale, l2, cu, cu_cpu, ci)
    else:
        x, a, b, c, cu, cu_cpu, ci, co = args
        back_args = (grad_out, *(t.detach() for t in (x, a, b, c)), cu, cu_cpu, ci, co)
    got = [t for t in backward(*back_args) if t.numel()]  # a missing conv bias gives empty(0)
    assert len(got) == len(expected)
    for g_got, g_want in zip(got, expected):
        assert g_got.is_contiguous() and torch.equal(g_got, g_want.contiguous())
    result = torch.library.opcheck(backward, back_args, test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_backward_operators_restore_the_autograd_exclusion_they_lift():
    """The reference backward differentiates inside an op kernel by lifting torch's exclusion of the
    autograd dispatch keys (private TLS API); the state after the call is the state before, nested or not."""
    key = torch._C.DispatchKey.AutogradFunctionality
    op, args = _cases()["ssd"]
    out = op(*args)
    back_args = (torch.ones_like(out), *(t.detach() for t in args[:4]), *args[4:])
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    fla_ac.ssd_scan_reference_backward(*back_args)
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    with torch._C._AutoDispatchBelowAutograd():
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)
        fla_ac.ssd_scan_reference_backward(*back_args)
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)


def test_saveable_ops_registry_names_both_backends_forward_operators():
    assert set(ops.SAVEABLE_OPS) == {"gated_delta_rule", "causal_conv1d", "ssd"}
    assert {name: [str(o) for o in overloads] for name, overloads in ops.SAVEABLE_OPS.items()} == {
        "gated_delta_rule": ["fla_ac_isolation.gated_delta_rule.default",
                             "fla_ac_isolation.gated_delta_rule_reference.default"],
        "causal_conv1d": ["fla_ac_isolation.causal_conv1d.default", "fla_ac_isolation.causal_conv1d_reference.default"],
        "ssd": ["fla_ac_isolation.simple_gla.default", "fla_ac_isolation.ssd_scan_reference.default"],
    }


def test_the_ssd_scan_operator_is_the_scan_of_reference_ssd():
    """The op covers the scan only (FLA's simple GLA boundary); the facade adds discretisation and D as
    :func:`reference.ssd` does, so both agree (bit for bit in the forward)."""
    g = torch.Generator().manual_seed(0)
    x, dt, A = torch.randn(1, T, 4, 16, generator=g), torch.randn(1, T, 4, generator=g), -torch.rand(4, generator=g)
    B, C, D = torch.randn(1, T, 2, 16, generator=g), torch.randn(1, T, 2, 16, generator=g), torch.randn(4, generator=g)
    local = LayerLocalSeqlens.from_seq_lens(LENS).local()
    kwargs = dict(D=D, dt_bias=torch.randn(4, generator=g), dt_limit=(0.001, float("inf")),
                  cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu)
    assert torch.equal(ops.ssd(x, dt, A, B, C, saveable=True, **kwargs), reference.ssd(x, dt, A, B, C, **kwargs))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x: ops.causal_conv1d(x, torch.ones(24, 4), saveable=1), TypeError, "saveable must be True or False, got 1"),
        (lambda x: ops.causal_conv1d(x, torch.ones(24, 4), activation="gelu", saveable=True), ValueError,
         "activation must be 'silu', 'swish' or None"),
        (lambda x: ops.causal_conv1d(x, torch.ones(23, 4), saveable=True), ValueError, r"weight must be \[D, W\] with D = 24"),
        (lambda x: ops.chunk_gated_delta_rule(x.view(1, T, 3, 8), x.view(1, T, 2, 12), x.view(1, T, 3, 8),
                                              x[..., :3], x[..., :3], saveable=True),
         ValueError, "q and k must share H heads"),
        (lambda x: ops.ssd(x.view(1, T, 3, 8), x[..., :3], torch.ones(3), x.view(1, T, 2, 12), x.view(1, T, 2, 12),
                           saveable=True), ValueError, r"heads \(3\) must be a multiple of the B/C groups \(2, 2\)"),
        (lambda x: ops.causal_conv1d(x, torch.ones(24, 4), backend="fla", saveable=True), ValueError,
         "backend='fla' needs CUDA tensors"),
    ],
    ids=["saveable-not-bool", "activation", "weight", "heads", "groups", "fla-on-cpu"],
)
def test_bad_input_is_refused_before_the_operator_runs(call, error, match, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(error, match=match):
        call(torch.randn(1, T, 24))


def test_mixers_take_saveable_keep_their_state_dict_and_refuse_non_bools(core_family):
    if core_family.family.name == "kimi_linear":  # KDA has no custom operator: refused, not ignored
        assert core_family.build(backend="reference").saveable is False
        with pytest.raises(NotImplementedError, match="saveable=True is not implemented for KimiLinearDeltaAttention"):
            core_family.build(backend="reference", saveable=True)
        with pytest.raises(TypeError, match="saveable must be True or False, got 'yes'"):
            core_family.build(backend="reference", saveable="yes")
        return
    plain, saveable = core_family.build(backend="reference"), core_family.build(backend="reference", saveable=True)
    assert saveable.saveable is True and plain.saveable is False
    assert list(saveable.state_dict()) == list(plain.state_dict())
    assert "saveable=True" in repr(saveable) and "saveable" not in repr(plain)
    with pytest.raises(TypeError, match="saveable must be True or False, got 'yes'"):
        core_family.build(backend="reference", saveable="yes")


def test_the_saveable_table_lists_one_forward_operator_per_operation_and_backend():
    assert {name: op._schema.name for name, op in saveable.OVERLOADS["fla"].items()} == {
        "causal_conv1d": "fla_ac_isolation::causal_conv1d",
        "gated_delta_rule": "fla_ac_isolation::gated_delta_rule",
        "ssd": "fla_ac_isolation::simple_gla",
    }
    assert {name: op._schema.name for name, op in saveable.OVERLOADS["reference"].items()} == {
        "causal_conv1d": "fla_ac_isolation::causal_conv1d_reference",
        "gated_delta_rule": "fla_ac_isolation::gated_delta_rule_reference",
        "ssd": "fla_ac_isolation::ssd_scan_reference",
    }
    assert FAMILIES  # the mixer cases build on the same registry
