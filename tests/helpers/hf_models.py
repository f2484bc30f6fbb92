"""Whole transformers models of every upstream mixer class, tiny, for the swap tests: builders, which path
transformers' mixers run (its torch fallback, FLA's kernel served on CPU), packed batches, one training step."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    DataCollatorWithFlattening,
    NemotronHConfig,
    NemotronHForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from fla_ac_isolation import families, foreign_classes
from fla_ac_isolation.harness.transformers_kernels import torch_fallback
from fla_ac_isolation.mixers import family_drop_in
from fla_ac_isolation.ops import reference
from fla_ac_isolation.policies import sac_context_fn, save_all_copies, save_ops

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
class ModelFamily:
    """A tiny transformers model of one upstream mixer class, and where its mixers sit."""

    build: Callable[[], nn.Module]
    family: families.Family  # the library's registry entry
    upstream: foreign_classes.UpstreamMixer  # the transformers mixer class (the library's registry)
    ours: type  # our drop-in
    paths: tuple[str, ...]  # mixer paths in the tiny model

    @property
    def modeling(self) -> str:
        """The transformers modeling module of the family."""
        return self.upstream.module

    @property
    def hf_mixer(self) -> str:
        """The transformers mixer class name."""
        return self.upstream.name

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        model = self.build()
        model.train()
        return model


def _model_family(build, family: str, upstream: int, paths: tuple[str, ...]) -> ModelFamily:
    entry = families.FAMILIES[family]
    return ModelFamily(build, entry, entry.upstream[upstream], family_drop_in(entry, entry.upstream[upstream]), paths)


_GDN_PATHS = tuple(f"model.layers.{i}.linear_attn" for i in range(3))
MODEL_FAMILIES = {
    "qwen3_5_moe": _model_family(_qwen3_5_moe, "qwen3_5_moe", 0, _GDN_PATHS),
    "qwen3_8_flash_next": _model_family(_qwen3_8_flash_next, "qwen3_8", 0, _GDN_PATHS),
    "nemotron_h": _model_family(_nemotron_h, "nemotron_h", 0, ("model.layers.0.mixer", "model.layers.2.mixer")),
}
DENSE = _model_family(_qwen3_5_dense, "qwen3_5_moe", 1, _GDN_PATHS)
ALL_MODEL_FAMILIES = {**MODEL_FAMILIES, "qwen3_5_dense": DENSE}
QWEN = [name for name, model in MODEL_FAMILIES.items() if model.family.layer == "gdn"]  # the GDN models


# ------------------------------------------------------------------------------------ which path ran
@contextlib.contextmanager
def hf_torch_fallback(family: ModelFamily) -> Iterator[None]:
    """Make transformers' mixers of ``family`` run transformers' pure-torch GDN, as without FLA installed
    (:func:`fla_ac_isolation.harness.transformers_kernels.torch_fallback`: transformers >= 5.25 does so by itself
    on a CPU). Nemotron-H's functions already fall back (no mamba_ssm here), so nothing changes for it."""
    names = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
             "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}
    with torch_fallback(importlib.import_module(family.modeling), names):
        yield


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
def hf_fla_kernel_on_cpu(family: ModelFamily) -> Iterator[None]:
    """Run transformers' Qwen GDN with its FLA call served on CPU by :func:`_fla_chunk_gated_delta_rule_on_cpu`."""
    modeling = importlib.import_module(family.modeling)
    saved = modeling.torch_chunk_gated_delta_rule
    modeling.torch_chunk_gated_delta_rule = _fla_chunk_gated_delta_rule_on_cpu
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule = saved


# --------------------------------------------------------------------------------------- batches, runs
def documents(seed: int = 0, lens=DOC_LENS) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lens]


def packed_batch(seed: int = 0, lens=DOC_LENS) -> dict:
    """A fresh packed batch (new tensor objects every call, as a data loader gives every step)."""
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(documents(seed, lens))
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    return dict(batch)


def unpacked_batch(seed: int = 0, batch: int = 2, tokens: int = 80) -> dict:
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def set_checkpointing(model: nn.Module, policy) -> None:
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


def train_step(model: nn.Module, batch: dict) -> Step:
    """One forward + backward on ``batch``; an exception is returned, not raised."""
    model.zero_grad(set_to_none=True)
    try:
        out = model(**batch, use_cache=False)
        out.loss.backward()
    except Exception as err:
        return Step(error=err)
    grads = {  # named as in state_dict(), also under torch's checkpoint_wrapper
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return Step(out.loss.detach().clone(), grads)


def max_grad_diff(a: Step, b: Step) -> float:
    assert a.grads.keys() == b.grads.keys()
    return max((a.grads[n] - b.grads[n]).abs().max().item() for n in a.grads)


def logits_of(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits


SWAP_POLICIES = {
    "save-all-copies": save_all_copies,  # FLA's int32 miss path casts with _to_copy
    "save-int-sub": lambda: save_ops([aten.sub.Tensor], dtypes=[torch.int32, torch.int64]),
}
