"""Shared builders for the mixer and ops tests: tiny real configs, the mixer families, transformers' torch path.

Tiny configs (hidden 64, a few heads, small head dims) keep every CPU test fast while exercising GVA
(value heads > key heads), grouped B/C (heads > groups) and chunk boundaries (documents longer than 64).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

HIDDEN = 64
PACKED_LENS = [5, 0, 17, 1, 41]  # zero-length and one-token documents on purpose


def qwen3_5_moe_config():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_gdn_fields(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32)


def qwen3_5_config():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_gdn_fields(), intermediate_size=128)


def qwen3_8_config(output_gate_type: str | None = "sigmoid"):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**_gdn_fields(), output_gate_type=output_gate_type, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def nemotron_h_config():
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    return NemotronHConfig(
        hidden_size=HIDDEN, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=16, use_conv_bias=True, layers_block_type=["linear_attention"] * 4, num_hidden_layers=4,
    )


def _gdn_fields() -> dict[str, Any]:
    return dict(
        hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4, layer_types=["linear_attention"] * 4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
    )


@dataclass(frozen=True)
class Family:
    """One mixer family: our class, the transformers class it replaces, and a config builder."""

    name: str
    ours: str                 # class name in fla_ac_isolation.mixers
    hf_module: str            # transformers modeling module
    hf_class: str
    config: Any               # () -> config

    def build(self, layer_idx: int = 0, seed: int = 0, **kwargs):
        import fla_ac_isolation.mixers as mixers

        torch.manual_seed(seed)
        mixer = getattr(mixers, self.ours)(self.config(), layer_idx, **kwargs)
        _randomize(mixer, seed)
        return mixer

    def build_hf(self, layer_idx: int = 0):
        module = importlib.import_module(self.hf_module)
        return getattr(module, self.hf_class)(self.config(), layer_idx)


FAMILIES = {
    f.name: f
    for f in (
        Family("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
               "Qwen3_5MoeGatedDeltaNet", qwen3_5_moe_config),
        Family("qwen3_5", "Qwen3_5MoeGatedDeltaNet", "transformers.models.qwen3_5.modeling_qwen3_5",
               "Qwen3_5GatedDeltaNet", qwen3_5_config),
        Family("qwen3_8", "Qwen3_8FlashNextGatedDeltaNet", "transformers.models.qwen4_exp.modeling_qwen4_exp",
               "Qwen4ExpTextGatedDeltaNet", qwen3_8_config),
        Family("nemotron_h", "NemotronHMamba2Mixer", "transformers.models.nemotron_h.modeling_nemotron_h",
               "NemotronHMamba2Mixer", nemotron_h_config),
    )
}
# One per mixer class (the dense Qwen3.5 config runs through the same class as Qwen3.5-MoE).
CORE_FAMILIES = ["qwen3_5_moe", "qwen3_8", "nemotron_h"]


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
_HF_KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_split_conv1d_scan_combined",
    "mamba2_selective_state_update",
    "mamba2_chunk_scan",
)


@pytest.fixture
def hf_torch_path(monkeypatch):
    """Force transformers' mixers onto their torch fallbacks, on CPU and everywhere else.

    transformers 5.24 binds FLA's ``chunk_gated_delta_rule`` (and mamba_ssm / causal_conv1d when
    installed) at import time through ``use_kernel_func_from_hub_with_fallback``; FLA's Triton kernels then
    fail on CPU ("0 active drivers"). The modeling module's global names (``torch_chunk_gated_delta_rule``,
    ``causal_conv1d_fn``, ``mamba2_chunk_scan``, ...) are what each mixer's forward calls, and each is a
    ``functools.wraps`` wrapper whose ``__wrapped__`` is transformers' own torch implementation, so we
    point the global names at ``__wrapped__`` for the duration of the test.
    """
    for family in FAMILIES.values():
        module = importlib.import_module(family.hf_module)
        for name in _HF_KERNEL_FUNCS:
            fn = getattr(module, name, None)
            if fn is not None and hasattr(fn, "__wrapped__"):
                monkeypatch.setattr(module, name, fn.__wrapped__)
    return FAMILIES


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(params=CORE_FAMILIES, ids=CORE_FAMILIES)
def core_family(request) -> Family:
    return FAMILIES[request.param]


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


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread: the tiny tensors here gain nothing from two, and on a busy
    2-core machine OpenMP's spinning threads slow small ops down by 10-50x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
