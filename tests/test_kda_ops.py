"""``ops.chunk_kda``'s reference backend (FLA's own ``naive_recurrent_kda`` per document): Kimi Delta Attention
against an independent float64 recurrence, FLA's naive KDA bit for bit, packed against per document, FLA's index
lookups, and its input checks.

The oracle here is written per head with explicit matrices, ``S <- (I - beta k k^T) diag(exp g) S + beta k v^T``
and ``o = scale * S^T q`` (the delta rule as a Householder-like update), in float64, document by document: a
different formulation from FLA's einsum recurrence. Tolerance: the recurrence is non-expansive (unit ``k`` after
the L2 norm, ``beta`` in (0, 1), decays <= 1), so float32 rounding does not grow with the document length;
measured over 4 seeds, max |float32 - float64| <= 5.5e-8 on the output (values up to 0.37) and <= 1.2e-7 on the
gradients (up to 1.5): bound 1e-6, an 8x margin for other CPUs' last digits (gradients: times ``max(1, |grad|)``).
"""

from __future__ import annotations

import pytest
import torch

from fla_ac_isolation import ops
from fla_ac_isolation.fla_seam.cache import probe_tensor_cache
from fla_ac_isolation.ops import reference_kda
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

LENS = [70, 0, 17, 1, 41]  # a two-chunk document, an empty one and a one-token one
H, HV, K, V = 2, 4, 16, 8  # grouped value attention: two value heads per key head
TOL = 1e-6


def _inputs(seed: int = 0, lens=LENS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return {
        "q": torch.randn(1, T, H, K, generator=gen), "k": torch.randn(1, T, H, K, generator=gen),
        "v": torch.randn(1, T, HV, V, generator=gen), "g": -torch.rand(1, T, HV, K, generator=gen) * 0.7,
        "beta": torch.rand(1, T, HV, generator=gen),
    }


def _oracle(q, k, v, g, beta, lens) -> torch.Tensor:
    """Float64, one document, one head, one token at a time, with explicit ``[K, K]`` matrices."""
    q, k, v, g, beta = (t.double()[0] for t in (q, k, v, g, beta))
    scale, group = K ** -0.5, HV // H
    out = torch.zeros(q.shape[0], HV, V, dtype=torch.float64)
    start = 0
    for n in lens:
        for h in range(HV):
            state = torch.zeros(K, V, dtype=torch.float64)
            for t in range(start, start + n):
                qt, kt = q[t, h // group], k[t, h // group]
                qt, kt = qt / torch.sqrt(qt @ qt + 1e-6), kt / torch.sqrt(kt @ kt + 1e-6)
                state = torch.diag(g[t, h].exp()) @ state
                state = (torch.eye(K, dtype=torch.float64) - beta[t, h] * torch.outer(kt, kt)) @ state
                state = state + beta[t, h] * torch.outer(kt, v[t, h])
                out[t, h] = scale * state.T @ qt
        start += n
    return out.unsqueeze(0)


def _reference(inputs, lens=LENS, **kw):
    local = LayerLocalSeqlens.from_seq_lens(lens).local()
    return ops.chunk_kda(**inputs, cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu,
                         backend="reference", **kw)


def test_reference_matches_an_independent_float64_recurrence_output_and_gradients():
    inputs = _inputs()
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    exact = {n: t.double().requires_grad_() for n, t in inputs.items()}
    out, want = _reference(leaves), _oracle(**exact, lens=LENS)
    assert out.dtype == torch.float32 and out.shape == (1, sum(LENS), HV, V)
    assert (out.double() - want).abs().max().item() <= TOL
    weight = torch.cos(torch.arange(out.numel(), dtype=torch.float64)).reshape(out.shape)
    (out.double() * weight).sum().backward()
    (want * weight).sum().backward()
    for name, leaf in leaves.items():
        scale = max(1.0, exact[name].grad.abs().max().item())
        assert (leaf.grad.double() - exact[name].grad).abs().max().item() <= TOL * scale, name


def test_float64_inputs_give_float64_computed_in_flas_float32():
    """FLA's ``naive_recurrent_kda`` casts every input to float32 (fla-core 0.5.2 and 0.6): a float64 batch comes
    back float64, within the float32 bound of the float64 oracle and not to float64 rounding."""
    inputs = {n: t.double() for n, t in _inputs(1).items()}
    out = _reference(inputs)
    assert out.dtype == torch.float64
    error = (out - _oracle(**inputs, lens=LENS)).abs().max().item()
    assert 1e-12 < error <= TOL


def test_reference_is_flas_naive_recurrent_kda_document_by_document():
    """FLA's ``naive_recurrent_kda`` (fla/ops/kda/naive.py) takes no offsets and no L2 norm: run on each document of
    the normalised inputs, it gives the reference bit for bit."""
    from fla.ops.kda.naive import naive_recurrent_kda

    inputs = _inputs(2)
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (inputs["q"], inputs["k"]))
    pieces, start = [], 0
    for n in LENS:
        if n:
            end = start + n
            piece, _ = naive_recurrent_kda(q[:, start:end], k[:, start:end], inputs["v"][:, start:end],
                                           inputs["g"][:, start:end], inputs["beta"][:, start:end])
            pieces.append(piece)
        start += n
    assert torch.equal(_reference(inputs), torch.cat(pieces, dim=1))


def test_packed_is_bit_equal_to_each_document_alone_and_batch_rows_are_documents():
    inputs = _inputs(3)
    packed = _reference(inputs)
    start = 0
    for n in LENS:
        if n:
            alone = ops.chunk_kda(**{k: t[:, start:start + n] for k, t in inputs.items()}, backend="reference")
            assert torch.equal(packed[:, start:start + n], alone)
        start += n
    rows = {k: t[:, :40].reshape(2, 20, *t.shape[2:]) for k, t in inputs.items()}
    batched = ops.chunk_kda(**rows, backend="reference")
    for b in range(2):
        assert torch.equal(batched[b:b + 1], ops.chunk_kda(**{k: t[b:b + 1] for k, t in rows.items()},
                                                           backend="reference"))


def test_no_tokens_packed_gives_an_empty_output():
    empty = {n: t[:, :0] for n, t in _inputs().items()}
    out = _reference(empty, lens=[0, 0])
    assert out.shape == (1, 0, HV, V)


def test_reference_asks_flas_index_helpers_what_chunk_kda_asks_and_reuses_them_by_identity():
    """``prepare_chunk_indices`` (by keyword, as ``ChunkKDAFunction.forward``) then ``prepare_chunk_offsets``
    (as ``chunk_gated_delta_rule_fwd_h``): both miss for a fresh ``cu_seqlens`` and hit for the same object."""
    inputs = _inputs(4)
    local = LayerLocalSeqlens.from_seq_lens(LENS).local()
    varlen = dict(cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu, backend="reference")
    with torch.no_grad(), probe_tensor_cache() as probe:
        first = ops.chunk_kda(**inputs, **varlen)
        second = ops.chunk_kda(**inputs, **varlen)
    seen = probe.by_helper()
    assert seen["prepare_chunk_indices"] == {"miss": 1, "hit": 1, "bypass": 0}
    assert seen["prepare_chunk_offsets"] == {"miss": 1, "hit": 1, "bypass": 0}
    assert torch.equal(first, second)


def test_a_schedule_that_contradicts_the_offsets_is_refused_not_mixed(monkeypatch):
    """What a misaligned SAC replay of FLA's helper output would hand the reference: it raises."""
    import fla_ac_isolation.ops.reference_kda as module

    monkeypatch.setattr(module, "prepare_kda_chunk_indices",
                        lambda cu, cu_cpu=None: torch.tensor([[0, 0], [0, 1], [2, 0], [2, 1], [4, 0]]))
    with pytest.raises(RuntimeError, match="FLA's chunk metadata does not match cu_seqlens"):
        _reference(_inputs(5))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: a | {"g": a["g"][..., :8]}, ValueError, r"g must be \[B, T, HV, K\] = \[1, 129, 4, 16\]"),
        (lambda a: a | {"beta": a["beta"][..., :2]}, ValueError, r"beta \[B, T, HV\] = \[1, 129, 4\]"),
        (lambda a: a | {"k": a["k"][:, :, :1]}, ValueError, "q and k must share H heads"),
        (lambda a: {n: t.expand(2, *t.shape[1:]) for n, t in a.items()}, ValueError,
         "q must have batch size 1 when cu_seqlens is given"),
    ],
    ids=["g-shape", "beta-shape", "heads", "batch-with-offsets"],
)
def test_bad_input_is_refused_at_the_boundary(change, error, match):
    with pytest.raises(error, match=match):
        _reference(change(_inputs()))


def test_backend_choice_is_checked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inputs = _inputs()
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'fla', 'reference'\), got 'triton'"):
        ops.chunk_kda(**inputs, backend="triton")
    with pytest.raises(ValueError, match="backend='fla' needs CUDA tensors"):
        ops.chunk_kda(**inputs, backend="fla")
    wide = {n: (t.repeat_interleave(17, dim=-1) if n in ("q", "k", "g") else t) for n, t in inputs.items()}
    with pytest.raises(ValueError, match="FLA's chunk_kda takes key head dims up to 256, got K = 272"):
        ops.chunk_kda(**wide, backend="fla")
    assert torch.equal(ops.chunk_kda(**inputs), reference_kda.chunk_kda(**inputs))  # auto on CPU: reference
