"""A decoder of a user's own, as issue 30's trial built it: flash-linear-attention's ``GatedDeltaNet`` and
``KimiDeltaAttention`` layers with an MLP, one ``cu_seqlens`` for every layer, and (``own_ckpt``) each block
checkpointed by the model itself with its own SAC policy saving every ``aten._to_copy`` and ``aten.mm``.

Callables for ``fla-ac-isolation check --model examples/own_decoder.py:<name>``: ``plain`` (no AC: the check
applies it), ``own_ckpt`` (checkpoints itself), ``isolated`` (``own_ckpt`` after ``isolate_seqlens``), ``local``
(its blocks call ``LayerLocalSeqlens.local()``), ``misspelt`` (``own_ckpt`` whose blocks hand the offsets as
``cu_seq_lens=``, a keyword FLA never reads), ``misspelt_isolated`` (that, after ``isolate_seqlens``) and
``isolated_sac`` (``isolated`` checkpointing with ``sac_context_fn(my_policy)``, safe under ``--autocast``);
``my_policy`` is the policy (``--policy examples/own_decoder.py:my_policy``).
"""

import functools

import torch
from fla.layers import GatedDeltaNet, KimiDeltaAttention
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

SAVE = {torch.ops.aten._to_copy.default, torch.ops.aten.mm.default}
DOCS = (0, 70, 93, 134)  # three packed documents


def my_policy(ctx, op, *args, **kwargs):
    """The user's own SAC policy: save every ``aten._to_copy`` and ``aten.mm``, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, d: int) -> None:
        super().__init__()
        self.norm1, self.mixer, self.norm2 = nn.LayerNorm(d), mixer, nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, cu_seqlens):
        x = x + self.mixer(self.norm1(x), cu_seqlens=cu_seqlens)[0]
        return x + self.mlp(self.norm2(x))


class MisspeltBlock(Block):
    """A block whose mixer call misspells FLA's keyword (``cu_seq_lens=``; FLA's layers take unknown keywords)."""

    def forward(self, x, cu_seqlens):
        x = x + self.mixer(self.norm1(x), cu_seq_lens=cu_seqlens)[0]
        return x + self.mlp(self.norm2(x))


class LocalBlock(Block):
    """A block that asks the model's ``LayerLocalSeqlens`` for fresh offsets inside its own forward."""

    def forward(self, x, seqlens):
        return super().forward(x, seqlens.local().cu_seqlens)


class Decoder(nn.Module):
    def __init__(self, d: int = 64, vocab: int = 128, ckpt: bool = False, block: type = Block,
                 context_fn=None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        gdn = functools.partial(GatedDeltaNet, hidden_size=d, num_heads=4, head_dim=16, expand_v=1, mode="chunk")
        kda = functools.partial(KimiDeltaAttention, hidden_size=d, num_heads=4, head_dim=16, mode="chunk")
        self.layers = nn.ModuleList(block(mixer(), d) for mixer in (gdn, kda, gdn, kda))
        self.head = nn.Linear(d, vocab)
        self.ckpt = ckpt  # the user's own SAC contexts unless another context_fn is given
        self.context_fn = context_fn or functools.partial(create_selective_checkpoint_contexts, my_policy)

    def offsets(self, cu_seqlens):
        return cu_seqlens

    def forward(self, input_ids, labels, cu_seqlens):
        x, offsets = self.embed(input_ids), self.offsets(cu_seqlens)
        for layer in self.layers:
            if self.ckpt:
                x = checkpoint(layer, x, offsets, use_reentrant=False, context_fn=self.context_fn)
            else:
                x = layer(x, offsets)
        return nn.functional.cross_entropy(self.head(x)[0, :-1], labels[0, 1:])


class LocalDecoder(Decoder):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__(ckpt=ckpt, block=LocalBlock)

    def offsets(self, cu_seqlens):
        from fla_ac_isolation import LayerLocalSeqlens

        return LayerLocalSeqlens(cu_seqlens)


def _batch() -> dict:
    ids = torch.randint(1, 128, (1, DOCS[-1]), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "cu_seqlens": torch.tensor(DOCS, dtype=torch.int32)}


def plain():
    torch.manual_seed(0)
    return Decoder(), _batch()


def own_ckpt():
    torch.manual_seed(0)
    return Decoder(ckpt=True), _batch()


def isolated():
    from fla_ac_isolation import isolate_seqlens

    model, batch = own_ckpt()
    isolate_seqlens(model)
    return model, batch


def local():
    torch.manual_seed(0)
    return LocalDecoder(ckpt=True), _batch()


def misspelt():
    torch.manual_seed(0)
    return Decoder(ckpt=True, block=MisspeltBlock), _batch()


def misspelt_isolated():
    from fla_ac_isolation import isolate_seqlens

    model, batch = misspelt()
    isolate_seqlens(model)
    return model, batch


def isolated_sac():
    from fla_ac_isolation import isolate_seqlens
    from fla_ac_isolation.policies import sac_context_fn

    torch.manual_seed(0)
    model = Decoder(ckpt=True, context_fn=sac_context_fn(my_policy))
    isolate_seqlens(model)
    return model, _batch()
