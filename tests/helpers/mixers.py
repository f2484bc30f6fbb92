"""Mixer test cases: one per upstream class of the library's registry (:data:`fla_ac_isolation.families.FAMILIES`),
with tiny configs built from the registry's config classes, and what the mixer tests share (documents, a
residual block, a loss with its gradients, relative errors)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fla_ac_isolation import families, foreign_classes
from fla_ac_isolation.mixers import family_drop_in

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

HIDDEN = 64
PACKED_LENS = [5, 0, 17, 1, 41]  # zero-length and one-token documents on purpose


def _config(family: str, upstream: int = 0, **extra: Any):
    """A tiny config of ``family``'s ``upstream``-th class, built from the registry's config class, with the
    test widths of the family's layer kind (:data:`LAYER_FIELDS`) and ``extra`` fields."""
    entry = families.FAMILIES[family]
    return entry.upstream[upstream].config_class()(**LAYER_FIELDS[entry.layer](), **extra)


def qwen3_5_moe_config():
    return _config("qwen3_5_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32)


def qwen3_5_config():
    return _config("qwen3_5_moe", 1, intermediate_size=128)  # the dense Qwen3.5: same mixer class


def qwen3_8_config(output_gate_type: str | None = "sigmoid"):
    return _config("qwen3_8", output_gate_type=output_gate_type, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32)


def nemotron_h_config():
    return _config("nemotron_h")


def _kda_config(upstream: int, **extra: Any):
    """A tiny config of the ``upstream``-th KDA class: 4 heads of 16 channels at :data:`HIDDEN`, width-4 conv.

    Bailing hybrid derives its KDA widths from its attention fields (``num_attention_heads``, ``head_dim``,
    ``short_conv_kernel_size``); Kimi-Linear and GLM-5-next read ``linear_*`` fields."""
    entry = families.FAMILIES["kimi_linear"]
    fields = dict(hidden_size=HIDDEN, num_hidden_layers=4, layer_types=["linear_attention"] * 4, vocab_size=128,
                  linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=16, short_conv_kernel_size=4, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None)
    return entry.upstream[upstream].config_class()(**fields, **extra)


def kimi_linear_config():
    return _kda_config(0)


def glm5_next_config(linear_lower_bound: float | None = -5.0):
    return _kda_config(1, linear_lower_bound=linear_lower_bound)


def bailing_hybrid_config(kda_safe_gate: bool = True):
    return _kda_config(2, kda_safe_gate=kda_safe_gate)


def _gdn_fields() -> dict[str, Any]:
    return dict(
        hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4, layer_types=["linear_attention"] * 4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
    )


def _mamba2_fields() -> dict[str, Any]:
    return dict(
        hidden_size=HIDDEN, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=16, use_conv_bias=True, layers_block_type=["linear_attention"] * 4, num_hidden_layers=4,
    )


LAYER_FIELDS = {"gdn": _gdn_fields, "mamba2": _mamba2_fields}
"""Tiny test widths per layer kind (:data:`fla_ac_isolation.harness.layer_widths.LAYERS`), at :data:`HIDDEN`."""


@dataclass(frozen=True)
class MixerFamily:
    """One mixer test case: a library family, the upstream (transformers) class, a tiny config builder."""

    name: str
    family: families.Family   # the library's registry entry
    upstream: foreign_classes.UpstreamMixer
    config: Any               # () -> config

    @property
    def ours(self) -> str:
        """Our class name in fla_ac_isolation.mixers (DROP_IN_NAMES: the drop-in replacing its upstream class)."""
        return self.family.drop_in_name(self.upstream)

    @property
    def hf_module(self) -> str:
        return self.upstream.module

    @property
    def hf_class(self) -> str:
        return self.upstream.name

    def build(self, layer_idx: int = 0, seed: int = 0, **kwargs):
        torch.manual_seed(seed)
        mixer = family_drop_in(self.family, self.upstream)(self.config(), layer_idx, **kwargs)
        _randomize(mixer, seed)
        return mixer

    def build_hf(self, layer_idx: int = 0):
        return self.upstream.resolve()(self.config(), layer_idx)


def _case(name: str, family: str, upstream: int, config) -> MixerFamily:
    entry = families.FAMILIES[family]
    return MixerFamily(name, entry, entry.upstream[upstream], config)


FAMILIES = {
    f.name: f
    for f in (
        _case("qwen3_5_moe", "qwen3_5_moe", 0, qwen3_5_moe_config),
        _case("qwen3_5", "qwen3_5_moe", 1, qwen3_5_config),  # dense Qwen3.5: same mixer class
        _case("qwen3_8", "qwen3_8", 0, qwen3_8_config),
        _case("nemotron_h", "nemotron_h", 0, nemotron_h_config),
        _case("kimi_linear", "kimi_linear", 0, kimi_linear_config),
        _case("glm5_next", "kimi_linear", 1, glm5_next_config),
        _case("bailing_hybrid", "kimi_linear", 2, bailing_hybrid_config),
    )
}
"""Mixer test cases: one per upstream class of :data:`fla_ac_isolation.families.FAMILIES`."""
# One per family (the dense Qwen3.5 config runs through the same class as Qwen3.5-MoE; GLM-5-next and Bailing
# run through the same KDA core as Kimi-Linear).
CORE_FAMILIES = list(families.FAMILY_NAMES)


@torch.no_grad()
def _randomize(mixer: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for the parameters that init leaves constant (norm weights, biases, D)."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in mixer.named_parameters():
        if name.endswith("norm.weight") or name == "D":
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


# transformers' kernel-or-torch functions: decorated at import with FLA / causal_conv1d / mamba_ssm when
# importable; `__wrapped__` (functools.wraps) is the plain torch function the decorator fell back from.
HF_KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_split_conv1d_scan_combined",
    "mamba2_selective_state_update",
    "mamba2_chunk_scan",
)


def split_documents(x: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    """``x [1, T, ...]`` cut into its non-empty documents ``[1, L, ...]``."""
    out, start = [], 0
    for n in lens:
        if n:
            out.append(x[:, start:start + n])
        start += n
    return out


def loss_and_grads(layers: torch.nn.ModuleList, x: torch.Tensor, seqlens: Any):
    """Run ``x`` through ``layers`` (each called as ``layer(h, seqlens)``), backward ``mean(out.float() ** 2)``.

    Returns ``(loss, dx, grads)``: the detached loss, the gradient of ``x`` (run on a fresh leaf, ``x`` itself is
    untouched) and ``{parameter name: grad}`` with checkpoint_wrapper's ``_checkpoint_wrapped_module.`` dropped
    from the names, so a checkpointed and an unwrapped stack compare name by name.
    """
    h = x.clone().requires_grad_()
    out = h
    for layer in layers:
        out = layer(out, seqlens)
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in layers.named_parameters()}
    return loss.detach(), h.grad, grads


class Block(nn.Module):
    """A residual block ``x + mixer(x, seqlens)``: the unit the SAC tests checkpoint."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor, seqlens: Any) -> torch.Tensor:
        return x + self.mixer(x, seqlens)



def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (GPU parity tests)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
