"""FLA's kernels served by reference ops, to run foreign models (OLMo-core, transformers, torchtitan) on a CPU.

Test support only: library code never imports this module. FLA's Triton kernels cannot run on a CPU, so
inside :func:`reference_kernels` the entry points foreign code calls are replaced, wherever that code looks
them up, by adapters with FLA's signatures:

* ``chunk_gated_delta_rule`` and ``causal_conv1d``: :mod:`fla_ac_isolation.ops.reference`, which asks FLA's
  own identity-cached index helpers for the chunk schedule with the kernels' arguments, so FLA's cache hits
  and misses (and the AC fault reproduces) exactly as with the kernels;
* ``chunk_kda``: FLA's own ``naive_kda_gate`` and ``naive_recurrent_kda``, one document at a time, after the
  same helper calls as ``chunk_kda`` (slow: a per-token loop; keep inputs short);
* ``FusedRMSNormGated.forward`` (a Triton kernel): ``rmsnorm(x) * weight (+ bias) * act(g)`` in float32.

Where foreign code finds FLA (fla-core 0.6, OLMo-core 3.0, transformers 5.24, torchtitan 0.3):

* module attributes bound to FLA's function objects: FLA's own modules and its alias modules
  (``fla.modules.convolution`` and ``fla.modules.conv`` are synthesised modules whose attributes are
  separate bindings), torchtitan's ``_fla_chunk_gated_delta_rule`` (bound at import), and the package
  attributes OLMo-core imports inside its dispatch functions. All are found by identity over ``sys.modules``.
* closure cells: transformers' ``use_kernel_func_from_hub_with_fallback`` captures FLA's function in the
  closure of the wrapper it binds as ``torch_chunk_gated_delta_rule``; the cell is rewritten, so every
  binding of that wrapper sees the adapter. (The wrapper passes on only FLA's named parameters, computed
  from FLA's signature at import: the adapters accept all of them.)
* the class: ``fla.modules.FusedRMSNormGated.forward``, so instances built earlier follow.

On exit everything is put back, in reverse order, and a module imported inside the block that bound an
adapter is pointed back at FLA (bindings that held an adapter before the block are left alone).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fla_ac_isolation.ops import reference

__all__ = ["KernelCall", "ServedKernels", "reference_kernels"]


@dataclass(frozen=True)
class KernelCall:
    """One call of a served kernel: its name and the offsets arguments it received (the objects)."""

    kernel: str
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    chunk_indices: torch.Tensor | None


@dataclass
class ServedKernels:
    """What :func:`reference_kernels` yields.

    Attributes:
        places: every binding replaced (``module.attr``, ``closure of module.attr``, ``Class.forward``).
        calls: the kernel calls made inside the block, in order.
    """

    places: list[str] = field(default_factory=list)
    calls: list[KernelCall] = field(default_factory=list)


_ACTIVE: list[ServedKernels] = []  # the innermost block records the calls


def _record(kernel: str, cu_seqlens: Any, cu_seqlens_cpu: Any, chunk_indices: Any) -> None:
    if _ACTIVE:
        _ACTIVE[-1].calls.append(KernelCall(kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices))


def _unsupported(name: str, **flags: Any) -> None:
    bad = sorted(k for k, v in flags.items() if v)
    if bad:
        raise NotImplementedError(f"reference_kernels: {name} has no reference for {bad}")


# ------------------------------------------------------------------------------ FLA-signature adapters
# FLA 0.6 wraps chunk_gated_delta_rule and chunk_kda in torch.compiler.disable; so do their stand-ins. The conv
# stand-in is opaque to torch.compile too (FLA's is not): its per-document loop would only add graph breaks.
@torch.compiler.disable
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    """FLA's ``chunk_gated_delta_rule`` (``q/k [B, T, H, K]``, ``v [B, T, HV, V]``) -> ``(o, None)``."""
    _unsupported("chunk_gated_delta_rule", initial_state=initial_state is not None,
                 output_final_state=output_final_state, state_v_first=state_v_first, cp_context=cp_context is not None)
    _record("chunk_gated_delta_rule", cu_seqlens, cu_seqlens_cpu, chunk_indices)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid()
    if allow_neg_eigval:
        beta = beta * 2.0
    o = reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                         chunk_indices=chunk_indices)
    return o, None


@torch.compiler.disable
def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    """FLA's ``causal_conv1d`` (``x [B, T, D]``, ``weight [D, W]``) -> ``(y, None)``."""
    _unsupported("causal_conv1d", initial_state=initial_state is not None, output_final_state=output_final_state,
                 cp_context=cp_context is not None)
    _record("causal_conv1d", cu_seqlens, cu_seqlens_cpu, chunk_indices)
    y = reference.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)
    return (y if residual is None else y + residual), None


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


@torch.compiler.disable
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """FLA's ``chunk_kda`` on packed documents: FLA's naive recurrence per document -> ``(o, None)``.

    Asks ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` as ``chunk_kda`` does in its forward, so FLA's
    cache sees what it sees with the kernel. ``A_log``/``dt_bias`` come in ``kwargs`` (``use_gate_in_kernel``).
    """
    from fla.ops.kda.gate import naive_kda_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    from fla_ac_isolation.fla_seam.layout import CHUNK_SIZE, prepare_chunk_indices, prepare_chunk_offsets

    _unsupported("chunk_kda", initial_state=initial_state is not None, output_final_state=output_final_state,
                 safe_gate=safe_gate, state_v_first=state_v_first, cp_context=cp_context is not None,
                 use_graph=use_graph, return_intermediate_states=return_intermediate_states)
    _record("chunk_kda", cu_seqlens, cu_seqlens_cpu, None)
    if use_gate_in_kernel:
        g = naive_kda_gate(g, kwargs["A_log"], kwargs.get("dt_bias"))
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
    if allow_neg_eigval:
        beta = beta * 2.0
    if use_qk_l2norm_in_kernel:
        q, k = _l2_normalize(q), _l2_normalize(k)
    if cu_seqlens is None:
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale)[0], None
    prepare_chunk_indices(cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)
    prepare_chunk_offsets(cu_seqlens, CHUNK_SIZE)
    offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    pieces = [naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale)[0]
              for a, b in itertools.pairwise(offsets) if b > a]
    return torch.cat(pieces, dim=1).to(q.dtype), None


def rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """``FusedRMSNormGated.forward``: ``rmsnorm(x) * weight (+ bias)``, then ``* silu(g)`` or ``* sigmoid(g)``."""
    if residual is not None:
        x = x + residual
        residual_out = x.float() if residual_in_fp32 else x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    if self.weight is not None:
        y = y * self.weight.float()
    if getattr(self, "bias", None) is not None:
        y = y + self.bias.float()
    gate = g.float()
    y = (y * (torch.sigmoid(gate) if self.activation == "sigmoid" else F.silu(gate))).to(x.dtype)
    return (y, residual_out) if prenorm and residual is not None else y


# ------------------------------------------------------------------------------------------ patching
def _targets() -> dict[int, tuple[Any, Any]]:
    """``{id(FLA function): (FLA function, adapter)}``."""
    from fla.modules.causal_conv1d.ops import causal_conv1d as fla_conv
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda.chunk import chunk_kda as fla_kda

    return {id(f): (f, a) for f, a in ((fla_gdn, chunk_gated_delta_rule), (fla_conv, causal_conv1d),
                                       (fla_kda, chunk_kda))}


def _module_dicts() -> Iterator[tuple[str, dict]]:
    """Every module's namespace but this one's (deprecated module attributes warn when touched: silenced)."""
    this = sys.modules[__name__]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if isinstance(module, types.ModuleType) and module is not this:
                yield name, vars(module)


def _cells(value: Any) -> tuple:
    """The closure cells of a ``functools.wraps`` wrapper (transformers' kernel wrappers), else ``()``."""
    if isinstance(value, types.FunctionType) and value.__closure__ and hasattr(value, "__wrapped__"):
        return value.__closure__
    return ()


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


class _Patches:
    """Replaced bindings, undone in reverse order."""

    def __init__(self) -> None:
        self.undo: list[tuple[str, Any, Any, Any]] = []

    def scan(self, targets: dict[int, tuple[Any, Any]], places: list[str]) -> None:
        for name, namespace in _module_dicts():
            for attr, value in list(namespace.items()):
                hit = targets.get(id(value))
                if hit is not None and hit[0] is value:
                    self.undo.append(("dict", namespace, attr, value))
                    namespace[attr] = hit[1]
                    places.append(f"{name}.{attr}")
                for cell in _cells(value):
                    content = _cell_contents(cell)
                    hit = targets.get(id(content))
                    if hit is not None and hit[0] is content:
                        self.undo.append(("cell", cell, None, content))
                        cell.cell_contents = hit[1]
                        places.append(f"closure of {name}.{attr}")

    def restore(self) -> None:
        for kind, holder, key, old in reversed(self.undo):
            if kind == "dict":
                holder[key] = old
            elif kind == "cell":
                holder.cell_contents = old
            else:
                setattr(holder, key, old)
        self.undo.clear()


def _adapter_bindings(adapters: dict[int, Any]) -> set[tuple[int, Any]]:
    """``(id(holder), key)`` of every binding (module attribute or closure cell) holding an adapter now."""
    found = set()
    for _, namespace in _module_dicts():
        for attr, value in list(namespace.items()):
            if id(value) in adapters:
                found.add((id(namespace), attr))
            found.update((id(cell), None) for cell in _cells(value) if id(_cell_contents(cell)) in adapters)
    return found


def _point_back_at_fla(adapters: dict[int, Any], keep: set[tuple[int, Any]]) -> None:
    """Bindings made inside the block (modules imported there) that hold an adapter: back to FLA's function."""
    for _, namespace in _module_dicts():
        for attr, value in list(namespace.items()):
            if id(value) in adapters and (id(namespace), attr) not in keep:
                namespace[attr] = adapters[id(value)]
            for cell in _cells(value):
                content = _cell_contents(cell)
                if id(content) in adapters and (id(cell), None) not in keep:
                    cell.cell_contents = adapters[id(content)]


@contextlib.contextmanager
def reference_kernels() -> Iterator[ServedKernels]:
    """Serve FLA's gated delta rule, causal conv, KDA and ``FusedRMSNormGated`` with reference ops in the block.

    Yields:
        :class:`ServedKernels`: the places patched and, filled as the block runs, every kernel call with the
        offsets objects it received.

    Raises:
        NotImplementedError: (from a served kernel) an argument the references do not cover: initial or
            final states, ``cp_context``, ``state_v_first``, KDA's ``safe_gate``/``use_graph``.
    """
    from fla.modules import FusedRMSNormGated

    targets = _targets()
    adapters = {id(adapter): fla for fla, adapter in targets.values()}
    keep = _adapter_bindings(adapters)  # a user's own import of an adapter stays as it is
    served = ServedKernels()
    patches = _Patches()
    try:
        patches.scan(targets, served.places)
        patches.undo.append(("attr", FusedRMSNormGated, "forward", FusedRMSNormGated.__dict__["forward"]))
        FusedRMSNormGated.forward = rms_norm_gated_forward
        served.places.append("fla.modules.FusedRMSNormGated.forward")
        _ACTIVE.append(served)
        yield served
    finally:
        if _ACTIVE and _ACTIVE[-1] is served:
            _ACTIVE.pop()
        patches.restore()
        _point_back_at_fla(adapters, keep)
