"""Tiny models of other libraries' FLA-backed families (transformers, ``fla.models``), float32 on the CPU, each with
one packed batch of 3 documents: what ``fla-ac-isolation check --model <name>`` builds. FLA models are built with
``fuse_cross_entropy=False`` (no CPU stand-in for FLA's fused loss); their labels are ``-100`` at each document's
first token."""

from __future__ import annotations

import importlib
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "DOC_LENS", "TRANSFORMERS_TINY", "VOCAB", "ForeignRecipe", "build_tiny", "family_model_type", "packed_batch",
    "tiny_names",
]

VOCAB = 128
DOC_LENS = (70, 23, 41)
"""Tokens of the three packed documents (134 in all; the first spans two of FLA's 64-token chunks)."""

_HF = "transformers.models"
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, attn_implementation="sdpa", pad_token_id=0,
               bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, use_cache=False)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
            intermediate_size=128, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            mlp_layer_types=["dense"] * 4)
_LINEAR = ["linear_attention"] * 3 + ["full_attention"]


@dataclass(frozen=True)
class ForeignRecipe:
    """A tiny transformers model: its config class, causal LM class (``"module.Class"``) and config fields."""

    config: str
    model: str
    fields: tuple[tuple[str, Any], ...]


def _recipe(folder: str, config: str, model: str, **fields: Any) -> ForeignRecipe:
    base = f"{_HF}.{folder}"
    return ForeignRecipe(f"{base}.configuration_{folder}.{config}", f"{base}.modeling_{folder}.{model}",
                      tuple({**_COMMON, **fields}.items()))


TRANSFORMERS_TINY: dict[str, ForeignRecipe] = {
    "qwen3_5_text": _recipe("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **_GDN, **_ATTN,
                            intermediate_size=128, layer_types=_LINEAR),
    "qwen3_5_moe_text": _recipe("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", **_GDN, **_ATTN,
                                **_MOE, layer_types=_LINEAR),
    "qwen4_exp_text": _recipe("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", **_GDN, **_ATTN, **_MOE,
                              output_gate_type="sigmoid", layer_types=["linear_attention"] * 3 + ["indexed_attention"],
                              hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                              indexer_budget=8, indexer_compress_ratio=4),
    "qwen3_next": _recipe("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", **_GDN, **_ATTN, **_MOE,
                          intermediate_size=128, layer_types=_LINEAR),
    "olmo_hybrid": _recipe("olmo_hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM", **_GDN, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, layer_types=_LINEAR),
    "lara_mini": _recipe("lara_mini", "LaraMiniConfig", "LaraMiniForCausalLM", **_GDN, **_ATTN, **_MOE,
                         layer_types=_LINEAR),
    "kimi_linear": _recipe("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", **_MLA, layer_types=_LINEAR),
    "bailing_hybrid": _recipe("bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", **_MLA,
                              n_group=1, topk_group=1, num_mtp_layers=0, layer_types=_LINEAR),
    "nemotron_h": _recipe("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM", **_ATTN, intermediate_size=128,
                          layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention"],
                          ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=16),
}
"""Tiny transformers models by ``model_type``."""

_FLA_FIELDS = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_heads=4, head_dim=16, expand_v=1,
                   fuse_cross_entropy=False, fuse_linear_cross_entropy=False, use_cache=False)


def _import(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _fla_configs() -> dict[str, type]:
    from fla_ac_isolation.harness.fla_seam.models import fla_config_classes

    try:
        return fla_config_classes()
    except ImportError:  # flash-linear-attention (fla.models) is not installed
        return {}


def family_model_type(name: str) -> str | None:
    """The transformers ``model_type`` of the tiny model of family ``name`` (:data:`fla_ac_isolation.families.
    FAMILY_NAMES`: the model of its first upstream class that has one), so that a family name means that family in
    ``check`` as in ``audit`` and ``regress``; ``None`` for another name."""
    from fla_ac_isolation.families import FAMILIES

    family = FAMILIES.get(name)
    if family is None:
        return None
    by_class = {r.config.rpartition(".")[2]: t for t, r in TRANSFORMERS_TINY.items()}
    return next((by_class[u.config.rpartition(".")[2]] for u in family.upstream
                 if u.config and u.config.rpartition(".")[2] in by_class), None)


def tiny_names() -> dict[str, str]:
    """``{name: "transformers" | "flash-linear-attention"}`` of every name :func:`build_tiny` takes: transformers'
    and FLA's ``model_type`` and config class names, and the family names."""
    names = {}
    for model_type, recipe in TRANSFORMERS_TINY.items():
        names[model_type] = names[recipe.config.rpartition(".")[2]] = "transformers"
    from fla_ac_isolation.families import FAMILY_NAMES

    names.update({f: "transformers" for f in FAMILY_NAMES if family_model_type(f)})
    for model_type, cls in _fla_configs().items():
        names[model_type] = names[cls.__name__] = "flash-linear-attention"
    return names


def packed_batch(framework: str, seed: int = 0, lens: tuple[int, ...] = DOC_LENS) -> dict:
    """A fresh packed batch (new tensors every call) for a model of ``framework``: its forward's keyword arguments.

    Raises:
        ValueError: an unknown ``framework``.
    """
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lens]
    if framework == "transformers":
        from transformers import DataCollatorWithFlattening

        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])
        return {**batch, "use_cache": False}
    if framework == "flash-linear-attention":
        ids = torch.cat(docs).unsqueeze(0)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        labels = ids.clone()
        labels[0, cu_seqlens[:-1].long()] = -100
        return {"input_ids": ids, "labels": labels, "cu_seqlens": cu_seqlens, "use_cache": False}
    raise ValueError(f"framework must be 'transformers' or 'flash-linear-attention', got {framework!r}")


def build_tiny(name: str, seed: int = 0) -> tuple[nn.Module, dict, str]:
    """``(model, packed batch, framework)`` of the tiny model ``name``, in training mode, float32, on the CPU,
    from seed ``seed``.

    Raises:
        ValueError: an unknown ``name`` (the message lists the names there are).
    """
    by_class = {r.config.rpartition(".")[2]: t for t, r in TRANSFORMERS_TINY.items()}
    model_type = by_class.get(name) or family_model_type(name) or name
    if model_type in TRANSFORMERS_TINY:
        recipe = TRANSFORMERS_TINY[model_type]
        config = _import(recipe.config)(**dict(recipe.fields))
        model_class, framework = _import(recipe.model), "transformers"
    else:
        fla = _fla_configs()
        config_class = fla.get(name) or next((c for c in fla.values() if c.__name__ == name), None)
        if config_class is None:
            raise ValueError(f"config must be one of {sorted(tiny_names())}, got {name!r}")
        from fla_ac_isolation.harness.fla_seam.models import fla_causal_lm_class

        accepted = inspect.signature(config_class.__init__).parameters
        config = config_class(**{k: v for k, v in _FLA_FIELDS.items() if k in accepted})
        model_class, framework = fla_causal_lm_class(config_class), "flash-linear-attention"
    torch.manual_seed(seed)
    model = model_class(config).float().train()
    return model, packed_batch(framework, seed), framework
