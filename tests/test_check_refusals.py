"""What ``check`` refuses or fails, each condition pinned by its exact exit code and message.

* A batch whose only 1-D tensors are floats holds no packed offsets (offsets are integer): exit 2.
* A step that raises under AC (not without it) while every checkpointed region is aligned: exit 1, ``FAILED
  under AC`` (nothing diverged: no ``DIVERGENT`` and no fix of code that did not diverge), and a step with no
  checkpointed region at all is not aligned (exit 1: nothing passed, ``NOT JUDGED``).
* FLA's own refusal of the environment (its #640 guard: the gated backward on a Hopper GPU with Triton >= 3.4 and
  < 3.7.1, ``fla/ops/common/chunk_o.py``) is the environment's, not the model's: exit 3 naming what to install.
  On a CPU the guard is made active the way FLA computes it on an H200 with Triton 3.6 (its module flags), so
  FLA's own ``chunk_bwd_dqkwg`` raises its own text.
* A named policy whose module is missing (``torchtitan``, or its dependency ``tyro``): exit 2 naming the install.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import textwrap

import pytest
from helpers import run_without

from fla_ac_isolation.fla_seam.versions import fla_version
from fla_ac_isolation.harness.check import CheckResult, CheckSpec, CheckStep, RegionVerdict
from fla_ac_isolation.harness.cli import main
from fla_ac_isolation.harness.cli.check import render
from fla_ac_isolation.harness.fla_seam.hopper_guard import is_hopper_gdn_refusal

pytestmark = pytest.mark.usefixtures("single_thread")

NO_AC = "model(**batch) fails without activation checkpointing, so the model or the batch is wrong, not AC: "

MODELS = """
import torch
from torch import nn

import fla.ops.common.chunk_o as chunk_o

OFFSETS = torch.tensor([0, 2, 3])  # two packed documents of 2 and 1 tokens


class Layered(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj_in = nn.Linear(2, 2)
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.steps = 0

    def forward(self, x, cu_seqlens=None, **kwargs):
        h = self.proj_in(x)
        for layer in self.layers:
            h = layer(h)
        return h.square().mean()


class RaisesInItsSecondBackward(torch.autograd.Function):
    '''Identity; its backward raises on the model's second step (the one under AC), after every layer's
    recompute has run (it sits before the layers).'''

    @staticmethod
    def forward(ctx, h, step):
        ctx.step = step
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        if ctx.step == 2:
            raise RuntimeError("raised in the backward of step 2, outside every checkpointed region")
        return grad, None


class FailsUnderAC(Layered):
    def forward(self, x, cu_seqlens=None):
        self.steps += 1
        h = RaisesInItsSecondBackward.apply(self.proj_in(x), self.steps)
        for layer in self.layers:
            h = layer(h)
        return h.square().mean()


class GatedBackward(torch.autograd.Function):
    '''Identity whose backward calls FLA's gated chunk_bwd_dqkwg (as the gated delta rule's backward does): FLA's
    #640 guard runs first and, where active, raises before any kernel.'''

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        q = grad.new_zeros(1, 3, 1, 2)
        chunk_o.chunk_bwd_dqkwg(q, q, q, q, q, q, g=grad.new_zeros(1, 3, 1))
        return grad


class CallsFLAsGatedBackward(Layered):
    def forward(self, x, cu_seqlens=None):
        h = self.proj_in(x)
        for layer in self.layers:
            h = GatedBackward.apply(layer(h))
        return h.square().mean()


class RaisesFLAsTextItself(Layered):
    def forward(self, x, cu_seqlens=None):
        raise RuntimeError(chunk_o_text())


def chunk_o_text():
    import ast, inspect
    tree = ast.parse(inspect.getsource(chunk_o.chunk_bwd_dqkwg))
    return next(n.exc.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Raise))


def float_only():
    return Layered(), {"x": torch.randn(3, 2), "cu_seqlens": torch.tensor([0.0, 2.0, 3.0])}


def fails_under_ac():
    return FailsUnderAC(), {"x": torch.randn(3, 2), "cu_seqlens": OFFSETS}


def gated_backward():
    return CallsFLAsGatedBackward(), {"x": torch.randn(3, 2), "cu_seqlens": OFFSETS}


def flas_text_from_the_model():
    return RaisesFLAsTextItself(), {"x": torch.randn(3, 2), "cu_seqlens": OFFSETS}
"""


def _flas_refusal_text() -> str:
    """FLA's #640 message, read from the installed ``fla/ops/common/chunk_o.py`` (its one ``raise``)."""
    import fla.ops.common.chunk_o as chunk_o

    tree = ast.parse(textwrap.dedent(inspect.getsource(chunk_o.chunk_bwd_dqkwg)))
    (text,) = [n.exc.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    return text


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "refused_models.py"
    path.write_text(MODELS)
    return lambda name: f"{path}:{name}"


@pytest.fixture
def hopper_with_triton_3_6(monkeypatch):
    """FLA's module flags as it computes them on an H200 with Triton 3.6: its #640 guard is active."""
    import fla.ops.common.chunk_o as chunk_o

    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------ the batch
def test_a_batch_whose_only_1d_tensors_are_floats_has_no_packed_offsets_exit_2(capsys, target):
    code, out, err = _check(capsys, "--model", target("float_only"))

    assert (code, out) == (2, "")
    assert err.splitlines()[0] == (
        "fla-ac-isolation check: error: the batch carries no packed offsets (no 1-D integer tensor, "
        "PackedSeqlens or restarting position_ids among model(**batch)'s keywords: x, cu_seqlens), so nothing can "
        "be checked: give one packed batch with its offsets under the keyword the model reads: cu_seq_lens_q (transformers), attention_masks (torchtitan), "
        "cu_doc_lens (OLMo-core), cu_seqlens (flash-linear-attention's models)")


# ------------------------------------------------------------------------------------------- the step
def test_a_step_that_raises_under_ac_with_every_region_aligned_fails_exit_1(capsys, target):
    code, out, _ = _check(capsys, "--model", target("fails_under_ac"))

    lines = out.splitlines()
    assert code == 1
    start = lines.index("as given: 2 of 2 checkpointed region(s) aligned")
    assert lines[start:start + 4] == [
        "as given: 2 of 2 checkpointed region(s) aligned",
        "  layers.0  aligned",
        "  layers.1  aligned",
        "  the step failed: RuntimeError: raised in the backward of step 2, outside every checkpointed region",
    ]
    assert "Fix:" not in lines and lines[-1] == "verdict: FAILED under AC (exit 1)"


def test_a_step_with_no_checkpointed_region_is_not_aligned_exit_1():
    """Constructed (the runner's own refusal of a step the audit judged nothing in comes before this): the step's
    verdict itself never passes without a region."""
    step = CheckStep(regions=())
    aligned = CheckStep(regions=(RegionVerdict("layers.0", "aligned"),))
    result = CheckResult(CheckSpec(config="qwen3_next", device="cpu"), "Model", [], step)

    assert (step.aligned, aligned.aligned, result.exit_code) == (False, True, 1)
    assert render(result).splitlines()[-3:] == [
        "as given: 0 of 0 checkpointed region(s) aligned", "", "verdict: NOT JUDGED (exit 1)"]


# ---------------------------------------------------------------------------- FLA refuses the environment
BYPASSING = """
import torch
from torch import nn
from fla.layers import GatedDeltaNet


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = GatedDeltaNet(hidden_size=64, num_heads=4, head_dim=16, expand_v=1, mode="chunk")

    def forward(self, x, cu_seqlens):
        return x + self.mixer(x, cu_seqlens=cu_seqlens)[0]


class Bypassing(nn.Module):
    \"\"\"Holds its layers in a layer list, but its forward calls each layer's mixer, never the layer.\"\"\"

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x, cu_seqlens):
        for layer in self.layers:
            x = x + layer.mixer(x, cu_seqlens=cu_seqlens)[0]
        return x.square().mean()


def bypassing():
    torch.manual_seed(0)
    return Bypassing(), {"x": torch.randn(1, 134, 64), "cu_seqlens": torch.tensor([0, 70, 93, 134], dtype=torch.int32)}
"""


def test_a_forward_that_runs_no_checkpointed_region_is_refused_as_such_exit_2(capsys, tmp_path):
    """The layers are checkpointed, but the forward never calls them (it calls their mixers): no region ran.
    FLA did receive the offsets (outside any region), so "no packed offsets reached FLA" would be false advice."""
    path = tmp_path / "bypassing.py"
    path.write_text(BYPASSING)
    code, out, err = _check(capsys, "--model", f"{path}:bypassing")
    assert (code, out) == (2, "")
    assert err == ("fla-ac-isolation check: error: no checkpointed region ran: nothing was recomputed, so nothing "
                   "was judged: the model's forward must call the layers of its layer list\n")


def _environment_error(text: str) -> str:
    return (
        f"fla-ac-isolation check: error: FLA refuses this environment, not the model: FLA {fla_version()} refuses "
        f"the gated backward (chunk_bwd_dqkwg: gated delta rule, simple GLA) on a Hopper GPU with Triton "
        f"{importlib.metadata.version('triton')} (Triton >= 3.4.0 and < 3.7.1 miscompile it, FLA issue #640); "
        f"install triton >= 3.7.1 (pip install 'triton>=3.7.1'), or tilelang (pip install tilelang), then run "
        f"check again; FLA's error: RuntimeError: {text}")


def test_flas_hopper_refusal_without_ac_is_named_as_the_environment_exit_3(capsys, target, hopper_with_triton_3_6):
    text = _flas_refusal_text()
    assert "(see #640)" in text and text.startswith("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs")  # FLA 0.5.2, 0.6

    code, out, err = _check(capsys, "--model", target("gated_backward"))
    assert (code, out) == (3, "")
    assert err == _environment_error(text) + "\n"

    code, out, err = _check(capsys, "--model", target("gated_backward"), "--json")
    assert code == 3 and json.loads(out) == {"error": _environment_error(text).split("error: ", 1)[1], "exit_code": 3}


def test_the_same_text_raised_by_the_model_itself_is_the_models_exit_2(capsys, target, hopper_with_triton_3_6):
    """The guard is active, but FLA did not raise it: the model's own error, reported as before."""
    code, out, err = _check(capsys, "--model", target("flas_text_from_the_model"))

    assert (code, out) == (2, "")
    assert err == f"fla-ac-isolation check: error: {NO_AC}RuntimeError: {_flas_refusal_text()}\n"


def test_the_refusal_is_recognised_only_where_the_guard_is_active_and_only_from_flas_module(hopper_with_triton_3_6,
                                                                                              monkeypatch):
    import fla.ops.common.chunk_o as chunk_o
    import torch

    q = torch.zeros(1, 3, 1, 2)
    with pytest.raises(RuntimeError) as raised:
        chunk_o.chunk_bwd_dqkwg(q, q, q, q, q, q, g=torch.zeros(1, 3, 1))
    refusal = raised.value
    text = _flas_refusal_text()
    assert str(refusal) == text

    assert is_hopper_gdn_refusal(refusal)
    assert not is_hopper_gdn_refusal(RuntimeError(text))  # no traceback into FLA's module
    try:
        raise RuntimeError(text)
    except RuntimeError as here:
        assert not is_hopper_gdn_refusal(here)  # raised here, not in fla/ops/common/chunk_o.py
    assert not is_hopper_gdn_refusal(ValueError(text).with_traceback(refusal.__traceback__))  # FLA raises RuntimeError
    assert not is_hopper_gdn_refusal(RuntimeError("other").with_traceback(refusal.__traceback__))
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", True)  # Triton >= 3.7.1: the guard is off
    assert not is_hopper_gdn_refusal(refusal)


# ------------------------------------------------------------------------------------ the environment
@pytest.mark.parametrize(("absent", "install"), [("torchtitan", "pip install 'fla-ac-isolation[ep]'"),
                                                 ("tyro", "pip install tyro")])
def test_a_named_policy_whose_module_is_missing_is_refused_exit_2_naming_the_install(tmp_path, absent, install):
    """``--policy torchtitan`` needs torchtitan, and torchtitan's activation checkpointing needs ``tyro``: without
    either, nothing can be judged (exit 2, before the model loads), where a traceback ended the command."""
    if absent == "tyro":
        pytest.importorskip("torchtitan")
    argv = ["-m", "fla_ac_isolation.harness.cli", "check", "--model", "examples/check_model.py:qwen3_next",
            "--policy", "torchtitan"]
    proc = run_without((absent,), argv, tmp_path)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-3000:]
    assert proc.stderr == (f"fla-ac-isolation check: error: policy 'torchtitan' cannot be built here: "
                           f"ModuleNotFoundError: No module named '{absent}' ({install})\n")
