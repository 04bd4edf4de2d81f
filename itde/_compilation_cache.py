"""JAX's persistent compilation cache: a second process reuses what the first compiled.

XLA compiles every program a process runs, and on a CPU that is most of the time a short
`itde` command takes. With the persistent cache on, each compiled program is also written
to a directory, keyed by the program and everything that changes its code (JAX and XLA
versions, flags, devices), and a later process loads it instead of compiling it again.

The `itde` command turns it on; `import itde` does not (a library writes nothing to a
user's disk unasked): in a script or a notebook, call
[`enable_compilation_cache`][itde.enable_compilation_cache].
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ._io import user_cache_dir

#: The environment variable that moves the cache (a directory) or turns it off.
VARIABLE = "ITDE_COMPILATION_CACHE"
#: Values of `ITDE_COMPILATION_CACHE` that turn the cache off (any case).
OFF = ("off", "0", "false", "no", "none", "")
#: Programs that compile in less than this many seconds are written too. JAX's default (1 s)
#: keeps none of `itde sample`'s or `itde converge`'s programs on a CPU, whose many short
#: compiles together are most of a command's time (measured: docs/api/cli.md).
MIN_COMPILE_SECONDS = 0.0

_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


def default_directory() -> Path:
    """Where the cache is kept unless told otherwise: `jax/` in
    itde's per-user cache directory (`itde._io.user_cache_dir`)."""
    return user_cache_dir() / "jax"


def _check_directory(value: str | os.PathLike, where: str, fix: str) -> Path:
    """Create the directory `value` (private to the user where this creates it) and check
    that files can be written in it; else a `ValueError` that says `where` the value came
    from, the value, what is wrong and `fix`."""
    text = os.fspath(value)
    if not text.strip():
        raise ValueError(f"{where} is empty; {fix}")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where} {text!r} is a file, not a directory; {fix}")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # `os.access` says yes to root everywhere: write (and remove) an empty file
        fd, probe = tempfile.mkstemp(prefix=".itde-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"{where} {text!r} cannot hold the compilation cache ({e.strerror or e}); {fix}"
        ) from None
    return path.resolve()


_FIX = (f"give a writable directory, or turn the cache off ({VARIABLE}=off, or "
        "`--no-compilation-cache` on the `itde` command).")  # fmt: skip


def resolve(path: str | os.PathLike | None = None, name: str = "`path`") -> Path | None:
    """The cache directory asked for, checked and created if missing; None for off.

    `path` if given (called `name` in an error), else `$ITDE_COMPILATION_CACHE` (`off`,
    `0`, `false` or empty: None), else the directory JAX is already set to use (its
    `JAX_COMPILATION_CACHE_DIR`, or an earlier call), else `jax/` in itde's per-user cache
    directory."""
    if path is not None:
        return _check_directory(path, name, _FIX)
    value = os.environ.get(VARIABLE)
    if value is not None:
        if value.strip().lower() in OFF:
            return None
        return _check_directory(value, VARIABLE, _FIX)
    import jax

    if configured := jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR, say
        return _check_directory(configured, "JAX's `jax_compilation_cache_dir`", _FIX)
    return _check_directory(
        default_directory(), "the default compilation cache directory",
        f"set {VARIABLE} to a writable directory (or to `off`), or ITDE_CACHE_DIR to move "
        "all of itde's caches.",
    )  # fmt: skip


def _set(directory: Path | None) -> None:
    """Point JAX's persistent cache at `directory` (None: off), for what this process
    compiles from now on."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    value = None if directory is None else str(directory)
    if jax.config.jax_compilation_cache_dir != value:
        jax.config.update("jax_compilation_cache_dir", value)
        # JAX opens its cache at the first compile after it is set: forget the one it opened
        compilation_cache.reset_cache()
    if directory is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache, so that a later process loads the
    programs this one compiles instead of compiling them again.

    The `itde` command does this for every command; `import itde` does not (a library
    writes nothing to your disk unasked), so a script or notebook that wants the cache
    calls this once, before its first computation. It applies to everything the process
    compiles from then on, not to itde's programs alone.

    **Arguments:**

    - `path`: the cache directory, created if missing. Default: the environment variable
      `ITDE_COMPILATION_CACHE` (a directory; `off`, `0`, `false` or empty turns the cache
      off), else the directory JAX is already set to use (`JAX_COMPILATION_CACHE_DIR`),
      else `jax/` in itde's per-user cache directory: `$ITDE_CACHE_DIR/jax`, else
      `$XDG_CACHE_HOME/itde/jax` or `~/.cache/itde/jax` on Linux,
      `~/Library/Caches/itde/jax` on macOS, `%LOCALAPPDATA%\\itde\\Cache\\jax` on Windows.

    **Returns:** the directory in use; None where `ITDE_COMPILATION_CACHE` turns the
    cache off (it is then off in this process).

    **Raises:** `ValueError`, naming the value, where the directory cannot be created or
    written.

    Every program is written, however short its compile (JAX's own threshold, one second,
    would keep few of itde's programs). Programs that call back into Python are never
    written (JAX cannot reload them): those holding an `eqx.error_if` check, which
    includes every `diffrax.diffeqsolve` that may fail, compile afresh in each process.
    Entries are keyed by the program, JAX's and XLA's versions, the flags and the device,
    so an upgrade starts afresh beside the old entries; nothing is pruned: delete the
    directory to reclaim the space. A cache holds code that is run: do not share a
    directory with users you do not trust.
    """
    directory = resolve(path)
    _set(directory)
    return directory


@contextlib.contextmanager
def session(directory: Path | None) -> Iterator[Path | None]:
    """JAX's persistent cache in `directory` (None: off) for the duration of one `itde`
    command, and JAX's settings put back as they were on exit, so that `itde.cli.main`
    called from Python leaves the process as it found it."""
    import jax

    before = {k: getattr(jax.config, k) for k in _SETTINGS}
    try:
        _set(directory)
        yield directory
    finally:
        if {k: getattr(jax.config, k) for k in _SETTINGS} != before:
            for k, v in before.items():
                jax.config.update(k, v)
            from jax.experimental.compilation_cache import compilation_cache

            compilation_cache.reset_cache()
