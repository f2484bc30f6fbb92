"""Scripts and subprocesses: examples loaded by path (they are not a package), interpreter cases in a fresh
process (``TRITON_INTERPRET=1`` must be set before FLA's kernels are decorated)."""

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
