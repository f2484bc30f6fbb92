"""The reference backend: exact against token-by-token recurrences, deterministic, and cached like FLA."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import PACKED_LENS, split_documents

from fla_ac_isolation import ops
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache, probe_tensor_cache
from fla_ac_isolation.op_inputs import discretize_dt
from fla_ac_isolation.ops import reference
from fla_ac_isolation.ops.backend import resolve_backend
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

LENS = [*PACKED_LENS, 70]  # adds a document spanning two 64-token chunks
T = sum(LENS)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------- naive recurrences
def naive_gated_delta_rule(q, k, v, g, beta, scale):
    """One token at a time, float64: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q.

    q and k are L2-normalised as FLA does it, ``x / sqrt(|x|^2 + 1e-6)``.
    """
    q = (q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(v.shape[2] // q.shape[2], 2) * scale
    k = (k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(v.shape[2] // k.shape[2], 2)
    state = q.new_zeros(q.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1)


def naive_ssd(x, dt, A, B, C, D, dt_bias):
    """One token at a time, float64: S = e^(dt A) S + B (dt x)^T; y = C^T S + D x."""
    dt = F.softplus(dt + dt_bias)
    heads = x.shape[2]
    B = B.repeat_interleave(heads // B.shape[2], 2)
    C = C.repeat_interleave(heads // C.shape[2], 2)
    state = x.new_zeros(x.shape[0], heads, B.shape[-1], x.shape[-1])
    out = []
    for t in range(x.shape[1]):
        state = state * (dt[:, t] * A).exp()[..., None, None] + torch.einsum(
            "bhn,bhp->bhnp", B[:, t], dt[:, t, :, None] * x[:, t]
        )
        out.append(torch.einsum("bhnp,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(out, 1)


def _gdn_inputs(dtype=torch.float64, batch=1, tokens=T, seed=0):
    g = _gen(seed)
    return (
        torch.randn(batch, tokens, 2, 8, generator=g, dtype=dtype),
        torch.randn(batch, tokens, 2, 8, generator=g, dtype=dtype),
        torch.randn(batch, tokens, 4, 6, generator=g, dtype=dtype),
        -torch.rand(batch, tokens, 4, generator=g, dtype=dtype) * 3,
        torch.rand(batch, tokens, 4, generator=g, dtype=dtype),
    )


def _ssd_inputs(dtype=torch.float64, batch=1, tokens=T, seed=0):
    g = _gen(seed)
    return dict(
        x=torch.randn(batch, tokens, 4, 6, generator=g, dtype=dtype),
        dt=torch.randn(batch, tokens, 4, generator=g, dtype=dtype),
        A=-torch.rand(4, generator=g, dtype=dtype) * 4,
        B=torch.randn(batch, tokens, 2, 5, generator=g, dtype=dtype),
        C=torch.randn(batch, tokens, 2, 5, generator=g, dtype=dtype),
        D=torch.randn(4, generator=g, dtype=dtype),
        dt_bias=torch.randn(4, generator=g, dtype=dtype),
    )


def _cu(lens=LENS, dtype=torch.int32):
    return LayerLocalSeqlens.from_seq_lens(lens, dtype=dtype).local()


# --------------------------------------------------------------------------------------- exactness
def test_gated_delta_rule_matches_token_by_token_recurrence_per_document():
    q, k, v, g, beta = _gdn_inputs()
    cu = _cu()
    out = reference.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu.cu_seqlens)
    expected = torch.cat(
        [naive_gated_delta_rule(*docs, scale=8 ** -0.5) for docs in zip(*(split_documents(t, LENS) for t in
                                                                        (q, k, v, g, beta)))], 1)
    assert (out - expected).abs().max().item() < 1e-12


def test_ssd_matches_token_by_token_recurrence_per_document():
    inputs = _ssd_inputs()
    cu = _cu()
    out = reference.ssd(**inputs, cu_seqlens=cu.cu_seqlens, cu_seqlens_cpu=cu.cu_seqlens_cpu)
    per_doc = [dict(zip(("x", "dt", "B", "C"), parts)) for parts in zip(
        *(split_documents(inputs[n], LENS) for n in ("x", "dt", "B", "C")))]
    expected = torch.cat([naive_ssd(**d, A=inputs["A"], D=inputs["D"], dt_bias=inputs["dt_bias"]) for d in per_doc], 1)
    assert (out - expected).abs().max().item() < 1e-12


def test_causal_conv1d_restarts_at_every_document():
    g = _gen()
    x, weight, bias = torch.randn(1, T, 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    out = reference.causal_conv1d(x, weight, bias, cu_seqlens=_cu().cu_seqlens)
    per_doc = [F.conv1d(d.transpose(1, 2), weight[:, None], bias, padding=3, groups=12)[..., :d.shape[1]]
               for d in split_documents(x, LENS)]
    expected = torch.cat([F.silu(y).transpose(1, 2) for y in per_doc], 1)
    assert torch.equal(out, expected)


def test_float32_chunked_ssd_stays_accurate_under_strong_decay():
    """Pairwise decays are summed directly, not taken as differences of large cumulative sums."""
    inputs = _ssd_inputs(torch.float64, tokens=64, seed=3)
    inputs["A"] = torch.full((4,), -16.0, dtype=torch.float64)
    inputs["dt_bias"] = torch.full((4,), 2.0, dtype=torch.float64)
    exact = reference.ssd(**inputs)
    approx = reference.ssd(**{n: t.float() for n, t in inputs.items()})
    assert (approx.double() - exact).abs().max().item() < 1e-5


def test_dt_limit_clamps_the_time_step():
    dt = torch.tensor([[[-20.0, 0.0, 20.0]]])
    clamped = discretize_dt(dt, None, (0.5, 3.0))
    assert clamped.flatten().tolist() == pytest.approx([0.5, math.log(2.0), 3.0])


def test_batch_rows_are_independent_documents():
    q, k, v, g, beta = _gdn_inputs(batch=3, tokens=70)
    batched = reference.chunk_gated_delta_rule(q, k, v, g, beta)
    rows = torch.cat([reference.chunk_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1])
                      for i in range(3)])
    assert (batched - rows).abs().max().item() < 1e-12


# ------------------------------------------------------------------------------------ determinism
def test_repeated_runs_are_bit_identical_including_gradients():
    def run():
        q, k, v, g, beta = (t.float().requires_grad_() for t in _gdn_inputs())
        cu = _cu()
        out = reference.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu.cu_seqlens)
        out.pow(2).sum().backward()
        return [out.detach(), *(t.grad for t in (q, k, v, g, beta))]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ------------------------------------------------------------------------- FLA tensor_cache behaviour
def test_reference_asks_fla_helpers_with_the_given_offsets_and_hits_within_a_layer():
    """conv -> GDN, as in one mixer call: one miss per helper, then hits, exactly as the kernel path."""
    q, k, v, g, beta = _gdn_inputs(torch.float32)
    cu = _cu()
    clear_tensor_cache()
    with probe_tensor_cache() as probe:
        reference.causal_conv1d(torch.randn(1, T, 4), torch.randn(4, 4), cu_seqlens=cu.cu_seqlens,
                                cu_seqlens_cpu=cu.cu_seqlens_cpu)
        reference.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu.cu_seqlens, cu_seqlens_cpu=cu.cu_seqlens_cpu)
    counts = probe.by_helper()
    assert counts["prepare_chunk_indices"]["miss"] == 1 and counts["prepare_chunk_indices"]["hit"] == 1
    assert counts["prepare_chunk_offsets"]["miss"] == 1

    fresh = _cu()  # the next layer's .local(): new objects, so misses again
    with probe_tensor_cache() as probe:
        reference.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=fresh.cu_seqlens,
                                         cu_seqlens_cpu=fresh.cu_seqlens_cpu)
    assert probe.by_helper()["prepare_chunk_indices"]["miss"] == 1


def test_no_helper_is_called_without_offsets():
    q, k, v, g, beta = _gdn_inputs(torch.float32, tokens=10)
    with probe_tensor_cache() as probe:
        reference.chunk_gated_delta_rule(q, k, v, g, beta)
    assert probe.events == []


def test_inconsistent_helper_metadata_is_reported(monkeypatch):
    """A replayed tensor that is not the helper's real answer must not be consumed silently."""
    wrong = torch.tensor([[0, 0], [0, 1]])
    from fla_ac_isolation.ops import documents  # where the reference asks FLA's helpers

    monkeypatch.setattr(documents, "prepare_chunk_indices", lambda *a, **kw: wrong)
    q, k, v, g, beta = _gdn_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="shared by checkpointed layers"):
        reference.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=_cu().cu_seqlens)


OFFSETS_SHORT = ("cu_seqlens ends at 120 but the input has 128 tokens: the offsets do not match the tokens (the last "
                 "offset must be the packed token count T of the inputs [1, T, ...])")


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "causal_conv1d", "ssd", "flas_gdn_served"])
def test_offsets_ending_short_of_the_tokens_without_ac_say_so_naming_both_numbers(op):
    """No checkpoint anywhere: the offsets are the caller's mistake. The message names the offsets' end and the
    token count; it does not ask about checkpointed layers (the text before: "FLA's chunk metadata covers 120 tokens
    but the input has 128; was one cu_seqlens object shared by checkpointed layers?")."""
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    cu = torch.tensor([0, 50, 120], dtype=torch.int32)
    q, k, v, g, beta = _gdn_inputs(tokens=128)
    ssd = _ssd_inputs(tokens=128)
    calls = {
        "chunk_gated_delta_rule": lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu),
        "causal_conv1d": lambda: ops.causal_conv1d(v.flatten(-2), torch.ones(24, 4, dtype=v.dtype), cu_seqlens=cu),
        "ssd": lambda: ops.ssd(**ssd, cu_seqlens=cu),
        "flas_gdn_served": lambda: __import__("fla.ops.gated_delta_rule", fromlist=["_"]).chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu),
    }
    with reference_kernels(), pytest.raises(ValueError) as info:
        calls[op]()
    assert str(info.value) == OFFSETS_SHORT


def test_offsets_ending_short_of_the_tokens_in_a_backward_ask_about_a_recompute():
    """The same offsets reaching the op in a backward (where a checkpointed region recomputes): a forward with
    these inputs would have raised, so the recompute got other offsets or inputs than its forward."""
    cu = torch.tensor([0, 50, 120], dtype=torch.int32)
    q, k, v, g, beta = _gdn_inputs(tokens=128)
    leaf = torch.ones(2, requires_grad=True)
    leaf.register_hook(lambda grad: ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu) and grad)
    with pytest.raises(RuntimeError) as info:
        (leaf * 2).sum().backward()
    assert str(info.value) == (
        "cu_seqlens ends at 120 but the input has 128 tokens: the offsets do not match the tokens in a backward (a "
        "checkpointed region's recompute): the recompute got other offsets or inputs than its forward; was one "
        "cu_seqlens object shared by checkpointed layers?")


# -------------------------------------------------------------------------------------- dispatch
def test_auto_backend_is_reference_on_cpu():
    assert resolve_backend("auto", torch.zeros(1)) == "reference"
    assert resolve_backend("fla", torch.zeros(1)) == "fla"


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.causal_conv1d(torch.zeros(1, 2, 3), torch.zeros(3, 2), backend="cuda")


def test_packed_input_needs_batch_size_one():
    q, k, v, g, beta = _gdn_inputs(torch.float32, batch=2, tokens=T)
    with pytest.raises(ValueError, match="q must have batch size 1 when cu_seqlens is given"):
        reference.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=_cu().cu_seqlens)


def test_given_chunk_indices_spare_prepare_chunk_indices_and_give_the_same_result():
    """As in FLA: conv and GDN use a given schedule and skip the helper; the result is unchanged."""
    q, k, v, g, beta = _gdn_inputs(torch.float32)
    x, w = torch.randn(1, T, 4, generator=_gen(5)), torch.randn(4, 4, generator=_gen(6))
    plain, given = _cu(), _cu()
    want = (reference.causal_conv1d(x, w, cu_seqlens=plain.cu_seqlens, cu_seqlens_cpu=plain.cu_seqlens_cpu),
            reference.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=plain.cu_seqlens))
    with probe_tensor_cache() as probe:
        got = (ops.causal_conv1d(x, w, cu_seqlens=given.cu_seqlens, cu_seqlens_cpu=given.cu_seqlens_cpu,
                                 chunk_indices=given.chunk_indices),
               ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=given.cu_seqlens,
                                          chunk_indices=given.chunk_indices))
    assert "prepare_chunk_indices" not in probe.by_helper()
    assert probe.by_helper()["prepare_chunk_offsets"]["miss"] == 1  # the state-passing lookup remains
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("chunk_indices", "cu_seqlens", "error", "match"),
    [
        pytest.param(torch.zeros(2, 2, dtype=torch.int32), None, ValueError, "needs cu_seqlens", id="no-offsets"),
        pytest.param(torch.zeros(2, 2), "cu", TypeError, r"int32/int64 tensor, got torch.float32", id="float"),
        pytest.param([[0, 0]], "cu", TypeError, "int32/int64 tensor, got list", id="list"),
        pytest.param(torch.zeros(4, dtype=torch.int32), "cu", ValueError, r"\[NT, 2\] rows .* got shape \(4,\)", id="1d"),
        pytest.param(torch.zeros(2, 2, dtype=torch.int32, device="meta"), "cu", ValueError, "on the device of cu_seqlens", id="device"),
    ],
)
def test_malformed_chunk_indices_are_refused_before_any_kernel(chunk_indices, cu_seqlens, error, match):
    x, w = torch.randn(1, T, 4), torch.randn(4, 4)
    offsets = _cu().cu_seqlens if cu_seqlens == "cu" else None
    with pytest.raises(error, match=match):
        ops.causal_conv1d(x, w, cu_seqlens=offsets, chunk_indices=chunk_indices)
