"""``examples/own_trainer.py`` (issue 37): a prime-rl-style trainer's own model (its Gated DeltaNet calling FLA's
ops, its MoE, its SAC policy saving every ``_to_copy`` and ``mm`` through torch's ``checkpoint_wrapper``, one
``cu_seqlens`` for every layer) on a CPU inside ``reference_kernels()``: the fixed model (``LayerLocalSeqlens``)
and the global disable equal no AC bit for bit; the shipped model fails; ``check`` says the same of both, the
model and the policy named by one file loaded once.

Its mixer and its policy in the EP=2 regression (item 2): built from the trainer's own config (``mixer_config``;
transformers' lacks ``output_gate_type``) or a factory, the policy reaching the spawned ranks by module and name;
widths that do not fit the tiny decoder, and policies the ranks cannot load, refused before any rank starts.

``docs/replace-global-disable.md``'s test files run as written, the page's ``my_trainer.model`` being the
example."""

from __future__ import annotations

import os
import re
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from helpers import INT_MEAN_MESSAGE, ROOT, int_mean_error
from torch import nn

from fla_ac_isolation.harness.cli import main
from fla_ac_isolation.harness.user_code import load_module

pytestmark = pytest.mark.usefixtures("single_thread")

EXAMPLE = "examples/own_trainer.py"
#: the shipped model's recompute of layer 0 hits FLA's cache where its forward missed, and SAC hands the MoE's
#: load statistic (a saved _to_copy) FLA's int32 offsets instead (FLA 0.6; the class is torch's, by version)
SHARED_ERROR = f"{int_mean_error().__name__}: {INT_MEAN_MESSAGE}"


@pytest.fixture(scope="module")
def example():
    return load_module(str(ROOT / EXAMPLE))  # the module check's --model and --policy load too (once per process)


def _step(example, path: str, policy=None) -> dict:
    model = example.build(path)
    if policy is not None:  # the same model under a policy that records what it is asked
        model = example.apply_ac(example.Model(example.ModelConfig(), fixed=path == "fixed"), policy)
        torch.manual_seed(0)
        model.load_state_dict(example.build("no-ac").state_dict())
    return example.train_step(model, example.packed_batch(), path)


def _assert_bit_for_bit(run: dict, reference: dict) -> None:
    assert "error" not in run, run.get("error")
    assert torch.equal(run["loss"], reference["loss"])
    assert run["grads"].keys() == reference["grads"].keys() and len(reference["grads"]) == 29
    for name, grad in reference["grads"].items():
        assert torch.equal(run["grads"][name], grad), name


def test_the_fixed_model_under_its_sac_policy_equals_no_ac_bit_for_bit(example):
    """The fixed model checkpointed under the trainer's policy saved ``_to_copy`` and ``mm`` outputs in its
    forwards (the policy was asked and said MUST_SAVE), and loss and every gradient equal the step without AC."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.utils.checkpoint import CheckpointPolicy

    saved = []

    def recording(ctx, op, *args, **kwargs):
        decision = example.sac_policy(ctx, op, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            saved.append(op)
        return decision

    reference = _step(example, "no-ac")
    _assert_bit_for_bit(_step(example, "fixed"), reference)
    _assert_bit_for_bit(_step(example, "fixed", policy=recording), reference)
    assert {torch.ops.aten._to_copy.default, torch.ops.aten.mm.default} <= set(saved)
    assert all(isinstance(layer, CheckpointWrapper) for layer in example.build("fixed").layers)


def test_the_shipped_model_fails_and_the_global_disable_equals_no_ac(example):
    import fla.utils

    reference = _step(example, "no-ac")
    assert _step(example, "shared") == {"error": SHARED_ERROR}
    assert fla.utils.FLA_DISABLE_TENSOR_CACHE is False
    _assert_bit_for_bit(_step(example, "global-disable"), reference)
    assert fla.utils.FLA_DISABLE_TENSOR_CACHE is False  # the example's switch is restored after its step


def test_the_fixed_model_hands_each_layer_fresh_offsets_and_the_shipped_one_the_same_tensor(example):
    """What the diff changes, seen at FLA's entry points (``reference_kernels()`` records each call's offsets):
    fixed, the conv and the rule of one layer share that layer's fresh tensor; shipped, one tensor for all."""
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    for path, distinct in (("fixed", 2), ("shared", 1)):
        model, batch = getattr(example, path)()
        with reference_kernels() as served, torch.no_grad():
            model(**batch)
        calls = [(c.kernel, id(c.cu_seqlens)) for c in served.calls]
        assert [k for k, _ in calls] == ["causal_conv1d", "chunk_gated_delta_rule"] * 2
        assert len({i for _, i in calls}) == distinct and calls[0][1] == calls[1][1], path
        assert (calls[0][1] == id(batch["cu_seqlens"])) == (path == "shared")


def test_check_passes_the_fixed_model_and_fails_the_shipped_one_under_the_trainers_policy(capsys, example):
    """``check --model FILE:fn --policy FILE:sac_policy``: the example binds ``causal_conv1d`` at import, so its
    module must be the one the CPU serving rebinds (loaded once: it is this test's module)."""
    code = main(["check", "--model", f"{EXAMPLE}:fixed", "--policy", f"{EXAMPLE}:sac_policy"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"fla-ac-isolation check: Model (--model {EXAMPLE}:fixed) | SAC policy {EXAMPLE}:sac_policy "
                        "| cpu (FLA served by reference_kernels)")
    assert lines[lines.index("as given: 2 of 2 checkpointed region(s) aligned"):][:3] == [
        "as given: 2 of 2 checkpointed region(s) aligned", "  layers.0  aligned", "  layers.1  aligned"]
    assert (code, lines[-1]) == (0, "verdict: OK (exit 0)")

    code = main(["check", "--model", f"{EXAMPLE}:shared", "--policy", f"{EXAMPLE}:sac_policy"])
    lines = capsys.readouterr().out.splitlines()
    region = lines.index("as given: 1 of 2 checkpointed region(s) aligned, 1 DIVERGENT")
    assert lines[region + 1].startswith("  layers.0  divergent at op #") and lines[region + 1].endswith(
        "(FLA cache: prepare_chunk_indices, prepare_chunk_offsets)")
    assert lines[region + 2:region + 4] == ["  layers.1  aligned", f"  the step failed: {SHARED_ERROR}"]
    assert (code, lines[-1]) == (1, "verdict: DIVERGENT (exit 1)")


def test_the_script_prints_each_path(capsys, example):
    result = example.main([])
    assert result["shared"] == {"error": SHARED_ERROR}
    assert {path: result[path]["max_grad_diff"] for path in ("no-ac", "global-disable", "fixed")} == {
        "no-ac": 0.0, "global-disable": 0.0, "fixed": 0.0}
    out = capsys.readouterr().out.splitlines()
    assert out[2] == f"  shared          raised {SHARED_ERROR}"
    assert [line.split()[0] for line in out[1:]] == list(example.PATHS)


# ------------------------------------------------------------------------ the EP=2 regression (item 2)
#: the trainer's config at the tiny decoder's width (hidden 64: heads of 16 channels, 2 key and 4 value heads)
CONFIG = SimpleNamespace(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, output_gate_type="sigmoid",
                         rms_norm_eps=1e-6)
MIXER = f"{EXAMPLE}:GatedDeltaNet"
SHOWN = os.path.relpath(ROOT / EXAMPLE)  # how a target names the example (from the working directory)
HERE = __name__  # this module, as the rank processes import it


def own_mixer(layer_idx):
    """A factory: the trainer's mixer from its own config."""
    example = load_module(str(ROOT / EXAMPLE))
    return example.GatedDeltaNet(example.ModelConfig(**vars(CONFIG)), layer_idx)


def wide_mixer(layer_idx):
    example = load_module(str(ROOT / EXAMPLE))
    return example.GatedDeltaNet(example.ModelConfig(hidden_size=256), layer_idx)


class _LayerOutput(nn.Module):  # returns (output, cache) as FLA's layers do
    def forward(self, hidden_states, seqlens):
        return hidden_states, None


def tuple_mixer(layer_idx):
    return _LayerOutput()


def not_a_module(layer_idx):
    return layer_idx


def own_policy(ctx, op, *args, **kwargs):
    """The example's policy, as a module-level function of this module (``module:callable``)."""
    return load_module(str(ROOT / EXAMPLE)).sac_policy(ctx, op, *args, **kwargs)


def recompute_all(ctx, op, *args, **kwargs):
    """Saves nothing: no saved output to shift, so even the shared path gives the gradients of no AC."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def test_the_regression_takes_the_trainers_config_or_factory_and_names_its_policy_for_the_ranks(example):
    from fla_ac_isolation.harness.regression import RegressionSpec

    spec = RegressionSpec(mixer=MIXER, mixer_config=CONFIG, policy=example.sac_policy, hidden_size=64,
                          device="cpu").validate()
    assert (spec.mixer, spec.policy, spec.policy_name) == (MIXER, f"{SHOWN}:sac_policy", f"{SHOWN}:sac_policy")
    assert spec.to_dict()["mixer_config"] == repr(CONFIG) and spec.serves_fla_on_cpu
    spec = RegressionSpec(mixer=own_mixer, policy=own_policy, hidden_size=64, device="cpu").validate()
    assert (spec.mixer, spec.policy) == (f"{HERE}:own_mixer", f"{HERE}:own_policy")


@pytest.mark.parametrize(("change", "message"), [
    ({"mixer": MIXER}, f"mixer {MIXER!r} in the tiny decoder (hidden_size 64): building it as cls(config, 0) raised "
                       "AttributeError: 'Qwen3_5MoeTextConfig' object has no attribute 'output_gate_type'"),
    ({"mixer": MIXER, "mixer_config": SimpleNamespace(**{**vars(CONFIG), "hidden_size": 128})},
     f"mixer {MIXER!r} in the tiny decoder (hidden_size 64): mixer_config.hidden_size is 128; give "
     "RegressionSpec(hidden_size=128) or a mixer_config of hidden_size 64"),
    ({"mixer": wide_mixer}, f"mixer '{HERE}:wide_mixer' in the tiny decoder (hidden_size 64): its forward on "
                            "hidden_states [1, 16, 64] with one LayerLocalSeqlens raised RuntimeError: mat1 and mat2 "
                            "shapes cannot be multiplied (16x64 and 256x128)"),
    ({"mixer": tuple_mixer}, f"mixer '{HERE}:tuple_mixer' in the tiny decoder (hidden_size 64): its forward on "
                             "hidden_states [1, 16, 64] with one LayerLocalSeqlens returned tuple; the decoder adds it "
                             "to the residual stream: return a tensor [1, 16, 64]"),
    ({"mixer": not_a_module}, f"mixer '{HERE}:not_a_module' in the tiny decoder (hidden_size 64): building it as "
                              "factory(0) raised TypeError: factory(0) returned int, not an nn.Module"),
    ({"mixer": own_mixer, "mixer_config": CONFIG},
     f"mixer_config is handed to a mixer class as cls(mixer_config, layer_idx); the factory '{HERE}:own_mixer' "
     "builds its own config: leave mixer_config out"),
    ({"mixer_config": CONFIG}, "mixer_config is the config of a user's mixer class (mixer=...); with mixer=None the "
                               f"family's drop-in is built from its own, got mixer_config={CONFIG!r}"),
    ({"policy": lambda ctx, op, *args, **kwargs: None},
     f"policy '{HERE}:<lambda>' is a lambda or is defined inside a function: the rank processes load the policy by "
     "module and name (it is not pickled), so define it with def at module level, or give 'module:name' naming a "
     "module-level variable that holds it"),
    ({"policy": "torchtitan-instance"}, "policy must be a name, 'module:callable', 'path/to/file.py:callable' or a "
                                        "module-level function (the rank processes load it again by module and name), "
                                        "got torchtitan_selective"),
    ({"policy": f"{EXAMPLE}:nothing"}, f"policy '{EXAMPLE}:nothing': {EXAMPLE} has no callable 'nothing'"),
], ids=["transformers-config", "config-width", "factory-width", "tuple-output", "not-a-module", "config-and-factory",
        "config-alone", "lambda", "policy-instance", "no-such-policy"])
def test_a_mixer_or_policy_the_ranks_cannot_run_is_refused_before_any_rank_starts(change, message):
    from fla_ac_isolation.harness.regression import RegressionSpec
    from fla_ac_isolation.policies import torchtitan_selective

    if change.get("policy") == "torchtitan-instance":
        pytest.importorskip("torchtitan")
        change = {"policy": torchtitan_selective()}
    with pytest.raises(ValueError) as raised:
        RegressionSpec(hidden_size=64, device="cpu", **change).validate()
    assert str(raised.value) == message


def test_a_trainers_config_class_loaded_by_path_is_refused_and_a_closure_policy_named_by_its_variable(example):
    from fla_ac_isolation.harness.regression import RegressionSpec
    from fla_ac_isolation.policies import save_all_copies

    with pytest.raises(ValueError) as raised:
        RegressionSpec(mixer=MIXER, mixer_config=example.ModelConfig(hidden_size=64), hidden_size=64,
                       device="cpu").validate()
    assert str(raised.value) == (
        f"mixer_config is a ModelConfig of a file loaded by path ({SHOWN}:ModelConfig), which the rank processes "
        "cannot unpickle by module name: give a types.SimpleNamespace or dict of its fields, a class of an importable "
        "module, or a factory (layer_idx) -> nn.Module")
    with pytest.raises(ValueError, match=re.escape("policy 'fla_ac_isolation.policies:save_ops.<locals>.policy' is a "
                                                   "lambda or is defined inside a function")):
        RegressionSpec(policy=save_all_copies(), device="cpu").validate()


def test_regress_takes_a_policy_file_or_module_and_refuses_one_it_cannot_load(capsys):
    import argparse

    from fla_ac_isolation.harness.cli import regress

    parser = argparse.ArgumentParser()
    regress.add_arguments(parser)
    for given in (f"{EXAMPLE}:sac_policy", f"{HERE}:own_policy"):
        assert regress.spec_from_arguments(parser.parse_args(["--policy", given])).policy == given
    assert main(["regress", "--policy", "examples/nothing.py:sac_policy"]) == 2
    assert " ".join(capsys.readouterr().out.split()) == ("fla-ac-isolation regress: error: policy "
                                                         "'examples/nothing.py:sac_policy': no file examples/nothing.py")


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_runs_the_trainers_mixer_under_its_policy_isolated_matches_and_shared_fails(example):
    """EP=2 over gloo with torchtitan's MoE: the trainer's mixer (its class by path, its own config) under its
    policy (the function itself; the ranks load it from the file); then the factory under a module:callable
    policy that saves nothing, with which the shared path matches (under the default policy it fails as above):
    the ranks ran the policy given."""
    from fla_ac_isolation.harness.pytest_plugin import assert_regression_safe
    from fla_ac_isolation.harness.regression import RegressionSpec, run_regression, verdicts

    found = assert_regression_safe(MIXER, mixer_config=CONFIG, policy=example.sac_policy, hidden_size=64,
                                   device="cpu")
    texts = {mode: verdict.text for mode, verdict in found.items()}
    assert re.fullmatch(r"FAILED: rank [01]: RuntimeError: Autograd not support dtype: Int", texts.pop("shared"))
    assert texts == {"no-ac": "reference", "isolated": "matches (bit for bit)", "global-disable": "matches (bit for bit)"}

    result = run_regression(RegressionSpec(mixer=own_mixer, policy=f"{HERE}:recompute_all", hidden_size=64,
                                           modes=("shared", "isolated"), device="cpu"))
    assert {mode: v.text for mode, v in verdicts(result).items()} == {
        "no-ac": "reference", "shared": "matches (bit for bit)", "isolated": "matches (bit for bit)"}


# -------------------------------------------------------------------- docs/replace-global-disable.md
PAGE = ROOT / "docs" / "replace-global-disable.md"


@pytest.fixture
def my_trainer(example, monkeypatch):
    """The page's ``my_trainer.model``: the example's module under that name."""
    package = ModuleType("my_trainer")
    package.model = example
    monkeypatch.setitem(sys.modules, "my_trainer", package)
    monkeypatch.setitem(sys.modules, "my_trainer.model", example)


def _page_python(index: int) -> dict:
    namespace: dict = {}
    block = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)[index]
    exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def test_the_pages_plugin_tests_pass_the_fixed_model_and_catch_the_shipped_one(my_trainer):
    page = _page_python(0)
    page["test_the_fixed_model_is_ac_safe"]()
    page["test_the_shipped_model_is_caught"]()


def test_the_pages_regression_call_builds_the_mixer_from_a_config_that_fits(my_trainer, example):
    from fla_ac_isolation.harness.regression import RegressionSpec

    page, calls = _page_python(1), []
    page["assert_regression_safe"] = lambda mixer, **spec: calls.append((mixer, spec))
    page["test_the_mixer_under_ep2"]()
    [(mixer, spec)] = calls
    assert mixer == "my_trainer/model.py:GatedDeltaNet" and spec["policy"] is example.sac_policy
    validated = RegressionSpec(mixer=MIXER, device="cpu", **spec).validate()  # the page's keywords, on the example
    assert (validated.policy, validated.mixer_config.output_gate_type) == (f"{SHOWN}:sac_policy", "swish")
