"""Make a transformers Qwen3.5-MoE safe under selective activation checkpointing with one call.

Builds a tiny random ``Qwen3_5MoeForCausalLM`` from its config (no download), packs 3 documents with
transformers' ``DataCollatorWithFlattening`` (``position_ids`` + ``cu_seq_lens_q/k`` + ``max_length_q/k``),
and trains one step four ways on the same weights: without the swap (no AC, then SAC), and after
``swap_mixers`` (no AC, then SAC). Without the swap, transformers hands the same ``cu_seq_lens_q`` object to
every GDN layer and SAC replays saved tensors into the wrong ops (an error, or wrong gradients); after it,
the SAC step equals the no-AC step bit for bit.

On CPU, transformers' GDN calls FLA's Triton kernel, which cannot run there ("0 active drivers"). This
script then serves that call with ``fla_ac_isolation.harness.reference_kernels.reference_kernels()``, whose gated
delta rule asks FLA's own index helpers for its schedule with the kernel's arguments, so FLA's identity cache
hits and misses as it would on a GPU; everything else is transformers' code. With ``--device cuda`` nothing
is replaced and FLA's kernels run.

Run: ``python examples/hf_swap.py`` (a few seconds on CPU); ``--help`` lists the size flags.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch
from transformers import DataCollatorWithFlattening, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from fla_ac_isolation import swap_mixers
from fla_ac_isolation.harness.reference_kernels import reference_kernels
from fla_ac_isolation.policies import POLICIES, sac_context_fn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers; every 4th is full attention (default 4)")
    parser.add_argument("--experts", type=int, default=4, help="routed experts, 2 per token (default 4)")
    parser.add_argument("--doc-lens", default="70,23,41", help="packed document lengths (default 70,23,41)")
    parser.add_argument("--policy", default="save-all-copies", choices=sorted(POLICIES), help="SAC policy")
    parser.add_argument("--device", default="cpu", help="cpu (FLA's kernel call served by the reference) or cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.doc_lens = [int(n) for n in args.doc_lens.split(",")]
    if len(args.doc_lens) < 2 or min(args.doc_lens) < 2:
        parser.error("--doc-lens needs at least two documents of 2 or more tokens")
    return args


def build_model(args: argparse.Namespace) -> Qwen3_5MoeForCausalLM:
    heads = max(2, args.hidden // 32)
    config = Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)],
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=16,
        linear_num_key_heads=heads // 2, linear_num_value_heads=heads, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=args.hidden // 2,
        shared_expert_intermediate_size=args.hidden // 2, attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return Qwen3_5MoeForCausalLM(config).to(args.device).train()


def packed_batch(args: argparse.Namespace) -> dict:
    """A new packed batch (new tensor objects, as a data loader yields every step)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    docs = [{"input_ids": torch.randint(0, 256, (n,), generator=gen).tolist()} for n in args.doc_lens]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs)
    return {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def fla_call_on_cpu(device: str):
    """On CPU, FLA's kernels served by pure-torch stand-ins (``reference_kernels``); on CUDA, FLA's own."""
    return contextlib.nullcontext() if torch.device(device).type == "cuda" else reference_kernels()


def set_checkpointing(model, policy) -> None:
    """transformers' own entry point (``gradient_checkpointing_enable`` is its deprecated alias in 5.24)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if policy is None:
            model.gradient_checkpointing_disable()
        elif enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac_context_fn(policy)})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac_context_fn(policy)}
            )


def train_step(model, batch: dict) -> dict:
    """One forward + backward: ``{"loss", "grads"}`` or ``{"error"}``."""
    model.zero_grad(set_to_none=True)
    try:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:160]}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def compare(model, args: argparse.Namespace) -> dict:
    """No-AC step, then SAC step; ``{"no_ac", "sac", "max_grad_diff"}``."""
    set_checkpointing(model, None)
    no_ac = train_step(model, packed_batch(args))
    set_checkpointing(model, POLICIES[args.policy]())
    sac = train_step(model, packed_batch(args))
    set_checkpointing(model, None)
    diff = None
    if "grads" in no_ac and "grads" in sac:
        diff = max((no_ac["grads"][n] - sac["grads"][n]).abs().max().item() for n in no_ac["grads"])
    return {"no_ac": no_ac, "sac": sac, "max_grad_diff": diff}


def _report(title: str, result: dict) -> None:
    print(title)
    for key, label in (("no_ac", "no AC"), ("sac", "SAC")):
        step = result[key]
        print(f"  {label:6s} " + (f"loss {step['loss']:.6f}" if "loss" in step else f"raised {step['error']}"))
    if result["max_grad_diff"] is not None:
        print(f"  largest |grad(SAC) - grad(no AC)| over all parameters: {result['max_grad_diff']:.3g}")


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison and print it; returns ``{"unswapped", "swapped", "swapped_paths"}``."""
    args = parse_args(argv)
    model = build_model(args)
    batch = packed_batch(args)
    print(
        f"tiny Qwen3.5-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts; "
        f"{len(args.doc_lens)} packed documents {args.doc_lens} ({sum(args.doc_lens)} tokens, "
        f"cu_seq_lens_q {batch['cu_seq_lens_q'].dtype}); SAC policy {args.policy}"
    )
    if torch.device(args.device).type != "cuda":
        print("(CPU: transformers' call of FLA's GDN kernel is served by fla_ac_isolation.harness.reference_kernels, "
              "which uses FLA's own index helpers and cache)")

    with fla_call_on_cpu(args.device):
        unswapped = compare(model, args)
    _report("without swap_mixers (transformers' GDN, one cu_seq_lens_q object for every layer):", unswapped)
    if unswapped["max_grad_diff"] == 0.0:
        print(f"  ({args.policy} saves no op that FLA's cache miss runs on {args.device}, so nothing shifted here; "
              "try --policy save-all-copies)")

    paths = swap_mixers(model)
    print(f"swap_mixers(model) -> {len(paths)} mixers: {', '.join(paths)}")
    swapped = compare(model, args)
    _report("with swap_mixers (each layer isolates its own cu_seqlens):", swapped)
    same = swapped["max_grad_diff"] == 0.0 and swapped["sac"]["loss"] == swapped["no_ac"]["loss"]
    print(f"after the swap: {'SAC == no AC, bit for bit' if same else 'SAC != no AC'}")
    print("(the no-AC losses before and after the swap differ slightly: transformers' torch conv fallback runs "
          "across document boundaries, ours restarts at each document)")
    return {"unswapped": unswapped, "swapped": swapped, "swapped_paths": paths}


if __name__ == "__main__":
    main()
