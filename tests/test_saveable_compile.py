"""torch.compile of the mixers with the saveable ops (reference backend, CPU).

* Graph breaks, counted with ``torch._dynamo.explain``: none with ``saveable=True`` (one graph holding the
  custom operators), several without (the reference's ``.tolist()`` in every varlen call, FLA's
  ``repeat_interleave`` on device counts).
* Gradients of the compiled mixer: bit-equal to eager with ``aot_eager``, with ``LayerLocalSeqlens``
  (``fullgraph=False``: its ``.local()`` copy is ``torch.compiler.disable`` d, which dynamo skips without
  a break) and with fixed per-layer tensors (``fullgraph=True``). Inductor fuses the norms and gates, so its
  gradients differ in the last bits: checked to 1e-5 of the largest entry (GDN mixer, fullgraph).
* A checkpointed block compiled under SAC with :func:`save_fla_ops` and fixed per-layer tensors: the
  compiled backward reruns no saved operator, and the gradients equal eager without AC (``aot_eager``).
  With ``LayerLocalSeqlens`` dynamo runs such a region eagerly (a documented limitation).
"""

import pytest
import torch
import torch._dynamo
from helpers import FAMILIES, HIDDEN, PACKED_LENS, Block, OpRecorder
from torch import nn

from fla_ac_isolation.fla_seam.cache import probe_tensor_cache
from fla_ac_isolation.harness.modes import SharedSeqlens
from fla_ac_isolation.policies import any_of, checkpoint_layers, save_device_to_host_copies, save_fla_ops
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

LENS = [*PACKED_LENS, 70]
CORE = {"qwen3_5_moe": "gated_delta_rule_reference", "nemotron_h": "ssd_scan_reference"}
MIXERS = list(CORE)  # one GDN and one Mamba2 mixer (Qwen3.8's GDN differs only in its output gate)


@pytest.fixture(params=MIXERS)
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _x():
    return 0.5 * torch.randn(1, sum(LENS), HIDDEN, generator=torch.Generator().manual_seed(0))


def _fixed():
    """Fixed per-layer tensors: no ``.local()`` copy, so dynamo can trace the whole forward."""
    return SharedSeqlens.from_seq_lens(LENS, chunk_indices=True)


def _outputs_and_grads(module, fn, seqlens):
    for p in module.parameters():
        p.grad = None
    h = _x().requires_grad_()
    out = fn(h, seqlens)
    (out.float() * torch.cos(torch.arange(out.numel()).reshape(out.shape))).sum().backward()
    return [out.detach(), h.grad] + [p.grad.clone() for p in module.parameters()]


def _breaks(explained) -> list[str]:
    return [f"{r.user_stack[-1].filename}: {r.reason.splitlines()[0]}" for r in explained.break_reasons]


def test_no_graph_break_at_the_fla_calls_with_saveable_ops(family):
    mixer = family.build(seed=3, backend="reference", saveable=True)
    explained = torch._dynamo.explain(mixer)(_x(), LayerLocalSeqlens.from_seq_lens(LENS))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), _breaks(explained)
    targets = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    assert {"fla_ac_isolation.causal_conv1d_reference.default",
            f"fla_ac_isolation.{CORE[family.name]}.default"} <= targets


def test_the_default_path_breaks_the_graph_at_every_varlen_call():
    """Control: without the operators dynamo traces into the reference and breaks at its ``.tolist()``."""
    mixer = FAMILIES["qwen3_5_moe"].build(seed=3, backend="reference")
    explained = torch._dynamo.explain(mixer)(_x(), LayerLocalSeqlens.from_seq_lens(LENS))
    assert explained.graph_break_count >= 6
    # the .tolist() of the schedule the reference walks (ops/documents.py, which asks FLA's helpers)
    assert any("ops/documents.py: Data dependent operator" in b for b in _breaks(explained)), _breaks(explained)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["LayerLocalSeqlens", "fullgraph-fixed-tensors"])
def test_aot_eager_compiled_mixer_gradients_equal_eager_bit_for_bit(family, fullgraph):
    mixer = family.build(seed=3, backend="reference", saveable=True)
    seqlens = _fixed() if fullgraph else LayerLocalSeqlens.from_seq_lens(LENS)
    eager = _outputs_and_grads(mixer, mixer, seqlens)
    compiled = _outputs_and_grads(mixer, torch.compile(mixer, backend="aot_eager", fullgraph=fullgraph), seqlens)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


def test_fullgraph_with_layer_local_seqlens_is_refused_by_dynamo():
    """The limitation the docs state: ``.local()`` is ``torch.compiler.disable`` d (it must hand out new
    objects), so a full graph needs fixed per-layer tensors."""
    mixer = FAMILIES["qwen3_5_moe"].build(seed=3, backend="reference", saveable=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch.compiler.disable"):
        torch.compile(mixer, backend="aot_eager", fullgraph=True)(_x(), LayerLocalSeqlens.from_seq_lens(LENS))


def test_inductor_compiled_gdn_mixer_gradients_match_eager_to_1e_5():
    """Inductor generates code around the operators from their fake kernels (one GDN mixer: conv + core)."""
    mixer = FAMILIES["qwen3_5_moe"].build(seed=3, backend="reference", saveable=True)
    seqlens = _fixed()
    eager = _outputs_and_grads(mixer, mixer, seqlens)
    compiled = _outputs_and_grads(mixer, torch.compile(mixer, fullgraph=True), seqlens)
    for got, want in zip(compiled, eager):
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())


def test_a_compiled_checkpointed_region_with_layer_local_seqlens_runs_eagerly():
    """The limitation the docs state: inside a checkpointed region dynamo gives up at ``.local()``'s
    ``torch.compiler.disable`` d copy and runs the whole region eagerly (no graph), correctly."""
    from torch._dynamo.utils import counters

    layers = nn.ModuleList([Block(FAMILIES["qwen3_5_moe"].build(seed=3, backend="reference", saveable=True))])
    checkpoint_layers(layers, mode="selective", policy=save_fla_ops())
    counters.clear()
    out = torch.compile(layers[0], backend="aot_eager")(_x().requires_grad_(), LayerLocalSeqlens.from_seq_lens(LENS))
    out.sum().backward()
    assert counters["stats"]["unique_graphs"] == 0
    assert [reason.split("\n")[0] for reason in counters["graph_break"]] == [
        "Skip calling `torch.compiler.disable()`d function"]


@pytest.mark.parametrize(("saved", "rerun"), [(("gated_delta_rule", "ssd", "causal_conv1d"), set()),
                                              (("causal_conv1d",), {"core"})], ids=["save-all", "save-conv"])
def test_compiled_checkpointed_block_under_sac_reruns_only_unsaved_ops(family, saved, rerun):
    torch.manual_seed(0)
    plain = nn.ModuleList([Block(family.build(seed=3, backend="reference", saveable=True))])
    checkpointed = nn.ModuleList([Block(family.build(seed=3, backend="reference", saveable=True))])
    checkpoint_layers(checkpointed, mode="selective", policy=any_of(save_fla_ops(saved), save_device_to_host_copies()))
    compiled = torch.compile(checkpointed[0], backend="aot_eager")
    want = _outputs_and_grads(plain, plain[0], _fixed())

    for p in checkpointed.parameters():
        p.grad = None
    h = _x().requires_grad_()
    out = compiled(h, _fixed())
    with probe_tensor_cache() as probe, OpRecorder(probe) as backward:
        (out.float() * torch.cos(torch.arange(out.numel()).reshape(out.shape))).sum().backward()
    got = [out.detach(), h.grad] + [p.grad.clone() for p in checkpointed.parameters()]
    for g_got, g_want in zip(got, want):
        assert torch.equal(g_got, g_want)
    core = "gated_delta_rule" if family.name != "nemotron_h" else "ssd"
    expected = {core: 1} if rerun else {}
    assert backward.forward_calls == expected  # the compiled recompute reruns exactly the unsaved operator
    assert backward.backward_calls == {"causal_conv1d": 1, core: 1}
