"""Scripts and subprocesses: examples loaded by path (they are not a package), interpreter cases in a fresh
process (``TRITON_INTERPRET=1`` must be set before FLA's kernels are decorated), commands run as if a module were
not installed."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: Path, name: str):
    """A script of ``examples/`` or ``benchmarks/`` (not packages) loaded from ``path`` as module ``name``.

    Registered in ``sys.modules`` before it runs: dataclasses look their module up while a class is created.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_ABSENT = """import sys

class _Absent:  # a finder before Python's own: the modules below import as if they were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""


def run_without(modules: tuple[str, ...], argv: list[str], folder: Path, timeout_s: float = 240):
    """Run ``python -W ignore *argv`` from the repository root as if ``modules`` were not installed: a
    ``sitecustomize.py`` written to ``folder`` (first on ``PYTHONPATH``, so processes the command spawns load it
    too) puts a finder first that raises Python's own ``ModuleNotFoundError("No module named 'x'")`` for them.
    Returns the ``subprocess.CompletedProcess`` (text)."""
    (folder / "sitecustomize.py").write_text(_ABSENT.format(names=set(modules)))
    env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-W", "ignore", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=ROOT)


def run_interpreter_cases(script: str, timeout_s: float) -> dict:
    """Run ``tests/<script>`` in a subprocess under ``TRITON_INTERPRET=1`` and one OpenMP thread; its JSON.

    The variable must be set before FLA's kernels are decorated, i.e. before this test session imported
    FLA, hence the subprocess. The script prints one JSON document as its last line of stdout.
    """
    path = ROOT / "tests" / script
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=timeout_s,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
