"""docs/design.md's trees name every module of the package, of benchmarks/ and of examples/, and nothing else:
the page a new maintainer reads first cannot fall behind the code."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _listed(block: str) -> set[str]:
    """Paths of a ```text tree: folders end in ``/``; a child is indented deeper than its folder."""
    paths, stack = set(), []  # stack of (indent, folder path)
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if not match or not re.fullmatch(r"[\w.]+/?", match[2]) or not (match[2].endswith("/") or match[2].endswith(".py")):
            continue
        indent, name = len(match[1]), match[2]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + name
        if name.endswith("/"):
            stack.append((indent, path))
        else:
            paths.add(path)
    return paths


def _trees() -> set[str]:
    page = (ROOT / "docs" / "design.md").read_text()
    blocks = re.findall(r"^```text\n(.*?)^```", page, re.S | re.M)
    return set().union(*(_listed(b) for b in blocks))


def test_design_md_lists_every_module_and_nothing_else():
    actual = {str(p.relative_to(ROOT)) for top in ("fla_ac_isolation", "benchmarks", "examples")
              for p in (ROOT / top).rglob("*.py")}
    listed = {p for p in _trees() if p.split("/")[0] in ("fla_ac_isolation", "benchmarks", "examples")}
    assert sorted(actual - listed) == [], "modules missing from docs/design.md"
    assert sorted(listed - actual) == [], "docs/design.md lists modules that do not exist"
