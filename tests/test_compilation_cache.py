"""JAX's persistent compilation cache (issue 44, item 4): the `itde` command keeps compiled
programs in a per-user directory that an option and an environment variable move or turn
off, and a second process loads them instead of compiling them again; `import itde`
alone writes nothing.

The suite runs with `ITDE_COMPILATION_CACHE=off` (conftest.py): each test here sets the
variable, the option or the per-user directories itself, to temporary directories."""

import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

import itde
from itde._internal import _compilation_cache as cc
from itde.cli import main

SOLVE = """
[model]
n_layers = 1
n_features = 4
n_heads = 1
n_hidden = 4
[solve]
n_tokens = 3
"""
# a command that stops with a mistake (exit 2) after the cache is set up, before any work
FAILS = ["sample", "--checkpoint", "nowhere", "--length", "-1"]


def _entries(directory):
    return sorted(p.name for p in directory.glob("*-cache")) if directory.exists() else []


@pytest.fixture
def jax_settings_restored():
    """JAX's cache settings as they were before the test, whatever it turned on."""
    before = {k: getattr(jax.config, k) for k in cc._SETTINGS}
    yield
    for k, v in before.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user whose cache directories are all under tmp_path, with no variable set."""
    for name in ("ITDE_COMPILATION_CACHE", "ITDE_CACHE_DIR", "LOCALAPPDATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path


@pytest.fixture
def seen(monkeypatch):
    """The directory each `itde` command ran its cache in, and JAX's setting meanwhile."""
    runs, real = [], cc.session

    @contextlib.contextmanager
    def spy(directory):
        with real(directory) as d:
            runs.append((d, jax.config.jax_compilation_cache_dir))
            yield d

    monkeypatch.setattr(cc, "session", spy)
    return runs


@contextlib.contextmanager
def _events():
    """Counts of JAX's monitoring events (cache hits, misses) inside the block."""
    counts = {}

    def listen(name, **kwargs):
        counts[name] = counts.get(name, 0) + 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listen)


def _fresh_program():
    """Run a program compiled from a new function object (no cache of this process holds
    it, so JAX compiles it or loads it from the persistent cache)."""
    return jax.jit(lambda x: jnp.cumsum(jnp.sin(x) * 3.0) + 1.0)(jnp.arange(11.0))


def test_a_program_is_written_once_and_then_loaded_not_compiled(tmp_path, jax_settings_restored):
    """On the CPU with the installed jax: a program compiled with the cache on is written,
    however short its compile; the same program from a new function object is loaded
    from the file; with the cache off again nothing is read or written."""
    directory = tmp_path / "c"
    with _events() as ev:
        assert itde.enable_compilation_cache(directory) == directory.resolve()
        assert jax.config.jax_compilation_cache_dir == str(directory.resolve())
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        first = np.asarray(_fresh_program())
        written = _entries(directory)
        assert written and ev.get("/jax/compilation_cache/cache_misses", 0) >= 1
        hits = ev.get("/jax/compilation_cache/cache_hits", 0)
        second = _fresh_program()
        assert ev.get("/jax/compilation_cache/cache_hits", 0) == hits + 1
        assert _entries(directory) == written
    np.testing.assert_array_equal(np.asarray(second), first)
    # `ITDE_COMPILATION_CACHE=off` (the suite's setting) turns it off
    assert itde.enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None
    jax.jit(lambda x: x * 7.0 - 2.0)(jnp.arange(5.0))
    assert _entries(directory) == written


def test_the_option_the_variable_and_the_default_choose_the_directory(home, seen, monkeypatch,
                                                                      capsys):  # fmt: skip
    """Precedence: --no-compilation-cache, --compilation-cache DIR, ITDE_COMPILATION_CACHE
    (a directory, or off), ITDE_CACHE_DIR/jax, the platform's per-user cache directory;
    JAX's setting is what the command chose while it runs and is put back after it."""
    assert jax.config.jax_compilation_cache_dir is None

    def ran(*flags):
        assert main([*FAILS, *flags]) == 2
        assert "`--length`=-1" in capsys.readouterr().err  # the command's own mistake
        directory, during = seen[-1]
        assert during == (None if directory is None else str(directory))
        assert jax.config.jax_compilation_cache_dir is None  # put back
        return directory

    default = ran()
    assert default == cc.default_directory().resolve() and default.is_dir()
    if sys.platform.startswith("linux"):
        assert default == (home / "xdg" / "itde" / "jax").resolve()
        monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # invalid by the XDG spec
        assert ran() == (home / "home" / ".cache" / "itde" / "jax").resolve()
    monkeypatch.setenv("ITDE_CACHE_DIR", str(home / "root"))
    assert ran() == (home / "root" / "jax").resolve()
    jax.config.update("jax_compilation_cache_dir", str(home / "jaxs"))  # a user's JAX setting
    try:
        assert main(FAILS) == 2 and seen[-1][0] == (home / "jaxs").resolve()
        assert jax.config.jax_compilation_cache_dir == str(home / "jaxs")
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
    monkeypatch.setenv("ITDE_COMPILATION_CACHE", str(home / "env"))
    assert ran() == (home / "env").resolve()
    assert ran("--compilation-cache", str(home / "opt")) == (home / "opt").resolve()
    assert ran("--no-compilation-cache") is None
    for off in ("off", "OFF", "0", "false", "", " "):
        monkeypatch.setenv("ITDE_COMPILATION_CACHE", off)
        assert ran() is None
    assert ran("--compilation-cache", str(home / "opt2")) == (home / "opt2").resolve()


@pytest.mark.parametrize("where", ["option", "variable"])
def test_a_directory_that_cannot_hold_the_cache_is_one_line_naming_it(where, home, monkeypatch,
                                                                      capsys):  # fmt: skip
    """A file, a path under a file, an empty value: exit 2, one line that names the option
    or the variable, the value and the fix."""
    (home / "file").write_text("x")
    name = "`--compilation-cache`" if where == "option" else "ITDE_COMPILATION_CACHE"
    for value, what in [(str(home / "file"), "is a file, not a directory"),
                        (str(home / "file" / "sub"), "cannot hold the compilation cache"),
                        ("", "is empty")]:  # fmt: skip
        if where == "option":
            argv = [*FAILS, "--compilation-cache", value]
        else:
            if not value:
                continue  # an empty variable turns the cache off (test above)
            monkeypatch.setenv("ITDE_COMPILATION_CACHE", value)
            argv = FAILS
        assert main(argv) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err
        assert lines[0].startswith(f"itde sample: error: {name}"), err
        assert what in err and (not value or repr(value) in err), err
        assert "ITDE_COMPILATION_CACHE=off" in err and "--no-compilation-cache" in err, err
    assert jax.config.jax_compilation_cache_dir is None


def test_an_unusable_default_is_a_note_and_the_command_runs_without(home, seen, monkeypatch,
                                                                   capsys):  # fmt: skip
    (home / "file").write_text("x")
    monkeypatch.setenv("ITDE_CACHE_DIR", str(home / "file"))
    assert main(FAILS) == 2
    err = capsys.readouterr().err
    assert seen[-1] == (None, None)
    note, error = [line for line in err.splitlines() if line.strip()]
    assert note.startswith("itde sample: note: running without the compilation cache: ")
    assert "ITDE_COMPILATION_CACHE" in note and "ITDE_CACHE_DIR" in note
    assert error.startswith("itde sample: error: `--length`=-1")


def test_the_library_function_names_its_argument(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"`path` '.*file' is a file, not a directory"):
        itde.enable_compilation_cache(tmp_path / "file")
    assert jax.config.jax_compilation_cache_dir is None


def test_both_options_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main([*FAILS, "--compilation-cache", "x", "--no-compilation-cache"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.runs("solve")
def test_a_command_writes_its_programs_into_the_directory_given(tmp_path, capsys):
    """`itde solve` with `--compilation-cache DIR` writes its programs there (the one
    whose solve may fail, an `eqx.error_if` that calls back into Python, excepted) and
    leaves JAX's setting as it found it."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(SOLVE)
    directory = tmp_path / "c"
    argv = ["solve", "--config", str(cfg), "--out", str(tmp_path / "o")]
    assert main([*argv, "--compilation-cache", str(directory)]) == 0
    assert len(_entries(directory)) >= 3
    assert jax.config.jax_compilation_cache_dir is None
    capsys.readouterr()


def test_import_itde_alone_turns_nothing_on(tmp_path):
    """A fresh interpreter with no variable set: `import itde`, its exports and a
    computation leave JAX's cache off and write nothing to the user's cache directory."""
    code = """
import jax, jax.numpy as jnp
import itde
itde.TransformerIDE, itde.solve, itde.train, itde.analysis
jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
print(jax.config.jax_compilation_cache_dir)
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ITDE_COMPILATION_CACHE", "ITDE_CACHE_DIR")}  # fmt: skip
    env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300, check=True)  # fmt: skip
    assert res.stdout.strip().splitlines()[-1] == "None", res.stdout
    assert not any(tmp_path.rglob("*")), list(tmp_path.rglob("*"))


@pytest.mark.slow  # two processes of `itde solve`
def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(SOLVE)
    directory = tmp_path / "c"
    env = dict(os.environ, ITDE_COMPILATION_CACHE=str(directory))
    code = """
import json, sys
import jax
counts = {}
jax.monitoring.register_event_listener(lambda name, **kw: counts.__setitem__(name,
                                                             counts.get(name, 0) + 1))
from itde.cli import main
status = main(sys.argv[1:])
print(json.dumps({k.rsplit("/", 1)[1]: v for k, v in counts.items()}))
sys.exit(status)
"""
    argv = ["solve", "--config", str(cfg), "--out", str(tmp_path / "o")]
    import json

    counts = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                             text=True, env=env, timeout=600)  # fmt: skip
        assert res.returncode == 0, res.stderr
        counts.append(json.loads(res.stdout.splitlines()[-1]))
    written = len(_entries(directory))
    assert counts[0].get("cache_misses") == written > 0 and not counts[0].get("cache_hits")
    assert counts[1].get("cache_hits") == written and not counts[1].get("cache_misses")
