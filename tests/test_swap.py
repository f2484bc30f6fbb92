"""swap_mixers / restore_mixers on tiny random transformers models of the three families, on CPU.

Families: Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``; the dense ``Qwen3_5ForCausalLM`` in the API tests),
Qwen3.8-Flash-Next (``Qwen4ExpForCausalLM``, with its indexed-attention layer and every indexer field set)
and Nemotron-H (``NemotronHForCausalLM``). 4 layers, hidden 64, built from configs (no hub download).
Packed batches come from transformers' own ``DataCollatorWithFlattening`` (``position_ids`` +
``cu_seq_lens_q/k`` + ``max_length_q/k``), 3 documents, one of them longer than a 64-token chunk.

Which code ran for the *unswapped* models, honestly:

* transformers' Qwen GDN mixers pick FLA's Triton kernels whenever ``fla`` imports, and those cannot run
  on a CPU (``RuntimeError: 0 active drivers``). :func:`_hf_torch_fallback` forces transformers' own
  pure-torch fallback instead: it re-applies transformers' kernel decorator to its torch function while
  ``fla`` is hidden from import, i.e. the exact path transformers takes when FLA is not installed (which
  refuses ``cu_seqlens``). The unpacked reference outputs and the state_dict round trip use it.
* To show the activation-checkpointing fault of the unswapped Qwen models on CPU, transformers' own GDN
  code must run with FLA's caching behaviour. :func:`_hf_fla_kernel_on_cpu` routes transformers' call of
  FLA's ``chunk_gated_delta_rule`` to ``fla_ac_isolation.ops.reference.chunk_gated_delta_rule``, which asks
  FLA's own index helpers (``prepare_chunk_indices``, ...) for the schedule with the kernel's arguments, so
  FLA's identity cache hits and misses exactly where the GPU kernel's would. transformers' conv stays its
  torch fallback (which ignores document boundaries; that is not what these tests measure).
* Nemotron-H has no FLA call in transformers: without mamba_ssm its torch path runs. It is immune to the
  cache fault (SAC matches no-AC) but lets state flow across packed documents; both are asserted.

After the swap every mixer is ours with the ``reference`` backend (``auto`` on CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DataCollatorWithFlattening,
    NemotronHConfig,
    NemotronHForCausalLM,
    Qwen3_5Config,  # noqa: F401  (imported to make sure the dense family exists in this transformers)
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback  # noqa: E402
from transformers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402

from fla_ac_isolation import mixers, restore_mixers, swap_mixers  # noqa: E402
from fla_ac_isolation.ops import reference  # noqa: E402
from fla_ac_isolation.policies import checkpoint_layers, sac_context_fn, save_all_copies, save_ops  # noqa: E402

aten = torch.ops.aten
VOCAB = 128
DOC_LENS = (70, 23, 41)  # 134 packed tokens; the first document spans two 64-token chunks


# ------------------------------------------------------------------------------------------- builders
def _qwen_fields(**extra):
    return dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, attn_implementation="sdpa", **extra,
    )


def _qwen3_5_moe() -> nn.Module:
    moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    layers = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_qwen_fields(layer_types=layers, **moe)))


def _qwen3_5_dense() -> nn.Module:
    layers = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_qwen_fields(layer_types=layers, intermediate_size=96)))


def _qwen3_8_flash_next() -> nn.Module:
    config = Qwen4ExpTextConfig(
        **_qwen_fields(
            layer_types=["linear_attention"] * 3 + ["indexed_attention"],
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            hc_count=2, hc_lowrank=8,
            # an indexed-attention layer needs every QSA indexer field
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        )
    )
    return Qwen4ExpForCausalLM(config)


def _nemotron_h() -> nn.Module:
    config = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, ssm_state_size=16,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=16, attn_implementation="sdpa",
    )
    return NemotronHForCausalLM(config)


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]
    modeling: str  # transformers modeling module of the family
    hf_mixer: str  # transformers mixer class
    ours: type  # our drop-in
    paths: tuple[str, ...]  # mixer paths in the tiny model

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        model = self.build()
        model.train()
        return model


_GDN_PATHS = tuple(f"model.layers.{i}.linear_attn" for i in range(3))
FAMILIES = {
    "qwen3_5_moe": Family(
        _qwen3_5_moe, "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet",
        mixers.Qwen3_5MoeGatedDeltaNet, _GDN_PATHS,
    ),
    "qwen3_8_flash_next": Family(
        _qwen3_8_flash_next, "transformers.models.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextGatedDeltaNet",
        mixers.Qwen3_8FlashNextGatedDeltaNet, _GDN_PATHS,
    ),
    "nemotron_h": Family(
        _nemotron_h, "transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer",
        mixers.NemotronHMamba2Mixer, ("model.layers.0.mixer", "model.layers.2.mixer"),
    ),
}
DENSE = Family(
    _qwen3_5_dense, "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet",
    mixers.Qwen3_5MoeGatedDeltaNet, _GDN_PATHS,
)
ALL_FAMILIES = {**FAMILIES, "qwen3_5_dense": DENSE}
QWEN = [name for name in FAMILIES if name != "nemotron_h"]


# ------------------------------------------------------------------------------------ which path ran
@contextlib.contextmanager
def _hf_torch_fallback(family: Family) -> Iterator[None]:
    """Make transformers' mixers of ``family`` run transformers' pure-torch GDN, as without FLA installed.

    transformers' decorator ``use_kernel_func_from_hub_with_fallback`` picks FLA when ``import fla``
    succeeds; re-applying it to the undecorated torch function while ``sys.modules["fla"] is None`` yields
    the wrapper transformers builds without FLA (torch function, refusing ``cu_seqlens``). Nemotron-H's
    functions already fall back (no mamba_ssm here), so nothing changes for it.
    """
    modeling = importlib.import_module(family.modeling)
    names = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
             "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}
    saved = {name: getattr(modeling, name) for name in names if hasattr(modeling, name)}
    hidden = sys.modules.get("fla")
    sys.modules["fla"] = None  # `import fla` raises ImportError while transformers resolves the kernel
    try:
        for name, fn in saved.items():
            setattr(modeling, name, use_kernel_func_from_hub_with_fallback(names[name], "fla")(inspect.unwrap(fn)))
    finally:
        sys.modules["fla"] = hidden
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling, name, fn)


def _fla_chunk_gated_delta_rule_on_cpu(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                       use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """FLA's ``chunk_gated_delta_rule`` as transformers calls it, computed by our reference backend.

    The reference asks FLA's index helpers for its chunk schedule with the arguments FLA's kernel passes,
    so FLA's identity cache sees the same hits and misses as on a GPU.
    """
    assert initial_state is None and not output_final_state  # training: no cache
    out = reference.chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens
    )
    return out, None


@contextlib.contextmanager
def _hf_fla_kernel_on_cpu(family: Family) -> Iterator[None]:
    """Run transformers' Qwen GDN with its FLA call served on CPU by :func:`_fla_chunk_gated_delta_rule_on_cpu`."""
    modeling = importlib.import_module(family.modeling)
    saved = modeling.torch_chunk_gated_delta_rule
    modeling.torch_chunk_gated_delta_rule = _fla_chunk_gated_delta_rule_on_cpu
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule = saved


# --------------------------------------------------------------------------------------- batches, runs
def _documents(seed: int = 0, lens=DOC_LENS) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lens]


def _packed_batch(seed: int = 0, lens=DOC_LENS) -> dict:
    """A fresh packed batch (new tensor objects every call, as a data loader gives every step)."""
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(_documents(seed, lens))
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    return dict(batch)


def _unpacked_batch(seed: int = 0, batch: int = 2, tokens: int = 80) -> dict:
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _set_checkpointing(model: nn.Module, policy) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 calls these deprecated aliases
        if policy is None:
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac_context_fn(policy)}
            )


@dataclass
class Step:
    loss: torch.Tensor | None = None
    grads: dict | None = None
    error: BaseException | None = None


def _train_step(model: nn.Module, batch: dict) -> Step:
    """One forward + backward on ``batch``; an exception is returned, not raised."""
    model.zero_grad(set_to_none=True)
    try:
        out = model(**batch, use_cache=False)
        out.loss.backward()
    except Exception as err:  # noqa: BLE001 - the unsafe path is expected to fail in several ways
        return Step(error=err)
    grads = {  # named as in state_dict(), also under torch's checkpoint_wrapper
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return Step(out.loss.detach().clone(), grads)


def _max_grad_diff(a: Step, b: Step) -> float:
    assert a.grads.keys() == b.grads.keys()
    return max((a.grads[n] - b.grads[n]).abs().max().item() for n in a.grads)


def _logits(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits


POLICIES = {
    "save-all-copies": save_all_copies,  # FLA's int32 miss path casts with _to_copy
    "save-int-sub": lambda: save_ops([aten.sub.Tensor], dtypes=[torch.int32, torch.int64]),
}


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one intra-op thread


# ------------------------------------------------------------------------------------------ API tests
@pytest.mark.parametrize("name", list(ALL_FAMILIES))
def test_swap_shares_parameter_objects_and_keeps_state_dict_keys(name):
    family = ALL_FAMILIES[name]
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
    model = FAMILIES["qwen3_5_moe"].model()
    swap_mixers(model)
    with pytest.warns(UserWarning, match="nothing to swap"):
        assert swap_mixers(model) == []


def test_model_built_from_our_mixers_needs_no_swap():
    config = FAMILIES["nemotron_h"].model().config
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
    model = FAMILIES["nemotron_h"].model()
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
    text = FAMILIES[kind].model().config.to_dict()
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=vision)).train()

    paths = swap_mixers(model)  # the mixers' config is the language model's text config

    assert paths == [f"model.language_model.layers.{i}.linear_attn" for i in range(3)]
    _set_checkpointing(model, save_all_copies())
    step = _train_step(model, _packed_batch())
    assert step.error is None, step.error


def test_unknown_backend_is_refused_before_anything_changes():
    model = FAMILIES["nemotron_h"].model()
    with pytest.raises(ValueError, match="backend"):
        swap_mixers(model, backend="triton")
    assert type(model.get_submodule("model.layers.0.mixer")).__name__ == "NemotronHMamba2Mixer"
    assert type(model.get_submodule("model.layers.0.mixer")) is not mixers.NemotronHMamba2Mixer


def test_mixer_with_hooks_is_refused():
    model = FAMILIES["nemotron_h"].model()
    model.get_submodule("model.layers.2.mixer").register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks"):
        swap_mixers(model)
    assert not any(isinstance(m, mixers.NemotronHMamba2Mixer) for m in model.modules())  # all or nothing


@pytest.mark.parametrize("fn", [swap_mixers, restore_mixers], ids=["swap_mixers", "restore_mixers"])
def test_non_module_model_is_refused_naming_the_argument(fn):
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got dict"):
        fn({})


def test_restore_on_the_swapped_mixer_itself_is_refused_and_changes_nothing():
    family = FAMILIES["nemotron_h"]
    model = family.model()
    swap_mixers(model)
    mixer = model.get_submodule(family.paths[0])
    keys = list(mixer.state_dict())
    with pytest.raises(ValueError, match="containing the swapped mixer, not the swapped mixer itself"):
        restore_mixers(mixer)
    assert list(mixer.state_dict()) == keys  # before the check, the original became a child named ""
    assert restore_mixers(model) == list(family.paths)


@pytest.mark.parametrize("name", list(ALL_FAMILIES))
def test_restore_mixers_puts_transformers_classes_back_on_the_same_parameters(name):
    family = ALL_FAMILIES[name]
    model = family.model()
    params = dict(model.named_parameters())
    with _hf_torch_fallback(family):
        expected = _logits(model, _unpacked_batch())
    swap_mixers(model)

    assert restore_mixers(model) == list(family.paths)

    for path in family.paths:
        assert type(model.get_submodule(path)).__qualname__ == family.hf_mixer
        assert type(model.get_submodule(path)).__module__ == family.modeling
    assert all(p is params[n] for n, p in model.named_parameters())
    with _hf_torch_fallback(family):
        assert torch.equal(_logits(model, _unpacked_batch()), expected)
    with pytest.warns(UserWarning, match="nothing to restore"):
        assert restore_mixers(model) == []
    assert swap_mixers(model) == list(family.paths)  # and it can be swapped again


def test_optimizer_built_before_the_swap_keeps_training_the_same_tensors():
    family = FAMILIES["qwen3_5_moe"]
    model = family.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _hf_torch_fallback(family):  # unswapped: transformers' torch GDN on an unpacked batch
        assert _train_step(model, _unpacked_batch()).error is None
    opt.step()
    with_state = {id(p) for p in opt.state}
    assert with_state == {id(p) for p in model.parameters()}

    swap_mixers(model)

    assert {id(p) for p in model.parameters()} == with_state  # every parameter keeps its AdamW state
    step = _train_step(model, _packed_batch())
    assert step.error is None, step.error
    opt.step()
    assert all(opt.state[p]["step"] == 2 for p in model.parameters())


@pytest.mark.parametrize("order", ["swap-then-checkpointing", "checkpointing-then-swap", "checkpoint_layers-then-swap"])
def test_swap_works_before_or_after_gradient_checkpointing_enable(order):
    family = FAMILIES["qwen3_5_moe"]
    ref = family.model()
    swap_mixers(ref)
    expected = _train_step(ref, _packed_batch())

    model = family.model()
    if order == "swap-then-checkpointing":
        swap_mixers(model)
        _set_checkpointing(model, save_all_copies())
    elif order == "checkpointing-then-swap":
        _set_checkpointing(model, save_all_copies())
        swap_mixers(model)
    else:  # torch's checkpoint_wrapper around each decoder layer, as torchtitan applies it
        checkpoint_layers(model, "selective", save_all_copies())
        wrapped = [p.replace("linear_attn", "_checkpoint_wrapped_module.linear_attn") for p in family.paths]
        assert swap_mixers(model) == wrapped
    got = _train_step(model, _packed_batch())

    assert got.error is None, got.error
    assert torch.equal(got.loss, expected.loss)
    assert _max_grad_diff(got, expected) == 0.0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_meta_built_model_is_swapped_then_materialised_from_a_state_dict(name):
    family = FAMILIES[name]
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

    batch = _packed_batch()
    assert torch.equal(_logits(model, batch), _logits(ref, batch))


# ------------------------------------------------------------------------------- the fault and the fix
CASES = [  # every family under save-all-copies; the int-sub policy once, on Qwen3.5-MoE
    *[pytest.param(name, "save-all-copies", id=f"{name}-save-all-copies") for name in FAMILIES],
    pytest.param("qwen3_5_moe", "save-int-sub", id="qwen3_5_moe-save-int-sub"),
]


@pytest.mark.parametrize(("name", "policy"), [c for c in CASES if c.values[0] in QWEN])
def test_unswapped_qwen_under_sac_on_a_packed_batch_raises_or_diverges(name, policy):
    family = FAMILIES[name]
    model = family.model()
    with _hf_fla_kernel_on_cpu(family):  # transformers' GDN code, FLA's cache behaviour (see module doc)
        reference_step = _train_step(model, _packed_batch())
        _set_checkpointing(model, POLICIES[policy]())
        sac = _train_step(model, _packed_batch())

    assert reference_step.error is None, reference_step.error
    if sac.error is None:
        assert _max_grad_diff(sac, reference_step) > 1e-4, "shared cu_seq_lens_q went unnoticed"
    # What it is today (torch 2.13, FLA 0.6.0): the MoE router's histogram receives one of FLA's int tensors
    # (save-all-copies) or autograd meets an int tensor where a float one was saved (save-int-sub).


def test_unswapped_qwen_torch_fallback_refuses_packed_sequences():
    family = FAMILIES["qwen3_5_moe"]
    model = family.model()
    with _hf_torch_fallback(family):
        step = _train_step(model, _packed_batch())
    assert isinstance(step.error, ValueError)
    assert "packed sequences" in str(step.error)


def test_unswapped_nemotron_h_is_immune_to_the_cache_fault_but_mixes_documents():
    family = FAMILIES["nemotron_h"]
    model = family.model()
    no_ac = _train_step(model, _packed_batch())
    _set_checkpointing(model, save_all_copies())
    sac = _train_step(model, _packed_batch())
    assert no_ac.error is None and sac.error is None
    assert torch.equal(sac.loss, no_ac.loss)  # transformers' torch path never calls FLA: nothing to misalign
    assert _max_grad_diff(sac, no_ac) == 0.0
    assert _packed_vs_per_document(model) > 1e-3  # but state flows across packed documents


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_swapped_model_under_sac_matches_its_no_ac_run(name, policy):
    family = FAMILIES[name]
    model = family.model()
    swap_mixers(model)
    no_ac = _train_step(model, _packed_batch())
    _set_checkpointing(model, POLICIES[policy]())
    sac = _train_step(model, _packed_batch())

    assert no_ac.error is None, no_ac.error
    assert sac.error is None, sac.error
    assert torch.equal(sac.loss, no_ac.loss)
    assert sac.grads.keys() == no_ac.grads.keys()
    mixer_params = {f"{path}.{n}" for path in family.paths for n, _ in model.get_submodule(path).named_parameters()}
    assert mixer_params <= no_ac.grads.keys()  # (Qwen4Exp's QSA indexer is not differentiable: no grads there)
    assert _max_grad_diff(sac, no_ac) == 0.0


@pytest.mark.parametrize("name", list(ALL_FAMILIES))
def test_swapped_unpacked_outputs_match_transformers_torch_path(name):
    family = ALL_FAMILIES[name]
    model = family.model()
    batch = _unpacked_batch()
    with _hf_torch_fallback(family):  # the unswapped reference runs transformers' torch GDN (see module doc)
        expected = _logits(model, batch)
    swap_mixers(model)
    got = _logits(model, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _packed_vs_per_document(model: nn.Module) -> float:
    """Largest |logit| difference between the packed batch and each document run alone."""
    packed = _logits(model, _packed_batch())[0]
    alone = torch.cat(
        [_logits(model, {"input_ids": torch.tensor([doc["input_ids"]])})[0] for doc in _documents()]
    )
    return (packed - alone).abs().max().item()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_swapped_packed_batch_equals_documents_run_alone(name):
    model = FAMILIES[name].model()
    swap_mixers(model)
    assert _packed_vs_per_document(model) < 1e-5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_state_dict_saved_before_swap_loads_after_swap(name):
    family = FAMILIES[name]
    source = family.model(seed=0)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    batch = _unpacked_batch()
    with _hf_torch_fallback(family):
        expected = _logits(source, batch)

    target = family.model(seed=1)
    swap_mixers(target)
    buffer.seek(0)
    result = target.load_state_dict(torch.load(buffer, weights_only=True), strict=True)

    assert not result.missing_keys and not result.unexpected_keys
    swap_mixers(source)
    assert torch.equal(_logits(target, batch), _logits(source, batch))
    torch.testing.assert_close(_logits(target, batch), expected, rtol=0, atol=1e-5)
