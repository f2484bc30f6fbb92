"""The layout holds: FLA is touched in one seam (the library's ``fla_seam/`` and the harness's
``harness/fla_seam/``), the library (every module outside ``harness/``) never imports the harness, nothing
imports test support but the harness's tests, the core install (torch + fla-core) is enough for the isolation,
the policies, the audit, the ops and the mixers.

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
    """Every module but test support (``harness/testing/``), which may patch FLA (that is its job)."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[:2] != ("harness", "testing")]


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
        if name.startswith(("fla_ac_isolation.harness.testing", "fla_ac_isolation.testing"))
    ]
    assert offenders == []


# ------------------------------------------------------------------------------------------ import graph
# The runtime import graph of the library, read from the AST of every module: import statements at module
# level and inside functions (a lazy import still runs, and a lazy circle is still a circle), never those under
# `if TYPE_CHECKING:`. An import of `pkg.sub.mod` also runs `pkg/sub/__init__.py`, so it counts as an import of
# every package above the target that does not hold the importer; `importlib.import_module("<literal>")`
# counts as an import of the literal (a lazy import by name).



def _module_names(package: pathlib.Path) -> dict[str, pathlib.Path]:
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


class _ImportTargets(ast.NodeVisitor):
    """The dotted names a module imports at run time (``from x import y`` gives ``x.y``; relative ones resolved)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module.split(".") if is_package else module.split(".")[:-1]
        self.targets: list[tuple[int, str]] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.targets += [(node.lineno, alias.name) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parent = self.package[: len(self.package) - node.level + 1]
            base = ".".join(parent + ([node.module] if node.module else []))
        self.targets += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]

    def visit_Call(self, node: ast.Call) -> None:
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        first = node.args[0] if node.args else None
        if name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str):
            self.targets.append((node.lineno, first.value))
        self.generic_visit(node)


def _import_graph(package: pathlib.Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module or package __init__: first line}}`` inside ``package``."""
    modules = _module_names(package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        visitor = _ImportTargets(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text()))
        edges = graph.setdefault(module, {})
        for line, target in visitor.targets:
            while target and target not in modules:  # `from pkg.mod import name` -> pkg.mod
                target = target.rpartition(".")[0]
            parts = target.split(".")
            for depth in range(2, len(parts) + 1):  # the target and the package __init__s its import runs
                runs = ".".join(parts[:depth])
                if runs in modules and runs != module and not module.startswith(runs + "."):
                    edges.setdefault(runs, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _test_support_mentions(package: pathlib.Path) -> list[str]:
    """``path:line`` of every mention of the test-support package outside it: its name (or its 0.3 name, a
    deprecated alias) in any text (strings, docstrings, comments) or an import that resolves into it
    (``from . import testing``)."""
    support = f"{package.name}.harness.testing"
    names = (support, f"{package.name}.testing")
    graph = _import_graph(package)
    found = []
    for module, path in _module_names(package).items():
        if module == support or module.startswith(support + "."):
            continue
        where = path.relative_to(package.parent)
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if any(name in text or name.replace(".", "/") in text for name in names):
                found.append(f"{where}:{number}")
        found += [f"{where}:{line}" for target, line in graph[module].items()
                  if target == support or target.startswith(support + ".")]
    return sorted(set(found), key=lambda s: (s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1])))


def test_the_library_has_no_import_cycle():
    cycles = _cycles(_import_graph(PACKAGE))
    assert cycles == []


def test_library_code_never_names_test_support():
    offenders = _test_support_mentions(PACKAGE)
    assert offenders == []


def test_the_import_graph_sees_lazy_cycles_package_inits_and_every_mention(tmp_path):
    """The two checks above on a planted package: they must see what they claim to see."""
    pkg = tmp_path / "fla_ac_isolation"
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fla_ac_isolation import b\n",
        "b.py": "def f():\n    from fla_ac_isolation.a import x\n",  # no cycle: a imports b for typing only
        "c.py": "def f():\n    from fla_ac_isolation.sub.d import y\n",  # runs sub/__init__.py, which imports c
        "sub/__init__.py": "from fla_ac_isolation import c\n",
        "sub/d.py": "",
        "e.py": "import importlib\ndef f():\n    return importlib.import_module('fla_ac_isolation.g')\n",
        "g.py": "from . import e\n",
        "h.py": '"""Run the shims of fla_ac_isolation.harness.testing.cp_shims."""\n',
        "i.py": "from .harness import testing\n",
        "j.py": "# the 0.3 path: fla_ac_isolation/testing/gpu.py\n",
        "harness/__init__.py": "",
        "harness/testing/__init__.py": "import fla_ac_isolation.h\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert _cycles(_import_graph(pkg)) == [
        ["fla_ac_isolation.c", "fla_ac_isolation.sub"], ["fla_ac_isolation.e", "fla_ac_isolation.g"],
    ]
    assert _test_support_mentions(pkg) == ["fla_ac_isolation/h.py:1", "fla_ac_isolation/i.py:1",
                                           "fla_ac_isolation/j.py:1"]


# ------------------------------------------------------------------------------------------ library vs harness
# The library is every module outside `harness/`; it never imports the harness, by any import the graph above
# sees (module level, inside functions, relative, `import_module("<literal>")`). `_moved.py` maps 0.3 paths to
# harness paths by table (package-relative strings, imported by a variable only when an old path is imported):
# the runtime check in the core-install script below shows the library loads no harness module.


def _harness_imports(package: pathlib.Path) -> list[str]:
    """``module:line -> target`` of every import from a module outside ``harness/`` into it."""
    harness = f"{package.name}.harness"
    inside = lambda name: name == harness or name.startswith(harness + ".")  # noqa: E731
    return sorted(
        f"{module}:{line} -> {target}"
        for module, edges in _import_graph(package).items() if not inside(module)
        for target, line in edges.items() if inside(target)
    )


def test_the_library_never_imports_the_harness():
    assert _harness_imports(PACKAGE) == []


CORE = ("fla_ac_isolation.seqlens", "fla_ac_isolation.local_seqlens", "fla_ac_isolation.offsets")


def _reached(graph: dict[str, dict[str, int]], start: tuple[str, ...]) -> set[str]:
    """Every module ``start`` imports, directly or through others (function-local imports counted)."""
    seen, todo = set(), list(start)
    while todo:
        for target in graph.get(todo.pop(), {}):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_core_imports_neither_parallel_nor_the_graphs_part():
    """CP (``parallel/``) and CUDA graphs (``graphs.py``) are siblings above the core, never arguments of it."""
    reached = _reached(_import_graph(PACKAGE), CORE)
    above = sorted(m for m in reached if m.startswith("fla_ac_isolation.parallel") or m == "fla_ac_isolation.graphs")
    assert above == []
    assert "fla_ac_isolation.fla_seam.layout" in reached, "the walk follows the core's real imports"


CAPABILITIES = ("fla_ac_isolation.parallel", "fla_ac_isolation.graphs", "fla_ac_isolation.audit",
                "fla_ac_isolation.mixers", "fla_ac_isolation.ops", "fla_ac_isolation.saveable_op",
                "fla_ac_isolation.fla_seam.saveable_kernels", "fla_ac_isolation.fla_seam.kda", "fla_ac_isolation.swap")


def test_importing_the_core_loads_no_capability():
    """``LayerLocalSeqlens``, ``isolate_seqlens`` and the SAC policies load none of the optional parts (CP and PP,
    CUDA graphs, the audit, the drop-ins and KDA, the ops and their saveable operators): those load on first use
    (``save_fla_ops()`` imports the operators it saves). Run in a fresh interpreter, as a user's import is."""
    script = ("import sys, json\nfrom fla_ac_isolation import LayerLocalSeqlens, isolate_seqlens\n"
              "import fla_ac_isolation.policies\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fla_ac_isolation'))))\n"
              "fla_ac_isolation.policies.save_fla_ops()\n"
              "print(json.dumps('fla_ac_isolation.ops' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()[-2:]
    loaded = json.loads(first)
    assert "fla_ac_isolation.isolate" in loaded and "fla_ac_isolation.seqlens" in loaded
    assert [m for m in loaded if m.startswith(CAPABILITIES)] == []
    assert json.loads(second) is True, "the control: the policy that saves the operators loads them"


def test_the_harness_check_sees_every_kind_of_import(tmp_path):
    """The check above on a planted package: each kind of import into the harness is caught, none else."""
    pkg = tmp_path / "fla_ac_isolation"
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from fla_ac_isolation.harness.modes import MODES\n",  # function-local
        "b.py": "import importlib\nimportlib.import_module('fla_ac_isolation.harness')\n",  # by string literal
        "c.py": "from .harness import modes\n",  # relative
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fla_ac_isolation.harness.modes\n",
        "e.py": "import fla_ac_isolation.harness.fla_seam.serving as s\n",  # runs harness/__init__ too
        "f.py": '"""Not an import: fla_ac_isolation.harness.modes."""\nfrom fla_ac_isolation import a\n',
        "harness/__init__.py": "",
        "harness/modes.py": "from fla_ac_isolation import a\n",  # the harness imports the library: fine
        "harness/fla_seam/__init__.py": "",
        "harness/fla_seam/serving.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert _harness_imports(pkg) == [
        "fla_ac_isolation.a:2 -> fla_ac_isolation.harness",
        "fla_ac_isolation.a:2 -> fla_ac_isolation.harness.modes",
        "fla_ac_isolation.b:2 -> fla_ac_isolation.harness",
        "fla_ac_isolation.c:1 -> fla_ac_isolation.harness",
        "fla_ac_isolation.c:1 -> fla_ac_isolation.harness.modes",
        "fla_ac_isolation.e:1 -> fla_ac_isolation.harness",
        "fla_ac_isolation.e:1 -> fla_ac_isolation.harness.fla_seam",
        "fla_ac_isolation.e:1 -> fla_ac_isolation.harness.fla_seam.serving",
    ]


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
    assert "fla-core>=0.5.2,<0.7" in project["dependencies"]  # 0.5.2 and 0.6 (fla_seam/features.py)
    assert any(dep.startswith("triton") and "sys_platform == 'linux'" in dep for dep in project["dependencies"])
    extras = project["optional-dependencies"]
    assert {dep.split(">")[0] for dep in extras["cli"]} == {"rich", "matplotlib"}
    assert {dep.split(">")[0] for dep in extras["ep"]} == {"torchtitan", "spmd_types", "transformers"}
    # FLA 0.5.2 does not import with triton >= 3.9 (measured: 3.9.0 fails, 3.8.0 / 3.7.1 / 3.6.0 import)
    assert extras["fla052"] == ["fla-core==0.5.2", "triton>=3.6,<3.9; sys_platform == 'linux'"]


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
import importlib, pathlib
import fla_ac_isolation
from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit
root = pathlib.Path(fla_ac_isolation.__file__).parent
library = sorted(".".join(("fla_ac_isolation", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
                 for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "harness")
for name in library:  # every library module, without any extra
    importlib.import_module(name)
harness_loaded = sorted(m for m in sys.modules if m.startswith("fla_ac_isolation.harness"))
import fla_ac_isolation.harness.cli, fla_ac_isolation.harness.modes
light = "fla" not in sys.modules  # nothing above imports FLA itself

from fla_ac_isolation.harness.fault_stack import run_stack
from fla_ac_isolation.policies import save_all_copies
out = {"light": light, "library": len(library), "harness_loaded": harness_loaded}
for mode in ("shared", "isolated"):
    with ReplayAudit(on_divergence="record") as audit:
        result = run_stack(mode, save_all_copies())
    out[mode] = [audit.ok, result.error]

local = LayerLocalSeqlens.from_seq_lens([5, 0, 9]).local()
out["offsets"] = local.cu_seqlens.tolist()

from fla_ac_isolation.harness.cli import main
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
    assert out["library"] > 50 and out["harness_loaded"] == []  # the library alone loads no harness module
    assert out["shared"][0] is False and out["shared"][1].startswith("RuntimeError: The size of tensor a")
    assert out["isolated"] == [True, None]
    assert out["offsets"] == [0, 5, 5, 14]
    assert out["doctor"] == 2
    assert "fla-ac-isolation doctor: error: fla-ac-isolation doctor needs rich, which is not installed: " \
           "pip install 'fla-ac-isolation[cli]'" in proc.stderr


@pytest.mark.parametrize("argv", [["regress", "--steps", "1"], ["audit", "--model", "qwen3_5_moe"]])
def test_commands_name_the_extra_they_need(argv):
    script = _CORE_SCRIPT.split("import torch\n")[0] + (
        "from fla_ac_isolation.harness.cli import main\n"
        f"raise SystemExit(main({argv!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, "torchtitan"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "needs torchtitan, which is not installed: pip install 'fla-ac-isolation[ep]'" in proc.stderr


def test_each_operation_has_one_entry_point_and_one_reference_in_the_library():
    """``def <operation>`` at module level in the library (``harness/`` aside): the entry point in ``ops`` (which holds
    the FLA path) and the pure-torch reference, nothing else (no per-backend or per-saveable copy)."""
    operations = ("causal_conv1d", "chunk_gated_delta_rule", "ssd", "chunk_kda")
    found: dict[str, list[str]] = {name: [] for name in operations}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "harness":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in found:
                found[node.name].append(str(path.relative_to(PACKAGE)))
    reference = {"chunk_kda": "ops/reference_kda.py"}
    assert found == {name: sorted(["ops/__init__.py", reference.get(name, "ops/reference.py")])
                     for name in operations}
