"""The boundaries of `itde_solvers`: it never imports `itde`, it is the only package in its
folder, and the diffrax internals it relies on behave as pinned.
"""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from itde_solvers._internal import _diffrax_private

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "solvers"


def _run(code: str, *, path: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=FOLDER,
        capture_output=True,
        text=True,
        timeout=300,
    )


# --- itde_solvers never imports itde --------------------------------------------------


def test_importing_itde_solvers_loads_no_itde_module():
    # `itde` is importable in this subprocess (the repository root is on the path), so an
    # import of it anywhere in `itde_solvers` would show up in sys.modules.
    code = (
        "import sys, itde_solvers\n"
        "print(itde_solvers.__file__)\n"
        "print(sorted(m for m in sys.modules if m == 'itde' or m.startswith('itde.')))\n"
        "import itde\n"  # the check above would have been able to see it
    )
    out = _run(code, path=[FOLDER, ROOT])
    assert out.returncode == 0, out.stderr
    file, loaded = out.stdout.splitlines()
    assert Path(file).resolve().is_relative_to(FOLDER / "itde_solvers"), file
    assert loaded == "[]", f"importing itde_solvers loaded {loaded}"


def _itde_imports(source: str, filename: str) -> list[str]:
    """`file:line` of every `import itde...` / `from itde... import` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n == "itde" or n.startswith("itde.") for n in names):
            found.append(f"{filename}:{node.lineno}")
    return found


def test_the_import_scan_sees_itde_imports():
    """The scan below can fail: it finds every spelling of an `itde` import."""
    source = "import itde\nimport os, itde.train as t\nfrom itde import x\nfrom itde.cli import y\n"
    assert len(_itde_imports(source, "planted.py")) == 4
    clean = "import itde_solvers\nfrom itde_solvers import x\nfrom . import itde\nimport os\n"
    assert _itde_imports(clean, "clean.py") == []


def test_no_file_under_solvers_imports_itde():
    files = sorted(FOLDER.rglob("*.py"))
    assert len(files) >= 10, files  # the scan really walks the package
    found = [hit for f in files for hit in _itde_imports(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == [], f"itde_solvers must never import itde: {found}"


# --- one importable package, `itde_solvers`; nothing importable as `solvers` ------------


def test_the_folder_holds_exactly_one_package():
    packages = sorted(
        p.name for p in FOLDER.iterdir() if p.is_dir() and (p / "__init__.py").is_file()
    )
    assert packages == ["itde_solvers"]
    modules = sorted(p.name for p in FOLDER.glob("*.py"))
    assert modules == ["__init__.py"]  # the guard below, nothing else at the top level


@pytest.mark.parametrize("name", ["solvers", "solvers.itde_solvers"])
def test_nothing_is_importable_as_solvers(name):
    out = _run(f"import {name}", path=[ROOT])
    assert out.returncode != 0, f"`import {name}` worked from the repository root"
    assert "ImportError" in out.stderr and "import itde_solvers" in out.stderr, out.stderr


# --- the diffrax internals in itde_solvers._diffrax_private ---------------------------

PIN = _diffrax_private.KNOWN_DIFFRAX
CHANGED = (
    f"diffrax {diffrax.__version__} changed an internal that itde_solvers relies on; "
    f"itde_solvers/_diffrax_private.py is known for diffrax{PIN} (the pin in "
    "pyproject.toml). Update that file and the pin together."
)


def test_pyproject_pins_the_range_that_was_verified():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"diffrax{PIN}" in dependencies, (dependencies, PIN)
    assert Version(diffrax.__version__) in SpecifierSet(PIN), (
        f"installed diffrax {diffrax.__version__} is outside diffrax{PIN}; run "
        "tests/test_solvers_boundary.py against it and widen the pin in pyproject.toml "
        "and itde_solvers/_diffrax_private.py."
    )


class _Probe(diffrax.AbstractSolver):
    """Explicit Euler that records, at trace time, the type of the terms it is handed."""

    seen: list = eqx.field(static=True)
    term_structure = diffrax.AbstractTerm
    interpolation_cls = diffrax.LocalLinearInterpolation

    def order(self, terms):
        return 1

    def init(self, terms, t0, t1, y0, args):
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        self.seen.append((type(terms), type(getattr(terms, "term", None))))
        y1 = jax.tree.map(jnp.add, y0, terms.vf_prod(t0, y0, args, terms.contr(t0, t1)))
        return y1, None, dict(y0=y0, y1=y1), None, diffrax.RESULTS.successful

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


def test_diffeqsolve_wraps_terms_in_the_pinned_wrapterm():
    seen: list = []
    term = diffrax.ODETerm(lambda t, y, args: -y)
    diffrax.diffeqsolve(term, _Probe(seen), 1.0, 0.0, -0.25, jnp.array([1.0]))
    assert seen, "the probe solver was never stepped"
    outer, inner = seen[0]
    assert outer is _diffrax_private.WrapTerm, f"{CHANGED} (terms arrived as {outer})"
    assert inner is diffrax.ODETerm, f"{CHANGED} (WrapTerm.term is {inner})"


def test_backsolve_adjoint_steps_over_the_pinned_adjointterm():
    seen: list = []
    term = diffrax.ODETerm(lambda t, y, args: args * y)

    def final(a):
        sol = diffrax.diffeqsolve(
            term,
            _Probe(seen),
            0.0,
            1.0,
            0.25,
            jnp.array([1.0]),
            args=a,
            adjoint=diffrax.BacksolveAdjoint(),
        )
        return sol.ys[-1, 0]

    jax.grad(final)(jnp.asarray(-0.5))
    inner_types = {inner for _, inner in seen}
    assert _diffrax_private.AdjointTerm in inner_types, f"{CHANGED} (saw {inner_types})"


def _private_diffrax_imports(path: Path) -> list[str]:
    """The `diffrax._...` modules a file imports (`import diffrax._x`, `from diffrax._x
    import ...`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [n for n in names if n.startswith("diffrax._")]
    return found


def test_diffrax_privates_are_imported_in_the_shim_only():
    """Every diffrax private the project uses is imported in itde_solvers/_diffrax_private.py,
    whose pin and tests say where it was verified; nowhere else (itde/studies/_meter.py
    imported diffrax._progress_meter by itself)."""
    shim = FOLDER / "itde_solvers" / "_diffrax_private.py"
    assert _private_diffrax_imports(shim), "the scan sees no private import in the shim"
    files = [
        *(ROOT / "itde").rglob("*.py"),
        *FOLDER.rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
    ]
    outside = {str(f.relative_to(ROOT)): _private_diffrax_imports(f) for f in files if f != shim}
    assert not {f: m for f, m in outside.items() if m}


def test_the_pinned_progress_meter_registry_threads_a_bar():
    """`progress_meter_manager` (diffrax._progress_meter) opens, steps and closes a bar by
    the index its `init` returns, as itde's StageMeter calls it."""
    manager = _diffrax_private.progress_meter_manager
    seen = []

    @jax.jit
    def solve_like(progress):
        idx = manager.init(lambda: seen.append("open") or "bar")
        idx = manager.step(lambda bar, p: seen.append((bar, float(p))), progress, idx)
        manager.close(lambda bar: seen.append(("close", bar)), idx)
        return progress

    jax.block_until_ready(solve_like(jnp.asarray(0.5)))
    jax.effects_barrier()
    assert seen == ["open", ("bar", 0.5), ("close", "bar")], f"{CHANGED} (saw {seen})"
