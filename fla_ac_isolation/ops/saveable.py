"""The custom operators behind ``ops(..., saveable=True)``: one :data:`TABLE` row per backend and operation.

``reference`` rows run the reference functions (arguments by position); their backward operator reruns them on
detached inputs under autograd. Gradients come back contiguous, so in float32 they may differ in the last bit
from the plain reference's; AC equals no AC bit for bit within each backend.
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
    """``function`` as an operator's kernel: parameters positional without defaults (for torch's inferred schema),
    types overridden by ``annotations``, the result contiguous."""
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
