"""One pipeline stage with several microbatches in flight, in ONE process: the cases of test_pipeline_fault_grid.py.

A stage is the fault stack (:class:`fla_ac_isolation.harness.fault_stack.HelperStack`: 4 checkpointed layers calling FLA's
cached index helpers). Its microbatches come from :func:`fla_ac_isolation.parallel.split_packed_microbatches` and
each stage call builds its ``seqlens`` from its offsets row with :func:`fla_ac_isolation.parallel.microbatch_seqlens`,
as a stage under ``torch.distributed.pipelining`` does. The microbatches run in the order torch's schedules run
them on one stage (torch 2.13, ``torch/distributed/pipelining/schedules.py``):

* ``gpipe``: ``ScheduleGPipe._step_microbatches``: every forward, then every backward in microbatch order;
* ``1f1b-first``: ``Schedule1F1B`` on stage 0 of 2: ``min(M, num_stages - stage_index) = 2`` warm-up forwards,
  then one backward and one forward alternately, then the remaining backwards;
* ``1f1b-last``: ``Schedule1F1B`` on the last stage: 1 warm-up forward (F0 B0 F1 B1 ...).

Ways to hand the stage's layers their offsets (the modes, and two broken isolations the tests must tell apart):

* ``no-ac`` (reference), ``shared``, ``global-disable``: one :class:`~fla_ac_isolation.harness.modes.SharedSeqlens` per stage
  call (one object for every layer of the stage), checkpointed in the last two;
* ``isolated``: one ``LayerLocalSeqlens`` per stage call, every layer calls ``.local()`` (the fix);
* ``local-per-stage``: ``.local()`` called once per stage call and its tensor handed to every layer (isolation per
  stage and microbatch instead of per layer call);
* ``reuse-mb``: every layer gets its own fresh tensor, made once per step and reused by every microbatch
  (isolation per layer, built per batch instead of per microbatch; value-correct only when every microbatch has
  the same offsets: data ``same``).
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from fla_ac_isolation.fla_seam.cache import clear_tensor_cache, tensor_cache_disabled, tensor_cache_size
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.fault_stack import HelperStack
from fla_ac_isolation.harness.modes import SharedSeqlens
from fla_ac_isolation.parallel import microbatch_seqlens, split_packed_microbatches
from fla_ac_isolation.policies import (
    checkpoint_layers,
    save_all_copies,
    save_device_to_host_copies,
    save_ops,
    torchtitan_selective,
)
from fla_ac_isolation.seqlens import LayerLocalSeqlens

DIM, LAYERS = 16, 4

#: documents of the packed batch the microbatches are cut from (varied lengths, zero-length documents included)
VARIED = (5, 0, 9, 1, 7, 3, 5, 4, 4, 6, 2, 9, 1, 7, 3, 6, 0, 6)
#: the offsets row every microbatch gets with data ``same`` (documents 5, 0, 9, 1, 7 and a 2-token padding document)
SAME_ROW = (0, 5, 5, 14, 15, 22, 24)

POLICIES = {
    "copies+sub": lambda: save_ops([torch.ops.aten._to_copy.default, torch.ops.aten.sub], name="copies+sub"),
    "save-all-copies": save_all_copies,
    "torchtitan": torchtitan_selective,
    "save-d2h-copies": save_device_to_host_copies,
    "full-ac": lambda: None,
}
MODES = ("shared", "isolated", "global-disable", "local-per-stage", "reuse-mb")

#: what the shared path raises when a recompute runs an op its forward did not (a cache hit in forward, a miss in
#: the recompute: the entry was evicted in between); torch 2.13's SAC looks every recompute op up by (op, index)
E_SLICE = ("RuntimeError: aten.slice.Tensor encountered during backward but not found in storage. This can happen if "
           "the operations in the checkpointed region are nondeterministic or depend on global state that changed "
           "between forward and backward.")


def e_shift(tokens: int, rows: int) -> str:
    """What the shared path raises when its recompute skips FLA's helpers (a miss in forward, a hit in the
    recompute) and SAC replays a saved integer ``sub`` of ``[T]`` position ids into the ``sub`` of the layer's
    ``[NC]`` chunk metadata."""
    return (f"RuntimeError: The size of tensor a ({tokens}) must match the size of tensor b ({rows}) at non-singleton "
            "dimension 0")


def schedule_order(name: str, m: int) -> list[tuple[str, int]]:
    """The ``("F" | "B", microbatch)`` sequence one stage runs under schedule ``name`` (see the module docstring)."""
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, {"1f1b-first": 2, "1f1b-last": 1}[name])
    order = [("F", i) for i in range(warmup)]
    for f in range(warmup, m):
        order += [("B", f - warmup), ("F", f)]
    return order + [("B", i) for i in range(m - warmup, m)]


def microbatch_rows(data: str, m: int) -> tuple[torch.Tensor, int]:
    """``([M, W] int32 offsets, T_mb)``: ``VARIED`` cut by ``split_packed_microbatches``, or ``SAME_ROW`` M times."""
    if data == "same":
        return torch.tensor([SAME_ROW] * m, dtype=torch.int32), SAME_ROW[-1]
    offsets = [0, *itertools.accumulate(VARIED)]
    split = split_packed_microbatches({}, offsets, m)
    return split.cu_seqlens_cpu, split.tokens


def run_cell(schedule: str, m: int, cache: int, mode: str, policy: str, data: str = "varied") -> dict:
    """One stage step: ``{"error": first line or None, "grads": {name: grad} or None, "losses": [...]}``."""
    torch.manual_seed(0)
    model = HelperStack(num_layers=LAYERS, dim=DIM)
    rows, tokens = microbatch_rows(data, m)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, DIM, generator=gen) for _ in range(m)]
    if mode != "no-ac":
        made = POLICIES[policy]()
        checkpoint_layers(model, mode="full" if made is None else "selective", policy=made)
    once = [LayerLocalSeqlens(rows[0]).local().cu_seqlens for _ in range(LAYERS)]  # reuse-mb: made once per step

    def layer_inputs(mb: int) -> list:
        """What each layer of the stage gets for microbatch ``mb`` (built when the stage call starts)."""
        if mode == "reuse-mb":
            return once
        cls = LayerLocalSeqlens if mode in ("isolated", "local-per-stage") else SharedSeqlens
        seqlens = microbatch_seqlens(rows[mb : mb + 1], tokens, seqlens_class=cls)
        if mode == "local-per-stage":
            return [seqlens.local().cu_seqlens] * LAYERS
        return [seqlens] * LAYERS

    outs: dict[int, torch.Tensor] = {}
    losses: dict[int, float] = {}
    error = None
    context = tensor_cache_disabled() if mode == "global-disable" else contextlib.nullcontext()
    with tensor_cache_size(cache):
        clear_tensor_cache()
        try:
            with context:
                for kind, mb in schedule_order(schedule, m):
                    if kind == "F":
                        x = xs[mb]
                        for layer, seqlens in zip(model.layers, layer_inputs(mb)):
                            x = layer(x, seqlens)
                        outs[mb] = (x.float() ** 2).mean()
                        losses[mb] = outs[mb].item()
                    else:
                        outs.pop(mb).backward()
        except Exception as e:
            error = first_line(e)
    grads = None
    if error is None:
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}
    return {"error": error, "grads": grads, "losses": [losses[i] for i in sorted(losses)]}


def outcome(cell: dict, reference: dict) -> str:
    """``"exact"`` (equal losses and gradients, bit for bit), the first error line, or the largest gradient
    difference."""
    if cell["error"] is not None:
        return cell["error"]
    diff = max((cell["grads"][k] - reference["grads"][k]).abs().max().item() for k in reference["grads"])
    if diff == 0.0 and cell["losses"] == reference["losses"]:
        return "exact"
    return f"max grad diff {diff:.3g}" + ("" if cell["losses"] == reference["losses"] else ", loss differs")
