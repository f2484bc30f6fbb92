"""How the unsafe shared path must end (:class:`SharedOutcome`: an exact error, or gradients off by more than a
floor; never "any exception"), and the fault matrix of the fault stack with its expected outcomes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fla_ac_isolation.harness.environment import sac_replay_semantics
from fla_ac_isolation.policies import any_of, policy_sees_op_output, save_all_copies, save_ops

aten = torch.ops.aten

INT_MEAN_MESSAGE = ("mean(): could not infer output dtype. Input dtype must be either a floating point or complex "
                    "dtype. Got: Int")
"""What torch says for ``mean()`` of an integer tensor, on every torch this project runs (2.11 to 2.15)."""


def int_mean_error() -> type[Exception]:
    """The class torch raises for ``mean()`` of an integer tensor (:data:`INT_MEAN_MESSAGE`): ``RuntimeError``
    up to torch 2.14 (measured on 2.11.0, 2.13.0 and 2.14.1), ``NotImplementedError`` from torch 2.15 (measured
    on 2.15.0). The table is by version, not probed, so a third behaviour fails the tests that use it."""
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return NotImplementedError if release >= (2, 15) else RuntimeError

@dataclass(frozen=True)
class SharedOutcome:
    """The exact outcome a control of the unsafe shared path must show: never "any exception".

    Either ``error`` (an exception class) whose message contains ``message``, or ``error=None`` and a
    largest gradient difference to the reference above ``floor``.
    """

    error: type[BaseException] | None
    message: str = ""
    floor: float = 0.0

    def check(self, error: BaseException | str | None, grad_diff: float | None = None) -> None:
        """Assert the outcome; ``error`` is the exception, or its ``"<Type>: <message>"`` text (examples)."""
        if self.error is None:
            assert error is None, f"expected gradients off by > {self.floor}, got an error: {error}"
            assert grad_diff is not None and grad_diff > self.floor, f"max |grad diff| {grad_diff} <= {self.floor}"
            return
        assert error is not None, f"expected {self.error.__name__}: {self.message}, got no error"
        if isinstance(error, str):
            kind, _, text = error.partition(": ")
            assert kind == self.error.__name__ and self.message in text, f"got {error!r}"
        else:
            assert type(error) is self.error and self.message in str(error), f"got {type(error).__name__}: {error}"


def raise_unrelated(ctx, op, *args, **kwargs):
    """A SAC policy that fails for a reason unrelated to the fault: controls must not accept it."""
    raise RuntimeError("unrelated failure inside the SAC policy")


#: transformers' own Qwen GDN (FLA's cache behaviour, see ``hf_fla_kernel_on_cpu``), one shared
#: ``cu_seq_lens_q``, under each swap policy (torch 2.13, FLA 0.6.0, CPU): the forward's cache miss and the
#: recompute's hit shift SAC's replay; the MoE's expert histogram (``histc``) then receives one of FLA's
#: int32 tensors (save-all-copies), or autograd an int tensor saved in place of a float one (save-int-sub).
UNSWAPPED_QWEN_UNDER_SAC = {
    "save-all-copies": SharedOutcome(NotImplementedError, "\"histogram_cpu\" not implemented for 'Int'"),
    "save-int-sub": SharedOutcome(RuntimeError, "Autograd not support dtype: Int"),
}

# ====================================================================== the fault matrix (fault stack)
FAULT_POLICIES = {
    "save-all-copies": save_all_copies,
    "save-int-sub": lambda: save_ops([aten.sub.Tensor], dtypes=[torch.int32, torch.int64]),
    "save-float-sub": lambda: save_ops([aten.sub.Tensor], dtypes=[torch.float32]),
    "save-copies-and-clone": lambda: any_of(save_all_copies(), save_ops([aten.clone.default, aten.alias.default])),
    "full-ac": lambda: None,
}


#: the fault policies that decide by the output's dtype (``save_ops(dtypes=)``)
DTYPE_POLICIES = ("save-int-sub", "save-float-sub")
#: how ``save_ops(dtypes=)`` refuses a torch whose SAC policy does not see the op's output (torch 2.11)
DTYPE_REFUSAL = "save_ops(dtypes=...) needs the op's output in the SAC policy"


def expected_shared_outcome(policy: str, dtype: torch.dtype, cache_size: int) -> str:
    """What the unsafe shared path does on this torch, worked out from which ops FLA's helpers run on a miss.

    On a miss, prepare_position_ids/prepare_chunk_indices run three integer ``sub``s, and two ``_to_copy``
    casts only when cu_seqlens is int32 (their results are int64). ``"refused"``: the policy cannot be built
    on this torch (:data:`DTYPE_REFUSAL`).

    * ``sac_replay_semantics() == "(op, index)"`` (torch >= 2.13): a recompute that skips them shifts SAC's
      (op, index) replay of those ops; a recompute that adds them meets ops the forward never ran.
    * ``"per-op FIFO"`` (torch 2.11): each op has one queue and the policy is asked again in the recompute,
      so only extra or missing invocations of a *saved* op shift anything: FLA's two int32 casts.
    """
    if policy in DTYPE_POLICIES and not policy_sees_op_output():
        return "refused"
    if policy == "full-ac":
        return "match"  # plain AC replays nothing by op index: immune
    if sac_replay_semantics() == "per-op FIFO":
        if dtype == torch.int64:
            return "match"  # FLA's miss path casts nothing for int64 offsets: no saved op is added or skipped
        if cache_size == 1:  # recompute miss: FLA's 2 casts pop the layer's own saved [T] and 0-d casts
            return "raise:IndexError: too many indices for tensor of dimension 0"  # chunks[:, 1] on the 0-d one
        return "raise:The size of tensor a"  # recompute hit: the layer's own cast pops FLA's int32 positions
    if cache_size == 1:
        return "raise:encountered during backward but not found in storage"  # recompute runs extra ops
    if policy == "save-int-sub":
        return "raise:Autograd not support dtype"  # an FLA int tensor replaces the layer's own int sub
    if policy == "save-float-sub":
        return "silent"  # 3 skipped int subs shift the 4 float subs: the 4th replays the 1st's value
    if dtype == torch.int64:
        return "match"  # no _to_copy on the miss path for int64 offsets: nothing to shift
    return "raise:The size of tensor a"  # the layer's own int->float cast receives FLA's int32 positions


def assert_refused(policy: str) -> None:
    """The policy cannot be built on this torch: ``save_ops(dtypes=)`` names what it needs."""
    with pytest.raises(RuntimeError) as err:
        FAULT_POLICIES[policy]()
    assert str(err.value).startswith(DTYPE_REFUSAL) and torch.__version__ in str(err.value)


MATRIX = [
    pytest.param(policy, dtype, size, early_stop, freq, id=f"{policy}-{str(dtype)[6:]}-cache{size}-es{int(early_stop)}-freq{freq}")
    for policy in FAULT_POLICIES
    for dtype in (torch.int32, torch.int64)
    for size in (4, 1)
    for early_stop in (True, False)
    for freq in (1, 2)
]
