"""Selective activation checkpointing (SAC) policies used by real trainers (``policy(ctx, op, *args, **kwargs) ->
CheckpointPolicy``), and :func:`checkpoint_layers` / :func:`sac_context_fn` to apply one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from fla_ac_isolation.checkpointing import Policy, check_policy, checkpoint_layers, sac_context_fn
from fla_ac_isolation.op_names import SAVEABLE_OP_NAMES

__all__ = [
    "POLICIES",
    "any_of",
    "checkpoint_layers",
    "policy_sees_op_output",
    "sac_context_fn",
    "save_all_copies",
    "save_device_to_host_copies",
    "save_fla_ops",
    "save_ops",
    "torchtitan_selective",
]

_TO_COPY = torch.ops.aten._to_copy.default


def _is_device_to_host(args: tuple, kwargs: dict) -> bool:
    src = args[0] if args else None
    dst = kwargs.get("device")
    return (
        isinstance(src, torch.Tensor)
        and src.device.type != "cpu"
        and dst is not None
        and torch.device(dst).type == "cpu"
    )


def save_device_to_host_copies() -> Policy:
    """MUST_SAVE every ``aten._to_copy`` from an accelerator to the CPU; recompute everything else.

    torchtitan's and prime-rl's rule (an MoE dispatcher's host copy of split sizes); saves nothing on a CPU run.
    """

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is _TO_COPY and _is_device_to_host(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.__name__ = "save_device_to_host_copies"
    return policy


def save_all_copies() -> Policy:
    """MUST_SAVE every ``aten._to_copy`` (device moves and dtype casts); recompute everything else."""
    return save_ops([_TO_COPY], name="save_all_copies")


def policy_sees_op_output() -> bool:
    """Whether this torch calls a SAC policy after the op ran, with its output (``ctx.op_output``, torch >= 2.13)."""
    import inspect

    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def save_ops(
    ops: Iterable[Any],
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    name: str | None = None,
) -> Policy:
    """MUST_SAVE the outputs of ``ops`` (aten overloads or packets); recompute everything else.

    Args:
        ops: e.g. ``[torch.ops.aten.mm.default, torch.ops.aten.sub]``; a packet matches all overloads.
        dtypes: when given, save only when the op's (first) output has one of these dtypes.
        name: ``__name__`` given to the returned policy (shown in reports).

    Raises:
        TypeError: an entry of ``ops`` is not a torch op.
        RuntimeError: ``dtypes`` given, but :func:`policy_sees_op_output` is false.
    """
    overloads: set = set()
    packets: set = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverload):
            overloads.add(op)
        elif isinstance(op, torch._ops.OpOverloadPacket):
            packets.add(op)
        else:
            raise TypeError(f"ops must hold torch ops such as torch.ops.aten.sub.Tensor, got {op!r}")
    wanted = tuple(dtypes) if dtypes is not None else None
    if wanted is not None and not policy_sees_op_output():
        raise RuntimeError(
            f"save_ops(dtypes=...) needs the op's output in the SAC policy (SelectiveCheckpointContext.op_output, "
            f"torch >= 2.13); torch {torch.__version__} asks the policy before the op runs: drop dtypes= or "
            f"upgrade torch"
        )

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in overloads or getattr(op, "overloadpacket", None) in packets:
            if wanted is None:
                return CheckpointPolicy.MUST_SAVE
            out = ctx.op_output
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.dtype in wanted:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.__name__ = name or "save_ops"
    return policy


def any_of(*policies: Policy, name: str | None = None) -> Policy:
    """Combine policies: MUST_SAVE if any of them says MUST_SAVE or PREFER_SAVE, else PREFER_RECOMPUTE.

    The result's ``fresh()`` renews every stateful member (one with ``fresh()``), as :func:`sac_context_fn` needs.

    Raises:
        TypeError: a member is not a policy function (``(ctx, op, *args, **kwargs)``); ``name`` is not a str.
        ValueError: no policies.
    """
    if not policies:
        raise ValueError("any_of needs at least one policy, e.g. any_of(save_fla_ops(), save_device_to_host_copies())")
    for p in policies:
        check_policy(p)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str (the policy's __name__), got {type(name).__name__}")
    return _AnyOf(policies, name or "any_of(" + ", ".join(getattr(p, "__name__", "?") for p in policies) + ")")


class _AnyOf:
    """The policy :func:`any_of` returns."""

    def __init__(self, policies: tuple[Policy, ...], name: str) -> None:
        self.policies = policies
        self.__name__ = name

    def fresh(self) -> _AnyOf:
        """The same combination with every stateful member renewed."""
        return _AnyOf(tuple(p.fresh() if hasattr(p, "fresh") else p for p in self.policies), self.__name__)

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        for p in self.policies:
            if p(ctx, op, *args, **kwargs) in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return self.__name__


def save_fla_ops(ops: Sequence[str] = SAVEABLE_OP_NAMES) -> Policy:
    """MUST_SAVE the outputs of the named FLA operations, on both backends; recompute everything else.

    Only calls made with ``saveable=True`` (:mod:`fla_ac_isolation.ops`, the mixers) are visible to a policy;
    what each saves: :mod:`fla_ac_isolation.ops`. Compose it, e.g. ``any_of(save_fla_ops(), torchtitan_selective())``.

    Args:
        ops: names among :data:`~fla_ac_isolation.op_names.SAVEABLE_OP_NAMES`; default all of them.

    Raises:
        TypeError: ``ops`` is a single string, not iterable, or holds non-strings.
        ValueError: ``ops`` is empty or names an unknown operation.
    """
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
        raise TypeError(f"ops must be a sequence of operation names such as {SAVEABLE_OP_NAMES}, got {ops!r}")
    ops = tuple(ops)  # once: a generator would be used up by the checks below
    if not all(isinstance(name, str) for name in ops):
        raise TypeError(f"ops must be a sequence of operation names such as {SAVEABLE_OP_NAMES}, got {ops!r}")
    unknown = [name for name in ops if name not in SAVEABLE_OP_NAMES]
    if unknown or not ops:
        raise ValueError(f"ops must name one or more of {SAVEABLE_OP_NAMES}, got {tuple(ops)!r}")
    from fla_ac_isolation.ops import SAVEABLE_OPS  # registers the custom operators on first use

    wanted = frozenset(overload for name in ops for overload in SAVEABLE_OPS[name])

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in wanted else CheckpointPolicy.PREFER_RECOMPUTE

    policy.__name__ = "save_fla_ops(" + ", ".join(ops) + ")"
    return policy


class torchtitan_selective:  # noqa: N801 - used like the other policy constructors
    """torchtitan's op-level selective AC policy: saves accelerator-to-CPU copies, torchtitan's default save list
    (``torchtitan.distributed.activation_checkpoint._get_default_save_ops``) and every other matmul.

    Stateful (a per-region matmul counter): :func:`sac_context_fn` calls ``fresh()`` per checkpointed call.

    Raises:
        ImportError: torchtitan is not installed (``pip install 'fla-ac-isolation[ep]'``).
    """

    __name__ = "torchtitan_selective"

    def __init__(self) -> None:
        from torchtitan.distributed.activation_checkpoint import _get_default_save_ops

        self._save_ops = _get_default_save_ops()
        self._mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
        self._count = {False: 0, True: 0}

    def fresh(self) -> torchtitan_selective:
        new = object.__new__(torchtitan_selective)
        new._save_ops, new._mm_ops, new._count = self._save_ops, self._mm_ops, {False: 0, True: 0}
        return new

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is _TO_COPY and _is_device_to_host(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if op in self._mm_ops:
            self._count[ctx.is_recompute] += 1
        if op in self._save_ops:
            if op in self._mm_ops and self._count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


#: Policies by the names the CLI accepts (``--policy``); each value builds a new policy.
POLICIES: dict[str, Callable[[], Policy]] = {
    "save-d2h-copies": save_device_to_host_copies,
    "save-all-copies": save_all_copies,
    "torchtitan": torchtitan_selective,
}
