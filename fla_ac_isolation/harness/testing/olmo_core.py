"""Running OLMo-core's hybrid models on a CPU (test support only): packed documents on its ``torch`` attention
backend, and FLA's kernels on reference ops (:func:`cpu_stand_ins`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fla_ac_isolation.harness.reference_kernels import ServedKernels, reference_kernels

__all__ = ["cpu_stand_ins", "document_causal_mask", "packed_attention_on_torch_backend"]


def document_causal_mask(cu_doc_lens: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: query ``i`` sees key ``j <= i`` of its own document (``cu_doc_lens [N + 1]`` over
    the flattened ``B * T`` tokens)."""
    pos = torch.arange(batch * tokens, device=cu_doc_lens.device)
    doc = torch.bucketize(pos, cu_doc_lens[1:].to(pos.dtype), right=True).view(batch, 1, tokens)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=pos.device).tril()
    return (doc.unsqueeze(-1) == doc.unsqueeze(-2)) & causal


@contextlib.contextmanager
def packed_attention_on_torch_backend() -> Iterator[None]:
    """Let OLMo-core's ``TorchAttentionBackend`` attend within packed documents (``cu_doc_lens``) in the block.

    Raises:
        NotImplementedError: (from the forward) ``cu_doc_lens`` together with a sliding window, attention
            sinks, a KV cache or context parallelism.
    """
    from olmo_core.nn.attention.backend import TorchAttentionBackend

    original = TorchAttentionBackend.__dict__["forward"]

    def forward(self, qkv, cu_doc_lens=None, cu_doc_lens_q=None, cu_doc_lens_k=None, max_doc_len=None,
                max_doc_len_q=None, max_doc_len_k=None, local_k_slice=None, kv_cache_manager=None, sinks=None):
        offsets = cu_doc_lens if cu_doc_lens is not None else cu_doc_lens_q
        if offsets is None:
            return original(self, qkv, local_k_slice=local_k_slice, kv_cache_manager=kv_cache_manager, sinks=sinks)
        if self.window_size != (-1, -1) or sinks is not None or kv_cache_manager is not None or self.cp_enabled:
            raise NotImplementedError("packed_attention_on_torch_backend covers plain causal attention only")
        q, k, v = (t.transpose(1, 2) for t in qkv)  # [B, H, T, Dh]
        mask = document_causal_mask(offsets, q.shape[0], q.shape[2])
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p, scale=self.scale,
                                             enable_gqa=True)  # as OLMo-core's own SDPA call
        # [B, T, H, Dh], contiguous as the flash backends return it: OLMo-core's gate then views it as
        # [B, T, H * Dh], which a transposed view (what eager CUDA SDPA happens to lay out densely, but a
        # compiled graph's fake tensor does not) cannot take under torch.compile
        return att.transpose(1, 2).contiguous()

    TorchAttentionBackend.forward = forward
    try:
        yield
    finally:
        TorchAttentionBackend.forward = original


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[ServedKernels]:
    """``reference_kernels()`` plus :func:`packed_attention_on_torch_backend`; yields what the first yields."""
    with reference_kernels() as served, packed_attention_on_torch_backend():
        yield served
