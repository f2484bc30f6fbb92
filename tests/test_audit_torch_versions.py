"""ReplayAudit sees every checkpoint on torch 2.11, 2.13, 2.14 and 2.15, reports the reentrant ones it cannot look
into, and refuses a torch whose checkpoint internals it does not know (fla_ac_isolation.audit.torch_checkpoint).

Each way of checkpointing is compared with an independent reference: the ops the same callable runs without any
checkpoint, recorded by a plain dispatch mode here (minus the ops SAC ignores, as the audit leaves them out)."""

import functools
import re
import warnings

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint  # imported before any audit starts

from fla_ac_isolation.audit import (
    ReplayAudit,
    UnauditedCheckpointWarning,
    UnauditedRegion,
    UnsupportedTorchCheckpointError,
)
from fla_ac_isolation.audit.records import ignored_ops, op_name
from fla_ac_isolation.audit.torch_checkpoint import checkpoint_internals

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
OLD, NEW = "_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl"
BOUND_BEFORE = functools.partial(checkpoint, use_reentrant=False)  # bound before any audit starts
REENTRANT_WARNING = ("ReplayAudit: {label}: reentrant checkpoint: not audited (use_reentrant=True recomputes inside "
                     "autograd with no context_fn; checkpoint with use_reentrant=False to audit it)")


class _Ops(TorchDispatchMode):
    """The reference: every op dispatched inside, minus those SAC (and the audit) ignore."""

    def __init__(self):
        super().__init__()
        self.ops, self._ignored = [], ignored_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self._ignored:
            self.ops.append(op_name(func))
        return func(*args, **(kwargs or {}))


def _reference(fn, *args):
    with torch.no_grad(), _Ops() as rec:  # grad mode does not change which aten ops a forward dispatches
        fn(*args)
    return rec.ops


def _recorded(audit):
    return [[op_name(op) for op, _ in r.forward.ops] for r in audit._session.regions]


def two_ops(x):
    return (x * 2).sin()


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x):
        return torch.sin(x * self.weight)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scale(), Scale()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _x():
    return torch.linspace(-1.0, 1.0, 4, requires_grad=True)


# ------------------------------------------------------------------------------------------ the internals
EXPECTED_INTERNALS = {(2, 11): (OLD, "checkpoint"), (2, 13): (OLD, "checkpoint"),
                      (2, 14): (NEW, "_checkpoint_impl"), (2, 15): (NEW, "_checkpoint_impl")}


def test_the_generator_intercepted_is_the_one_this_torch_calls():
    if TORCH not in EXPECTED_INTERNALS:
        pytest.fail(f"torch {torch.__version__} is not a release this test knows: add what it calls")
    internals = checkpoint_internals()
    assert (internals.generator, internals.caller) == EXPECTED_INTERNALS[TORCH]
    assert internals.torch_version == torch.__version__
    # torch 2.14 and 2.15 keep the old name as a shim no in-tree caller uses: patching it alone saw nothing
    assert hasattr(cp, OLD)
    assert (OLD in cp._checkpoint_impl.__code__.co_names) is False if TORCH >= (2, 14) else not hasattr(
        cp, "_checkpoint_impl")


def test_the_old_name_alone_records_nothing_on_torch_2_14_and_later(monkeypatch):
    """The unsafe path, patching only the shim as the audit did before: every region is lost from 2.14 on."""
    calls = []
    shim = cp._checkpoint_without_reentrant_generator

    def counting(*args, **kwargs):
        calls.append(args[0])
        return shim(*args, **kwargs)

    monkeypatch.setattr(cp, OLD, counting)
    checkpoint(two_ops, _x(), use_reentrant=False).sum().backward()
    assert calls == ([] if TORCH >= (2, 14) else [two_ops])


# --------------------------------------------------------------------------- every way to checkpoint
def _plain(x):
    return checkpoint(two_ops, x, use_reentrant=False)


def _partial(x):
    return BOUND_BEFORE(two_ops, x)


def _sequential(x):
    return cp.checkpoint_sequential([Scale(), Scale()], 2, x, use_reentrant=False)


@pytest.mark.parametrize("route", [_plain, _partial], ids=["checkpoint", "partial-bound-before"])
def test_a_function_checkpointed_any_way_is_recorded_with_its_ops(route):
    x = _x()
    with ReplayAudit(on_divergence="raise") as audit:
        route(x).sum().backward()
    assert _recorded(audit) == [["aten.mul.Tensor", "aten.sin.default"]] == [_reference(two_ops, x)]
    assert [(r.label, r.verdict, r.forward_ops) for r in audit.regions] == [("region #0", "aligned", 2)]
    assert (audit.verdict, audit.why_blind, audit.unaudited, audit.ok) == ("aligned", None, [], True)


def test_the_curried_checkpoint_of_torch_2_14_is_recorded():
    if TORCH < (2, 14):
        with pytest.raises(TypeError):  # 2.11 / 2.13: checkpoint() needs the function
            checkpoint(use_reentrant=False)
        return
    curried = checkpoint(use_reentrant=False)(two_ops)
    x = _x()
    with ReplayAudit() as audit:
        curried(x).sum().backward()
    assert _recorded(audit) == [_reference(two_ops, x)] == [["aten.mul.Tensor", "aten.sin.default"]]
    assert audit.verdict == "aligned"


def test_checkpoint_sequential_is_recorded():
    x = _x()
    with ReplayAudit() as audit:
        _sequential(x).sum().backward()
    # segments=2: torch checkpoints every segment but the last, which it runs plainly
    assert _recorded(audit) == [_reference(Scale(), x)] == [["aten.mul.Tensor", "aten.sin.default"]]
    assert [r.verdict for r in audit.regions] == ["aligned"]


def _wrapped_stack(wrap):
    torch.manual_seed(0)
    model = Stack()
    for i, layer in enumerate(model.layers):
        model.layers[i] = wrap(layer)
    return model


def _torch_wrapper(layer):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _composable(layer):
    from torch.distributed._composable import checkpoint as composable_checkpoint

    return composable_checkpoint(layer)


@pytest.mark.parametrize("wrap", [_torch_wrapper, _composable], ids=["checkpoint_wrapper", "composable"])
def test_modules_wrapped_by_torch_are_recorded_by_module_path(wrap):
    model = _wrapped_stack(wrap)
    x = _x()
    with ReplayAudit(model) as audit:
        model(x).sum().backward()
    layer_ops = _reference(Scale(), x)
    assert layer_ops == ["aten.mul.Tensor", "aten.sin.default"]
    assert _recorded(audit) == [layer_ops, layer_ops]
    assert [(r.label, r.verdict) for r in audit.regions] == [("layers.0", "aligned"), ("layers.1", "aligned")]
    assert audit.verdict == "aligned"


def test_torchtitan_full_ac_is_recorded():
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint",
                             reason="torchtitan is not installed on this stack")
    torch.manual_seed(0)
    model = Stack()
    ac.FullAC(ac.FullAC.Config()).apply(model)
    x = _x()
    with ReplayAudit(model) as audit:
        model(x).sum().backward()
    ops = ["aten.mul.Tensor", "aten.sin.default"]
    assert _recorded(audit) == [ops, ops]
    assert [(r.label, r.verdict, r.prefix) for r in audit.regions] == [("layers.0", "aligned", False),
                                                                      ("layers.1", "aligned", False)]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _per_layer_reference(model, ids):
    """The ops of each decoder layer in a forward without checkpointing (forward hooks around each layer)."""
    found = []

    def enter(module, args, kwargs):
        module._ref = _Ops()
        module._ref.__enter__()

    def leave(module, args, kwargs, out):
        module._ref.__exit__(None, None, None)
        found.append(module._ref.ops)

    handles = [h for layer in model.model.layers
               for h in (layer.register_forward_pre_hook(enter, with_kwargs=True),
                         layer.register_forward_hook(leave, with_kwargs=True))]
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    for h in handles:
        h.remove()
    return found


def test_transformers_gradient_checkpointing_is_recorded_with_each_layers_ops():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    reference = _per_layer_reference(model, ids)
    assert len(reference) == 2 and len(reference[0]) > 20
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with ReplayAudit(model) as audit:
        model(input_ids=ids, labels=ids).loss.backward()
    assert _recorded(audit) == reference
    assert [(r.label, r.verdict) for r in audit.regions] == [("model.layers.0", "aligned"),
                                                            ("model.layers.1", "aligned")]
    assert audit.verdict == "aligned"


# --------------------------------------------------------------------------------- unknown internals
def _enter_and_leave(audit):
    with audit:  # a broken refusal leaves nothing patched behind for the next test
        pass


def test_an_unknown_torch_is_refused_on_entry_naming_its_version(monkeypatch):
    monkeypatch.delattr(cp, NEW, raising=False)
    monkeypatch.delattr(cp, OLD)
    audit = ReplayAudit()
    with pytest.raises(UnsupportedTorchCheckpointError) as err:
        _enter_and_leave(audit)
    message = str(err.value)
    assert message.startswith(f"ReplayAudit does not know the checkpoint internals of torch {torch.__version__}: ")
    assert "present here: neither" in message and message.endswith("use a torch from 2.11 to 2.15")
    assert isinstance(err.value, RuntimeError)
    assert audit._stack is None  # nothing left patched or entered


def test_a_generator_with_other_parameters_is_refused(monkeypatch):
    name = checkpoint_internals().generator
    monkeypatch.setattr(cp, name, lambda fn, *args, **kwargs: None)
    with pytest.raises(UnsupportedTorchCheckpointError, match=re.escape(f"torch {torch.__version__}: ")) as err:
        _enter_and_leave(ReplayAudit())
    assert f"present here: {OLD}, {NEW}" in str(err.value) or f"present here: {name}" in str(err.value)


def test_only_the_shim_left_is_refused_on_torch_2_14_and_later(monkeypatch):
    """2.14 / 2.15 with the new generator gone: the old name is still there, but checkpoint does not call it."""
    if TORCH < (2, 14):
        assert checkpoint_internals().generator == OLD  # nothing to remove: the old name is what runs
        return
    monkeypatch.delattr(cp, NEW)
    with pytest.raises(UnsupportedTorchCheckpointError, match=f"present here: {OLD}$|present here: {OLD}\\."):
        _enter_and_leave(ReplayAudit())


def test_a_known_generator_that_checkpoint_does_not_call_is_refused_on_every_torch(monkeypatch):
    """A torch whose checkpoint runs its generator under another name while the known name is still there with its
    known parameters (as torch 2.14 and 2.15 keep the old name as a shim): the audit reads what the caller calls,
    so it refuses, on any torch (here: the caller's code renamed, the generator copied under the new name). The
    unsafe path (presence and parameters alone): the audit patches the stale name and records no region of a
    checkpoint that ran."""
    import inspect
    import types

    from fla_ac_isolation.audit import torch_checkpoint

    internals = checkpoint_internals()
    caller = inspect.unwrap(getattr(cp, internals.caller))
    real = getattr(cp, internals.generator)
    moved = types.FunctionType(real.__code__, real.__globals__, "_moved_generator", real.__defaults__,
                               real.__closure__)
    moved.__kwdefaults__ = real.__kwdefaults__
    monkeypatch.setattr(cp, "_moved_generator", moved, raising=False)
    names = tuple("_moved_generator" if n == internals.generator else n for n in caller.__code__.co_names)
    monkeypatch.setattr(caller, "__code__", caller.__code__.replace(co_names=names))
    x = _x()
    checkpoint(two_ops, x, use_reentrant=False).sum().backward()  # checkpoint runs, through the moved generator
    assert x.grad is not None

    with pytest.raises(UnsupportedTorchCheckpointError) as err:
        _enter_and_leave(ReplayAudit())
    present = ", ".join(name for name in (NEW, OLD) if hasattr(cp, name))
    assert str(err.value).startswith(
        f"ReplayAudit does not know the checkpoint internals of torch {torch.__version__}: torch.utils.checkpoint."
        f"{internals.caller} calls none of the non-reentrant generators it knows with their known parameters (")
    assert str(err.value).endswith(f"); present here: {present}. Auditing would record no region, so it refuses; "
                                   f"use a torch from 2.11 to 2.15")

    monkeypatch.setattr(torch_checkpoint, "_code_names", lambda fn: (internals.generator,))  # the unsafe path
    with ReplayAudit() as audit:
        checkpoint(two_ops, _x(), use_reentrant=False).sum().backward()
    assert audit.regions == [] and audit.why_blind == "no checkpointed region ran"


def test_a_checkpoint_function_of_another_shape_is_refused(monkeypatch):
    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fn, *args):
            return fn(*args)

    monkeypatch.setattr(cp, "CheckpointFunction", Other)
    with pytest.raises(UnsupportedTorchCheckpointError, match=re.escape(
            f"torch {torch.__version__}: torch.utils.checkpoint.CheckpointFunction.forward(ctx, run_function, "
            f"preserve_rng_state, args) was not found")):
        _enter_and_leave(ReplayAudit())


# ------------------------------------------------------------------------------------------ reentrant
def test_a_reentrant_checkpoint_is_reported_never_counted_clean():
    x = _x()
    with ReplayAudit(on_divergence="raise") as audit, pytest.warns(UnauditedCheckpointWarning) as caught:
        out = checkpoint(two_ops, x, use_reentrant=True)
        out.sum().backward()
    assert [str(w.message) for w in caught] == [REENTRANT_WARNING.format(label="unaudited region #0")]
    # what the audit alone would say (its old report): nothing recorded and ok, though the region ran 2 ops
    assert (audit.regions, audit.ok) == ([], True)
    assert torch.equal(x.grad, 2 * torch.cos(2 * x.detach()))  # it did run, forward and backward
    assert audit.unaudited == [UnauditedRegion("unaudited region #0", "reentrant checkpoint: not audited")]
    assert audit.verdict == "blind"
    assert audit.why_blind == ("no checkpointed region ran; 1 checkpointed region run(s) not audited (reentrant "
                               "checkpoint: not audited): unaudited region #0")
    assert audit.summary().splitlines()[1:] == [
        "unaudited region #0  -        -        reentrant checkpoint: not audited  -                 -"]


def test_reentrant_module_checkpoints_are_reported_by_module_path():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = _wrapped_stack(lambda layer: checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.REENTRANT))
    with ReplayAudit(model) as audit, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(_x()).sum().backward()
    reported = [str(w.message) for w in caught if w.category is UnauditedCheckpointWarning]
    assert reported == [REENTRANT_WARNING.format(label=f"layers.{i}") for i in (0, 1)]
    assert [(u.label, u.reason) for u in audit.unaudited] == [("layers.0", "reentrant checkpoint: not audited"),
                                                              ("layers.1", "reentrant checkpoint: not audited")]
    assert audit.verdict == "blind"


def test_transformers_reentrant_gradient_checkpointing_is_reported():
    model = _tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with ReplayAudit(model) as audit, pytest.warns(UnauditedCheckpointWarning):
        model(input_ids=ids, labels=ids).loss.backward()
    assert audit.regions == []
    assert [u.label for u in audit.unaudited] == ["model.layers.0", "model.layers.1"]
    assert audit.verdict == "blind"


def test_checkpoint_function_applied_directly_is_reported():
    with ReplayAudit() as audit, pytest.warns(UnauditedCheckpointWarning):
        cp.CheckpointFunction.apply(two_ops, True, _x()).sum().backward()
    assert audit.unaudited == [UnauditedRegion("unaudited region #0", "reentrant checkpoint: not audited")]


def test_a_debug_mode_checkpoint_is_reported_not_audited():
    with ReplayAudit() as audit, pytest.warns(UnauditedCheckpointWarning, match="debug checkpoint: not audited"):
        checkpoint(two_ops, _x(), use_reentrant=False, debug=True).sum().backward()
    assert (audit.regions, audit.verdict) == ([], "blind")
    assert audit.unaudited == [UnauditedRegion("unaudited region #0", "debug checkpoint: not audited")]


def test_verdict_with_judged_regions_alongside_unaudited_or_not_recomputed_ones():
    x = _x()
    with ReplayAudit() as audit, pytest.warns(UnauditedCheckpointWarning):
        (checkpoint(two_ops, x, use_reentrant=False) + checkpoint(two_ops, x, use_reentrant=True)).sum().backward()
    assert ([r.verdict for r in audit.regions], len(audit.unaudited), audit.ok) == (["aligned"], 1, True)
    assert audit.verdict == "blind"
    assert audit.why_blind == ("1 checkpointed region run(s) not audited (reentrant checkpoint: not audited): "
                               "unaudited region #0")

    with ReplayAudit() as forward_only:
        checkpoint(two_ops, x, use_reentrant=False)  # no backward: never recomputed
    assert [r.verdict for r in forward_only.regions] == ["not recomputed"]
    assert (forward_only.verdict, forward_only.why_blind) == ("blind", "none of the 1 recorded region(s) was "
                                                                       "recomputed")

    with ReplayAudit() as nothing:
        pass
    assert (nothing.verdict, nothing.why_blind, nothing.ok) == ("blind", "no checkpointed region ran", True)


def test_a_divergence_outranks_blindness():
    state = {"n": 0}

    def changes(x):
        state["n"] += 1
        return (x * 2).sin() if state["n"] == 1 else (x + 2).sin()  # the recompute runs add where forward ran mul

    x = _x()
    with ReplayAudit(on_divergence="record") as audit, pytest.warns(UnauditedCheckpointWarning):
        (checkpoint(changes, x, use_reentrant=False) + checkpoint(two_ops, x, use_reentrant=True)).sum().backward()
    assert [(r.verdict, r.first_diff, r.forward_op, r.recompute_op) for r in audit.regions] == [
        ("divergent", 0, "aten.mul.Tensor -> [4] float32 cpu", "aten.add.Tensor -> [4] float32 cpu")]
    assert (audit.verdict, audit.ok, len(audit.unaudited)) == ("divergent", False, 1)


# ------------------------------------------------------------------------------------------ doctor
YES = "yes (non-reentrant recorded: 1 region, 2 ops, recompute compared; reentrant reported, not audited)"


def test_doctor_says_the_audit_sees_checkpoints_here(capsys):
    from fla_ac_isolation.harness.cli import main
    from fla_ac_isolation.harness.environment import AuditProbe, audit_self_probe, environment_report

    assert audit_self_probe() == AuditProbe(True, 1, 2, "aligned", 1)
    assert environment_report()["audit sees checkpoints"] == YES
    assert main(["doctor"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "audit sees checkpoints" in text and "yes (non-reentrant recorded: 1 region, 2 ops" in text


def test_doctor_says_no_on_a_torch_it_does_not_know(monkeypatch):
    from fla_ac_isolation.harness.environment import audit_self_probe, environment_report

    monkeypatch.delattr(cp, NEW, raising=False)
    monkeypatch.delattr(cp, OLD)
    probe = audit_self_probe()
    assert (probe.sees, probe.regions, probe.reentrant_reported) == (False, 0, 0)
    assert environment_report()["audit sees checkpoints"].startswith(
        f"NO: ReplayAudit does not know the checkpoint internals of torch {torch.__version__}: ")


def test_doctor_says_no_when_the_audit_misses_the_checkpoint(monkeypatch):
    """The unsafe path the probe guards against (the audit patching a name checkpoint does not call): simulated by
    an intercept that hands torch the user's context_fn untouched."""
    import fla_ac_isolation.audit.replay_audit as replay_audit
    from fla_ac_isolation.audit.torch_checkpoint import intercept_checkpoints
    from fla_ac_isolation.harness.environment import audit_self_probe

    def blind(on_non_reentrant, on_reentrant):
        return intercept_checkpoints(lambda fn, context_fn, debug: context_fn, lambda fn: None)

    monkeypatch.setattr(replay_audit, "intercept_checkpoints", blind)
    assert audit_self_probe().line() == (
        f"NO: on torch {torch.__version__}, a non-reentrant checkpoint of 2 ops gave 0 region(s), 0 forward op(s), "
        "verdict None (expected 1, 2, aligned); a reentrant checkpoint was reported 0 time(s) (expected 1)")


# ------------------------------------------------------------------------------------------- check
BLIND_MODELS = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Inner(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant:  # the user's own reentrant checkpoint inside the layer
            return checkpoint(self.proj, x, use_reentrant=True)
        return x + self.proj.bias  # saves no tensor: torch never recomputes it


class Model(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.layers = nn.ModuleList([Inner(reentrant), Inner(reentrant)])

    def forward(self, x, cu_seqlens):
        for layer in self.layers:
            x = layer(x)
        return x.square().sum()


def _batch():
    torch.manual_seed(0)
    return {"x": torch.randn(3, 4, requires_grad=True), "cu_seqlens": torch.tensor([0, 2, 3])}


def reentrant():
    torch.manual_seed(0)
    return Model(True), _batch()


def never_recomputed():
    torch.manual_seed(0)
    return Model(False), _batch()
"""


def _blind_check(capsys, tmp_path, name, policy):
    from fla_ac_isolation.harness.cli import main

    path = tmp_path / "blind_models.py"
    path.write_text(BLIND_MODELS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnauditedCheckpointWarning)
        code = main(["check", "--model", f"{path}:{name}", "--device", "cpu", *policy])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("name", "policy", "why"), [
    ("never_recomputed", ["--ac", "full"], "none of the 2 recorded region(s) was recomputed"),
    # each layer's reentrant checkpoint runs in its forward and again in its recompute
    ("reentrant", ["--ac", "full"], "4 checkpointed region run(s) not audited (reentrant checkpoint: not audited): "
                                    "layers.0.proj, layers.1.proj"),
])
def test_check_refuses_a_step_the_audit_could_not_judge_exit_2(capsys, tmp_path, monkeypatch, name, policy, why):
    code, out, err = _blind_check(capsys, tmp_path, name, policy)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"fla-ac-isolation check: error: the audit could not judge this step ({why}), so nothing can be passed: "
        "checkpoint with use_reentrant=False and make the loss depend on every checkpointed layer"]

    # the unsafe path, without the rule: the same step passes as aligned
    import fla_ac_isolation.harness.check.runner as check_runner

    monkeypatch.setattr(check_runner, "_require_judged", lambda step, mixers: None)
    code, out, _ = _blind_check(capsys, tmp_path, name, policy)
    assert code == 0 and out.rstrip().endswith("verdict: OK (exit 0)")
