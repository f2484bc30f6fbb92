"""Whole transformers models with Kimi Delta Attention (Kimi-Linear, GLM-5-next, Bailing hybrid), tiny, and the
CPU path of their shipped KDA mixers: transformers' call of FLA's ``chunk_kda`` served by our reference.

transformers 5.24 binds FLA's ``chunk_kda`` (``chunk_kimi_delta_attention``) through
``use_kernel_func_from_hub_with_fallback``: a wrapper whose closure holds ``implementation`` (FLA's function
when ``fla`` imports) and ``applicable_params`` (FLA's parameter names, the only keywords it hands on). FLA's
kernel cannot run on a CPU; :func:`shipped_kda_on_cpu` puts a spy in the ``implementation`` cell that records
the keywords that reached it and computes FLA's ``chunk_kda`` with ``fla_ac_isolation.ops.reference_kda``
(same signature, same maths, same index lookups). transformers' short conv is its torch fallback here
(``causal_conv1d`` is not installed), which ignores document bounds as well.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DataCollatorWithFlattening

from fla_ac_isolation import families, foreign_classes
from fla_ac_isolation.harness.transformers_kernels import hub_name, implementation_cell, kernelized_serving
from fla_ac_isolation.mixers import family_drop_in
from fla_ac_isolation.ops import reference_kda

VOCAB = 128
KDA_DOC_LENS = (70, 23, 41)  # the first document spans two 64-token chunks
_HF = "transformers.models"
_TOKENS = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, pad_token_id=None, bos_token_id=None,
               eos_token_id=None, tie_word_embeddings=False, attn_implementation="sdpa")
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16)
_MIXED = ["linear_attention"] * 3 + ["full_attention"]


def _kimi_linear() -> nn.Module:
    from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(**_TOKENS, **_MLA, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                              intermediate_size=128, moe_intermediate_size=32, num_local_experts=4,
                              num_experts_per_tok=2, layer_types=_MIXED, mlp_layer_types=["dense"] * 4)
    return KimiLinearForCausalLM(config)


def _glm5_next() -> nn.Module:
    """KDA layers only: GLM-5-next's indexed (DSA) attention is not packing-safe at this size (outside FLA)."""
    from transformers.models.glm5_next import Glm5NextTextConfig, Glm5NextTextModel

    config = Glm5NextTextConfig(**_TOKENS, **dict(_MLA, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16),
                                linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                                intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                                num_experts_per_tok=2, layer_types=["linear_attention"] * 4,
                                mlp_layer_types=["dense"] * 4, index_topk=16, index_kpool=4, index_head_dim=16,
                                index_n_heads=2, hc_mult=2)
    return Glm5NextTextModel(config)


def _bailing_hybrid() -> nn.Module:
    from transformers.models.bailing_hybrid import BailingHybridConfig, BailingHybridForCausalLM

    config = BailingHybridConfig(**_TOKENS, **_MLA, head_dim=16, short_conv_kernel_size=4, intermediate_size=128,
                                 moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, n_group=1,
                                 topk_group=1, layer_types=_MIXED, mlp_layer_types=["dense"] * 4, num_mtp_layers=0)
    return BailingHybridForCausalLM(config)


@dataclass(frozen=True)
class KDAModel:
    """A tiny transformers model of one KDA mixer class, and where its mixers sit."""

    name: str
    build: Callable[[], nn.Module]
    upstream: foreign_classes.UpstreamMixer  # the transformers mixer class (the library's registry)
    paths: tuple[str, ...]            # mixer paths in the tiny model
    has_head: bool = True             # GLM-5-next's text model has no LM head: its output is the last hidden state

    @property
    def ours(self) -> type:
        return family_drop_in(families.FAMILIES["kimi_linear"], self.upstream)

    @property
    def modeling(self):
        return importlib.import_module(self.upstream.module)

    def model(self, seed: int = 0) -> nn.Module:
        """The model in train mode, float32, seed ``seed``; ``A_log`` and ``dt_bias`` (left to ``_init_weights``)
        drawn as transformers' init does, so the decays are those of a fresh model."""
        torch.manual_seed(seed)
        model = self.build().train()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.empty_like(p).uniform_(1.0, 4.0).log())
                elif name.endswith("dt_bias"):
                    p.copy_(torch.empty_like(p).uniform_(-2.0, 0.5))
        return model


def _kda_case(name: str, build, upstream: int, paths, **kw) -> KDAModel:
    return KDAModel(name, build, families.FAMILIES["kimi_linear"].upstream[upstream], tuple(paths), **kw)


KDA_MODELS = {
    m.name: m
    for m in (
        _kda_case("kimi_linear", _kimi_linear, 0, (f"model.layers.{i}.self_attn" for i in range(3))),
        _kda_case("glm5_next", _glm5_next, 1, (f"layers.{i}.self_attn" for i in range(4)), has_head=False),
        _kda_case("bailing_hybrid", _bailing_hybrid, 2, (f"model.layers.{i}.self_attn" for i in range(3))),
    )
}
"""One tiny model per transformers KDA class: Kimi-Linear and Bailing with 3 KDA layers and one attention layer,
GLM-5-next with 4 KDA layers."""


# ------------------------------------------------------------------------------------- batches and runs
def kda_packed_batch(seed: int = 1, lens=KDA_DOC_LENS) -> dict:
    """transformers' ``DataCollatorWithFlattening`` batch (``position_ids``, ``cu_seq_lens_q/k``, ``labels``)."""
    gen = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in lens]
    return dict(DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs))


def kda_output(model: nn.Module, case: KDAModel, batch: dict) -> torch.Tensor:
    """Logits (GLM-5-next: the last hidden state) ``[1, T, *]`` of ``batch`` (labels dropped), no cache."""
    out = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
    return out.logits if case.has_head else out.last_hidden_state


def per_document_gap(model: nn.Module, case: KDAModel, batch: dict) -> list[float]:
    """Per document, max |output packed - output of the document alone|."""
    bounds = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        packed = kda_output(model, case, batch)
        gaps = []
        for a, b in itertools.pairwise(bounds):
            alone = kda_output(model, case, {"input_ids": batch["input_ids"][:, a:b]})
            gaps.append((packed[:, a:b] - alone).abs().max().item())
    return gaps


def kda_loss(model: nn.Module, case: KDAModel, batch: dict) -> torch.Tensor:
    """The causal-LM loss (GLM-5-next, headless: the mean square of the last hidden state, in float32)."""
    if case.has_head:
        return model(**batch, use_cache=False).loss
    return kda_output(model, case, batch).float().pow(2).mean()


# ---------------------------------------------------------------------------------- the shipped CPU path
@dataclass
class ServedCalls:
    """What reached FLA's ``chunk_kda`` through transformers' wrapper: one sorted keyword tuple per call."""

    keywords: list[tuple[str, ...]] = field(default_factory=list)


def _fla_chunk_kda_on_cpu(calls: ServedCalls):
    """FLA's ``chunk_kda`` as transformers' wrapper calls it (``q, k, v`` positional, the rest by keyword),
    computed by the reference backend; records the keyword names that reached it."""

    def chunk_kda(q, k, v, **kwargs):
        calls.keywords.append(tuple(sorted(kwargs)))
        assert kwargs.get("initial_state") is None and not kwargs.get("output_final_state")  # training: no cache
        out = reference_kda.chunk_kda(
            q, k, v, kwargs["g"], kwargs["beta"], scale=kwargs.get("scale"),
            use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False),
            cu_seqlens=kwargs.get("cu_seqlens"), cu_seqlens_cpu=kwargs.get("cu_seqlens_cpu"),
        )
        return out, None

    return chunk_kda


@contextlib.contextmanager
def shipped_kda_on_cpu(case: KDAModel) -> Iterator[ServedCalls]:
    """Run transformers' own KDA mixers of ``case`` on CPU: its wrapper around FLA's ``chunk_kda`` kept (and with
    it the keyword filter), FLA's implementation replaced by our reference. Yields the calls that reached it.

    Without the ``kernels`` package (transformers <= 5.24) the spy goes in the wrapper's ``implementation`` cell;
    with it (>= 5.25) the function module is kernelized to the spy, called with the keywords FLA's ``chunk_kda``
    takes (:mod:`fla_ac_isolation.harness.transformers_kernels`)."""
    wrapper = case.modeling.chunk_kimi_delta_attention
    calls = ServedCalls()
    cell = implementation_cell(wrapper)
    if cell is None:
        assert hub_name(wrapper) == "chunk_kda", wrapper
        with kernelized_serving({"chunk_kda": _fla_chunk_kda_on_cpu(calls)}, []) as served:
            assert [s.module for s in served if s.module is wrapper], served
            yield calls
        return
    assert getattr(cell.cell_contents, "__module__", "").startswith("fla."), cell.cell_contents  # FLA was bound
    saved = cell.cell_contents
    cell.cell_contents = _fla_chunk_kda_on_cpu(calls)
    try:
        yield calls
    finally:
        cell.cell_contents = saved
