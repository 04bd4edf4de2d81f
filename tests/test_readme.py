"""Every code block of README.md runs as written, in the default suite.

- `python` blocks: each in a namespace of its own (no block leans on another's names), in a
  fresh interpreter started in a scratch directory holding a copy of `configs/`.
- `bash` blocks: every `itde` command runs (`itde.cli.main`, same arguments, in the test
  process) in a scratch directory, with the smaller settings the README states next to the
  block; the install line is checked against `pyproject.toml`; the suite does not run
  itself.
- `text` blocks: the layout listing; every file and folder it names exists.

The blocks are small by design (the model blocks compile small models, about 30 s
together on a 2-core CPU; the training block and `itde train` take 20 steps), so they run
by default: a README command that stops working fails the suite (`test_commands.py` checks
that every README block and command is run so).
"""

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
    from itde.cli._main import build_parser

    for code, line in _blocks("python"):
        compile(code, f"README.md:{line}", "exec")
    for code, line in _blocks("bash"):
        for cmd in _commands(code):
            if cmd.startswith("itde "):  # the options and choices exist
                build_parser().parse_args(shlex.split(cmd)[1:])
            else:
                assert cmd.startswith(SETUP), f"README.md:{line}: unknown command {cmd!r}"


def test_setup_line_names_real_extras_and_the_itde_script():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (code, _), *_ = _blocks("bash")
    (extras,) = re.findall(r'pip install -e "\.\[([\w,]+)\]"', code)
    assert set(extras.split(",")) <= set(project["optional-dependencies"])
    assert project["scripts"]["itde"] == "itde.cli:main"


def test_layout_names_files_that_exist():
    """The tree's entries (top level and one level in) and every `.py` file its
    descriptions name exist."""
    ((code, line),) = _blocks("text")
    top, seen = "", 0
    for row in code.splitlines():
        indent = len(row) - len(row.lstrip())
        name = row.split()[0]
        if indent in (0, 2):
            path = name if indent == 0 else top + name
            assert (ROOT / path).exists(), f"README.md:{line}: {path} does not exist"
            top, seen = (name, seen + 1) if indent == 0 else (top, seen + 1)
        for py in re.findall(r"[\w/]+\.py\b", row[24:]):
            assert (ROOT / py).exists() or (ROOT / top / py).exists(), py
    assert seen >= 15


RUNNER = """
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
failed = []
for line, code in blocks:
    try:
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})
    except Exception:
        failed.append(traceback.format_exc())
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _scratch(tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


def _run_python(blocks, cwd):
    res = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), cwd=cwd,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.runs("README.md python blocks")
def test_python_blocks_run_as_written(tmp_path):
    """Every Python block, in order, in one fresh interpreter (one import of JAX and
    PyTorch), each in its own namespace: the model blocks (from PyTorch, continuous depth,
    function kernels, the family, the Hugging Face conversion, the continuum of a network)
    and the training block (20 steps, evaluation, `tr.load`)."""
    blocks = [(line, code) for code, line in _blocks("python")]
    assert sum("tr.train(" in code for _, code in blocks) == 1  # the training block
    out = _run_python(blocks, _scratch(tmp_path))
    assert "(5, 8, 12)" in out and "(16, 16) (32, 32)" in out
    assert "checkpoint.json" in out and "state-00000020.eqx" in out
    assert (tmp_path / "runs" / "sort-20" / "loss_curve.png").is_file()


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
