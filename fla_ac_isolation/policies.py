"""Selective activation checkpointing (SAC) policies found in the field, and a layer checkpointer.

A policy is a function ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`` as
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` expects. These are the rules that real
trainers use and that expose the FLA cache fault (docs: "The fault in one picture"):

* :func:`save_device_to_host_copies` - torchtitan's and prime-rl's rule: save every ``aten._to_copy``
  from an accelerator to the CPU (MoE split sizes read on the host), so the recompute does not sync.
* :func:`save_all_copies` - save every ``aten._to_copy`` (dtype casts included).
* :func:`save_ops` - save a given list of ops, optionally only when the output has given dtypes.
* :func:`torchtitan_selective` - torchtitan 0.3's op-level SAC: the D2H rule, its compute/communication
  save list (``torchtitan.distributed.activation_checkpoint``), every second matmul recomputed.
* :func:`save_fla_ops` - save the outputs of FLA's calls made saveable (``saveable=True`` in
  :mod:`fla_ac_isolation.ops` and the mixers): per op, memory instead of recompute time.
* :func:`any_of` - combine policies; the first one that says "save" wins.

:func:`checkpoint_layers` and :func:`sac_context_fn` apply a policy (:mod:`fla_ac_isolation.checkpointing`,
re-exported here).
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

    The rule torchtitan (``SelectiveAC``) and prime-rl apply so that an MoE dispatcher's host copy of
    split sizes is not repeated (and does not sync) in the recompute. On a CPU-only run it saves nothing.
    """

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is _TO_COPY and _is_device_to_host(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.__name__ = "save_device_to_host_copies"
    return policy


def save_all_copies() -> Policy:
    """MUST_SAVE every ``aten._to_copy`` (device moves and dtype casts); recompute everything else.

    FLA's index helpers cast int32 ``cu_seqlens`` with ``_to_copy`` on a cache miss, so once one layer
    misses in forward and hits in recompute this policy replays saved casts into the wrong ops. Whether
    that raises depends on the ops after the helpers: a stack whose layers make no ``_to_copy`` after
    them (e.g. GDN-only in float32) still computes the same numbers, and only the audit sees it.
    """
    return save_ops([_TO_COPY], name="save_all_copies")


def policy_sees_op_output() -> bool:
    """Whether this torch calls a SAC policy after the op ran, with its output (``ctx.op_output``).

    A feature probe of ``torch.utils.checkpoint.SelectiveCheckpointContext``: torch 2.13 and later pass
    ``op_output``; torch 2.11 asks the policy before the op runs, so a rule on the output's dtype cannot be
    decided there (:func:`save_ops` with ``dtypes=`` refuses).
    """
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
        dtypes: when given, save only when the op's (first) output has one of these dtypes, e.g.
            ``[torch.int64]`` for integer ``sub`` only or ``[torch.float32]`` for float-only ``sub``.
        name: ``__name__`` given to the returned policy (shown in reports).

    Raises:
        TypeError: an entry of ``ops`` is not a torch op.
        RuntimeError: ``dtypes`` given on a torch whose SAC policy does not see the op's output
            (:func:`policy_sees_op_output`; torch 2.11).
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

    The result has a ``fresh()`` method that renews every stateful member (one with ``fresh()``, e.g.
    :class:`torchtitan_selective`), so :func:`sac_context_fn` gives each checkpointed call fresh members,
    as it does for a stateful policy used alone.

    Raises:
        TypeError: a member is not a policy function (``(ctx, op, *args, **kwargs)``); ``name`` is not a str.
        ValueError: no policies (the result would save nothing, i.e. full recompute).
    """
    if not policies:
        raise ValueError("any_of needs at least one policy, e.g. any_of(save_fla_ops(), save_device_to_host_copies())")
    for p in policies:
        check_policy(p)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str (the policy's __name__), got {type(name).__name__}")
    return _AnyOf(policies, name or "any_of(" + ", ".join(getattr(p, "__name__", "?") for p in policies) + ")")


class _AnyOf:
    """The policy :func:`any_of` returns: callable like a policy function, renewed by :meth:`fresh`."""

    def __init__(self, policies: tuple[Policy, ...], name: str) -> None:
        self.policies = policies
        self.__name__ = name

    def fresh(self) -> _AnyOf:
        """The same combination with every stateful member renewed (``member.fresh()``)."""
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

    Only calls made with ``saveable=True`` (:mod:`fla_ac_isolation.ops`, the mixers' ``saveable``) are
    custom operators a policy can see; the default path is not affected. A saved operation is not rerun in
    the recompute (nor does it look anything up in FLA's cache there); its outputs stay in memory from the
    forward to the backward of the checkpointed region. Per call (``fla`` backend, the operators of
    :data:`fla_ac_isolation.ops.SAVEABLE_OPS`):

    * ``"gated_delta_rule"`` (GDN core): ``o [B, T, HV, V]``, ``A [B, T, HV, 64]`` (bf16 with bf16 inputs),
      ``g_cumsum [B, T, HV]`` and ``q_rstd``/``k_rstd`` ``[B, T, H]`` in float32;
    * ``"causal_conv1d"``: ``y [B, T, D]`` (the conv output, ``D`` its channels);
    * ``"ssd"`` (Mamba2 core, FLA's simple GLA): ``o [B, T, H, P]`` and ``g_cumsum [B, T, H]`` float32.

    Compose it with the policy you use for everything else, e.g.
    ``any_of(save_fla_ops(("gated_delta_rule", "ssd")), torchtitan_selective())``; docs/benchmarks.md gives
    the sizes per layer and the trade per operation.

    Args:
        ops: names among :data:`~fla_ac_isolation.op_names.SAVEABLE_OP_NAMES`; default all of them.

    Raises:
        TypeError: ``ops`` is a single string, not iterable (``None``), or holds non-strings.
        ValueError: ``ops`` is empty or names an unknown operation (the message lists the valid names).
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
    """torchtitan 0.3's op-level selective AC policy (``SelectiveAC``), rebuilt per checkpointed call.

    Saves accelerator-to-CPU copies, torchtitan's default compute and communication save list
    (``torchtitan.distributed.activation_checkpoint._get_default_save_ops``: SDPA, ``linear``, ``topk``,
    ``max``, all-to-all, reduce-scatter, ...) and every other matmul. The matmul counter is per region,
    so :func:`sac_context_fn` calls :meth:`fresh` for every checkpointed call, as torchtitan does.

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
