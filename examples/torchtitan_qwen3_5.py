"""torchtitan 0.3's own Qwen3.5-MoE model under its own selective AC: shared vs per-layer ``cu_seqlens``.

What torchtitan 0.3.0 does (read from ``torchtitan/models/qwen3_5/model.py``): ``Qwen35Model.get_attention_masks``
builds one ``VarlenMetadata`` per batch (device offsets ``cu_seq_q`` plus host offsets as a tuple of ints)
and every ``Qwen35TransformerBlock`` hands that same object to its ``GatedDeltaNet``. Inside its forward
the GatedDeltaNet then (a) clones ``cu_seq_q`` (its source comment names FLA's identity cache as the
reason) and (b) builds a new host tensor from the tuple, so as shipped each layer call already gives FLA
fresh objects. This script measures that, and what happens without it:

* ``as-shipped``  torchtitan's code untouched.
* ``shared``      every GatedDeltaNet receives the model-level ``cu_seq_q`` object itself: the metadata is
                  given a ``cu_seq_q`` whose ``clone()`` returns the shared tensor, i.e. torchtitan's layer
                  minus its clone line (the "one shared ``cu_seqlens`` for every GDN layer" situation that
                  transformers' Qwen3.5 models are in today).
* ``fixed``       the same neutralised clone, plus the fix from this package: the mask dict carries a
                  ``LayerLocalSeqlens`` and a forward pre-hook on each GatedDeltaNet (which runs inside the
                  checkpointed block) turns it into ``VarlenMetadata`` from ``seqlens.local()``.

AC is torchtitan's own ``SelectiveAC`` (``torchtitan.distributed.activation_checkpoint``) applied with its own
``apply``; ``--policy torchtitan+sub`` is the same class with ``get_save_ops`` (its documented extension
point) also saving ``aten.sub.Tensor``, an op that FLA's ``prepare_chunk_offsets`` runs on a cache miss. It
stands in for any policy that saves an op of FLA's miss path: with FLA < 0.6 on a GPU that was the
device-to-host copy of ``.tolist()``, which torchtitan's own rule saves (docs/index.md, "The fault in one picture").
Every step runs under :class:`~fla_ac_isolation.ReplayAudit` (``record`` mode), which reports which
checkpointed block's recompute diverged and why.

What runs on CPU and what does not (said in the output too):

* FLA's Triton kernels cannot run on CPU (no driver). torchtitan's two FLA calls are therefore served,
  for the duration of ``main`` only, by this package's reference ops: ``chunk_gated_delta_rule`` (patched
  where torchtitan's ``model.py`` imported it) and FLA's ``causal_conv1d`` (patched in the FLA module that
  torchtitan imports it from at call time). The reference ops call FLA's real, identity-cached index helpers
  (``prepare_chunk_indices``, ``prepare_chunk_offsets``) with the kernels' arguments, so FLA's cache hits and
  misses as it would with the kernels. Everything else is torchtitan's code: blocks, GatedDeltaNet, MoE
  (router, grouped experts, shared expert), norms, initialisation, SelectiveAC.
* The model has 3 blocks, all GatedDeltaNet + MoE: torchtitan's Qwen3.5 puts full attention on every 4th
  block, and neither of its attention backends trains on CPU (``varlen``: ``aten::_flash_attention_forward``
  has no CPU kernel; ``flex``: "FlexAttention does not support backward on CPU"). Full-attention blocks hold no
  FLA call, so leaving them out changes nothing about the fault.
* No expert parallelism here (single process): the fault is about one block's recompute; the EP=2 run is
  ``fla-ac-isolation regress``.

Expected (torch 2.13, FLA 0.6.0, torchtitan 0.3.0, CPU): ``as-shipped`` and ``fixed`` equal no-AC bit for bit
under both policies, with every block aligned. ``shared`` diverges in block 0 (FLA's ``prepare_chunk_offsets``
misses in forward and hits in the recompute) under both policies; with torchtitan's policy as shipped no
shifted op is saved, so the gradients still match (a latent fault), and with ``torchtitan+sub`` the step
fails with ``RuntimeError: Autograd not support dtype: Int``.

Run: ``python examples/torchtitan_qwen3_5.py`` (a few seconds on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")  # FLA's notice on CPU-only machines
warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's MoE router asks for fp32 autocast

from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit  # noqa: E402
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache  # noqa: E402
from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan  # noqa: E402
from fla_ac_isolation.ops import reference  # noqa: E402

VARIANTS = ("as-shipped", "shared", "fixed")
POLICY_NAMES = ("torchtitan", "torchtitan+sub")
VOCAB = 256
SPECIAL_TOKENS = {"image_id": VOCAB + 1, "video_id": VOCAB + 2}  # no image/video tokens in the batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc-lens", default="70,23,41", help="packed document lengths (default 70,23,41)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.doc_lens = [int(n) for n in args.doc_lens.split(",")]
    if min(args.doc_lens) < 1:
        parser.error(
            "--doc-lens: torchtitan finds documents where positions restart at 0, so every length must be >= 1"
        )
    return args


# ------------------------------------------------------------------ FLA's kernels on CPU: the reference ops
def _gdn_on_reference(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **_):
    out = reference.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return out, None


def _conv_on_reference(x, weight, bias=None, activation=None, cu_seqlens=None, cu_seqlens_cpu=None, **_):
    out = reference.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                  cu_seqlens_cpu=cu_seqlens_cpu)
    return out, None


@contextlib.contextmanager
def fla_kernels_on_reference() -> Iterator[None]:
    """Serve torchtitan's two FLA kernel calls with the reference ops; restore both on exit."""
    model_module = importlib.import_module("torchtitan.models.qwen3_5.model")
    conv_module = importlib.import_module("fla.modules.conv.causal_conv1d")  # torchtitan imports from here
    saved = (model_module._fla_chunk_gated_delta_rule, conv_module.causal_conv1d)
    model_module._fla_chunk_gated_delta_rule = _gdn_on_reference
    conv_module.causal_conv1d = _conv_on_reference
    try:
        yield
    finally:
        model_module._fla_chunk_gated_delta_rule, conv_module.causal_conv1d = saved


# ----------------------------------------------------------------------------------------- the model
def build_model(dim: int, seed: int):
    """torchtitan's ``Qwen35Model`` from its own config helpers: 3 GatedDeltaNet + MoE blocks, tiny sizes."""
    import torchtitan.models.qwen3_5 as qwen3_5
    from torchtitan.models.common import Embedding, Linear

    layers = qwen3_5._build_qwen35_moe_layers(
        n_layers=3, dim=dim, n_heads=2, n_kv_heads=1, head_dim=32, rotary_dim=16,
        rope=qwen3_5.MRoPE.Config(dim=16, max_seq_len=512, theta=1e7, mrope_section=[3, 3, 2]),
        attn_backend="varlen", moe_hidden_dim=32, num_experts=4, top_k=2, shared_expert_hidden_dim=32,
        n_key_heads=2, n_value_heads=4, key_head_dim=16, value_head_dim=16, fla_backend="fla_chunked",
    )
    config = qwen3_5.Qwen35Model.Config(
        vocab_size=VOCAB, dim=dim, norm=qwen3_5._offset_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3_5._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3_5._output_linear_init(dim)),
        layers=layers,
        vision_encoder=qwen3_5._qwen35_vision_encoder_config(
            dim=32, ffn_dim=64, num_layers=1, num_heads=2, patch_size=16, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=dim, num_position_embeddings=64,
        ),
    )
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model.train()


def apply_ac(model, policy: str) -> None:
    """torchtitan's ``SelectiveAC`` (``policy="torchtitan"``) or its subclass that also saves ``aten.sub``."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    class SelectiveACSavingSub(SelectiveAC):
        def get_save_ops(self) -> set:
            return super().get_save_ops() | {torch.ops.aten.sub.Tensor}

    cls = SelectiveAC if policy == "torchtitan" else SelectiveACSavingSub
    cls(SelectiveAC.Config()).apply(model)


class _SharedOffsets:
    """Stands in for ``cu_seq_q``: its ``clone()`` hands back the one shared tensor (no per-layer copy)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def clone(self) -> torch.Tensor:
        return self.tensor


def _localise(module, args, kwargs):
    """Forward pre-hook of a GatedDeltaNet: ``LayerLocalSeqlens`` -> fresh ``VarlenMetadata`` for this call."""
    from torchtitan.models.common.attention import VarlenMetadata

    x, seqlens = args
    if isinstance(seqlens, LayerLocalSeqlens):
        local = seqlens.local()  # inside the block's forward, so inside its checkpointed region
        cu, max_len = local.cu_seqlens, local.max_seqlen
        seqlens = VarlenMetadata(_SharedOffsets(cu), cu, max_len, max_len, tuple(local.cu_seqlens_cpu.tolist()))
    return (x, seqlens), kwargs


def train_step(args: argparse.Namespace, policy: str | None, variant: str) -> dict:
    """One forward + backward of a fresh model (same seed). ``policy=None``: no AC (the reference)."""
    from torchtitan.models.qwen3_5.model import GatedDeltaNet

    model = build_model(args.dim, args.seed)
    if policy is not None:
        apply_ac(model, policy)
    positions = torch.cat([torch.arange(n) for n in args.doc_lens])[None]            # [1, T]
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, VOCAB, positions.shape, generator=gen)
    masks = model.get_attention_masks(positions)                                      # one VarlenMetadata
    metadata = masks["deltanet"]
    if variant == "shared":
        masks = {**masks, "deltanet": metadata._replace(cu_seq_q=_SharedOffsets(metadata.cu_seq_q))}
    elif variant == "fixed":
        host = torch.tensor(metadata.cu_seq_q_host, dtype=metadata.cu_seq_q.dtype)
        masks = {**masks, "deltanet": LayerLocalSeqlens(metadata.cu_seq_q, cu_seqlens_cpu=host)}
        for module in model.modules():
            if isinstance(module, GatedDeltaNet):
                module.register_forward_pre_hook(_localise, with_kwargs=True)
    clear_tensor_cache()
    error = None
    with ReplayAudit(model, on_divergence="record") as audit:
        try:
            logits = model(tokens, attention_masks=masks, positions=positions, special_tokens=SPECIAL_TOKENS)
            loss = F.cross_entropy(logits[0, :-1], tokens[0, 1:])
            loss.backward()
        except Exception as err:
            error = f"{type(err).__name__}: {str(err).splitlines()[0]}"[:160]
    out = {"error": error, "divergent": [r.label for r in audit.divergent], "audit": audit.summary()}
    if error is None:
        out["loss"] = loss.item()
        out["grads"] = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                        for n, p in model.named_parameters() if p.grad is not None}
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run no-AC, then every (policy, variant); print and return ``{(policy, variant): {...}}``.

    Each value holds ``loss`` (or ``error``), ``max_grad_diff`` against no-AC (``None`` after an error) and
    ``divergent``: the checkpointed blocks whose recompute ReplayAudit found divergent.
    """
    args = parse_args(argv)
    ensure_torch_compat()
    setup_torchtitan("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add overhead
    print(f"torchtitan Qwen3.5-MoE, 3 GatedDeltaNet + MoE blocks, dim {args.dim}; packed documents {args.doc_lens}")
    print("(CPU: torchtitan's FLA kernel calls are served by fla_ac_isolation.ops.reference, which calls FLA's "
          "own cached index helpers; no full-attention block: its backends cannot train on CPU)")
    results: dict = {}
    try:
        with fla_kernels_on_reference():
            ref = train_step(args, None, "as-shipped")
            print(f"  {'no AC':34s} loss {ref['loss']:.6f}")
            for policy in POLICY_NAMES:
                for variant in VARIANTS:
                    run = train_step(args, policy, variant)
                    diff = None
                    if run["error"] is None:
                        diff = max((run["grads"][n] - ref["grads"][n]).abs().max().item() for n in ref["grads"])
                        line = f"loss {run['loss']:.6f}  max |grad - no AC| {diff:.3g}"
                    else:
                        line = f"raised {run['error']}"
                    where = ", ".join(run["divergent"]) or "none"
                    print(f"  {policy + ', ' + variant:34s} {line}  | divergent blocks: {where}")
                    results[(policy, variant)] = {
                        "loss": run.get("loss"), "error": run["error"], "max_grad_diff": diff,
                        "divergent": run["divergent"], "audit": run["audit"],
                    }
    finally:
        torch.set_num_threads(threads)
    print("\nReplayAudit of 'torchtitan, shared':")
    print(results[("torchtitan", "shared")]["audit"])
    return results


if __name__ == "__main__":
    main()
