"""Mutation testing of the numerical core: does the default suite notice a one-line bug?

Each mutant in `benchmarks/mutants.toml` is a realistic one-line bug (a wrong axis, a
swapped pair, a dropped term, an off-by-one, a sign) in one source file. For each, this
script copies the repository (the files `git ls-files` lists, tracked and untracked but
not ignored, as they are in the working tree: HEAD plus any uncommitted change) into a
temporary directory, applies the replacement there, and runs the mutant's tests on the
copy:

    python -m pytest -x -q -n 0 -m "not slow" -p no:cacheprovider <tests>

with `PYTHONPATH=<copy>:<copy>/solvers` and the working directory in the copy, under a
per-mutant timeout. The repository itself is never modified. Outcomes:

- `caught`: the tests failed (pytest exit code 1, or 2 for an error during collection);
- `survived`: the tests passed with the bug in place;
- `timeout`: the tests ran past the timeout (killed);
- `not-applicable`: the `find` string occurs zero times or more than once in `file`
  (the code changed under the mutant: fix the entry), reported, never skipped silently;
- `equivalent`: marked `equivalent = true` in the TOML (the mutated code computes the
  same thing, the reason in `why`); its `find` string is still checked, its tests are run
  only with `--run-equivalent`;
- `error`: pytest could not run the tests (exit code 3, 4, 5: a bad test id, no test
  collected, an internal error), or the baseline failed.

Before the mutants, a baseline runs every mutant's tests once on the unmutated copy (one
pytest call over the union of the test ids, without `-x`); a mutant whose tests fail
there is reported as `error`, since its tests catch nothing. `--no-baseline` skips it.

Each mutant in the TOML is a `[[mutant]]` table:

```toml
[[mutant]]
name = "attention-softmax-axis"      # unique, used by --only
file = "itde/_operators/_blocked.py" # relative to the repository root
find = "jnp.max(s, axis=-1, keepdims=True)"   # must occur exactly once in `file`
replace = "jnp.max(s, axis=-2, keepdims=True)"
tests = ["tests/test_operators.py"]  # files or node ids of the default suite
why = "the softmax normalised over queries instead of keys"
# optional: equivalent = true (with the reason in `why`), timeout = 300 (seconds)
```

**Usage** (from the repository root, with the project's environment):

    python benchmarks/mutation.py                      # every mutant, table + runs/mutation.json
    python benchmarks/mutation.py --list               # the mutants and whether each applies
    python benchmarks/mutation.py --only NAME [--only NAME2]   # some mutants only
    python benchmarks/mutation.py --out runs/mutation.json --timeout 600 --no-baseline

The exit status is 1 when a mutant survived, timed out, did not apply or gave an error
(so the script can gate a change), 0 when every mutant was caught or is equivalent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MUTANTS = ROOT / "benchmarks" / "mutants.toml"
PYTEST = ["-m", "pytest", "-q", "-n", "0", "-m", "not slow", "-p", "no:cacheprovider"]
STATUSES = ("caught", "survived", "equivalent", "timeout", "not-applicable", "error")
FIELDS = {"name", "file", "find", "replace", "tests", "why", "equivalent", "timeout"}


@dataclass
class Mutant:
    name: str
    file: str
    find: str
    replace: str
    tests: list[str]
    why: str
    equivalent: bool = False
    timeout: float | None = None


@dataclass
class Result:
    name: str
    file: str
    status: str
    why: str
    tests: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    detail: str = ""
    output_tail: str = field(default="", repr=False)


def load_mutants(path: Path) -> list[Mutant]:
    """The `[[mutant]]` tables of `path`, checked for their fields and unique names."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    unknown = set(data) - {"mutant"}
    if unknown:
        raise SystemExit(f"{path}: unknown top-level keys {sorted(unknown)}; use [[mutant]].")
    out, seen = [], set()
    for i, m in enumerate(data.get("mutant", [])):
        where = f"{path} mutant #{i + 1} ({m.get('name', '?')})"
        missing = {"name", "file", "find", "replace", "tests", "why"} - set(m)
        if missing:
            raise SystemExit(f"{where}: missing {sorted(missing)}.")
        extra = set(m) - FIELDS
        if extra:
            raise SystemExit(f"{where}: unknown keys {sorted(extra)}; known: {sorted(FIELDS)}.")
        if not isinstance(m["tests"], list) or not m["tests"]:
            raise SystemExit(f"{where}: `tests` must be a non-empty list of test ids.")
        if m["find"] == m["replace"]:
            raise SystemExit(f"{where}: `find` and `replace` are equal: no mutation.")
        if m["name"] in seen:
            raise SystemExit(f"{where}: the name {m['name']!r} is used twice.")
        seen.add(m["name"])
        out.append(Mutant(**m))
    return out


def occurrences(root: Path, m: Mutant) -> int:
    path = root / m.file
    if not path.is_file():
        return 0
    return path.read_text(encoding="utf-8").count(m.find)


def repo_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files of the working tree (that exist)."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    )  # fmt: skip
    names = sorted({n for n in proc.stdout.decode().split("\0") if n})
    return [n for n in names if (root / n).is_file()]


def copy_repo(root: Path, files: list[str], dest: Path) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)


def run_pytest(copy: Path, tests: list[str], python: str, timeout: float, stop_first: bool):
    """`(returncode or None on timeout, seconds, output)` of pytest on `copy`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "solvers")])
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [python, *PYTEST, *(["-x"] if stop_first else []), *tests]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: a timeout kills every child
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return rc, time.monotonic() - start, out.decode(errors="replace")


def check_import_location(copy: Path, python: str) -> None:
    """The copy's `itde` and `itde_solvers` must be the ones imported (not an installed
    copy of the package), or the mutants would test nothing."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "solvers")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    code = "import itde, itde_solvers; print(itde.__file__); print(itde_solvers.__file__)"
    out = subprocess.run(
        [python, "-c", code], cwd=copy, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in out:
        if not Path(f).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"the copy's packages are not the ones imported: {f} is outside it.")


def classify(rc: int | None) -> str:
    if rc is None:
        return "timeout"
    if rc == 0:
        return "survived"
    if rc in (1, 2):
        return "caught"
    return "error"


def tail(text: str, n: int = 3000) -> str:
    return text[-n:]


def first_failure(output: str) -> str:
    """The first `FAILED`/`ERROR` line of pytest's short summary (what caught the mutant)."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:200]
    return ""


def print_table(results: list[Result]) -> None:
    w = max([len(r.name) for r in results] + [6])
    print(f"\n{'mutant':<{w}}  {'status':<14}  {'time':>6}  caught by / detail")
    print(f"{'-' * w}  {'-' * 14}  {'-' * 6}  {'-' * 40}")
    for r in results:
        print(f"{r.name:<{w}}  {r.status:<14}  {r.seconds:6.1f}  {r.detail}")
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items() if n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mutants", type=Path, default=DEFAULT_MUTANTS, help="the TOML file")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run this mutant only (repeatable, or comma-separated)")  # fmt: skip
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "mutation.json")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    p.add_argument("--python", default=sys.executable, help="the interpreter for pytest")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the unmutated run of the mutants' tests")  # fmt: skip
    p.add_argument("--run-equivalent", action="store_true",
                   help="also run the tests of mutants marked equivalent")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = p.parse_args(argv)

    mutants = load_mutants(args.mutants)
    only = {n for o in args.only for n in o.split(",") if n}
    if only:
        unknown = only - {m.name for m in mutants}
        if unknown:
            raise SystemExit(f"--only: no mutant named {sorted(unknown)}.")
        mutants = [m for m in mutants if m.name in only]

    if args.list:
        for m in mutants:
            n = occurrences(ROOT, m)
            state = "applies" if n == 1 else f"NOT APPLICABLE ({n} occurrences)"
            eq = " [equivalent]" if m.equivalent else ""
            print(f"{m.name}: {m.file}: {state}{eq}\n    {m.why}\n    tests: {' '.join(m.tests)}")
        return 0

    files = repo_files(ROOT)
    work = Path(tempfile.mkdtemp(prefix="itde-mutation-"))
    results: list[Result] = []
    baseline_failed: set[str] = set()
    try:
        base = work / "base"
        copy_repo(ROOT, files, base)
        check_import_location(base, args.python)
        to_run = [m for m in mutants if occurrences(ROOT, m) == 1 and
                  (not m.equivalent or args.run_equivalent)]  # fmt: skip
        if to_run and not args.no_baseline:
            ids = sorted({t for m in to_run for t in m.tests})
            print(f"baseline: {len(ids)} test ids on the unmutated copy ...", flush=True)
            rc, secs, out = run_pytest(base, ids, args.python, 4 * args.timeout, False)
            print(f"baseline: exit {rc} in {secs:.0f} s", flush=True)
            if rc != 0:
                failing = [ln.split()[1] for ln in out.splitlines()
                           if ln.startswith(("FAILED ", "ERROR "))]  # fmt: skip
                print(tail(out, 4000))
                baseline_failed = {
                    t
                    for t in ids
                    if rc is None
                    or rc > 1
                    or any(f.startswith(t) or t.startswith(f) for f in failing)
                }
        for i, m in enumerate(mutants, 1):
            r = Result(m.name, m.file, "", m.why, m.tests)
            n = occurrences(ROOT, m)
            print(f"[{i}/{len(mutants)}] {m.name} ...", end=" ", flush=True)
            if n != 1:
                r.status = "not-applicable"
                r.detail = f"`find` occurs {n} times in {m.file} (must be exactly once)"
            elif m.equivalent and not args.run_equivalent:
                r.status, r.detail = "equivalent", "not run (equivalent = true)"
            elif baseline_failed & set(m.tests):
                r.status = "error"
                bad = sorted(baseline_failed & set(m.tests))
                r.detail = f"tests fail without the mutant: {bad}"
            else:
                copy = work / f"m{i:03d}"
                shutil.copytree(base, copy)
                path = copy / m.file
                path.write_text(
                    path.read_text(encoding="utf-8").replace(m.find, m.replace), encoding="utf-8"
                )
                rc, r.seconds, out = run_pytest(
                    copy, m.tests, args.python, m.timeout or args.timeout, True
                )
                r.returncode, r.output_tail = rc, tail(out)
                r.status = classify(rc)
                if r.status == "survived" and m.equivalent:
                    r.status = "equivalent"
                    r.detail = "tests passed, as they must for an equivalent mutant"
                if r.status == "caught":
                    r.detail = first_failure(out) or f"pytest exit {rc}"
                elif r.status == "survived":
                    r.detail = "tests passed with the bug in place"
                elif r.status == "timeout":
                    r.detail = f"killed after {m.timeout or args.timeout:.0f} s"
                elif r.status == "error":
                    r.detail = f"pytest exit {rc}: {first_failure(out) or tail(out, 200)}"
                if not args.keep:
                    shutil.rmtree(copy, ignore_errors=True)
            print(f"{r.status} ({r.seconds:.1f} s)", flush=True)
            results.append(r)
    finally:
        if args.keep:
            print(f"copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "mutants_file": str(
            args.mutants.relative_to(ROOT) if args.mutants.is_relative_to(ROOT) else args.mutants
        ),  # fmt: skip
        "counts": {s: sum(r.status == s for r in results) for s in STATUSES},
        "results": [r.__dict__ for r in results],
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    bad = [r for r in results if r.status not in ("caught", "equivalent")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
