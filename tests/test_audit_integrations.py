"""ReplayAudit finds the regions that transformers' and torchtitan's checkpointing create, and names them."""

import pytest
import torch

from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.policies import sac_context_fn, save_all_copies


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


def test_transformers_gradient_checkpointing_regions_are_named_by_module_path():
    model = _tiny_llama()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac_context_fn(save_all_copies())}
    )
    ids = torch.randint(0, 64, (1, 12))
    with ReplayAudit(on_divergence="raise") as audit:
        model(input_ids=ids, labels=ids).loss.backward()
    assert [(r.label, r.verdict) for r in audit.regions] == [("model.layers.0", "aligned"), ("model.layers.1", "aligned")]


def test_transformers_context_fn_route_without_the_with_block():
    model = _tiny_llama()
    audit = ReplayAudit(model, on_divergence="raise")
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": audit.context_fn(sac_context_fn(save_all_copies()))}
    )
    ids = torch.randint(0, 64, (1, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    assert [r.label for r in audit.regions] == ["model.layers.0", "model.layers.1"]
    assert audit.ok


def test_torchtitan_ptd_checkpoint_wrapper_regions_are_audited():
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2))
    for i, layer in enumerate(layers):
        layers[i] = ac.ptd_checkpoint_wrapper(layer, preserve_rng_state=False)
    model = torch.nn.Sequential(*layers)
    with ReplayAudit(on_divergence="raise") as audit:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert [(r.label, r.verdict) for r in audit.regions] == [("0", "aligned"), ("1", "aligned")]
