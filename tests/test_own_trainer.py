"""``examples/own_trainer.py`` (issue 37): a prime-rl-style trainer's own model (its Gated DeltaNet calling FLA's
ops, its MoE, its SAC policy saving every ``_to_copy`` and ``mm`` through torch's ``checkpoint_wrapper``, one
``cu_seqlens`` for every layer) on a CPU inside ``reference_kernels()``: the fixed model (``LayerLocalSeqlens``)
and the global disable equal no AC bit for bit; the shipped model fails; ``check`` says the same of both, the
model and the policy named by one file loaded once."""

from __future__ import annotations

import pytest
import torch
from helpers import INT_MEAN_MESSAGE, ROOT, int_mean_error, load_script

from fla_ac_isolation.harness.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

EXAMPLE = "examples/own_trainer.py"
#: the shipped model's recompute of layer 0 hits FLA's cache where its forward missed, and SAC hands the MoE's
#: load statistic (a saved _to_copy) FLA's int32 offsets instead (FLA 0.6; the class is torch's, by version)
SHARED_ERROR = f"{int_mean_error().__name__}: {INT_MEAN_MESSAGE}"


@pytest.fixture(scope="module")
def example():
    return load_script(ROOT / EXAMPLE, "example_own_trainer")


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
