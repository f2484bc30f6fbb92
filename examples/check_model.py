"""Two callables for ``fla-ac-isolation check --model``: each returns ``(model, batch)``, the model WITHOUT
activation checkpointing (the check applies it) and ONE packed batch, a dict of ``model(**batch)``'s keywords.

Run from the repository root (about 10 s each on a CPU, where FLA's kernels are served by
``fla_ac_isolation.harness.reference_kernels``)::

    fla-ac-isolation check --model examples/check_model.py:qwen3_next
    fla-ac-isolation check --model examples/check_model.py:fla_gated_deltanet

Both models hand one offsets object to every layer, so both print a DIVERGENT first layer, the fix
(``isolate_seqlens(model)``) and the same step with the fix applied: aligned. Qwen3-Next also mixes packed
documents in its short conv where the ``causal_conv1d`` package cannot be imported (transformers' torch
fallback): the check names that leak and its fix too. Write your own callable the same way: your model, your
data loader's first packed batch, with its offsets (``check`` refuses a batch without them).
"""

from __future__ import annotations

import torch

DOCS = (70, 23, 41)  # tokens of three documents packed into one row


def _documents(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in DOCS]


def qwen3_next():
    """transformers' Qwen3-Next, tiny (3 Gated DeltaNet layers + 1 attention layer), and a batch packed by
    transformers' ``DataCollatorWithFlattening`` (``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``)."""
    from transformers import DataCollatorWithFlattening, Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config)
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collate([{"input_ids": doc.tolist()} for doc in _documents(config.vocab_size)])
    return model, {**batch, "use_cache": False}


def fla_gated_deltanet():
    """flash-linear-attention's own ``GatedDeltaNetForCausalLM``, tiny (4 layers), and a batch as FLA's trainer
    ``flame`` builds it: one row of ``input_ids``/``labels`` and one int32 ``cu_seqlens`` for every layer."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    config = GatedDeltaNetConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_heads=4, head_dim=16,
                                 expand_v=1, fuse_cross_entropy=False, use_cache=False)
    torch.manual_seed(0)
    model = GatedDeltaNetForCausalLM(config)
    docs = _documents(config.vocab_size)
    input_ids = torch.cat(docs)[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    labels = input_ids.clone()
    labels[0, cu_seqlens[:-1].long()] = -100  # no token predicts the first token of the next document
    return model, {"input_ids": input_ids, "labels": labels, "cu_seqlens": cu_seqlens, "use_cache": False}
