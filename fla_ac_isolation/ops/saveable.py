"""The custom operators behind ``ops(..., saveable=True)``: one table per backend, registered in one loop.

Each saveable operation (:data:`~fla_ac_isolation.op_names.SAVEABLE_OP_NAMES`) has one operator per backend in
the ``fla_ac_isolation`` namespace, each with a fake (meta) kernel and a backward operator
(``<name>_backward``), all made by :func:`~fla_ac_isolation.saveable_op.register_saveable_op` from a row of
:data:`TABLE`:

* ``fla``: :data:`fla_ac_isolation.fla_seam.saveable_kernels.KERNELS`, FLA's own forward and backward functions
  (``causal_conv1d``, ``gated_delta_rule``, ``simple_gla``);
* ``reference``: the reference functions as forward kernels (``causal_conv1d_reference``:
  :func:`~fla_ac_isolation.ops.reference.causal_conv1d`; ``gated_delta_rule_reference``:
  :func:`~fla_ac_isolation.ops.reference.chunk_gated_delta_rule`; ``ssd_scan_reference``:
  :func:`~fla_ac_isolation.ops.reference.ssd_scan`, the part FLA's simple GLA computes; their arguments taken
  by position, in the order of their signatures, ``scale`` a float), and no backward function: the backward
  operator reruns the function on detached copies of the saved inputs under autograd, then
  ``torch.autograd.grad``. Gradients are returned contiguous (the fakes promise it), so in float32 they
  can differ from the plain reference's in the last bit (another summation order downstream); the promise is
  "AC equals no AC bit for bit" within this backend. The reference reads FLA's cached index helpers inside
  the operator, forward and backward, so a saved operator looks nothing up in the recompute, as on FLA.

So the CPU tests cover what the ``fla`` operators offer on a GPU: a SAC policy can save their outputs
(:func:`fla_ac_isolation.policies.save_fla_ops`), and ``torch.compile`` traces a mixer without a graph break at
the call (the reference's ``.tolist()`` calls run inside the kernel, never traced). Which operator a call
runs, and what the entry point computes around it, is :mod:`fla_ac_isolation.ops`'s business.

* :data:`CALLS` - ``{backend: {operation: operator}}``, the registered operators (callable positionally);
* :data:`OVERLOADS` - the same as ``OpOverload`` s (what a SAC policy compares against).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from fla_ac_isolation.fla_seam.saveable_kernels import KERNELS as FLA_KERNELS
from fla_ac_isolation.op_names import by_operation
from fla_ac_isolation.ops import reference
from fla_ac_isolation.saveable_op import NAMESPACE, register_saveable_op

__all__ = ["CALLS", "OVERLOADS", "TABLE"]


def _contiguous_like(first: Tensor, *_args) -> Tensor:
    return torch.empty_like(first, memory_format=torch.contiguous_format)


def _kernel(function: Callable[..., Tensor], **annotations: str) -> Callable[..., Tensor]:
    """``function`` as an operator's kernel: every parameter positional and without a default (the schema torch
    infers from the signature: ``Tensor? bias``, not ``Tensor? bias=None``), ``annotations`` replacing the types
    of the parameters they name, the result contiguous (the fakes promise it). ``function`` itself is unchanged.
    """
    signature = inspect.signature(function)
    parameters = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, default=inspect.Parameter.empty,
                            annotation=annotations.get(p.name, p.annotation))
                  for p in signature.parameters.values()]
    names = [p.name for p in parameters]

    @functools.wraps(function)
    def kernel(*args):
        return function(**dict(zip(names, args))).contiguous()

    del kernel.__wrapped__  # torch reads the signature below, not the function's
    kernel.__signature__ = signature.replace(parameters=parameters)
    return kernel


TABLE: dict[str, dict[str, dict]] = {
    "fla": FLA_KERNELS,
    "reference": by_operation(
        causal_conv1d=dict(name="causal_conv1d_reference", forward=_kernel(reference.causal_conv1d),
                           fake=_contiguous_like, grads_of=("x", "weight", "bias")),
        gated_delta_rule=dict(name="gated_delta_rule_reference",
                              forward=_kernel(reference.chunk_gated_delta_rule, scale="float"),
                              fake=lambda q, k, v, *_: q.new_empty(v.shape),  # o [B, T, HV, V], dtype of q
                              grads_of=("q", "k", "v", "g", "beta")),
        ssd=dict(name="ssd_scan_reference", forward=_kernel(reference.ssd_scan), fake=_contiguous_like,
                 grads_of=("x", "log_decay", "B", "C")),
    ),
}
"""Per backend and saveable operation, the keyword arguments of
:func:`~fla_ac_isolation.saveable_op.register_saveable_op`."""

CALLS: dict[str, dict[str, torch._library.custom_ops.CustomOpDef]] = {
    backend: {operation: register_saveable_op(**row) for operation, row in rows.items()}
    for backend, rows in TABLE.items()
}
"""The registered forward operators, ``{backend: {operation: operator}}``."""

OVERLOADS: dict[str, dict[str, torch._ops.OpOverload]] = {
    backend: {operation: getattr(getattr(torch.ops, NAMESPACE), row["name"]).default
              for operation, row in rows.items()}
    for backend, rows in TABLE.items()
}
"""The forward operators as ``OpOverload`` s (what :func:`~fla_ac_isolation.policies.save_fla_ops` saves)."""
