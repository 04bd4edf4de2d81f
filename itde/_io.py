"""Files written by the library: atomically (a reader never sees half a file) and into
output directories checked before any work starts."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem / OS supports it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | Path, write) -> Path:
    """Call `write(binary_file)` on a temporary file next to `path`, fsync it, and rename
    it onto `path` (readable by all, as a plain file would be)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def write_json(path: str | Path, obj) -> Path:
    """Write `obj` as indented JSON, atomically."""
    data = json.dumps(obj, indent=2).encode()
    return atomic_write(path, lambda f: f.write(data))


def user_cache_dir() -> Path:
    """itde's per-user cache directory: `$ITDE_CACHE_DIR` if set, else the platform's
    (`$XDG_CACHE_HOME/itde` or `~/.cache/itde` on Linux, `~/Library/Caches/itde` on
    macOS, `%LOCALAPPDATA%\\itde\\Cache` on Windows). Not created here."""
    if root := os.environ.get("ITDE_CACHE_DIR"):
        return Path(root).expanduser()
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local",
                    "itde", "Cache")  # fmt: skip
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "itde"
    base = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG specification: a relative path is invalid, and is ignored
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "itde"


def check_output_dir(path: str | Path, name: str = "--out") -> Path:
    """Create the output directory `path`, or say why it cannot be one, before any work."""
    if not str(path).strip():
        raise ValueError(f"`{name}` is empty; give a directory path.")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(
            f"`{name}` {str(path)!r} is an existing file, not a directory; give a directory "
            "path (it is created if missing)."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileExistsError(
            f"`{name}` {str(path)!r} cannot be created as a directory ({e.strerror}); give "
            "another path."
        ) from None
    if not os.access(path, os.W_OK):
        raise PermissionError(f"`{name}` {str(path)!r} is not writable; give another directory.")
    return path


def check_output_location(path: str | Path, name: str = "--out") -> None:
    """Say now, without creating anything, why `path` could not become an output directory:
    a file in its way (the path itself or a parent), or no permission to write where it
    would be created."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise FileExistsError(
            f"`{name}` {str(path)!r} cannot be created as a directory ({str(existing)!r} is a "
            "file); give another path."
        )
    if existing.exists() and not os.access(existing, os.W_OK):
        raise PermissionError(f"`{name}` {str(path)!r} is not writable; give another directory.")
    if existing.exists():
        # `os.access` answers yes to root everywhere and knows nothing of /proc or /sys:
        # create (and remove) an empty directory where the output would go
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".itde-probe-", dir=existing))
        except OSError as e:
            raise PermissionError(
                f"`{name}` {str(path)!r} cannot be created as a directory ({e.strerror} in "
                f"{str(existing)!r}); give another path."
            ) from None
