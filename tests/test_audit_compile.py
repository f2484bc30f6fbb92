"""ReplayAudit on compiled regions: ``torch.compile(layer, fullgraph=False)`` (inductor, CPU) under full AC.

What the audit sees there is what SAC sees: the aten ops that inductor's generated code still sends through
the dispatcher (extern kernels such as ``addmm.out``, fallbacks such as ``repeat_interleave`` from FLA's
helpers) and the eager ops between graphs; the ops fused into generated kernels are invisible. FLA's
``tensor_cache`` wrapper breaks the graph, so its hit/miss decision runs eagerly and the cache probe still
attributes the divergence. Slow (one inductor compile per cache state; ~30 s on a cold 2-core machine).
"""

import pytest
import torch

from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
from fla_ac_isolation.harness.fault_stack import HelperStack
from fla_ac_isolation.policies import checkpoint_layers
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.slow


def _compiled_step(mode: str):
    torch.manual_seed(0)
    model = HelperStack(num_layers=2)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, fullgraph=False)
    checkpoint_layers(model, mode="full")
    seqlens = LayerLocalSeqlens.from_seq_lens([5, 0, 9, 1, 7], with_cpu=False)
    cu = seqlens.local().cu_seqlens
    x = torch.randn(22, 16)
    clear_tensor_cache()
    with ReplayAudit(model, on_divergence="record") as audit:
        model(x, seqlens if mode == "isolated" else cu).pow(2).mean().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return audit, grads


def test_compiled_region_isolated_is_aligned_and_shared_is_flagged():
    torch._dynamo.reset()
    isolated, grads_isolated = _compiled_step("isolated")
    assert [(r.label, r.verdict) for r in isolated.regions] == [("layers.0", "aligned"), ("layers.1", "aligned")]
    # the audit sees only dispatcher-level ops of the compiled graphs (the eager stack records 54 per layer)
    assert all(0 < r.forward_ops < 20 for r in isolated.regions)

    shared, grads_shared = _compiled_step("shared")
    (bad,) = shared.divergent
    assert bad.label == "layers.0" and bad.first_diff == 0
    assert bad.forward_op.startswith("aten.repeat_interleave")  # FLA's miss path, inside the compiled graph
    assert {(d.helper, d.forward, d.recompute) for d in bad.fla} >= {("prepare_position_ids", "miss", "hit")}
    # full AC replays nothing by index: the hazard is reported while the gradients stay right
    assert all(torch.equal(grads_shared[k], g) for k, g in grads_isolated.items())
