"""A 2-layer Gated DeltaNet + MoE language model written from scratch, made AC-safe with LayerLocalSeqlens.

This is *user* code: nothing here comes from transformers or torchtitan. Each layer is

    RMSNorm -> Gated DeltaNet mixer -> residual -> RMSNorm -> top-k MoE -> residual

and the mixer calls ``fla_ac_isolation.ops`` (``causal_conv1d`` and ``chunk_gated_delta_rule``), which run
FLA's Triton kernels on CUDA and the pure-torch reference on CPU. Both backends ask FLA's own
identity-cached index helpers (``prepare_chunk_indices``, ``prepare_chunk_offsets``) for their chunk
schedule, so the cache hits and misses on CPU exactly where it would on a GPU.

The one line that matters is in ``GDNMixer.forward``::

    local = seqlens.local()   # inside the layer, so inside its AC region: fresh cu_seqlens objects

The script trains one step four ways from the same weights and batch:

* ``no-ac``     no checkpointing (the reference);
* ``shared``    every layer checkpointed under a selective-AC policy, and every layer handed the *same*
                ``cu_seqlens`` object (``fla_ac_isolation.harness.modes.SharedSeqlens``: what passing the raw
                tensor to each layer does);
* ``isolated``  the same, with one ``LayerLocalSeqlens`` whose ``.local()`` gives each layer fresh objects;
* ``isolated`` under full AC as well, to show the fix does not depend on the policy.

Expected on CPU (torch 2.13, FLA 0.6): ``shared`` raises or its gradients differ from ``no-ac``;
``isolated`` equals ``no-ac`` bit for bit.

Run: ``python examples/own_model.py`` (about 2 s on CPU); ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")  # FLA's notice on CPU-only machines

from fla_ac_isolation import LayerLocalSeqlens, ops  # noqa: E402
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache  # noqa: E402
from fla_ac_isolation.harness.modes import SharedSeqlens  # noqa: E402
from fla_ac_isolation.policies import POLICIES, checkpoint_layers  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class GDNMixer(nn.Module):
    """Gated DeltaNet token mixer: ``[1, T, D] -> [1, T, D]`` over packed documents."""

    def __init__(self, dim: int, heads: int = 2, head_dim: int = 16, conv: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(3 * inner, conv) / conv)   # depthwise, [C, W]
        self.gates = nn.Linear(dim, 2 * heads, bias=False)                     # decay input a, write strength b
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        # THE FIX: fresh cu_seqlens objects for this call, taken inside the (checkpointed) layer.
        local = seqlens.local()
        varlen = {"cu_seqlens": local.cu_seqlens, "cu_seqlens_cpu": local.cu_seqlens_cpu,
                  "chunk_indices": local.chunk_indices}  # FLA's chunk schedule, precomputed once per batch

        B, T, _ = x.shape
        qkv = ops.causal_conv1d(self.qkv(x), self.conv_weight, activation="silu", **varlen)  # [1, T, 3*H*K]
        q, k, v = qkv.view(B, T, 3, self.heads, self.head_dim).unbind(2)                     # [1, T, H, K] each
        a, b = self.gates(x).chunk(2, dim=-1)                                                # [1, T, H] each
        g = -self.A_log.exp() * F.softplus(a)                                                # log decay <= 0
        o = ops.chunk_gated_delta_rule(q, k, v, g, b.sigmoid(), use_qk_l2norm_in_kernel=True, **varlen)
        return self.out(o.reshape(B, T, -1))


class TinyMoE(nn.Module):
    """Softmax top-k router over small SwiGLU experts, with a per-expert load count (int -> float cast)."""

    def __init__(self, dim: int, experts: int = 4, top_k: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, 2 * hidden) * dim**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                                    # [T, D]
        scores, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)               # [T, k]
        load = torch.bincount(chosen.flatten(), minlength=self.w_in.shape[0]).to(flat.dtype)  # [E] (a _to_copy)
        out = torch.zeros_like(flat)
        for e in range(self.w_in.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            gate, up = (flat[token] @ self.w_in[e]).chunk(2, dim=-1)
            out = out.index_add(0, token, (F.silu(gate) * up) @ self.w_out[e] * scores[token, slot, None])
        return (out * (1.0 + 0.0 * load.mean())).view_as(x)    # keep the load statistic in the graph


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.mixer, self.norm2, self.moe = RMSNorm(dim), GDNMixer(dim), RMSNorm(dim), TinyMoE(dim)

    def forward(self, x: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x), seqlens)
        return x + self.moe(self.norm2(x))


class TinyGDNMoE(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(num_layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        """``input_ids [1, T]`` packed, ``seqlens`` built once for this forward -> logits ``[1, T, vocab]``."""
        seqlens.check_tokens(input_ids.shape[1], name="input_ids")
        x = self.embed(input_ids)
        for layer in self.layers:            # each layer may be checkpointed; seqlens is not a tensor
            x = layer(x, seqlens)
        return self.head(self.norm(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc-lens", default="70,0,23,41", help="packed document lengths (default 70,0,23,41)")
    parser.add_argument("--policy", default="save-all-copies", choices=sorted(POLICIES), help="SAC policy")
    parser.add_argument("--dtype", default="int32", choices=("int32", "int64"), help="cu_seqlens dtype")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.doc_lens = [int(n) for n in args.doc_lens.split(",")]
    return args


def train_step(args: argparse.Namespace, mode: str, ac: str) -> dict:
    """Build the model from ``args.seed``, run one forward + backward; ``{"loss", "grads"}`` or ``{"error"}``."""
    torch.manual_seed(args.seed)
    model = TinyGDNMoE()
    if mode != "no-ac":
        policy = POLICIES[args.policy]() if ac == "selective" else None
        checkpoint_layers(model, mode=ac, policy=policy)
    gen = torch.Generator().manual_seed(args.seed + 1)
    input_ids = torch.randint(0, 128, (1, sum(args.doc_lens)), generator=gen)
    dtype = torch.int32 if args.dtype == "int32" else torch.int64
    cls = SharedSeqlens if mode == "shared" else LayerLocalSeqlens
    seqlens = cls.from_seq_lens(args.doc_lens, dtype=dtype)
    clear_tensor_cache()   # every run starts from an empty FLA cache
    try:
        logits = model(input_ids, seqlens)
        loss = F.cross_entropy(logits[0, :-1], input_ids[0, 1:])
        loss.backward()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"[:160]}
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads}


def _max_diff(a: dict, b: dict) -> float | None:
    if "grads" not in a or "grads" not in b:
        return None
    return max((a["grads"][n] - b["grads"][n]).abs().max().item() for n in a["grads"])


def main(argv: list[str] | None = None) -> dict:
    """Run the four steps and print them; returns ``{name: {"loss" | "error", "max_grad_diff"}}``."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add overhead
    try:
        ref = train_step(args, "no-ac", "full")
        runs = {
            "no-ac": ref,
            f"shared, SAC {args.policy}": train_step(args, "shared", "selective"),
            f"isolated, SAC {args.policy}": train_step(args, "isolated", "selective"),
            "isolated, full AC": train_step(args, "isolated", "full"),
        }
    finally:
        torch.set_num_threads(threads)
    print(f"2-layer GDN + MoE, {len(args.doc_lens)} packed documents {args.doc_lens}, cu_seqlens {args.dtype}, "
          "ops backend: reference (CPU; FLA's own index helpers and cache)")
    result = {}
    for name, run in runs.items():
        diff = _max_diff(run, ref)
        line = f"raised {run['error']}" if "error" in run else f"loss {run['loss']:.6f}  max |grad - no-ac| {diff:.3g}"
        print(f"  {name:32s} {line}")
        result[name] = {k: v for k, v in run.items() if k != "grads"} | {"max_grad_diff": diff}
    shared = result[f"shared, SAC {args.policy}"]
    if shared.get("max_grad_diff") == 0.0:
        print(f"  (the shared path's recompute still ran other ops than its forward, but {args.policy} saves none of "
              f"the ops FLA's cache miss runs here (cu_seqlens {args.dtype}, CPU), so nothing was replayed into the "
              "wrong op; try the defaults: --policy save-all-copies --dtype int32)")
    return result


if __name__ == "__main__":
    main()
