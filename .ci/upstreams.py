"""Print the upstream releases this environment resolved, the newest release on the registry, and whether that
one is outside the ranges fla-ac-isolation declares (CI's log then says when a release appeared that no job
tests yet). Informational: always exits 0; a registry it cannot ask is said so."""

import importlib.metadata
import os
import re
import subprocess
import sys

UPSTREAMS = ("torch", "triton", "fla-core", "flash-linear-attention", "transformers", "torchtitan", "ai2-olmo-core")


def _declared() -> dict[str, str]:
    """Each upstream's version range in fla-ac-isolation's metadata (core and extras), by distribution."""
    found: dict[str, set[str]] = {}
    for requirement in importlib.metadata.requires("fla-ac-isolation") or []:
        match = re.match(r"([A-Za-z0-9_.\-]+)\s*([^;]*)", requirement)
        if match and match.group(1).lower() in UPSTREAMS and match.group(2).strip():
            found.setdefault(match.group(1).lower(), set()).add(match.group(2).strip())
    return {name: " | ".join(sorted(ranges)) for name, ranges in found.items()}


def _newest(name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True,
                         env={**os.environ, "PIP_CONSTRAINT": "/dev/null"}, check=False)
    match = re.search(rf"^{re.escape(name)} \(([^)]+)\)", out.stdout, re.M | re.I)
    return match.group(1) if match else f"unknown ({(out.stderr or out.stdout).strip().splitlines()[-1:]})"


def _note(installed: str, newest: str, ranges: str) -> str:
    """What the log reader should know about ``newest`` (empty when it is what is installed)."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        newest_version, local = Version(newest), Version(installed.split("+")[0])
    except Exception:  # no packaging, or an unknown version: nothing to compare
        return ""
    if newest_version <= local:
        return ""
    if ranges != "any" and not any(newest_version in SpecifierSet(r) for r in ranges.split(" | ")):
        return "NEWER RELEASE OUTSIDE OUR RANGE: untested; widen the range after a job passes with it"
    return "newer release in our range, not installed here (pinned by this job, or held back by another requirement)"


def main() -> int:
    declared = _declared()
    print(f"{'upstream':24} {'installed':14} {'newest released':16} {'declared by fla-ac-isolation':30} note")
    for name in UPSTREAMS:
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "-"
        newest, ranges = _newest(name), declared.get(name, "any")
        note = _note(installed, newest, ranges) if installed != "-" else ""
        print(f"{name:24} {installed:14} {newest:16} {ranges:30} {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
