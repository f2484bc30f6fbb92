""".ci/stack-tests, the list of test files CI runs on each other stack: every listed file exists and every stack is
one that .ci/run sets up. A missing file makes the stack's pytest stop before running anything (CI red)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rows() -> list[tuple[str, list[str]]]:
    rows = []
    for line in (ROOT / ".ci" / "stack-tests").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, *stacks = line.split()
            rows.append((path, stacks))
    return rows


def test_every_listed_file_exists_and_runs_on_a_stack_ci_sets_up():
    stacks_run = set(re.search(r"for stack in ([\w ]+); do", (ROOT / ".ci" / "run").read_text()).group(1).split())
    rows = _rows()
    assert stacks_run == {"latest", "fla052"} and len(rows) >= 25
    assert [path for path, _ in rows if not (ROOT / path).is_file()] == []
    assert [(path, stacks) for path, stacks in rows if not stacks or not set(stacks) <= stacks_run] == []
