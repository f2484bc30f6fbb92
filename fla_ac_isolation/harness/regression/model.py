"""Tiny decoders shaped like the real model families (built from their transformers configs with small sizes),
with torchtitan's MoE, for the regression. A family's layout is its :data:`TINY_RECIPES` entry
(:data:`LAYOUTS`); the decoder hands ONE ``seqlens`` object to every layer, and each mixer calls ``.local()``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fla_ac_isolation.families import FAMILIES
from fla_ac_isolation.harness.regression.attention import AttentionLayout, PackedAttention
from fla_ac_isolation.harness.regression.expert_parallel import MoEShape, build_moe
from fla_ac_isolation.local_seqlens import PackedSeqlens

if TYPE_CHECKING:
    from fla_ac_isolation.families import Family

__all__ = ["LAYOUTS", "TINY_RECIPES", "AttentionLayout", "ModelSize", "PackedAttention", "TinyDecoder", "TinyRecipe",
           "build_model", "tiny_config"]


@dataclass(frozen=True)
class TinyRecipe:
    """How the regression builds a family's tiny decoder (from the family's
    :meth:`~fla_ac_isolation.families.Family.config_class`).

    Attributes:
        layout: ``"qwen"`` (three mixer blocks then a gated attention block, each with an MoE; ``layer_types``)
            or ``"nemotron_h"`` (Mamba2 / MoE / attention / MoE blocks; ``layers_block_type``).
        attention_type: the config's name of the attention layers.
        config: further config fields the family sets, as ``(name, value)`` pairs.
    """

    layout: str
    attention_type: str = "full_attention"
    config: tuple[tuple[str, Any], ...] = ()


TINY_RECIPES: dict[str, TinyRecipe] = {
    "qwen3_5_moe": TinyRecipe("qwen"),
    "qwen3_8": TinyRecipe("qwen", attention_type="indexed_attention", config=(("output_gate_type", "sigmoid"),)),
    "nemotron_h": TinyRecipe("nemotron_h"),
    # the "qwen" layout with KDA widths
    "kimi_linear": TinyRecipe("qwen", config=(("linear_num_heads", 4), ("linear_head_dim", 16),
                                             ("pad_token_id", None), ("bos_token_id", None), ("eos_token_id", None))),
}
"""Each family's tiny decoder recipe, by family name."""


@dataclass(frozen=True)
class ModelSize:
    """Sizes of a tiny model (defaults: the CPU regression).

    Attributes:
        hidden_size: model width ``D``.
        num_layers: decoder blocks.
        num_experts: routed experts per MoE (a multiple of the EP degree).
        top_k: experts per token.
        vocab_size: vocabulary of the random-token batches.
    """

    hidden_size: int = 128
    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 4
    vocab_size: int = 256

    @property
    def head_dim(self) -> int:
        """Channels per head: 16 up to hidden 64, 32 up to 256, else 64."""
        return 16 if self.hidden_size <= 64 else 32 if self.hidden_size <= 256 else 64


# --------------------------------------------------------------------------------------------- blocks
class DecoderBlock(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + moe(post_norm(x))``; either may be ``None``."""

    def __init__(self, kind: str, mixer: nn.Module | None, moe: nn.Module | None, hidden_size: int, eps: float):
        super().__init__()
        self.kind = kind
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=eps) if mixer is not None else None
        self.mixer = mixer
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps) if moe is not None else None
        self.mlp = moe

    def forward(
        self, hidden_states: torch.Tensor, seqlens: PackedSeqlens, layout: AttentionLayout
    ) -> torch.Tensor:
        if self.mixer is not None:
            h = self.input_layernorm(hidden_states)
            h = self.mixer(h, layout) if isinstance(self.mixer, PackedAttention) else self.mixer(h, seqlens)
            hidden_states = hidden_states + h
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


class TinyDecoder(nn.Module):
    """Embedding, decoder blocks, final norm and LM head.

    Forward: ``input_ids [1, T]`` and one ``seqlens`` for the batch -> float32 logits ``[1, T, vocab]``.
    """

    def __init__(self, family: str, config: Any, blocks: list[DecoderBlock], vocab_size: int, eps: float):
        super().__init__()
        self.family = family
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    @property
    def conv_kernel_size(self) -> int:
        """Width of the mixers' causal conv."""
        return getattr(self.config, "linear_conv_kernel_dim", None) or self.config.conv_kernel

    def moes(self) -> list[nn.Module]:
        """The torchtitan MoE modules, in layer order."""
        from torchtitan.models.common.moe import MoE

        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, input_ids: torch.Tensor, seqlens: PackedSeqlens) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be packed as [1, T], got shape {tuple(input_ids.shape)}")
        seqlens.check_tokens(input_ids.shape[1], name="input_ids")
        hidden_states = self.embed_tokens(input_ids)
        layout = AttentionLayout.from_seqlens(seqlens, hidden_states.device)
        for block in self.layers:
            hidden_states = block(hidden_states, seqlens, layout)
        return self.lm_head(self.norm(hidden_states)).float()


# -------------------------------------------------------------------------------------------- layouts
def _qwen_layer_types(num_layers: int) -> list[str]:
    """Three Gated DeltaNet layers then one attention layer, repeated; 2 or 3 layers still end with attention."""
    last = num_layers - 1 if 1 < num_layers < 4 else None
    return ["full_attention" if (i + 1) % 4 == 0 or i == last else "linear_attention" for i in range(num_layers)]


def _mixer_fields(layer: str, size: ModelSize) -> dict[str, Any]:
    hd = size.head_dim
    if layer == "gdn":
        key_heads = max(2, size.hidden_size // (4 * hd))
        return dict(linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads, linear_key_head_dim=hd,
                    linear_value_head_dim=hd, linear_conv_kernel_dim=4)
    return dict(mamba_num_heads=2 * size.hidden_size // hd, mamba_head_dim=hd, n_groups=2, ssm_state_size=32,
                conv_kernel=4, chunk_size=64)


def _common_fields(size: ModelSize) -> dict[str, Any]:
    hd = size.head_dim
    return dict(vocab_size=size.vocab_size, hidden_size=size.hidden_size, num_attention_heads=size.hidden_size // hd,
                num_key_value_heads=2, head_dim=hd)


def _qwen_config(family: Family, size: ModelSize) -> Any:
    tiny = TINY_RECIPES[family.name]
    types = [tiny.attention_type if t == "full_attention" else t for t in _qwen_layer_types(size.num_layers)]
    return family.config_class()(
        **_common_fields(size), **_mixer_fields(family.layer, size), num_hidden_layers=size.num_layers,
        num_experts=size.num_experts, num_experts_per_tok=size.top_k, moe_intermediate_size=size.hidden_size // 2,
        shared_expert_intermediate_size=size.hidden_size // 2, layer_types=types, **dict(tiny.config),
    )


def _qwen_moe(config: Any, size: ModelSize, ep_enabled: bool) -> nn.Module:
    shape = MoEShape(
        dim=config.hidden_size,
        hidden_dim=config.moe_intermediate_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        shared_hidden_dim=config.shared_expert_intermediate_size,
        score_func="softmax",
        route_norm=True,
    )
    return build_moe(shape, num_layers=size.num_layers, ep_enabled=ep_enabled)


def _qwen_attention(config: Any) -> PackedAttention:
    rotary = int(config.head_dim * _partial_rotary_factor(config)) // 2 * 2
    return PackedAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        gated=True, qk_norm=True, rotary_dim=rotary, eps=config.rms_norm_eps,
    )


def _partial_rotary_factor(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.25)))


def _make_mixer(family: Family, backend: str, mixer: str | None, mixer_config: Any = None) -> Any:
    """``(config, layer_idx) -> module`` of the linear-attention slots: our drop-in, or the user's ``mixer``."""
    if mixer is None:
        from fla_ac_isolation.mixers import family_drop_in

        ours = family_drop_in(family)
        return lambda config, i: ours(config, i, backend=backend)
    from fla_ac_isolation.harness.regression.user_mixer import mixer_builder

    return mixer_builder(mixer, mixer_config)


def _qwen_blocks(family: Family, config: Any, size: ModelSize, backend: str, ep_enabled: bool,
                 mixer: str | None = None, mixer_config: Any = None) -> list[DecoderBlock]:
    mixer_cls = _make_mixer(family, backend, mixer, mixer_config)
    blocks = []
    for i, kind in enumerate(config.layer_types):
        if kind == "linear_attention":
            mixer = mixer_cls(config, i)
            name = "gdn+moe"
        else:
            mixer = _qwen_attention(config)
            name = "attention+moe"
        blocks.append(DecoderBlock(name, mixer, _qwen_moe(config, size, ep_enabled), config.hidden_size,
                                   config.rms_norm_eps))
    return blocks


def _nemotron_h_config(family: Family, size: ModelSize) -> Any:
    pattern = ["mamba", "moe", "attention", "moe"]
    types = {"mamba": "linear_attention", "moe": "moe", "attention": TINY_RECIPES[family.name].attention_type}
    return family.config_class()(
        **_common_fields(size), **_mixer_fields(family.layer, size),
        layers_block_type=[types[pattern[i % 4]] for i in range(size.num_layers)],
        n_routed_experts=size.num_experts, num_experts_per_tok=size.top_k, moe_intermediate_size=size.hidden_size // 2,
        moe_shared_expert_intermediate_size=size.hidden_size // 2, n_shared_experts=1,
        **dict(TINY_RECIPES[family.name].config),
    )


def _nemotron_h_blocks(family: Family, config: Any, size: ModelSize, backend: str,
                       ep_enabled: bool, mixer: str | None = None, mixer_config: Any = None) -> list[DecoderBlock]:
    mamba2_cls = _make_mixer(family, backend, mixer, mixer_config)
    eps = config.layer_norm_epsilon
    blocks = []
    for i, kind in enumerate(config.layers_block_type):
        if kind == "linear_attention":
            blocks.append(DecoderBlock("mamba2", mamba2_cls(config, i), None,
                                       config.hidden_size, eps))
        elif kind == TINY_RECIPES[family.name].attention_type:
            attention = PackedAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                gated=False, qk_norm=False, rotary_dim=0, eps=eps,
            )
            blocks.append(DecoderBlock("attention", attention, None, config.hidden_size, eps))
        else:
            shape = MoEShape(
                dim=config.hidden_size,
                hidden_dim=config.moe_intermediate_size,
                num_experts=config.n_routed_experts,
                top_k=config.num_experts_per_tok,
                shared_hidden_dim=config.moe_shared_expert_intermediate_size if config.n_shared_experts else None,
                score_func="sigmoid",
                route_norm=bool(config.norm_topk_prob),
            )
            moe = build_moe(shape, num_layers=size.num_layers, ep_enabled=ep_enabled)
            blocks.append(DecoderBlock("moe", None, moe, config.hidden_size, eps))
    return blocks


class _Layout(NamedTuple):
    config: Any  # (family, size) -> transformers config
    blocks: Any  # (family, config, size, backend, ep_enabled, mixer, mixer_config) -> [DecoderBlock]
    eps: str  # the config's norm epsilon field


LAYOUTS: dict[str, _Layout] = {
    "qwen": _Layout(_qwen_config, _qwen_blocks, "rms_norm_eps"),
    "nemotron_h": _Layout(_nemotron_h_config, _nemotron_h_blocks, "layer_norm_epsilon"),
}
"""The tiny decoders' layouts by :attr:`TinyRecipe.layout`."""


def tiny_config(family: str, size: ModelSize = ModelSize()) -> Any:
    """The transformers config the tiny ``family`` decoder of ``size`` is built from (what a mixer class gets).

    Raises:
        KeyError: unknown ``family``.
    """
    entry = FAMILIES[family]
    return LAYOUTS[TINY_RECIPES[entry.name].layout].config(entry, size)


def build_model(
    family: str, size: ModelSize = ModelSize(), *, backend: str = "auto", ep_enabled: bool = False,
    mixer: str | None = None, mixer_config: Any = None,
) -> TinyDecoder:
    """Build the tiny ``family`` decoder on the CPU in float32, initialised from the global RNG (seed it first).
    Move it and apply expert parallelism afterwards.

    Args:
        family: a key of :data:`fla_ac_isolation.families.FAMILIES`.
        size: model sizes.
        backend: ``"auto"`` | ``"fla"`` | ``"reference"``.
        ep_enabled: build the MoEs' expert-parallel sharding plan.
        mixer: ``"module:qualname"`` (or ``"path/to/file.py:qualname"``) of a user's mixer class or factory
            (:mod:`.user_mixer`); ``None``: the family's drop-in.
        mixer_config: the config a user's mixer class is built with instead of the family's.

    Raises:
        ValueError: unknown ``family``; ``num_experts`` smaller than ``top_k``; a ``mixer`` that cannot be
            imported or built as ``cls(config, layer_idx)`` / ``factory(layer_idx)``.
    """
    if family not in FAMILIES:
        raise ValueError(f"model must be one of {sorted(FAMILIES)}, got {family!r}")
    if size.top_k > size.num_experts:
        raise ValueError(f"top_k ({size.top_k}) must not exceed num_experts ({size.num_experts})")
    entry = FAMILIES[family]
    layout = LAYOUTS[TINY_RECIPES[entry.name].layout]
    config = layout.config(entry, size)
    blocks = layout.blocks(entry, config, size, backend, ep_enabled, mixer, mixer_config)
    model = TinyDecoder(family, config, blocks, size.vocab_size, getattr(config, layout.eps))
    with torch.no_grad():
        nn.init.normal_(model.embed_tokens.weight, std=0.02)
        nn.init.normal_(model.lm_head.weight, std=0.02)
    return model
