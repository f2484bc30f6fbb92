"""An operation's forward and backward as a pair of torch custom operators (:func:`register_saveable_op`), so a
SAC policy can save the forward's outputs and ``torch.compile`` traces the call without a graph break.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["NAMESPACE", "register_saveable_op"]

NAMESPACE = "fla_ac_isolation"
"""The torch library namespace of every operator of the package (``torch.ops.fla_ac_isolation``)."""

_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")


@contextlib.contextmanager
def _autograd_inside_kernel() -> Iterator[None]:
    """Let autograd record inside a custom op's kernel (lifts the autograd keys' exclusion; private torch TLS API)."""
    keys = [getattr(torch._C.DispatchKey, name) for name in _AUTOGRAD_KEYS]
    prior = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in keys]
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for key, was in zip(keys, prior):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def _autograd_grads(forward: Callable[..., Tensor], args: list, wanted: list[int], grad_out: Tensor) -> list[Tensor]:
    """Gradients of ``forward(*args)`` for the positions ``wanted`` (a ``None`` input: ``empty(0)``), contiguous
    and not aliasing ``grad_out`` (a custom op's output may not alias its inputs)."""
    with _autograd_inside_kernel():
        args = list(args)
        for i in wanted:
            if args[i] is not None:
                args[i] = args[i].detach().requires_grad_(True)
        leaves = [args[i] for i in wanted if args[i] is not None]
        found = iter(torch.autograd.grad(forward(*args), leaves, grad_out, allow_unused=True))
    grads = []
    for i in wanted:
        t = args[i]
        if t is None:
            grads.append(grad_out.new_empty(0))
            continue
        g = next(found)
        g = t.new_zeros(t.shape) if g is None else g.contiguous()
        if g.untyped_storage().data_ptr() == grad_out.untyped_storage().data_ptr():
            g = g.clone()
        grads.append(g)
    return grads


def _arguments(schema: torch.FunctionSchema) -> str:
    """The argument list of ``schema`` as written in a schema string (``Tensor x, Tensor? bias, ...``)."""
    return str(schema).split("(", 1)[1].rsplit(") ->", 1)[0]


def register_saveable_op(
    name: str,
    forward: Callable,
    *,
    fake: Callable,
    grads_of: Sequence[str],
    outputs: Sequence[str] = ("out",),
    backward: Callable | None = None,
    backward_fake: Callable | None = None,
) -> torch._library.custom_ops.CustomOpDef:
    """Register ``fla_ac_isolation::<name>`` (``forward``) and ``<name>_backward``, joined by autograd.

    Custom ops may not return an input or alias outputs (torch checks): return fresh tensors, and gradients
    contiguous and owning their memory.

    Args:
        name: the operator name in the ``fla_ac_isolation`` namespace.
        forward: the kernel, type-annotated (torch derives the schema); returns a tensor or a tuple of tensors,
            of which only the first is differentiable.
        fake: the forward's fake kernel (shapes and dtypes of the outputs, contiguous).
        grads_of: the forward inputs that get a gradient, in the order the backward returns them (an input given
            as ``None`` gets none).
        outputs: names of the forward's outputs, which the backward's parameters may name.
        backward: the annotated backward kernel ``(grad, *needed)`` -> one gradient per ``grads_of``; each
            parameter after ``grad`` names a forward input, an output, or ``<input>_dtype``. ``None``: autograd
            through ``forward`` on the saved inputs (``backward_fake`` derived too).
        backward_fake: the backward's fake kernel (required with ``backward``).

    Returns:
        The forward operator (callable with ``forward``'s positional arguments).

    Raises:
        ValueError: ``grads_of`` or a backward parameter names nothing ``forward`` has; ``backward`` without
            ``backward_fake``.
    """
    names = list(inspect.signature(forward).parameters)
    unknown = [g for g in grads_of if g not in names]
    if unknown:
        raise ValueError(f"grads_of names {unknown}, which are not parameters of forward {names}")
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward, mutates_args=())
    op.register_fake(fake)
    wanted = [names.index(g) for g in grads_of]
    if backward is None:
        needed = names
        arguments = _arguments(getattr(getattr(torch.ops, NAMESPACE), name).default._schema)
        schema = f"(Tensor grad, {arguments}) -> ({', '.join(['Tensor'] * len(wanted))})"

        def backward_kernel(grad, *args):
            return tuple(_autograd_grads(forward, list(args), wanted, grad))

        def backward_fake_kernel(grad, *args):
            return tuple(args[i].new_empty(args[i].shape) if args[i] is not None else grad.new_empty(0)
                         for i in wanted)

        backward_op = torch.library.custom_op(f"{NAMESPACE}::{name}_backward", backward_kernel, mutates_args=(),
                                              schema=schema)
        backward_op.register_fake(backward_fake_kernel)
    else:
        if backward_fake is None:
            raise ValueError(f"backward_fake is required with a backward function for {name!r}")
        needed = list(inspect.signature(backward).parameters)[1:]
        known = set(names) | set(outputs) | {f"{i}_dtype" for i in names}
        unknown = [n for n in needed if n not in known]
        if unknown:
            raise ValueError(f"backward of {name!r} asks for {unknown}: neither inputs {names}, outputs "
                             f"{list(outputs)} nor '<input>_dtype'")
        backward_op = torch.library.custom_op(f"{NAMESPACE}::{name}_backward", backward, mutates_args=())
        backward_op.register_fake(backward_fake)

    def setup_context(ctx, inputs: tuple, output) -> None:
        args = inputs
        values = dict(zip(names, args))
        if isinstance(output, tuple):
            values.update(zip(outputs, output))
            ctx.mark_non_differentiable(*output[1:])
        for i in names:
            if isinstance(values[i], Tensor):
                values[f"{i}_dtype"] = values[i].dtype
        kept = [values[n] for n in needed]
        ctx.is_tensor = [v is None or isinstance(v, Tensor) for v in kept]
        ctx.save_for_backward(*(v for v, t in zip(kept, ctx.is_tensor) if t))
        ctx.meta = [v for v, t in zip(kept, ctx.is_tensor) if not t]
        ctx.absent = [args[i] is None for i in wanted]

    def autograd_backward(ctx, grad, *_non_differentiable):
        tensors, meta = iter(ctx.saved_tensors), iter(ctx.meta)
        kept = [next(tensors) if t else next(meta) for t in ctx.is_tensor]
        grads = backward_op(grad, *kept)
        result = [None] * len(names)
        for i, g, absent in zip(wanted, grads, ctx.absent):
            result[i] = None if absent else g
        return tuple(result)

    op.register_autograd(autograd_backward, setup_context=setup_context)
    return op
