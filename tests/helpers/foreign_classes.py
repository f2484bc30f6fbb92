"""Foreign FLA-backed classes on a CPU for the table of ``docs/foreign-classes.md``: one audited training step of a
tiny model (the library's :func:`fla_ac_isolation.harness.foreign_models.build_tiny`), packed-vs-alone leaks, and the
models the library does not build (GLM-5-next's base model, FLA's layers without a CPU kernel).

FLA's kernels are served by :func:`fla_ac_isolation.harness.reference_kernels.reference_kernels` (the callers open it)."""

from __future__ import annotations

import copy
import itertools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from fla_ac_isolation import ReplayAudit
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
from fla_ac_isolation.harness.foreign_models import VOCAB, packed_batch
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies

LEAK_LENS = (37, 23, 41)  # shorter documents for the leak checks (FLA's naive KDA loops over tokens)


@dataclass
class AuditedStep:
    """One forward + backward: the loss, ``{name: grad}`` (checkpoint wrappers' segments dropped), the audit,
    or the error the step raised (the regions before it are still in the audit)."""

    audit: ReplayAudit
    loss: torch.Tensor | None = None
    grads: dict | None = None
    error: BaseException | None = None

    @property
    def divergent(self) -> list[str]:
        return [r.label for r in self.audit.divergent]


def audited_step(model: nn.Module, framework: str, *, checkpointed: bool, lens=None, policy=None) -> AuditedStep:
    """One step of ``model`` on a fresh packed batch under :class:`ReplayAudit`, every decoder layer checkpointed
    when ``checkpointed``, under ``policy`` (default: SAC saving every ``_to_copy``, the field's most sensitive
    policy on a CPU).

    FLA's cache is cleared first, so every step starts from the same cache state.
    """
    if checkpointed:
        checkpoint_layers(model, "selective", policy if policy is not None else save_all_copies())
    clear_tensor_cache()
    model.zero_grad(set_to_none=True)
    batch = packed_batch(framework) if lens is None else packed_batch(framework, lens=lens)
    with ReplayAudit(model, on_divergence="record") as audit:
        try:
            loss = model(**batch).loss
            loss.backward()
        except Exception as err:
            return AuditedStep(audit, error=err)
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return AuditedStep(audit, loss.detach().clone(), grads)


def gradient_error(got: AuditedStep, want: AuditedStep) -> float:
    """``||g - g_ref|| / ||g_ref||`` over all parameters, in float64 (0.0: bit for bit)."""
    assert got.grads.keys() == want.grads.keys()
    num = sum(((got.grads[n].double() - g.double()) ** 2).sum() for n, g in want.grads.items())
    den = sum((g.double() ** 2).sum() for g in want.grads.values())
    return (num / den).sqrt().item()


def documents_of(lens) -> list[tuple[int, int]]:
    """``[(start, end)]`` of packed documents of ``lens`` tokens."""
    ends = list(itertools.accumulate(lens))
    return list(zip([0, *ends[:-1]], ends))


def leak(model: nn.Module, framework: str, *, output: str = "logits", lens=LEAK_LENS) -> list[float]:
    """Per document: max |packed output - the document run alone| (0 up to rounding: documents kept apart)."""
    batch = packed_batch(framework, lens=lens)
    batch.pop("labels")
    ids = batch["input_ids"]
    with torch.no_grad():
        packed = getattr(model(**batch), output)
        alone = [getattr(model(input_ids=ids[:, a:b], use_cache=False), output) for a, b in documents_of(lens)]
    return [(packed[:, a:b] - one).abs().max().item() for (a, b), one in zip(documents_of(lens), alone)]


def glm5_next_kda_only(seed: int = 0) -> nn.Module:
    """transformers' ``Glm5NextTextModel`` (no causal LM exists), tiny, fp32, 4 KDA layers: its indexed attention
    is not packing-safe at this size (top-16 of pooled keys), so it would blur a leak check."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    config = Glm5NextTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, attn_implementation="sdpa", pad_token_id=0,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16,
        v_head_dim=16, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, layer_types=["linear_attention"] * 4,
        mlp_layer_types=["dense"] * 4, index_topk=16, index_kpool=4, index_head_dim=16, index_n_heads=2, hc_mult=2,
    )
    torch.manual_seed(seed)
    return Glm5NextTextModel(config).float().eval()


def fla_layer(name: str) -> nn.Module:
    """A tiny ``fla.layers`` mixer (hidden 64) of class ``name``, built on the CPU (its kernels are Triton's)."""
    import fla.layers

    kwargs = {
        "BasedLinearAttention": dict(hidden_size=64, num_heads=4, feature_dim=8, num_key_value_heads=4),
        "ReBasedLinearAttention": dict(hidden_size=64, num_heads=4, feature_dim=8),
        "Mamba": dict(hidden_size=64, state_size=8),
        "Mamba2": dict(hidden_size=64, num_heads=4, head_dim=32, state_size=16, n_groups=1),
        "LogLinearMamba2": dict(hidden_size=64, num_heads=4, head_dim=32, state_size=16, n_groups=1),
    }[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "fast path is not available", "does not recommend Triton's conv1d"
        return getattr(fla.layers, name)(**kwargs)


def deep_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
