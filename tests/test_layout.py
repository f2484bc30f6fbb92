"""The layout holds: FLA is touched in one seam, library code never imports test support, the core install
(torch + fla-core) is enough for the isolation, the policies, the audit, the ops and the mixers.

The core-install check runs in a fresh interpreter in which every optional distribution (transformers,
torchtitan, spmd_types, rich, matplotlib, mkdocs) is made unimportable by a meta-path finder, the
equivalent of a venv holding only the core requirements (their own dependencies, e.g. numpy, may remain).
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fla_ac_isolation"
EXTRA_MODULES = ("transformers", "torchtitan", "spmd_types", "rich", "matplotlib", "mkdocs")


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import statement of ``path`` (``from x import y`` gives ``x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def _library_modules():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "testing" not in p.relative_to(PACKAGE).parts]


def test_only_the_fla_seam_imports_fla():
    outside = [
        f"{p.relative_to(ROOT)}:{line} imports {name}"
        for p in _library_modules()
        if "fla_seam" not in p.relative_to(PACKAGE).parts
        for line, name in _imports(p)
        if name == "fla" or name.startswith("fla.")
    ]
    assert outside == []


def test_library_code_never_imports_test_support():
    offenders = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _library_modules()
        for line, name in _imports(p)
        if name.startswith("fla_ac_isolation.testing")
    ]
    assert offenders == []


def test_tests_import_shared_helpers_from_helpers_only():
    offenders = [
        f"{p.name}:{line} imports {name}"
        for p in sorted((ROOT / "tests").glob("*.py"))
        for line, name in _imports(p)
        if name == "conftest" or name.startswith("test_")
    ]
    assert offenders == []


def test_core_dependencies_are_torch_fla_core_and_triton_for_fla():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [dep.split(">")[0].split("=")[0].split(";")[0].strip() for dep in project["dependencies"]]
    assert names == ["torch", "fla-core", "triton"]
    assert "fla-core>=0.6,<0.7" in project["dependencies"]
    assert any(dep.startswith("triton") and "sys_platform == 'linux'" in dep for dep in project["dependencies"])
    extras = project["optional-dependencies"]
    assert {dep.split(">")[0] for dep in extras["cli"]} == {"rich", "matplotlib"}
    assert {dep.split(">")[0] for dep in extras["ep"]} == {"torchtitan", "spmd_types", "transformers"}


_CORE_SCRIPT = r"""
import importlib.abc, json, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
import warnings
warnings.filterwarnings("ignore")
import torch
import fla_ac_isolation
from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit
import fla_ac_isolation.audit, fla_ac_isolation.cli, fla_ac_isolation.fla_seam.kernels, fla_ac_isolation.mixers
import fla_ac_isolation.modes, fla_ac_isolation.ops, fla_ac_isolation.policies, fla_ac_isolation.swap
import fla_ac_isolation.isolate
light = "fla" not in sys.modules  # nothing above imports FLA itself

from fla_ac_isolation.fault_stack import run_stack
from fla_ac_isolation.policies import save_all_copies
out = {"light": light}
for mode in ("shared", "isolated"):
    with ReplayAudit(on_divergence="record") as audit:
        result = run_stack(mode, save_all_copies())
    out[mode] = [audit.ok, result.error]

local = LayerLocalSeqlens.from_seq_lens([5, 0, 9]).local()
out["offsets"] = local.cu_seqlens.tolist()

from fla_ac_isolation.cli import main
out["doctor"] = main(["doctor"])
print(json.dumps(out))
"""


def test_core_install_runs_layer_local_seqlens_and_replay_audit_without_any_extra(tmp_path, capfd):
    proc = subprocess.run(
        [sys.executable, "-c", _CORE_SCRIPT, ",".join(EXTRA_MODULES)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["light"] is True
    assert out["shared"][0] is False and out["shared"][1].startswith("RuntimeError: The size of tensor a")
    assert out["isolated"] == [True, None]
    assert out["offsets"] == [0, 5, 5, 14]
    assert out["doctor"] == 2
    assert "fla-ac-isolation doctor: error: fla-ac-isolation doctor needs rich, which is not installed: " \
           "pip install 'fla-ac-isolation[cli]'" in proc.stderr


@pytest.mark.parametrize("argv", [["regress", "--steps", "1"], ["audit", "--model", "qwen3_5_moe"]])
def test_commands_name_the_extra_they_need(argv):
    script = _CORE_SCRIPT.split("import torch\n")[0] + (
        "from fla_ac_isolation.cli import main\n"
        f"raise SystemExit(main({argv!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, "torchtitan"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "needs torchtitan, which is not installed: pip install 'fla-ac-isolation[ep]'" in proc.stderr
