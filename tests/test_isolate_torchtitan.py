"""isolate_seqlens on torchtitan 0.3's own Qwen3.5-MoE, with its per-call clone of ``cu_seq_q`` removed, on CPU.

torchtitan's ``GatedDeltaNet.forward`` clones ``attention_masks.cu_seq_q`` on every call (model.py:410, its
comment names FLA's identity cache), so as shipped it is safe. Without that line it is in the situation of
every other model: one ``VarlenMetadata`` per batch, its ``cu_seq_q`` handed to FLA by every block. The tests
remove the line (``torchtitan_gdn_forward_without_clone``: torchtitan's own source, that expression replaced)
and show that ``isolate_seqlens`` restores what the clone did. The model is the one of
``examples/torchtitan_qwen3_5.py`` (3 GatedDeltaNet + MoE blocks, torchtitan's config helpers), AC is
torchtitan's ``SelectiveAC`` extended to save ``aten.sub.Tensor`` (an op of FLA's cache-miss path). FLA's
calls are served by :func:`fla_ac_isolation.harness.reference_kernels.reference_kernels`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    INT_REPLAY,
    divergent,
    max_grad_diff,
    skip_unless_torchtitan_qwen3_5,
    torchtitan_gdn_forward_without_clone,
    torchtitan_qwen3_5,
)

from fla_ac_isolation import ReplayAudit, isolate_seqlens
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache

skip_unless_torchtitan_qwen3_5()
pytestmark = pytest.mark.usefixtures("single_thread", "served")

DOCS = (70, 23, 41)
GDN_PATHS = [f"layers.{i}.attn" for i in range(3)]


@pytest.fixture(scope="module")
def titan():
    return torchtitan_qwen3_5()


@pytest.fixture(scope="module")
def served(titan):
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    with reference_kernels() as served:
        yield served


@pytest.fixture
def without_clone(monkeypatch):
    import torchtitan.models.qwen3_5.model as titan_model

    monkeypatch.setattr(titan_model.GatedDeltaNet, "forward", torchtitan_gdn_forward_without_clone())


def _step(titan, model):
    from helpers import Step

    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    tokens = torch.randint(0, titan.VOCAB, positions.shape, generator=torch.Generator().manual_seed(1))
    masks = model.get_attention_masks(positions)  # one VarlenMetadata for every block
    clear_tensor_cache()
    with ReplayAudit(model, on_divergence="record") as audit:
        try:
            logits = model(tokens, attention_masks=masks, positions=positions, special_tokens=titan.SPECIAL_TOKENS)
            loss = F.cross_entropy(logits[0, :-1], tokens[0, 1:])
            loss.backward()
        except Exception as err:
            return Step(error=err), audit
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return Step(loss.detach(), grads), audit


@pytest.fixture(scope="module")
def no_ac(titan, served):
    return _step(titan, titan.build_model(64, 0))[0]


def _checkpointed(titan, isolate: str | None = None):
    model = titan.build_model(64, 0)
    handle = isolate_seqlens(model) if isolate == "before" else None
    titan.apply_ac(model, "torchtitan+sub")
    if isolate == "after":
        handle = isolate_seqlens(model)
    if isolate:  # after AC the mixers sit inside torchtitan's checkpoint wrappers
        wrapped = [path.replace(".attn", "._checkpoint_wrapped_module.attn") for path in GDN_PATHS]
        assert handle.paths == (GDN_PATHS if isolate == "before" else wrapped)
    return model


def _assert_equal_to(result, reference):
    assert result.error is None, result.error
    assert torch.equal(result.loss, reference.loss)
    assert max_grad_diff(result, reference) == 0.0


def test_as_shipped_its_clone_keeps_every_block_aligned(titan, no_ac):
    result, audit = _step(titan, _checkpointed(titan))
    assert audit.ok
    _assert_equal_to(result, no_ac)


@pytest.mark.usefixtures("without_clone")
@pytest.mark.parametrize("order", ["after", "before"], ids=["isolate-after-ac", "isolate-before-ac"])
def test_without_its_clone_sac_fails_and_isolate_seqlens_restores_it(titan, no_ac, order):
    shipped, shipped_audit = _step(titan, _checkpointed(titan))
    result, audit = _step(titan, _checkpointed(titan, isolate=order))

    assert isinstance(shipped.error, RuntimeError) and str(shipped.error) == INT_REPLAY
    assert divergent(shipped_audit) == [("layers.0", ["prepare_chunk_offsets"])]
    assert audit.ok and len(audit.regions) == 3
    _assert_equal_to(result, no_ac)
