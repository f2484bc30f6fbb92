"""swap_mixers / restore_mixers on tiny random transformers models of the three families, on CPU.

Families: Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``; the dense ``Qwen3_5ForCausalLM`` in the API tests),
Qwen3.8-Flash-Next (``Qwen4ExpForCausalLM``, with its indexed-attention layer and every indexer field set)
and Nemotron-H (``NemotronHForCausalLM``). 4 layers, hidden 64, built from configs (no hub download).
Packed batches come from transformers' own ``DataCollatorWithFlattening`` (``position_ids`` +
``cu_seq_lens_q/k`` + ``max_length_q/k``), 3 documents, one of them longer than a 64-token chunk.

Which code ran for the *unswapped* models, honestly:

* transformers' Qwen GDN mixers pick FLA's Triton kernels whenever ``fla`` imports, and those cannot run
  on a CPU (``RuntimeError: 0 active drivers``). :func:`hf_torch_fallback` forces transformers' own
  pure-torch fallback instead: it re-applies transformers' kernel decorator to its torch function while
  ``fla`` is hidden from import, i.e. the exact path transformers takes when FLA is not installed (which
  refuses ``cu_seqlens``). The unpacked reference outputs and the state_dict round trip use it.
* To show the activation-checkpointing fault of the unswapped Qwen models on CPU, transformers' own GDN
  code must run with FLA's caching behaviour. :func:`hf_fla_kernel_on_cpu` routes transformers' call of
  FLA's ``chunk_gated_delta_rule`` to ``fla_ac_isolation.ops.reference.chunk_gated_delta_rule``, which asks
  FLA's own index helpers (``prepare_chunk_indices``, ...) for the schedule with the kernel's arguments, so
  FLA's identity cache hits and misses exactly where the GPU kernel's would. transformers' conv stays its
  torch fallback (which ignores document boundaries; that is not what these tests measure).
* Nemotron-H has no FLA call in transformers: without mamba_ssm its torch path runs. It is immune to the
  cache fault (SAC matches no-AC) but lets state flow across packed documents; both are asserted.

After the swap every mixer is ours with the ``reference`` backend (``auto`` on CPU).
"""

from __future__ import annotations

import io

import pytest
import torch
from helpers import (
    ALL_MODEL_FAMILIES,
    MODEL_FAMILIES,
    QWEN,
    SWAP_POLICIES,
    UNSWAPPED_QWEN_UNDER_SAC,
    documents,
    hf_fla_kernel_on_cpu,
    hf_torch_fallback,
    logits_of,
    max_grad_diff,
    packed_batch,
    raise_unrelated,
    set_checkpointing,
    train_step,
    unpacked_batch,
)
from torch import nn

from fla_ac_isolation import mixers, restore_mixers, swap_mixers
from fla_ac_isolation.mixers import DropIn
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies

aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one intra-op thread


# ------------------------------------------------------------------------------------------ API tests
@pytest.mark.parametrize("name", list(ALL_MODEL_FAMILIES))
def test_swap_shares_parameter_objects_and_keeps_state_dict_keys(name):
    family = ALL_MODEL_FAMILIES[name]
    model = family.model()
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())

    swapped = swap_mixers(model)

    assert swapped == list(family.paths)
    for path in family.paths:
        assert type(model.get_submodule(path)) is family.ours
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before)
    assert list(model.state_dict()) == keys_before


def test_second_swap_swaps_nothing_and_warns():
    model = MODEL_FAMILIES["qwen3_5_moe"].model()
    swap_mixers(model)
    with pytest.warns(UserWarning, match="nothing to swap"):
        assert swap_mixers(model) == []


def test_model_built_from_our_mixers_needs_no_swap():
    config = MODEL_FAMILIES["nemotron_h"].model().config
    model = nn.ModuleList([mixers.NemotronHMamba2Mixer(config, layer_idx=0)])
    with pytest.warns(UserWarning, match="nothing to swap"):
        assert swap_mixers(model) == []


def test_model_without_supported_mixer_raises_naming_the_classes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="no supported mixer") as err:
        swap_mixers(model)
    for cls in ("Qwen3_5MoeGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen4ExpTextGatedDeltaNet", "NemotronHMamba2Mixer"):
        assert cls in str(err.value)


@pytest.mark.parametrize("backend", ["reference", "fla"])
def test_backend_reaches_every_swapped_mixer(backend):
    model = MODEL_FAMILIES["nemotron_h"].model()
    swap_mixers(model, backend=backend)
    assert [m.backend for m in model.modules() if isinstance(m, mixers.NemotronHMamba2Mixer)] == [backend] * 2


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_8_flash_next"])
def test_swap_finds_the_language_model_mixers_of_multimodal_models(kind):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen4_exp import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    config_cls, model_cls = {
        "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration),
        "qwen3_8_flash_next": (Qwen4ExpConfig, Qwen4ExpForConditionalGeneration),
    }[kind]
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    text = MODEL_FAMILIES[kind].model().config.to_dict()
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=vision)).train()

    paths = swap_mixers(model)  # the mixers' config is the language model's text config

    assert paths == [f"model.language_model.layers.{i}.linear_attn" for i in range(3)]
    set_checkpointing(model, save_all_copies())
    step = train_step(model, packed_batch())
    assert step.error is None, step.error


def test_unknown_backend_is_refused_before_anything_changes():
    model = MODEL_FAMILIES["nemotron_h"].model()
    with pytest.raises(ValueError, match="backend"):
        swap_mixers(model, backend="triton")
    assert type(model.get_submodule("model.layers.0.mixer")).__name__ == "NemotronHMamba2Mixer"
    assert type(model.get_submodule("model.layers.0.mixer")) is not mixers.NemotronHMamba2Mixer


def test_a_mixer_keeps_its_hooks_and_one_whose_forward_is_replaced_on_the_instance_is_refused():
    """The swap changes the module's class only: its hooks stay and fire. A forward set on the instance
    (accelerate's device_map hooks, kernelize) would shadow the drop-in's: refused, and nothing is swapped."""
    model = MODEL_FAMILIES["nemotron_h"].model()
    mixer = model.get_submodule("model.layers.2.mixer")
    seen = []
    mixer.register_forward_hook(lambda module, args, out: seen.append(type(module).__name__))
    swap_mixers(model)
    model(**unpacked_batch())
    assert seen == ["NemotronHMamba2Mixer"] and isinstance(mixer, DropIn)
    restore_mixers(model)

    mixer.forward = mixer.forward  # a bound method on the instance, as accelerate leaves it
    with pytest.raises(ValueError, match=r"swap_mixers cannot swap 'model.layers.2.mixer': its forward is replaced "
                                         r"on the instance"):
        swap_mixers(model)
    assert not any(isinstance(m, DropIn) for m in model.modules())  # all or nothing


@pytest.mark.parametrize("fn", [swap_mixers, restore_mixers], ids=["swap_mixers", "restore_mixers"])
def test_non_module_model_is_refused_naming_the_argument(fn):
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got dict"):
        fn({})


def test_restore_on_the_swapped_mixer_itself_is_refused_and_changes_nothing():
    family = MODEL_FAMILIES["nemotron_h"]
    model = family.model()
    swap_mixers(model)
    mixer = model.get_submodule(family.paths[0])
    keys = list(mixer.state_dict())
    with pytest.raises(ValueError, match="containing the swapped mixer, not the swapped mixer itself"):
        restore_mixers(mixer)
    assert list(mixer.state_dict()) == keys  # before the check, the original became a child named ""
    assert restore_mixers(model) == list(family.paths)


@pytest.mark.parametrize("name", list(ALL_MODEL_FAMILIES))
def test_restore_mixers_puts_transformers_classes_back_on_the_same_parameters(name):
    family = ALL_MODEL_FAMILIES[name]
    model = family.model()
    params = dict(model.named_parameters())
    with hf_torch_fallback(family):
        expected = logits_of(model, unpacked_batch())
    swap_mixers(model)

    assert restore_mixers(model) == list(family.paths)

    for path in family.paths:
        assert type(model.get_submodule(path)).__qualname__ == family.hf_mixer
        assert type(model.get_submodule(path)).__module__ == family.modeling
    assert all(p is params[n] for n, p in model.named_parameters())
    with hf_torch_fallback(family):
        assert torch.equal(logits_of(model, unpacked_batch()), expected)
    with pytest.warns(UserWarning, match="nothing to restore"):
        assert restore_mixers(model) == []
    assert swap_mixers(model) == list(family.paths)  # and it can be swapped again


def test_optimizer_built_before_the_swap_keeps_training_the_same_tensors():
    family = MODEL_FAMILIES["qwen3_5_moe"]
    model = family.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hf_torch_fallback(family):  # unswapped: transformers' torch GDN on an unpacked batch
        assert train_step(model, unpacked_batch()).error is None
    opt.step()
    with_state = {id(p) for p in opt.state}
    assert with_state == {id(p) for p in model.parameters()}

    swap_mixers(model)

    assert {id(p) for p in model.parameters()} == with_state  # every parameter keeps its AdamW state
    step = train_step(model, packed_batch())
    assert step.error is None, step.error
    opt.step()
    assert all(opt.state[p]["step"] == 2 for p in model.parameters())


@pytest.mark.parametrize("order", ["swap-then-checkpointing", "checkpointing-then-swap", "checkpoint_layers-then-swap"])
def test_swap_works_before_or_after_gradient_checkpointing_enable(order):
    family = MODEL_FAMILIES["qwen3_5_moe"]
    ref = family.model()
    swap_mixers(ref)
    expected = train_step(ref, packed_batch())

    model = family.model()
    if order == "swap-then-checkpointing":
        swap_mixers(model)
        set_checkpointing(model, save_all_copies())
    elif order == "checkpointing-then-swap":
        set_checkpointing(model, save_all_copies())
        swap_mixers(model)
    else:  # torch's checkpoint_wrapper around each decoder layer, as torchtitan applies it
        checkpoint_layers(model, "selective", save_all_copies())
        wrapped = [p.replace("linear_attn", "_checkpoint_wrapped_module.linear_attn") for p in family.paths]
        assert swap_mixers(model) == wrapped
    got = train_step(model, packed_batch())

    assert got.error is None, got.error
    assert torch.equal(got.loss, expected.loss)
    assert max_grad_diff(got, expected) == 0.0


@pytest.mark.parametrize("name", list(MODEL_FAMILIES))
def test_meta_built_model_is_swapped_then_materialised_from_a_state_dict(name):
    family = MODEL_FAMILIES[name]
    ref = family.model()
    swap_mixers(ref)
    with torch.device("meta"):
        model = family.build()
    assert swap_mixers(model) == list(family.paths)

    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict(), strict=True)
    for buf_name, buf in ref.named_buffers():  # non-persistent buffers (rotary inv_freq, ...) are not saved
        model.get_buffer(buf_name).copy_(buf)
    model.train()

    batch = packed_batch()
    assert torch.equal(logits_of(model, batch), logits_of(ref, batch))


# ------------------------------------------------------------------------------- the fault and the fix
CASES = [  # every family under save-all-copies; the int-sub policy once, on Qwen3.5-MoE
    *[pytest.param(name, "save-all-copies", id=f"{name}-save-all-copies") for name in MODEL_FAMILIES],
    pytest.param("qwen3_5_moe", "save-int-sub", id="qwen3_5_moe-save-int-sub"),
]


@pytest.mark.parametrize(("name", "policy"), [c for c in CASES if c.values[0] in QWEN])
def test_unswapped_qwen_under_sac_on_a_packed_batch_fails_as_predicted(name, policy):
    """The control: transformers' own model, one shared cu_seq_lens_q, fails exactly as
    ``helpers.UNSWAPPED_QWEN_UNDER_SAC`` says (error class and message), not with any error."""
    family = MODEL_FAMILIES[name]
    model = family.model()
    with hf_fla_kernel_on_cpu(family):  # transformers' GDN code, FLA's cache behaviour (see module doc)
        reference_step = train_step(model, packed_batch())
        set_checkpointing(model, SWAP_POLICIES[policy]())
        sac = train_step(model, packed_batch())

    assert reference_step.error is None, reference_step.error
    UNSWAPPED_QWEN_UNDER_SAC[policy].check(sac.error)


def test_the_control_fails_when_the_policy_raises_an_unrelated_error(monkeypatch):
    """Mutation check: the control above must not pass on just any exception."""
    monkeypatch.setitem(SWAP_POLICIES, "save-all-copies", lambda: raise_unrelated)
    with pytest.raises(AssertionError, match="got RuntimeError: unrelated failure inside the SAC policy"):
        test_unswapped_qwen_under_sac_on_a_packed_batch_fails_as_predicted("qwen3_5_moe", "save-all-copies")


def test_unswapped_qwen_torch_fallback_refuses_packed_sequences():
    family = MODEL_FAMILIES["qwen3_5_moe"]
    model = family.model()
    with hf_torch_fallback(family):
        step = train_step(model, packed_batch())
    assert isinstance(step.error, ValueError)
    assert "packed sequences" in str(step.error)


def test_unswapped_nemotron_h_is_immune_to_the_cache_fault_but_mixes_documents():
    family = MODEL_FAMILIES["nemotron_h"]
    model = family.model()
    no_ac = train_step(model, packed_batch())
    set_checkpointing(model, save_all_copies())
    sac = train_step(model, packed_batch())
    assert no_ac.error is None and sac.error is None
    assert torch.equal(sac.loss, no_ac.loss)  # transformers' torch path never calls FLA: nothing to misalign
    assert max_grad_diff(sac, no_ac) == 0.0
    assert _packed_vs_per_document(model) > 1e-3  # but state flows across packed documents


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_swapped_model_under_sac_matches_its_no_ac_run(name, policy):
    family = MODEL_FAMILIES[name]
    model = family.model()
    swap_mixers(model)
    no_ac = train_step(model, packed_batch())
    set_checkpointing(model, SWAP_POLICIES[policy]())
    sac = train_step(model, packed_batch())

    assert no_ac.error is None, no_ac.error
    assert sac.error is None, sac.error
    assert torch.equal(sac.loss, no_ac.loss)
    assert sac.grads.keys() == no_ac.grads.keys()
    mixer_params = {f"{path}.{n}" for path in family.paths for n, _ in model.get_submodule(path).named_parameters()}
    assert mixer_params <= no_ac.grads.keys()  # (Qwen4Exp's QSA indexer is not differentiable: no grads there)
    assert max_grad_diff(sac, no_ac) == 0.0


@pytest.mark.parametrize("name", list(ALL_MODEL_FAMILIES))
def test_swapped_unpacked_outputs_match_transformers_torch_path(name):
    family = ALL_MODEL_FAMILIES[name]
    model = family.model()
    batch = unpacked_batch()
    with hf_torch_fallback(family):  # the unswapped reference runs transformers' torch GDN (see module doc)
        expected = logits_of(model, batch)
    swap_mixers(model)
    got = logits_of(model, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _packed_vs_per_document(model: nn.Module) -> float:
    """Largest |logit| difference between the packed batch and each document run alone."""
    packed = logits_of(model, packed_batch())[0]
    alone = torch.cat(
        [logits_of(model, {"input_ids": torch.tensor([doc["input_ids"]])})[0] for doc in documents()]
    )
    return (packed - alone).abs().max().item()


@pytest.mark.parametrize("name", list(MODEL_FAMILIES))
def test_swapped_packed_batch_equals_documents_run_alone(name):
    model = MODEL_FAMILIES[name].model()
    swap_mixers(model)
    assert _packed_vs_per_document(model) < 1e-5


@pytest.mark.parametrize("name", list(MODEL_FAMILIES))
def test_state_dict_saved_before_swap_loads_after_swap(name):
    family = MODEL_FAMILIES[name]
    source = family.model(seed=0)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    batch = unpacked_batch()
    with hf_torch_fallback(family):
        expected = logits_of(source, batch)

    target = family.model(seed=1)
    swap_mixers(target)
    buffer.seek(0)
    result = target.load_state_dict(torch.load(buffer, weights_only=True), strict=True)

    assert not result.missing_keys and not result.unexpected_keys
    swap_mixers(source)
    assert torch.equal(logits_of(target, batch), logits_of(source, batch))
    torch.testing.assert_close(logits_of(target, batch), expected, rtol=0, atol=1e-5)
