"""The FLA cache fault, reproduced on CPU with FLA's real index helpers, and fixed by LayerLocalSeqlens.

A stack of 4 checkpointed layers shares one ``cu_seqlens`` (``fla_ac_isolation.harness.fault_stack``).
For every field policy the shared path must raise or give wrong gradients (or, where the policy cannot
see FLA's ops, match: asserted too), while ``isolated`` and ``global-disable`` match the no-AC reference
bit for bit. Cache size 4 gives "forward miss, recompute hit" (layer 0); cache size 1 with an evicting head
gives "forward hit, recompute miss" (the last layer).
"""

import contextlib

import pytest
import torch
from helpers import FAULT_POLICIES, MATRIX, assert_refused, expected_shared_outcome

from fla_ac_isolation.fla_seam.cache import tensor_cache_size
from fla_ac_isolation.harness.fault_stack import run_stack
from fla_ac_isolation.policies import policy_sees_op_output
from fla_ac_isolation.seqlens import LayerLocalSeqlens


def _run_all(policy_name, dtype, size, early_stop, freq):
    ctx = tensor_cache_size(size) if size != 4 else contextlib.nullcontext()
    kw = dict(dtype=dtype, evict=size == 1)
    with ctx:
        ref = run_stack("no-ac", None, **kw)
        out = {
            mode: run_stack(mode, FAULT_POLICIES[policy_name](), early_stop=early_stop, freq=freq, **kw)
            for mode in ("shared", "isolated", "global-disable")
        }
    return ref, out


@pytest.mark.parametrize(("policy", "dtype", "size", "early_stop", "freq"), MATRIX)
def test_isolation_and_global_disable_match_no_ac_while_shared_fails(policy, dtype, size, early_stop, freq):
    expected = expected_shared_outcome(policy, dtype, size)  # by torch's SAC replay semantics (helpers.faults)
    if expected == "refused":  # torch 2.11: a dtype rule cannot be built, so the policy is refused
        assert_refused(policy)
        return
    ref, out = _run_all(policy, dtype, size, early_stop, freq)
    assert ref.error is None
    for mode in ("isolated", "global-disable"):
        res = out[mode]
        assert res.error is None, f"{mode}: {res.error}"
        assert res.loss == ref.loss
        for name, grad in ref.grads.items():
            assert torch.equal(res.grads[name], grad), f"{mode}: gradient of {name} differs"

    shared = out["shared"]
    if expected.startswith("raise:"):
        assert shared.error is not None and expected[len("raise:"):] in shared.error, shared.error
    elif expected == "silent":
        assert shared.error is None
        assert shared.loss == ref.loss, "the silent case keeps the loss"
        assert shared.max_grad_diff(ref) > 1e-3, "...and corrupts the gradients"
    else:
        assert shared.error is None and shared.max_grad_diff(ref) == 0.0


def test_isolation_fails_when_local_returns_the_shared_tensor(monkeypatch):
    """The tests above are not vacuous: with .local() handing out one shared object, 'isolated' breaks."""
    shared = {}

    def shared_local(self):
        from fla_ac_isolation.local_seqlens import LocalSeqlens

        t = shared.setdefault(id(self), self._cu_seqlens)
        return LocalSeqlens(t, None, self.max_seqlen)

    monkeypatch.setattr(LayerLocalSeqlens, "local", shared_local)
    if policy_sees_op_output():  # the silent case: SAC says nothing while the gradients are wrong
        ref, out = _run_all("save-float-sub", torch.int32, 4, True, 1)
        assert out["isolated"].error is None and out["isolated"].max_grad_diff(ref) > 1e-3
    else:  # torch 2.11: the float-sub rule cannot be built (its matrix rows assert the refusal too)
        assert_refused("save-float-sub")
    ref, out = _run_all("save-all-copies", torch.int32, 4, True, 1)
    assert "The size of tensor a" in out["isolated"].error
