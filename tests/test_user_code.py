"""A user's file named by ``check`` runs once per process (issue 37 item 1), whatever mix of ``file.py:fn`` and
``module:fn`` names its model and its policy: run twice, the second module replaced the first in ``sys.modules``,
and the model's own module (the first) escaped ``reference_kernels()``: its step ``FAILED under AC`` with FLA's
``causal_conv1d`` called on CPU tensors outside the serving. The model here binds ``causal_conv1d`` at import, so
only its own module's name can be served. Each run of the file appends its process id to ``<file>.runs``."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from fla_ac_isolation.harness.cli import main
from fla_ac_isolation.harness.user_code import (
    FILE_MODULE_PREFIX,
    callable_target,
    importable,
    load_callable,
    load_module,
)

pytestmark = pytest.mark.usefixtures("single_thread")

MODEL = textwrap.dedent('''
    import os
    import pathlib

    import torch
    from fla.modules.conv import causal_conv1d
    from torch import nn
    from torch.utils.checkpoint import CheckpointPolicy

    from fla_ac_isolation import LayerLocalSeqlens

    with open(pathlib.Path(__file__).with_suffix(".runs"), "a") as runs:
        runs.write(f"{os.getpid()}\\n")

    SAVE = {torch.ops.aten._to_copy.default, torch.ops.aten.mm.default}


    def my_policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE


    class Conv(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.proj = nn.Linear(d, d)
            self.weight = nn.Parameter(torch.randn(d, 4) / 4)

        def forward(self, x, seqlens):
            local = seqlens.local()
            y, _ = causal_conv1d(self.proj(x), self.weight, activation="silu", cu_seqlens=local.cu_seqlens)
            return x + y


    class Model(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.layers = nn.ModuleList(Conv(d) for _ in range(2))

        def forward(self, x, cu_seqlens):
            seqlens = LayerLocalSeqlens(cu_seqlens, num_tokens=x.shape[1])
            for layer in self.layers:
                x = layer(x, seqlens)
            return x.pow(2).mean()


    def build():
        torch.manual_seed(0)
        return Model(), {"x": torch.randn(1, 40, 16), "cu_seqlens": torch.tensor([0, 15, 40], dtype=torch.int32)}
''')


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """``tmp_path`` as the working directory; the modules loaded in the test are forgotten after it."""
    monkeypatch.chdir(tmp_path)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _write(folder, stem: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.py").write_text(MODEL)


def _runs(folder, stem: str) -> list[str]:
    path = folder / f"{stem}.runs"
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize(("model", "policy"), [
    ("{stem}.py:build", "{stem}.py:my_policy"),
    ("{stem}:build", "./{stem}.py:my_policy"),
    ("{dir}/{stem}.py:build", "{stem}:my_policy"),
    ("{stem}:build", "{stem}:my_policy"),
], ids=["file-file", "module-file", "file-module", "module-module"])
def test_check_runs_a_file_naming_model_and_policy_once_and_serves_its_fla_calls(user_dir, capsys, request, model,
                                                                                  policy):
    stem = "served_" + request.node.callspec.id.replace("-", "_")  # a module name per case
    _write(user_dir, stem)
    names = {"stem": stem, "dir": user_dir}
    code = main(["check", "--model", model.format(**names), "--policy", policy.format(**names)])
    lines = capsys.readouterr().out.splitlines()

    assert (code, lines[-1]) == (0, "verdict: OK (exit 0)")
    assert lines[lines.index("as given: 2 of 2 checkpointed region(s) aligned") + 1:][:2] == [
        "  layers.0  aligned", "  layers.1  aligned"]
    assert _runs(user_dir, stem) == [str(os.getpid())]  # once, in this process


def test_a_file_by_path_and_by_module_name_is_one_module_in_either_order(user_dir):
    _write(user_dir, "first_path")
    _write(user_dir, "first_name")
    by_path = load_module("first_path.py")
    assert load_module("first_path") is by_path is sys.modules["first_path"]
    assert by_path.__name__ == f"{FILE_MODULE_PREFIX}first_path"
    by_name = load_module("first_name")
    assert load_module(str(user_dir / "first_name.py")) is by_name and by_name.__name__ == "first_name"
    assert load_callable("first_name.py:build", "model") is load_callable("first_name:build", "model")
    assert _runs(user_dir, "first_path") == _runs(user_dir, "first_name") == [str(os.getpid())]


def test_two_files_of_one_stem_are_two_modules_and_a_failed_run_is_not_kept(user_dir):
    _write(user_dir / "a", "model")
    _write(user_dir / "b", "model")
    a, b = load_module("a/model.py"), load_module("b/model.py")
    assert a is not b and (a.__name__, b.__name__) == (f"{FILE_MODULE_PREFIX}model", f"{FILE_MODULE_PREFIX}model_2")
    assert load_module("a/model.py") is a and load_module(str(user_dir / "b" / "model.py")) is b

    (user_dir / "broken.py").write_text("raise RuntimeError('half run')\n")
    for _ in range(2):
        with pytest.raises(ValueError) as raised:
            load_callable("broken.py:build", "model")
        assert str(raised.value) == "model 'broken.py:build': importing broken.py failed: RuntimeError: half run"
    assert not [name for name in sys.modules if name.startswith(f"{FILE_MODULE_PREFIX}broken")]


def test_callable_target_names_a_file_loaded_by_path_by_its_path_and_a_module_by_its_name(user_dir):
    """A rank process loads what the target names: a module by a name it cannot import again (a file loaded by
    path, by us or by ``spec_from_file_location`` under a name of the user's) is named by its file."""
    import importlib.util
    import types

    from fla_ac_isolation.policies import save_all_copies

    _write(user_dir / "sub", "named")
    policy = load_callable("sub/named.py:my_policy", "policy")
    assert callable_target(policy) == "sub/named.py:my_policy"
    assert load_callable(callable_target(policy), "policy") is policy

    _write(user_dir / "sub", "own_name")
    spec = importlib.util.spec_from_file_location("users_private_name", user_dir / "sub" / "own_name.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert (importable("users_private_name"), callable_target(module.build)) == (False, "sub/own_name.py:build")
    assert load_callable("sub/own_name.py:build", "model") is module.build  # that module, not a second run
    assert _runs(user_dir / "sub", "own_name") == [str(os.getpid())]

    _write(user_dir, "plain")
    assert load_module("plain") is sys.modules["plain"] and importable("plain")
    assert callable_target(load_callable("plain:build", "model")) == "plain:build"
    assert callable_target(main) == "fla_ac_isolation.harness.cli:main"
    assert callable_target(save_all_copies()) == "fla_ac_isolation.policies:save_ops.<locals>.policy"
    assert importable("torch._C") and importable("types") and callable_target(types.SimpleNamespace) == (
        "types:SimpleNamespace")
