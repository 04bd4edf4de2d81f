"""The lower bounds of pyproject.toml against the versions an environment holds.

Reads the project's requirements (its dependencies and the extras named on the command
line, following `itde[...]` references between extras) and `name==version` lines on stdin
(`uv pip freeze`, `pip freeze`); prints one row per requirement (name, lower bound,
installed) and exits 1 when a lower bound is not the version installed: in the job of
.ci/min-versions, which installs with `--resolution lowest-direct`, such a bound was not
tested (another requirement forces a higher version): raise it to the version installed.
A requirement without a lower bound (`>=`, `==` or `~=`) is an error too: every floor must
be one a run has checked.

    uv pip freeze | python .ci/floors.py test,torch
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503 normalisation


def requirements(project: dict, extras: list[str]) -> list[Requirement]:
    """The project's dependencies and those of `extras`, self-references expanded."""
    optional = project.get("optional-dependencies", {})
    own, seen, todo = _key(project["name"]), set(), list(extras)
    for extra in todo:
        if extra not in optional:
            raise SystemExit(
                f"floors.py: no extra {extra!r}; pyproject.toml has {sorted(optional)}"
            )
    reqs = [Requirement(r) for r in project["dependencies"]]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            req = Requirement(text)
            if _key(req.name) == own:
                todo += sorted(req.extras)
            else:
                reqs.append(req)
    unique = {}
    for req in reqs:
        unique.setdefault(_key(req.name), req)
    return list(unique.values())


def floor(req: Requirement) -> Version | None:
    """The lowest version `req` allows, from its `>=`, `==` or `~=` clause (None without one)."""
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    return max(lows) if lows else None


def parse_freeze(text: str) -> dict[str, Version]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if m:
            out[_key(m.group(1))] = Version(m.group(2))
    return out


def check(reqs: list[Requirement], installed: dict[str, Version]) -> tuple[list[str], list[str]]:
    """(table rows, problems): a problem is a floor that is missing or not the installed one."""
    rows, problems = [], []
    for req in reqs:
        low, got = floor(req), installed.get(_key(req.name))
        rows.append(f"{req.name:<24} {str(low or '-'):>12} {str(got or '-'):>12}")
        if low is None:
            problems.append(f"{req}: no lower bound; give it the lowest version a run has tested")
        elif got is None:
            problems.append(f"{req.name}: not installed")
        elif Version(got.public) != low:  # a local label (2.6.0+cpu) is the same release
            problems.append(f"{req.name}: lower bound {low}, installed {got}; the bound is not "
                            f"tested: raise it to {got} in pyproject.toml")  # fmt: skip
    return rows, problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = requirements(project, [e for e in argv[0].split(",") if e])
    rows, problems = check(reqs, parse_freeze(sys.stdin.read()))
    print(f"{'requirement':<24} {'lower bound':>12} {'installed':>12}")
    print("\n".join(rows))
    for p in problems:
        print(f"floors.py: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
