"""A trainer's own model, in the style of prime-rl: a Qwen3.5-style Gated DeltaNet calling FLA's ops itself
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, ``fla.modules.conv.causal_conv1d``, ``FusedRMSNormGated``),
its own top-k MoE, its own SAC policy (every ``aten._to_copy`` and ``aten.mm`` saved) applied with torch's
``checkpoint_wrapper``, and one ``cu_seqlens`` from the packed batch for every layer. Its config carries a field
transformers' ``Qwen3_5MoeTextConfig`` lacks (``output_gate_type``).

Three ways to train it (``PATHS``), from the same weights and batch, against ``no-ac`` (no checkpointing):

* ``shared``          as such trainers ship it: the batch's one ``cu_seqlens`` tensor handed to every layer (UNSAFE
                      under SAC: FLA's identity cache makes a layer's recompute run other ops than its forward);
* ``global-disable``  the same model with ``fla.utils.FLA_DISABLE_TENSOR_CACHE = True`` (process-wide; on a GPU every
                      index helper then recomputes, with its host syncs);
* ``fixed``           ``LayerLocalSeqlens`` built once per forward, ``.local()`` inside each layer::

      # Model.forward
      -    offsets = cu_seqlens
      +    offsets = LayerLocalSeqlens(cu_seqlens, num_tokens=input_ids.shape[1])
      # GatedDeltaNet.forward
      -    varlen = {"cu_seqlens": offsets}
      +    local = offsets.local()
      +    varlen = {"cu_seqlens": local.cu_seqlens, "cu_seqlens_cpu": local.cu_seqlens_cpu,
      +              "chunk_indices": local.chunk_indices}

On a CPU the steps run inside ``reference_kernels()`` (FLA's kernels served by pure torch). For
``fla-ac-isolation check``: ``fixed`` and ``shared`` return ``(model, batch)`` without AC; ``sac_policy`` is the
policy (``--policy examples/own_trainer.py:sac_policy``).

Run: ``python examples/own_trainer.py`` (a few seconds on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")  # FLA's notice on CPU-only machines

import fla.utils  # noqa: E402
from fla.modules import FusedRMSNormGated  # noqa: E402
from fla.modules.conv import causal_conv1d  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402

from fla_ac_isolation import LayerLocalSeqlens  # noqa: E402

PATHS = ("no-ac", "shared", "global-disable", "fixed")
DOC_LENS = (70, 23, 41)  # the packed batch's documents


@dataclass
class ModelConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_hidden_layers: int = 2
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    output_gate_type: str = "swish"  # the trainer's own field: "swish" or "sigmoid"
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    rms_norm_eps: float = 1e-6


SAVE = {torch.ops.aten._to_copy.default, torch.ops.aten.mm.default}


def sac_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The trainer's SAC policy: save every ``aten._to_copy`` and ``aten.mm``, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class GatedDeltaNet(nn.Module):
    """Qwen3.5-style Gated DeltaNet: ``hidden_states [1, T, D]`` of packed documents -> ``[1, T, D]``.

    ``offsets``: the batch's ``cu_seqlens [N + 1]`` (as shipped) or the forward's ``LayerLocalSeqlens`` (fixed).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.h, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.k, self.v = config.linear_key_head_dim, config.linear_value_head_dim
        d, key, value = config.hidden_size, self.h * self.k, self.hv * self.v
        self.in_proj_qkv = nn.Linear(d, 2 * key + value, bias=False)
        self.in_proj_z = nn.Linear(d, value, bias=False)                # the output gate
        self.in_proj_ba = nn.Linear(d, 2 * self.hv, bias=False)         # write strength b, decay input a
        self.conv1d = nn.Conv1d(2 * key + value, 2 * key + value, config.linear_conv_kernel_dim,
                                groups=2 * key + value, bias=False)     # depthwise, weight [C, 1, W]
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.hv).uniform_(1, 16)))
        self.norm = FusedRMSNormGated(self.v, eps=config.rms_norm_eps, activation=config.output_gate_type)
        self.out_proj = nn.Linear(value, d, bias=False)

    def forward(self, hidden_states: torch.Tensor, offsets: torch.Tensor | LayerLocalSeqlens) -> torch.Tensor:
        if isinstance(offsets, torch.Tensor):  # as shipped: the one tensor every layer gets
            varlen = {"cu_seqlens": offsets}
        else:  # the fix: fresh offsets inside this layer, so inside its checkpointed region
            local = offsets.local()
            varlen = {"cu_seqlens": local.cu_seqlens, "cu_seqlens_cpu": local.cu_seqlens_cpu,
                      "chunk_indices": local.chunk_indices}
        B, T, _ = hidden_states.shape
        qkv, _ = causal_conv1d(self.in_proj_qkv(hidden_states), self.conv1d.weight.squeeze(1), activation="silu",
                               **varlen)                                                   # [1, T, 2*H*K + HV*V]
        q, k, v = qkv.split([self.h * self.k, self.h * self.k, self.hv * self.v], dim=-1)
        q, k = q.view(B, T, self.h, self.k), k.view(B, T, self.h, self.k)                 # [1, T, H, K]
        v = v.view(B, T, self.hv, self.v)                                                 # [1, T, HV, V]
        b, a = self.in_proj_ba(hidden_states).chunk(2, dim=-1)                           # [1, T, HV] each
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)             # log decay <= 0
        o, _ = chunk_gated_delta_rule(q, k, v, g, b.sigmoid(), use_qk_l2norm_in_kernel=True, **varlen)
        o = self.norm(o, self.in_proj_z(hidden_states).view(B, T, self.hv, self.v))      # [1, T, HV, V]
        return self.out_proj(o.reshape(B, T, -1))


class MoE(nn.Module):
    """Softmax top-k router over SwiGLU experts: ``[1, T, D] -> [1, T, D]``; the expert load (a ``bincount``
    cast to float, a ``_to_copy``) scales an auxiliary term kept in the graph, as load-balancing losses do."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, e, hidden = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(d, e, bias=False)
        self.w13 = nn.Parameter(torch.randn(e, d, 2 * hidden) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, hidden, d) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                                # [T, D]
        scores, chosen = self.gate(flat).softmax(-1).topk(self.top_k, dim=-1)           # [T, k]
        load = torch.bincount(chosen.flatten(), minlength=self.w13.shape[0]).to(flat.dtype)
        out = torch.zeros_like(flat)
        for e in range(self.w13.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            gate, up = (flat[token] @ self.w13[e]).chunk(2, dim=-1)
            out = out.index_add(0, token, (F.silu(gate) * up) @ self.w2[e] * scores[token, slot, None])
        return (out * (1.0 + 0.0 * load.mean())).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.linear_attn = GatedDeltaNet(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MoE(config)

    def forward(self, hidden_states: torch.Tensor, offsets: torch.Tensor | LayerLocalSeqlens) -> torch.Tensor:
        hidden_states = hidden_states + self.linear_attn(self.input_layernorm(hidden_states), offsets)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Model(nn.Module):
    """``model(input_ids [1, T], labels [1, T], cu_seqlens [N + 1])`` -> the loss; ``fixed`` builds a
    ``LayerLocalSeqlens`` once per forward, else every layer gets ``cu_seqlens`` itself."""

    def __init__(self, config: ModelConfig, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        offsets = LayerLocalSeqlens(cu_seqlens, num_tokens=input_ids.shape[1]) if self.fixed else cu_seqlens
        for layer in self.layers:
            hidden_states = layer(hidden_states, offsets)
        logits = self.lm_head(self.norm(hidden_states)).float()
        return F.cross_entropy(logits[0, :-1], labels[0, 1:])


def apply_ac(model: Model, policy=sac_policy) -> Model:
    """Every decoder layer in torch's ``checkpoint_wrapper`` under ``policy`` (selective AC), in place."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                             context_fn=context_fn)
    return model


def packed_batch(device: str | torch.device = "cpu", doc_lens=DOC_LENS, vocab_size: int = 128, seed: int = 1) -> dict:
    """``model(**batch)``'s keywords: ``input_ids``/``labels [1, T]``, ``cu_seqlens [N + 1]`` int32."""
    ids = torch.randint(0, vocab_size, (1, sum(doc_lens)), generator=torch.Generator().manual_seed(seed))
    offsets = torch.tensor([0, *doc_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return {"input_ids": ids.to(device), "labels": ids.to(device), "cu_seqlens": offsets.to(device)}


def build(path: str, config: ModelConfig | None = None, seed: int = 0) -> Model:
    """The model of ``path`` (one of :data:`PATHS`) from ``seed``; AC applied except for ``no-ac``."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    torch.manual_seed(seed)
    model = Model(config or ModelConfig(), fixed=path == "fixed")
    return model if path == "no-ac" else apply_ac(model)


@contextlib.contextmanager
def fla_cache_disabled(disabled: bool):
    """``fla.utils.FLA_DISABLE_TENSOR_CACHE = disabled`` inside the block (the trainers' process-wide switch)."""
    prior = fla.utils.FLA_DISABLE_TENSOR_CACHE
    fla.utils.FLA_DISABLE_TENSOR_CACHE = disabled
    try:
        yield
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = prior


def serving(device: torch.device):
    """On a CPU, FLA's kernels served by pure torch (``reference_kernels()``); on CUDA, FLA's own."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    return reference_kernels()


def train_step(model: Model, batch: dict, path: str) -> dict:
    """One forward and backward: ``{"loss", "grads"}`` (gradients by parameter name, the wrapper's prefix
    dropped), or ``{"error"}``."""
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache

    clear_tensor_cache()  # every step starts from an empty FLA cache
    device = batch["input_ids"].device
    try:
        with serving(device), fla_cache_disabled(path == "global-disable"):
            loss = model(**batch)
            loss.backward()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"}
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads}


def max_grad_diff(run: dict, reference: dict) -> float | None:
    """The largest ``|grad - reference grad|`` over every parameter, or ``None`` when either step failed."""
    if "grads" not in run or "grads" not in reference:
        return None
    return max((run["grads"][n] - reference["grads"][n]).abs().max().item() for n in reference["grads"])


def _as_shipped() -> tuple[Model, dict]:
    torch.manual_seed(0)
    return Model(ModelConfig(), fixed=False), packed_batch()


def shared() -> tuple[Model, dict]:
    """For ``check``: the model as shipped (one ``cu_seqlens`` for every layer), without AC, and its batch."""
    return _as_shipped()


def fixed() -> tuple[Model, dict]:
    """For ``check``: the fixed model (``LayerLocalSeqlens``), without AC, and its batch."""
    torch.manual_seed(0)
    return Model(ModelConfig(), fixed=True), packed_batch()


def main(argv: list[str] | None = None) -> dict:
    """Train one step per path and print it; ``{path: {"loss" | "error", "max_grad_diff"}}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (FLA served by pure torch) or cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add overhead
    try:
        runs = {path: train_step(build(path).to(device), packed_batch(device), path) for path in PATHS}
    finally:
        torch.set_num_threads(threads)
    print(f"own trainer: {ModelConfig.num_hidden_layers} x (Gated DeltaNet + MoE), documents {list(DOC_LENS)}, "
          f"cu_seqlens int32, SAC saving every _to_copy and mm, {device.type}")
    result = {}
    for path, run in runs.items():
        diff = max_grad_diff(run, runs["no-ac"])
        if "error" in run:
            print(f"  {path:15s} raised {run['error']}")
            result[path] = {"error": run["error"]}
        else:
            print(f"  {path:15s} loss {run['loss'].item():.6f}  max |grad - no-ac| {diff:.3g}")
            result[path] = {"loss": run["loss"].item(), "max_grad_diff": diff}
    return result


if __name__ == "__main__":
    main()
