"""One pipeline stage with microbatches in flight, in one process: how the shared path fails, and the fix in every cell.

The stage, its microbatches and the schedule orders are in :mod:`helpers.pipeline`. Each case runs one
(schedule, microbatches M, FLA cache size) cell under five AC policies and asserts every outcome exactly.

What decides the shared path's outcome (derived here from the schedule order, not copied from a run):

* *in flight* = the most microbatches whose forwards ran before one of them is recomputed: GPipe ``M``, 1F1B on
  the first of 2 stages ``min(M, 2)``, 1F1B on the last stage 1. Each microbatch's offsets are one object for
  every layer of the stage, so each holds one entry of FLA's per-helper queue (``FLA_TENSOR_CACHE_SIZE``).
* in flight > cache size: a later microbatch evicts the entry, a layer that hit in its forward misses in its
  recompute and runs ops its forward did not: torch 2.13's SAC finds no saved output for them (it looks every
  recompute op up by op and invocation index) and raises ``aten.slice.Tensor ... not found in storage``, under
  every selective policy, even those that save nothing on a CPU (torchtitan's, the device-to-host copies);
* otherwise the first layer misses in its forward and hits in its recompute, which then skips FLA's ops: a policy
  that saves copies and subs gets a saved ``[T]`` tensor replayed into the ``sub`` of the ``[NC]`` chunk metadata
  (``The size of tensor a (T) must match the size of tensor b (NC)``); a policy that saves nothing on a CPU
  replays nothing, and the skipped ops change no value: latent (exact), until a device-to-host copy is saved;
* full AC replays nothing by index: exact.

``isolated`` and ``global-disable`` equal no AC bit for bit in every cell; the two broken isolations are caught:
``.local()`` once per stage call, shared by the stage's layers, fails exactly as ``shared``; isolation per layer built
once per step and reused by every microbatch fails under the policies that save copies.
"""

import pytest
import torch
from helpers.pipeline import E_SLICE, POLICIES, e_shift, microbatch_rows, outcome, run_cell

SAVING = ("copies+sub", "save-all-copies")  # save the integer subs and casts FLA's index helpers run
SAVE_NOTHING_ON_CPU = ("torchtitan", "save-d2h-copies")
IN_FLIGHT = {"gpipe": lambda m: m, "1f1b-first": lambda m: min(m, 2), "1f1b-last": lambda m: 1}

CELLS = [(schedule, m, cache) for schedule in IN_FLIGHT for m in (2, 6) for cache in (1, 4)]


def expected_shared(schedule: str, m: int, cache: int, policy: str) -> str:
    """The shared path's outcome by the rule of the module docstring."""
    if policy == "full-ac":
        return "exact"
    if IN_FLIGHT[schedule](m) > cache:
        return E_SLICE
    if policy in SAVE_NOTHING_ON_CPU:
        return "exact"
    rows, tokens = microbatch_rows("varied", m)
    row = rows[0]  # microbatch 0 is the first one recomputed in every order here
    chunks = int(((row[1:] - row[:-1] + 3) // 4).sum())  # its FLA chunk rows (the fault stack's 4-token chunks)
    return e_shift(tokens, chunks)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    yield


@pytest.mark.parametrize(("schedule", "m", "cache"), CELLS, ids=[f"{s}-M{m}-cache{c}" for s, m, c in CELLS])
def test_shared_fails_as_predicted_and_isolated_is_bit_exact(schedule, m, cache):
    reference = run_cell(schedule, m, cache, "no-ac", "full-ac")
    assert reference["error"] is None
    for policy in POLICIES:
        shared = outcome(run_cell(schedule, m, cache, "shared", policy), reference)
        assert shared == expected_shared(schedule, m, cache, policy), (policy, shared)
        assert outcome(run_cell(schedule, m, cache, "isolated", policy), reference) == "exact", policy
        # the broken isolation: .local() once per stage call, one tensor for the stage's layers = shared
        assert outcome(run_cell(schedule, m, cache, "local-per-stage", policy), reference) == shared, policy


@pytest.mark.parametrize(("schedule", "m", "cache"), CELLS, ids=[f"{s}-M{m}-cache{c}" for s, m, c in CELLS])
def test_global_disable_is_bit_exact_and_isolation_reused_across_microbatches_fails(schedule, m, cache):
    reference = run_cell(schedule, m, cache, "no-ac", "full-ac")
    for policy in POLICIES:
        assert outcome(run_cell(schedule, m, cache, "global-disable", policy), reference) == "exact", policy
    # per-layer objects made once per step and reused by every microbatch (data 'same': equal offsets in every
    # microbatch, so the values are right): a layer's second microbatch hits the entry its first one left
    same = run_cell(schedule, m, cache, "no-ac", "full-ac", data="same")
    assert same["error"] is None
    for policy in SAVING:
        reused = outcome(run_cell(schedule, m, cache, "reuse-mb", policy, data="same"), same)
        assert reused == e_shift(24, 9), (policy, reused)  # T_mb 24, 9 chunk rows of 4 tokens
        assert outcome(run_cell(schedule, m, cache, "isolated", policy, data="same"), same) == "exact"


def test_microbatches_of_the_grid_have_the_token_counts_the_errors_name():
    rows, tokens = microbatch_rows("varied", 2)
    assert tokens == 39 and rows.shape[0] == 2
    rows, tokens = microbatch_rows("varied", 6)
    assert tokens == 14 and rows.shape == (6, rows.shape[1])
    assert torch.equal(microbatch_rows("same", 3)[0][2], torch.tensor([0, 5, 5, 14, 15, 22, 24], dtype=torch.int32))
