"""The packed offsets a drop-in mixer reads from its call: ours (``seqlens``, a
:class:`~fla_ac_isolation.PackedSeqlens`: ``LayerLocalSeqlens``, ``CPSeqlens`` or ``StaticSeqlens``), FLA's
(``cu_seqlens``, with ``cu_seqlens_cpu``), transformers' (``cu_seq_lens_q``/``cu_seq_lens_k`` with
``max_length_q``, or ``seq_idx``) and OLMo-core's (``cu_doc_lens``, with ``max_doc_len``). Two that describe
different documents, or an offsets-like keyword none of these (named ``cu_*`` and holding offsets), raise naming
them: a packed batch never runs as one sequence because of a keyword the mixer did not read.

A model-level offsets tensor is validated once per batch: the first layer's call builds a ``LayerLocalSeqlens``
for that object (its values read on the host, outside the dispatcher: SAC and the audit see nothing), later calls
and recomputes find it by identity. Each layer then takes fresh objects from it (``.local()``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fla_ac_isolation.local_seqlens import PackedSeqlens
from fla_ac_isolation.offsets_hook import offsets_like_keywords
from fla_ac_isolation.seqlens import LayerLocalSeqlens, devices_match

__all__ = ["COMPANIONS", "SOURCES", "resolve_offsets"]

SOURCES: tuple[str, ...] = ("seqlens", "cu_seqlens", "cu_seq_lens_q", "seq_idx", "cu_doc_lens")
"""The keywords a drop-in takes its offsets from (any one; several must agree)."""

COMPANIONS: tuple[str, ...] = ("cu_seqlens_cpu", "cu_seq_lens_k", "max_length_q", "max_length_k", "max_seqlen",
                               "max_doc_len", "chunk_indices")
"""Keywords read with a source: host offsets, the key offsets of self-attention, longest document, FLA's schedule."""

_CACHE_LIMIT = 8  # model-level offsets objects kept (one per batch in flight)
_BY_ID: dict[int, tuple[weakref.ref, LayerLocalSeqlens]] = {}


def _describe(seqlens: PackedSeqlens) -> str:
    offsets = seqlens.seq_lens()
    shown = offsets if len(offsets) <= 8 else [*offsets[:8], "..."]
    return f"{seqlens.num_seqs} documents of {shown} tokens"


@torch.compiler.disable
def _validated(key: torch.Tensor, build: Any, name: str) -> LayerLocalSeqlens:
    """The ``LayerLocalSeqlens`` built for the object ``key`` (``build()`` on its first call), raising naming
    ``name`` when ``build`` refuses it."""
    entry = _BY_ID.get(id(key))
    if entry is not None and entry[0]() is key:
        return entry[1]
    with _disable_current_modes(), torch.no_grad():  # invisible to SAC and the audit: a recompute runs none of it
        try:
            seqlens = build()
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name} is not valid packed-sequence offsets: {err}") from err
    live = {k: v for k, v in _BY_ID.items() if v[0]() is not None}
    _BY_ID.clear()
    _BY_ID.update(list(live.items())[-(_CACHE_LIMIT - 1):])
    _BY_ID[id(key)] = (weakref.ref(key), seqlens)
    return seqlens


def _max_len(value: Any) -> int | None:
    return int(value) if isinstance(value, torch.Tensor) else value


def _from_seq_idx(seq_idx: torch.Tensor) -> LayerLocalSeqlens:
    """Offsets from transformers' ``seq_idx`` ``[1, T]``: the document index of every token, from 0, non-decreasing
    (a skipped index is an empty document)."""
    if seq_idx.dim() != 2 or seq_idx.shape[0] != 1 or seq_idx.is_floating_point() or seq_idx.dtype == torch.bool:
        raise ValueError(f"seq_idx must be a [1, T] integer tensor, got {seq_idx.dtype} of shape "
                         f"{tuple(seq_idx.shape)}")
    host = seq_idx[0].cpu().long()
    if host.numel() and (host[0] != 0 or bool((host.diff() < 0).any())):
        raise ValueError("seq_idx must start at 0 and never decrease from token to token")
    lengths = torch.bincount(host, minlength=int(host.max()) + 1 if host.numel() else 1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()
    return LayerLocalSeqlens(offsets.to(seq_idx.device), cu_seqlens_cpu=offsets)


def _one_source(name: str, value: Any, kwargs: dict, hidden_states: torch.Tensor) -> PackedSeqlens:
    if name == "seqlens":
        if not isinstance(value, PackedSeqlens):
            raise TypeError(f"seqlens must be a fla_ac_isolation.PackedSeqlens (LayerLocalSeqlens, CPSeqlens or "
                            f"StaticSeqlens), got {type(value).__name__}; "
                            "pass offsets tensors as cu_seqlens= (FLA's name) or cu_seq_lens_q= (transformers')")
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer offsets tensor [N + 1], got {type(value).__name__}")
    if name == "seq_idx":
        return _validated(value, lambda: _from_seq_idx(value), name)
    longest = {"cu_seqlens": "max_seqlen", "cu_seq_lens_q": "max_length_q", "cu_doc_lens": "max_doc_len",
               "cu_seq_lens_k": "max_length_k"}[name]
    host = kwargs.get("cu_seqlens_cpu") if name == "cu_seqlens" else None
    # the token count and device are checked before FLA's chunk schedule is built (a bad last offset can be huge)
    return _validated(value, lambda: LayerLocalSeqlens(
        value, max_seqlen=_max_len(kwargs.get(longest)), cu_seqlens_cpu=host, device=hidden_states.device,
        num_tokens=hidden_states.shape[1]), name)


def _same(a: PackedSeqlens, b: PackedSeqlens) -> bool:
    return a is b or a.seq_lens() == b.seq_lens()


def resolve_offsets(kwargs: dict, hidden_states: torch.Tensor, where: str) -> PackedSeqlens | None:
    """The packed offsets of one mixer call, validated against ``hidden_states [B, T, D]``; ``None`` unpacked.
    Reads (and leaves in place) :data:`SOURCES` and :data:`COMPANIONS` of ``kwargs``.

    Args:
        kwargs: the call's keyword arguments.
        hidden_states: the call's input.
        where: the mixer, for messages (``"Qwen3_5MoeGatedDeltaNet"``).

    Raises:
        TypeError: a source of the wrong type (``seqlens`` not a ``PackedSeqlens``, a non-tensor offsets).
        ValueError: invalid offsets; two sources describing different documents; ``cu_seq_lens_k`` unequal to
            ``cu_seq_lens_q``; an offsets-like keyword this mixer does not read; packed input with ``B > 1``;
            offsets not ending at ``T`` or on another device than ``hidden_states``.
    """
    unknown = [k for k in offsets_like_keywords(kwargs) if k not in SOURCES and k not in COMPANIONS]
    if unknown:
        raise ValueError(
            f"{where} got the offsets-like keyword(s) {unknown}, which it does not read: it takes packed offsets "
            f"from {list(SOURCES)} only, so these documents would run as one sequence (they mix); pass the "
            "offsets under one of those names")
    given = [(n, kwargs[n]) for n in SOURCES if kwargs.get(n) is not None]
    if not given:
        for name in ("cu_seqlens_cpu", "cu_seq_lens_k"):
            if kwargs.get(name) is not None:
                source = "cu_seqlens" if name == "cu_seqlens_cpu" else "cu_seq_lens_q"
                raise ValueError(f"{where} got {name} without {source}: pass {source} (the offsets on the "
                                 "activations' device) too, or neither")
        return None
    first_name = given[0][0]
    if hidden_states.shape[0] != 1:
        raise ValueError(f"packed input ({first_name} given) must have batch size 1, got hidden_states of shape "
                         f"{tuple(hidden_states.shape)}; flatten the batch into one row")
    resolved = [(n, _one_source(n, v, kwargs, hidden_states)) for n, v in given]
    seqlens = resolved[0][1]
    for name, other in resolved[1:]:
        if not _same(seqlens, other):
            raise ValueError(f"{where} got {first_name} ({_describe(seqlens)}) and {name} ({_describe(other)}), "
                             "which describe different documents: pass one of them")
    keys = kwargs.get("cu_seq_lens_k")
    if keys is not None and keys is not kwargs.get("cu_seq_lens_q"):
        other = _one_source("cu_seq_lens_k", keys, kwargs, hidden_states)
        if not _same(seqlens, other):
            raise ValueError(f"{where} got cu_seq_lens_k ({_describe(other)}) unlike its offsets "
                             f"({_describe(seqlens)}): a linear-attention layer reads one set of documents")
    seqlens.check_tokens(hidden_states.shape[1], name="hidden_states")
    if not devices_match(seqlens.device, hidden_states.device):
        raise ValueError(f"{first_name} is on {seqlens.device} but hidden_states is on {hidden_states.device}; "
                         "build the offsets on the activations' device")
    return seqlens
