"""SAC policies from the field and checkpoint_layers."""

import pytest
import torch
from helpers import sac_forward_storages, saved_indices
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from fla_ac_isolation.policies import (
    POLICIES,
    any_of,
    checkpoint_layers,
    policy_sees_op_output,
    save_all_copies,
    save_device_to_host_copies,
    save_fla_ops,
    save_ops,
    torchtitan_selective,
)

aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def ctx(out=None, recompute=False):
    if not policy_sees_op_output():  # torch 2.11: the context has no op_output (the policy runs before the op)
        return SelectiveCheckpointContext(is_recompute=recompute)
    return SelectiveCheckpointContext(is_recompute=recompute, op_output=out)


def test_device_to_host_rule_saves_only_accelerator_to_cpu_copies():
    policy = save_device_to_host_copies()
    on_device = torch.empty(3, device="meta")  # stands for a CUDA tensor: any non-CPU source counts
    assert policy(ctx(), aten._to_copy.default, on_device, device=torch.device("cpu")) is SAVE
    assert policy(ctx(), aten._to_copy.default, on_device, device="cpu") is SAVE
    assert policy(ctx(), aten._to_copy.default, torch.empty(3), device="cpu") is RECOMPUTE  # host to host
    assert policy(ctx(), aten._to_copy.default, on_device, dtype=torch.int32) is RECOMPUTE  # a cast
    assert policy(ctx(), aten.mm.default, on_device, on_device) is RECOMPUTE


def test_save_all_copies_and_dtype_filtered_save_ops():
    assert save_all_copies()(ctx(), aten._to_copy.default, torch.empty(2), dtype=torch.int32) is SAVE
    if not policy_sees_op_output():  # torch 2.11: a dtype rule cannot be decided, refused at the boundary
        with pytest.raises(RuntimeError, match=r"save_ops\(dtypes=\.\.\.\) needs the op's output in the SAC policy"):
            save_ops([aten.sub], dtypes=[torch.int64])
        return
    int_sub = save_ops([aten.sub], dtypes=[torch.int64])
    assert int_sub(ctx(torch.zeros(2, dtype=torch.int64)), aten.sub.Tensor) is SAVE
    assert int_sub(ctx(torch.zeros(2)), aten.sub.Tensor) is RECOMPUTE
    assert int_sub(ctx(torch.zeros(2, dtype=torch.int64)), aten.add.Tensor) is RECOMPUTE
    with pytest.raises(TypeError, match="ops must hold torch ops"):
        save_ops(["aten.sub"])


def test_any_of_saves_when_one_policy_saves():
    p = any_of(save_ops([aten.mm.default]), save_ops([aten.clone.default]))
    assert p(ctx(), aten.clone.default) is SAVE and p(ctx(), aten.mm.default) is SAVE
    assert p(ctx(), aten.add.Tensor) is RECOMPUTE


def test_any_of_renews_a_stateful_member_for_every_checkpointed_region():
    """Regression: any_of used to drop ``fresh()``, so torchtitan's per-region matmul counter ran on across
    regions (region 2 saved the matmuls region 1 recomputed). ``sac_context_fn`` freshens the policy for
    every checkpointed call; each region must then start counting at its first matmul."""
    pytest.importorskip("torchtitan")
    policy = any_of(torchtitan_selective(), save_ops([aten.clone.default]))
    w = torch.empty(4, 4)
    regions = []
    for _ in range(3):
        p = policy.fresh() if hasattr(policy, "fresh") else policy  # what sac_context_fn does per region
        regions.append([p(ctx(), aten.mm.default, w, w) for _ in range(3)])
    assert regions == [[SAVE, RECOMPUTE, SAVE]] * 3
    assert policy.__name__ == "any_of(torchtitan_selective, save_ops)"


def test_any_of_with_torchtitan_saves_the_same_matmuls_in_every_checkpointed_layer():
    """End to end, read from SAC's own storage after the forward: both regions save matmuls 1 and 3."""
    pytest.importorskip("torchtitan")
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layers = [nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3))) for _ in range(2)]

    def forward(context_fn):
        h = torch.randn(2, 4, requires_grad=True)
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False, context_fn=context_fn)

    storages = sac_forward_storages(any_of(torchtitan_selective(), save_ops([aten.clone.default])), forward)
    assert [saved_indices(storage, aten.mm.default) for storage in storages] == [[0, 2], [0, 2]]


def test_save_fla_ops_saves_the_named_operations_of_both_backends_only():
    ops = torch.ops.fla_ac_isolation
    everything = save_fla_ops()
    core = save_fla_ops(("gated_delta_rule", "ssd"))
    for op in (ops.gated_delta_rule.default, ops.gated_delta_rule_reference.default, ops.simple_gla.default,
               ops.ssd_scan_reference.default):
        assert everything(ctx(), op) is SAVE and core(ctx(), op) is SAVE
    for op in (ops.causal_conv1d.default, ops.causal_conv1d_reference.default):
        assert everything(ctx(), op) is SAVE and core(ctx(), op) is RECOMPUTE
    for op in (ops.gated_delta_rule_backward.default, ops.causal_conv1d_reference_backward.default, aten.mm.default,
               aten._to_copy.default):
        assert everything(ctx(), op) is RECOMPUTE
    assert core.__name__ == "save_fla_ops(gated_delta_rule, ssd)"
    combined = any_of(core, save_device_to_host_copies())
    assert combined(ctx(), ops.simple_gla.default) is SAVE
    assert combined(ctx(), aten._to_copy.default, torch.empty(2, device="meta"), device="cpu") is SAVE
    assert combined(ctx(), ops.causal_conv1d.default) is RECOMPUTE


@pytest.mark.parametrize(
    ("ops", "error", "match"),
    [
        (("gated_delta_rule", "conv"), ValueError,
         r"ops must name one or more of \('gated_delta_rule', 'causal_conv1d', 'ssd'\), got \('gated_delta_rule', 'conv'\)"),
        ((), ValueError, r"ops must name one or more of .*, got \(\)"),
        ("ssd", TypeError, "ops must be a sequence of operation names .* got 'ssd'"),
        ((torch.ops.fla_ac_isolation.simple_gla.default,), TypeError, "ops must be a sequence of operation names"),
        (None, TypeError, r"ops must be a sequence of operation names .* got None"),
        ((name for name in ["ssd", "conv"]), ValueError, r"ops must name one or more of .*, got \('ssd', 'conv'\)"),
        ((name for name in []), ValueError, r"ops must name one or more of .*, got \(\)"),
    ],
    ids=["unknown", "empty", "one-string", "an-overload", "none", "generator-unknown", "generator-empty"],
)
def test_save_fla_ops_refuses_unknown_names(ops, error, match):
    with pytest.raises(error, match=match):
        save_fla_ops(ops)


def test_save_fla_ops_reads_a_generator_once():
    """Regression: the type check used to exhaust a generator, leaving a policy that saved nothing."""
    from fla_ac_isolation.ops import SAVEABLE_OPS

    policy = save_fla_ops(name for name in ["ssd"])
    assert policy.__name__ == "save_fla_ops(ssd)"
    assert all(policy(None, op) is SAVE for op in SAVEABLE_OPS["ssd"])


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((), {}, ValueError, r"any_of needs at least one policy"),
        ((save_all_copies(),), {"name": 3}, TypeError, r"name must be a str \(the policy's __name__\), got int"),
    ],
    ids=["no-policies", "name-not-str"],
)
def test_any_of_refuses_no_policies_and_a_non_string_name(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        any_of(*args, **kwargs)


def test_any_of_refuses_an_uncalled_policy_constructor():
    with pytest.raises(TypeError, match=r"save_fla_ops does not take \(ctx, op\); did you mean save_fla_ops\(\)"):
        any_of(save_fla_ops, save_all_copies())


def test_torchtitan_policy_recomputes_every_second_matmul_per_pass():
    pytest.importorskip("torchtitan")
    policy = torchtitan_selective().fresh()
    w = torch.empty(4, 4)
    forward = [policy(ctx(), aten.mm.default, w, w) for _ in range(4)]
    recompute = [policy(ctx(recompute=True), aten.mm.default, w, w) for _ in range(4)]
    assert forward == recompute == [SAVE, RECOMPUTE, SAVE, RECOMPUTE]
    assert policy(ctx(), aten.topk.default, w, 2) is SAVE


def test_policy_registry_builds_new_policies():
    pytest.importorskip("torchtitan")
    assert set(POLICIES) == {"save-d2h-copies", "save-all-copies", "torchtitan"}
    for make in POLICIES.values():
        assert callable(make())


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("freq", [1, 2, 4])
def test_checkpoint_layers_wraps_every_freq_th_layer_and_keeps_state_dict(freq):
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(Block() for _ in range(4))
    keys = list(model.state_dict())
    x = torch.randn(2, 4)
    ref = x
    for layer in model.layers:
        ref = layer(ref)
    checkpoint_layers(model, mode="selective", policy=save_all_copies(), freq=freq)
    wrapped = [isinstance(layer, CheckpointWrapper) for layer in model.layers]
    assert wrapped == [i % freq == 0 for i in range(4)]
    assert list(model.state_dict()) == keys
    out = x
    for layer in model.layers:
        out = layer(out)
    assert torch.equal(out, ref)
    checkpoint_layers(model.layers, freq=1)  # idempotent for wrapped layers
    assert sum(isinstance(layer, CheckpointWrapper) for layer in model.layers) == 4
    assert not any(isinstance(m._checkpoint_wrapped_module, CheckpointWrapper) for m in model.layers)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "partial"}, "mode must be 'full' or 'selective'"),
        ({"freq": 0}, "freq must be an int >= 1"),
        ({"mode": "selective"}, "needs a policy"),
        ({"mode": "full", "policy": save_all_copies()}, "takes no policy"),
    ],
)
def test_checkpoint_layers_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_layers(nn.ModuleList([Block()]), **kwargs)


def test_checkpoint_layers_needs_layers():
    with pytest.raises(ValueError, match=r"ModuleList/nn\.Sequential/nn\.ModuleDict"):
        checkpoint_layers(nn.Linear(2, 2))


def test_checkpoint_layers_accepts_a_module_dict_in_insertion_order():
    """torchtitan keeps its transformer blocks in an nn.ModuleDict keyed "0", "1", ..."""
    layers = nn.ModuleDict({str(i): Block() for i in range(4)})
    checkpoint_layers(layers, freq=2)
    assert [isinstance(layers[k], CheckpointWrapper) for k in layers] == [True, False, True, False]


def test_an_uncalled_policy_constructor_is_rejected_with_a_hint():
    with pytest.raises(TypeError, match=r"save_all_copies does not take \(ctx, op\); did you mean save_all_copies\(\)"):
        checkpoint_layers(nn.ModuleList([Block()]), mode="selective", policy=save_all_copies)
    with pytest.raises(TypeError, match="policy must be a SAC policy function"):
        checkpoint_layers(nn.ModuleList([Block()]), mode="selective", policy="save-all-copies")
