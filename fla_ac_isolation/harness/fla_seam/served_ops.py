"""Pure-torch stand-ins with the signatures of FLA's entry points (fla-core 0.6), for :mod:`~.serving`. They ask
FLA's own cached index helpers as the kernels do, so FLA's cache (and the AC fault) behaves as with the kernels.
Recurrent states, ``cp_context`` and KDA's ``use_graph``/``return_intermediate_states`` raise
``NotImplementedError``."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fla_ac_isolation.op_inputs import l2_normalize
from fla_ac_isolation.ops import reference, reference_kda

__all__ = [
    "KernelCall",
    "ServedKernels",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "recording",
    "rms_norm_forward",
    "rms_norm_gated_forward",
    "swiglu",
    "swiglu_linear",
]


def _check_schedule(name: str, chunk_indices: Any, cu_seqlens: Any, cu_seqlens_cpu: Any, chunk_size: Any) -> None:
    """A precomputed ``chunk_indices`` holds one row per ``chunk_size``-token chunk of each document: a schedule of
    64-token chunks (``LayerLocalSeqlens.local()``'s) handed with another ``chunk_size`` makes FLA's kernels read the
    wrong rows (overflow, NaN) where the stand-ins would not notice. Raises ``ValueError`` naming both."""
    if chunk_indices is None or chunk_size is None or (cu_seqlens is None and cu_seqlens_cpu is None):
        return
    offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    rows = sum(-(-(b - a) // int(chunk_size)) for a, b in itertools.pairwise(offsets))
    if rows != chunk_indices.shape[0]:
        raise ValueError(
            f"{name}: chunk_indices has {chunk_indices.shape[0]} rows but chunk_size={chunk_size} makes {rows} chunks "
            f"of these documents: the schedule was built for another chunk size (LayerLocalSeqlens.local() builds "
            f"FLA's 64-token one); pass chunk_size=64, or no chunk_indices")


def _unsupported(name: str, **flags: Any) -> None:
    bad = sorted(k for k, v in flags.items() if v)
    if bad:
        raise NotImplementedError(f"reference_kernels: {name} has no reference for {bad}")


# ---------------------------------------------------------------------------------------- what is recorded
@dataclass(frozen=True)
class KernelCall:
    """One call of a served kernel: its name and the offsets arguments it received (the objects themselves)."""

    kernel: str
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    chunk_indices: torch.Tensor | None


@dataclass
class ServedKernels:
    """What :func:`~fla_ac_isolation.harness.fla_seam.serving.reference_kernels` yields.

    Attributes:
        places: every binding replaced (``module.attr``, ``closure of module.attr``, ``Class.forward``).
        calls: the kernel calls made inside the block, in order.
    """

    places: list[str] = field(default_factory=list)
    calls: list[KernelCall] = field(default_factory=list)


_RECORDING: list[ServedKernels] = []  # the serving blocks open now; the innermost records the calls


@contextlib.contextmanager
def recording(served: ServedKernels) -> Iterator[ServedKernels]:
    """Record the stand-ins' calls into ``served`` inside the block (the innermost block records)."""
    _RECORDING.append(served)
    try:
        yield served
    finally:
        if _RECORDING and _RECORDING[-1] is served:
            _RECORDING.pop()


def _record(kernel: str, cu_seqlens: Any, cu_seqlens_cpu: Any, chunk_indices: Any) -> None:
    if _RECORDING:
        _RECORDING[-1].calls.append(KernelCall(kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices))


# ------------------------------------------------------------------------------ FLA-signature stand-ins
# FLA 0.6 wraps chunk_gated_delta_rule and chunk_kda in torch.compiler.disable; so do their stand-ins. The conv
# stand-in is opaque to torch.compile too (FLA's is not): its per-document loop would only add graph breaks.
@torch.compiler.disable
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, **kwargs):
    """FLA's ``chunk_gated_delta_rule`` (``q/k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g``/``beta``
    ``[B, T, HV]``) -> ``(o [B, T, HV, V], None)``."""
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate

    _unsupported("chunk_gated_delta_rule", initial_state=initial_state is not None,
                 output_final_state=output_final_state, cp_context=cp_context is not None)
    _record("chunk_gated_delta_rule", cu_seqlens, cu_seqlens_cpu, chunk_indices)
    _check_schedule("chunk_gated_delta_rule", chunk_indices, cu_seqlens, cu_seqlens_cpu, kwargs.get("chunk_size"))
    if kwargs.get("use_gate_in_kernel", False):
        g = naive_gdn_gate(g, kwargs["A_log"], kwargs.get("dt_bias"))
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
    if allow_neg_eigval:
        beta = beta * 2.0
    o = reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                         cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)
    return o, None


@torch.compiler.disable
def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    """FLA's ``causal_conv1d`` (``x [B, T, D]``, ``weight [D, W]``) -> ``(y [B, T, D], None)``."""
    _unsupported("causal_conv1d", initial_state=initial_state is not None, output_final_state=output_final_state,
                 cp_context=cp_context is not None)
    _record("causal_conv1d", cu_seqlens, cu_seqlens_cpu, chunk_indices)
    _check_schedule("causal_conv1d", chunk_indices, cu_seqlens, cu_seqlens_cpu, kwargs.get("chunk_size"))
    y = reference.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)
    return (y if residual is None else y + residual), None


@torch.compiler.disable
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """FLA's ``chunk_kda`` (``q/k [B, T, H, K]``, ``g [B, T, HV, K]``): its gates here, then
    :func:`fla_ac_isolation.ops.reference_kda.chunk_kda` (FLA's naive recurrence per document, a per-token loop:
    keep inputs short) -> ``(o [B, T, HV, V], None)``."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    _unsupported("chunk_kda", initial_state=initial_state is not None, output_final_state=output_final_state,
                 cp_context=cp_context is not None, use_graph=use_graph,
                 return_intermediate_states=return_intermediate_states)
    _record("chunk_kda", cu_seqlens, cu_seqlens_cpu, None)
    if use_gate_in_kernel and lower_bound is not None:  # safe_gate only tells the kernel the gate's range
        g = naive_kda_lowerbound_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"), lower_bound)
    elif use_gate_in_kernel:
        g = naive_kda_gate(g, kwargs["A_log"], kwargs.get("dt_bias"))
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
    if allow_neg_eigval:
        beta = beta * 2.0
    if use_qk_l2norm_in_kernel:  # FLA's l2norm_fwd returns the input dtype
        q, k = (l2_normalize(t.float()).to(t.dtype) for t in (q, k))
    # the reference asks FLA's helpers by keyword, as chunk_kda's forward does: FLA's cache keys an entry by its
    # positional count and keyword set, so a positional lookup would hit the conv's entry for the same offsets
    return reference_kda.chunk_kda(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=False,
                                   cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu), None


def swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """FLA's ``swiglu``: ``silu(x) * y``, the activation in float32."""
    return (F.silu(x.float()) * y.float()).to(x.dtype)


def swiglu_linear(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """FLA's ``swiglu_linear``: ``linear(swiglu(x, y), weight, bias)``."""
    return F.linear(swiglu(x, y), weight, bias)


def _rms_norm(module: Any, x: torch.Tensor, residual: torch.Tensor | None, residual_in_fp32: bool):
    if residual is not None:
        x = x + residual
    residual_out = x.float() if residual_in_fp32 else x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)
    if getattr(module, "weight", None) is not None:
        y = y * module.weight.float()
    if getattr(module, "bias", None) is not None:
        y = y + module.bias.float()
    return x, y, residual_out


def rms_norm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    """``RMSNorm.forward``: ``rmsnorm(x (+ residual)) * weight (+ bias)`` (with ``prenorm``, also the residual)."""
    x, y, residual_out = _rms_norm(self, x, residual, residual_in_fp32)
    y = y.to(x.dtype)
    return (y, residual_out) if prenorm else y


def rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """``FusedRMSNormGated.forward``: ``rmsnorm(x) * weight (+ bias)``, then ``* silu(g)`` or ``* sigmoid(g)``."""
    x, y, residual_out = _rms_norm(self, x, residual, residual_in_fp32)
    gate = g.float()
    y = (y * (torch.sigmoid(gate) if self.activation == "sigmoid" else F.silu(gate))).to(x.dtype)
    return (y, residual_out) if prenorm and residual is not None else y
