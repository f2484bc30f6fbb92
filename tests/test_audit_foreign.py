"""ReplayAudit on divergences that are not FLA's: it names the region and the first divergent op, never FLA.

Three modules of the class the audit exists for (state consulted inside a checkpointed region that changes
between the forward and the recompute), each in a block after an isolated FLA-backed mixer (the layers of a
real hybrid model), on CPU:

* ``EPBufferSetup`` - expert-parallel buffer set-up: the first call copies the expert layout to the host
  (``_to_copy``) and keeps it; later calls, the recompute among them, skip the copy;
* ``ProbedConv`` - a memoised backend probe: the first call runs the portable torch conv and records that
  the fast path works; later calls run ``fla_ac_isolation.ops.causal_conv1d``, which asks FLA's index
  helpers for its chunk schedule (so FLA's helpers run in the recompute only: a path change, not FLA's
  cache);
* ``BiasedRouter`` - a router whose per-expert bias is updated in its forward (auxiliary-loss-free load
  balancing done in place): the recompute sees the new bias and its top-1 choice flips.

The expected first divergent op comes from an independent reference: the op sequences of a first and a
second call of the same fresh block, recorded by a plain dispatch mode (the recompute is a second call).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILIES, HIDDEN, SharedOutcome
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointError

from fla_ac_isolation import ops
from fla_ac_isolation.audit import ReplayAudit
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

DOC_LENS = [5, 70, 9]
EXPERTS = 4


class EPBufferSetup(nn.Module):
    """Routes to ``EXPERTS`` experts; on its first call copies its expert layout to the host and keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(HIDDEN, HIDDEN)
        self.layout = torch.arange(EXPERTS, dtype=torch.int32)
        self.layout_host: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout_host is None:  # buffer set-up, once: a host copy of the layout
            self.layout_host = self.layout.to("cpu", dtype=torch.int64, copy=True)
        return self.experts(x)


class ProbedConv(nn.Module):
    """A packed depthwise causal conv whose fast path is enabled by a probe made on the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN, 4) / 4)
        self.fast: bool | None = None  # memoised probe result

    def forward(self, x: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        if self.fast is None:  # first call: the portable path, then remember that the fast one works
            self.fast = True
            return self._portable(x, seqlens)
        local = seqlens.local()
        return ops.causal_conv1d(x, self.weight, activation=None, cu_seqlens=local.cu_seqlens,
                                 cu_seqlens_cpu=local.cu_seqlens_cpu, backend="reference")

    def _portable(self, x: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        outs = []
        for doc in x[0].split(seqlens.seq_lens()):  # [L, D] per document
            padded = F.pad(doc.t()[None], (self.weight.shape[1] - 1, 0))  # [1, D, W - 1 + L]
            outs.append(F.conv1d(padded, self.weight[:, None], groups=HIDDEN)[0].t())
        return torch.cat(outs)[None]


class BiasedRouter(nn.Module):
    """Top-1 routing over ``EXPERTS`` experts with a bias that its forward lowers for the chosen expert."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))
        with torch.no_grad():  # expert 0 first for every token, expert 1 a close second
            self.gate.weight.zero_()
        self.register_buffer("bias", torch.tensor([1.0, 0.5, 0.0, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        scores = self.gate(flat) + self.bias
        chosen = scores.argmax(-1)
        with torch.no_grad():  # load balancing in place: the busiest expert becomes less attractive
            self.bias[torch.bincount(chosen, minlength=EXPERTS).argmax()] -= 1.0
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).nonzero().flatten()
            out = out.index_add(0, rows, expert(flat[rows]))
        return out.view_as(x)


class Block(nn.Module):
    """An isolated FLA-backed mixer (Qwen3.5 Gated DeltaNet, reference backend), then ``extra``."""

    def __init__(self, extra: nn.Module) -> None:
        super().__init__()
        self.mixer = FAMILIES["qwen3_5_moe"].build(seed=3)
        self.extra = extra

    def forward(self, x: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        x = x + self.mixer(x, seqlens)
        needs_seqlens = isinstance(self.extra, ProbedConv)
        return x + (self.extra(x, seqlens) if needs_seqlens else self.extra(x))


class Model(nn.Module):
    def __init__(self, extra: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(extra())])

    def forward(self, x: torch.Tensor, seqlens: LayerLocalSeqlens) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, seqlens)
        return x


class _Record(TorchDispatchMode):
    """The reference: every op with its outputs' (shape, dtype, device), as a plain list."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in torch.utils.checkpoint.SAC_IGNORED_OPS:
            meta = tuple((tuple(t.shape), t.dtype, t.device) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.ops.append((func, meta))
        return out


def _first_and_second_call_differ_at(extra: type[nn.Module], x, seqlens) -> tuple[int, str, str]:
    """Index and op names where a fresh block's second call first leaves its first call's op sequence."""
    block = Model(extra).layers[0]
    calls = []
    for _ in range(2):
        with torch.no_grad(), _Record() as rec:
            block(x, seqlens)
        calls.append(rec.ops)
    first, second = calls
    i = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    return i, str(first[i][0]), str(second[i][0])


METADATA = SharedOutcome(CheckpointError, "Recomputed values for the following tensors have different metadata")
SCENARIOS = {
    # extra module, checkpointing policy (None: full AC), how the step ends (None: it completes)
    "ep-buffer-setup": (EPBufferSetup, save_all_copies, None),  # the saved copy is left unused in storage
    "memoised-backend-probe": (ProbedConv, None, METADATA),  # torch's own check sees other saved tensors
    "router-top-k-flip": (BiasedRouter, None, METADATA),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_audit_names_region_and_first_divergent_op_without_blaming_fla(scenario):
    extra, policy, outcome = SCENARIOS[scenario]
    seqlens = LayerLocalSeqlens.from_seq_lens(DOC_LENS)
    x = torch.randn(1, sum(DOC_LENS), HIDDEN, generator=torch.Generator().manual_seed(1))
    index, forward_op, recompute_op = _first_and_second_call_differ_at(extra, x, seqlens)

    model = Model(extra)
    checkpoint_layers(model, mode="full" if policy is None else "selective",
                      policy=None if policy is None else policy(), early_stop=False)
    error = None
    with ReplayAudit(model, on_divergence="record") as audit:
        try:
            model(x.clone().requires_grad_(), seqlens).pow(2).mean().backward()
        except CheckpointError as err:  # torch's own check refuses the recompute; the audit has recorded it
            error = err
    if outcome is None:
        assert error is None
    else:
        outcome.check(error)

    (bad,) = audit.divergent
    assert (bad.label, bad.first_diff) == ("layers.0", index), audit.summary()
    assert bad.forward_op.startswith(forward_op + " -> ") and bad.recompute_op.startswith(recompute_op + " -> ")
    assert bad.message.splitlines()[0].startswith(f"ReplayAudit: region layers.0: recompute op #{index} ")
    assert bad.fla == (), "no FLA helper's cache state differed"
    assert "FLA" not in bad.message and "cu_seqlens" not in bad.message, bad.message
    assert "reads state that changed between forward and backward" in bad.message


def test_raise_mode_message_of_a_path_change_does_not_blame_fla():
    """The message raised at the divergent op (built from the helper calls seen so far) names no FLA either."""
    from fla_ac_isolation.audit import ReplayDivergenceError

    seqlens = LayerLocalSeqlens.from_seq_lens(DOC_LENS)
    x = torch.randn(1, sum(DOC_LENS), HIDDEN, generator=torch.Generator().manual_seed(1))
    index, forward_op, recompute_op = _first_and_second_call_differ_at(ProbedConv, x, seqlens)
    model = Model(ProbedConv)
    checkpoint_layers(model, mode="full", early_stop=False)
    with ReplayAudit(model, on_divergence="raise"), pytest.raises(ReplayDivergenceError) as err:
        model(x.clone().requires_grad_(), seqlens).pow(2).mean().backward()
    first, *rest = str(err.value).splitlines()
    assert first == (f"ReplayAudit: region layers.0: recompute op #{index} (in layers.0.extra) is {recompute_op}, "
                     f"forward had {forward_op} -> [{sum(DOC_LENS)}, {HIDDEN}] float32 cpu.")
    assert rest[0].startswith("Something inside the region reads state that changed between forward and backward")
    assert "FLA" not in str(err.value) and "cu_seqlens" not in str(err.value)
