"""Saveable FLA ops under selective AC (reference backend, CPU): every policy, bit for bit, and what reruns.

A 4-layer stack (GDN, Mamba2, GDN with the sigmoid gate, Mamba2) of the real mixers with ``saveable=True``,
one ``LayerLocalSeqlens`` for all layers. Under each policy (the field's, :func:`save_fla_ops` alone and
composed, full AC) the loss, the input gradient and every parameter gradient equal the same stack without
AC bit for bit; the recompute runs no forward of a saved op and makes no FLA cache lookup for it, while an
unsaved op reruns with exactly the lookups of its forward (the isolation still holds). The controls run the
unsafe shared ``cu_seqlens``: the default path fails, the custom ops hide the fault for themselves only.
"""

import pytest
import torch
from helpers import FAMILIES, HIDDEN, PACKED_LENS, Block, assert_bit_equal, recorded_step, sac_storage_bytes
from torch import nn

from fla_ac_isolation.fla_seam.layout import prepare_position_ids
from fla_ac_isolation.harness.modes import SharedSeqlens
from fla_ac_isolation.policies import (
    any_of,
    checkpoint_layers,
    save_all_copies,
    save_device_to_host_copies,
    save_fla_ops,
    torchtitan_selective,
)
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = pytest.mark.usefixtures("single_thread")

LENS = [*PACKED_LENS, 70]  # zero-length, one-token and a two-chunk document: 134 tokens
STACK = ["qwen3_5_moe", "nemotron_h", "qwen3_8", "nemotron_h"]
ALL = {"gated_delta_rule", "causal_conv1d", "ssd"}
CORE = ("gated_delta_rule", "ssd")
CALLS = {"causal_conv1d": 4, "gated_delta_rule": 2, "ssd": 2}  # forward calls of the stack, per op

# policy name -> (policy constructor or None for full AC, the ops it saves)
POLICIES = {
    "save-d2h-copies": (save_device_to_host_copies, set()),
    "save-all-copies": (save_all_copies, set()),
    "torchtitan": (torchtitan_selective, set()),
    "save-fla-ops": (save_fla_ops, ALL),
    "save-core": (lambda: save_fla_ops(CORE), set(CORE)),
    "save-conv": (lambda: save_fla_ops(("causal_conv1d",)), {"causal_conv1d"}),
    "save-core+torchtitan": (lambda: any_of(save_fla_ops(CORE), torchtitan_selective()), set(CORE)),
    "save-fla-ops+all-copies": (lambda: any_of(save_fla_ops(), save_all_copies()), ALL),
    "save-fla-ops+d2h": (lambda: any_of(save_fla_ops(), save_device_to_host_copies()), ALL),
    "full-ac": (None, set()),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ForeignHelperBlock(nn.Module):
    """A block whose own code calls an FLA index helper outside the custom ops, as foreign model code,
    context-parallel metadata or other FLA helpers do: ``position_ids`` from this layer's ``cu_seqlens``."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor, seqlens) -> torch.Tensor:
        position = prepare_position_ids(seqlens.local().cu_seqlens)  # FLA's identity-cached helper
        return x + self.mixer(x, seqlens) * torch.cos(position.to(x.dtype))[None, :, None]


def _run(dtype, *, policy="no-ac", seqlens_cls=LayerLocalSeqlens, saveable=True, block=Block):
    layers = nn.ModuleList(
        block(FAMILIES[f].build(layer_idx=i, seed=10 + i, backend="reference", saveable=saveable))
        for i, f in enumerate(STACK)
    ).to(dtype)
    if policy != "no-ac":
        make = POLICIES[policy][0]
        if make is None:
            checkpoint_layers(layers, mode="full")
        else:
            checkpoint_layers(layers, mode="selective", policy=make())
    x = torch.randn(1, sum(LENS), HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    return recorded_step(layers, x, seqlens_cls.from_seq_lens(LENS))


@pytest.fixture(scope="module")
def no_ac():
    prior = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: _run(dtype) for name, dtype in DTYPES.items()}
    finally:
        torch.set_num_threads(prior)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_is_bit_exact_and_reruns_only_unsaved_ops(no_ac, policy, dtype):
    if "torchtitan" in policy:
        pytest.importorskip("torchtitan")
    saved = POLICIES[policy][1]
    step = _run(DTYPES[dtype], policy=policy)
    assert_bit_equal(step, no_ac[dtype])

    forward, backward = step.forward, step.backward
    assert forward.forward_calls == CALLS
    assert backward.backward_calls == CALLS  # every op's backward operator ran once per call
    # the recompute: a saved op does not run, an unsaved one runs as often as in the forward
    assert {n: backward.forward_calls.get(n, 0) for n in CALLS} == {n: 0 if n in saved else c for n, c in CALLS.items()}
    # ... and a saved op looks nothing up in FLA's cache, an unsaved one makes its forward's lookups
    assert forward.forward_events["gated_delta_rule"]  # lookups to compare (prepare_chunk_offsets)
    assert forward.forward_events.get("ssd", []) == []  # given the schedule and its chunk offsets: none
    for name in CALLS:
        expected = [] if name in saved else forward.forward_events.get(name, [])
        assert backward.forward_events.get(name, []) == expected, name
    assert forward.outside == [] and backward.outside == []  # every FLA lookup happens inside the ops


def test_the_saveable_path_computes_the_reference_numbers(no_ac):
    """Independent oracle: the default (plain) reference path. bf16 is bit-equal; fp32 differs in the last
    bits only, because the backward operators return contiguous gradients (their downstream sums run in
    another order) - why the promise is "AC equals no AC" within one path."""
    for name, dtype in DTYPES.items():
        plain = _run(dtype, saveable=False)
        got = no_ac[name]
        assert plain.forward.forward_calls == {}  # the default path makes no custom-op call
        if dtype is torch.bfloat16:
            assert_bit_equal(got, plain)
            continue
        assert torch.equal(got.loss, plain.loss)
        for key, grad in plain.grads.items():
            err = (got.grads[key] - grad).abs().max() / grad.abs().max().clamp(min=1e-30)
            assert err <= 1e-6, (key, float(err))


def test_custom_ops_make_a_shared_cu_seqlens_safe_for_these_ops_and_only_for_them(no_ac):
    """The two statements of the docs, with the field policy that saves every ``_to_copy``, in bf16.

    1. The stack's FLA calls are the custom ops: with one shared ``cu_seqlens`` the default path raises,
       the custom-op path is bit-exact, although layer 0's recompute still hits FLA's cache where its
       forward missed (SAC cannot see it: the lookups run inside one op).
    2. Code outside the ops that reads FLA's cache (here a helper call of the block itself) still breaks
       with the shared object, and is bit-exact with ``LayerLocalSeqlens``: ``.local()`` is what makes
       everything else safe.
    """
    with pytest.raises(RuntimeError, match="Autograd not support dtype: Int"):
        _run(torch.bfloat16, policy="save-all-copies", seqlens_cls=SharedSeqlens, saveable=False)

    shared = _run(torch.bfloat16, policy="save-all-copies", seqlens_cls=SharedSeqlens)
    assert_bit_equal(shared, no_ac["bf16"])
    forward = [e.outcome for name in CALLS for e in shared.forward.forward_events[name]]
    recompute = [e.outcome for name in CALLS for e in shared.backward.forward_events[name]]
    assert forward.count("miss") == 4 and recompute.count("miss") == 0  # the fault, hidden inside the ops

    reference = _run(torch.bfloat16, block=ForeignHelperBlock)
    with pytest.raises(RuntimeError, match="Autograd not support dtype: Int"):
        _run(torch.bfloat16, policy="save-all-copies", seqlens_cls=SharedSeqlens, block=ForeignHelperBlock)
    isolated = _run(torch.bfloat16, policy="save-all-copies", block=ForeignHelperBlock)
    assert_bit_equal(isolated, reference)


def test_sac_holds_exactly_the_outputs_of_the_saved_ops():
    """What a checkpointed layer keeps from its forward to its backward under ``save_fla_ops``: the op
    outputs, counted from SAC's own storage, equal to sizes computed from the layer's shapes (no copies)."""
    tokens = sum(LENS)
    for family, core_output in (("qwen3_5_moe", 4 * 8), ("nemotron_h", 4 * 16)):  # HV * V | H * P
        mixer = FAMILIES[family].build(backend="reference", saveable=True)
        conv_channels = mixer.conv_dim
        seqlens = LayerLocalSeqlens.from_seq_lens(LENS)
        x = torch.randn(1, tokens, HIDDEN, requires_grad=True)

        def forward(context_fn, mixer=mixer, seqlens=seqlens, x=x):
            torch.utils.checkpoint.checkpoint(mixer, x, seqlens, use_reentrant=False, context_fn=context_fn)

        held = sac_storage_bytes(save_fla_ops(), forward)
        core = "gated_delta_rule_reference" if family != "nemotron_h" else "ssd_scan_reference"
        assert held == {"causal_conv1d_reference": tokens * conv_channels * 4, core: tokens * core_output * 4}
        assert sac_storage_bytes(save_fla_ops(("causal_conv1d",)), forward) == {
            "causal_conv1d_reference": tokens * conv_channels * 4}
