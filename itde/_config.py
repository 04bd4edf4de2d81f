"""The TOML loader of typed experiment configuration, read once at the edge (the CLI).

Each section of a TOML file maps onto a frozen dataclass; an unknown key, a value of
the wrong type or an impossible value raises `ConfigError` naming the key and the
file. Library constructors never read files: the CLI turns these objects into
explicit arguments. The schemas live beside their commands: `itde.cli._solve_config`
(`itde solve`, `itde analyze --config`), `itde.studies._converge_config` (`itde
converge`), `itde.train._config` (`itde train`); the value checks they share
(`choices`, `seed`, `positive`) are here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A configuration file holds an unknown key, a wrong type or an impossible value."""


T = TypeVar("T")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str):
    """Check `value` against the annotation `tp` (at dotted `key`); ints pass for floats."""
    where = f"`{key}`"
    origin = get_origin(tp)
    if origin is typing.Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where} must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(get_args(tp)):
            return None
        errors = []
        for a in args:
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin in (list, tuple):
        (inner, *_) = get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table [{key}], got {value!r}")
        return _build(tp, value, key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported config annotation {_type_name(tp)} at {where}")


def _build(cls: type[T], table: dict, prefix: str) -> T:
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - fields)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        near = difflib.get_close_matches(unknown[0], sorted(fields), n=1)
        hint = f"; did you mean `{prefix + '.' if prefix else ''}{near[0]}`?"
        raise ConfigError(
            f"unknown key `{key}`{hint if near else ''}; known keys here: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in table.items():
        kwargs[name] = _coerce(value, hints[name], f"{prefix}.{name}" if prefix else name)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{e} (in [{prefix}])" if prefix else str(e)) from None


def from_dict(cls: type[T], table: dict, source: str = "<dict>") -> T:
    """Build a config dataclass from a nested dict, naming `source` in every error."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: a config must be a table (dict), got {type(table).__name__}")
    try:
        return _build(cls, table, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def read_table(path: str | Path) -> dict:
    """The TOML file `path` as a nested dict; a missing file, a directory or a file that is
    not TOML (or not UTF-8) is a `ConfigError` naming the path."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config path {str(path)!r} is a directory; give --config PATH to a TOML file"
        )
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist; give --config PATH to a TOML file"
        )
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    return table


def load(cls: type[T], path: str | Path, overrides: Sequence[str] = ()) -> T:
    """Read a TOML file into the config dataclass `cls`, with the `KEY=VALUE` strings of
    `overrides` applied after the file and before validation (see `override`)."""
    table = override(cls, read_table(path), overrides)
    return from_dict(cls, table, described(str(path), overrides))


def experiment(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()):
    """A command's config and the name its messages give it: the TOML file `path` (None:
    the built-in defaults of `cls`) with `overrides` (`--set KEY=VALUE`) applied."""
    if path is None:
        source = described("<built-in default>", overrides)
        cfg = from_dict(cls, override(cls, {}, overrides), source) if overrides else cls()
        return cfg, source
    return load(cls, path, overrides), described(str(path), overrides)


# ---------------------------------------------------------------------- --set KEY=VALUE
def described(source: str, overrides: Sequence[str]) -> str:
    """The name of a config read from `source` with `overrides`, e.g.
    `"configs/sort.toml --set optim.steps=150"`."""
    return " ".join([source, *(f"--set {o}" for o in overrides)])


def _schema_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the config dataclass `cls`: its tables' keys and leaf keys."""
    keys = []
    for name, tp in get_type_hints(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        keys.append(key)
        if dataclasses.is_dataclass(tp):
            keys += _schema_keys(tp, key)
    return keys


def _did_you_mean(cls, path: list[str], i: int) -> str:
    """The hint "; did you mean `KEY`?" for the unknown component `path[i]` of a dotted key
    of `cls` (the nearest name at that level, else the nearest key anywhere), or ""."""
    tp = cls
    for name in path[:i]:
        tp = get_type_hints(tp)[name]
    here = list(get_type_hints(tp))
    near = difflib.get_close_matches(path[i], here, n=1)
    if near:
        guess = ".".join([*path[:i], near[0], *path[i + 1 :]])
    else:  # a key of another table, or a table left out: `steps` for `optim.steps`
        keys = _schema_keys(cls)
        wanted = ".".join(path[i:])
        same = [k for k in keys if k.endswith("." + wanted)]
        near = same or difflib.get_close_matches(".".join(path), keys, n=1, cutoff=0.75)
        if not near:
            return ""
        guess = near[0]
    return f"; did you mean `{guess}`?"


def _key_type(cls, key: str, renamed: Mapping[str, str]):
    """The annotation of the dotted `key` of `cls`; a `ConfigError` for a key that is not
    one, naming the nearest that is."""
    path = key.split(".")
    tp = cls
    for i, name in enumerate(path):
        here = ".".join(path[: i + 1])
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(
                f"`{'.'.join(path[:i])}` is a value, not a table: it has no key `{name}`"
            )
        hints = get_type_hints(tp)
        if name not in hints:
            if here in renamed:
                raise ConfigError(f"`{here}` was renamed; set `{renamed[here]}` instead")
            table = f"keys of [{'.'.join(path[:i])}]" if i else "tables"
            raise ConfigError(
                f"unknown key `{here}`{_did_you_mean(cls, path, i)} ({table}: "
                f"{', '.join(hints)})"
            )
        tp = hints[name]
    if dataclasses.is_dataclass(tp):
        first = next(iter(get_type_hints(tp)))
        raise ConfigError(f"`{key}` is a table; set one of its keys, e.g. `{key}.{first}`")
    return tp


def _takes_text(tp) -> bool:
    """Whether the annotation `tp` is `str` or `str | None`."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return set(get_args(tp)) <= {str, type(None)} and str in get_args(tp)
    return tp is str


def parse_override(text: str) -> tuple[str, Any]:
    """`"KEY=VALUE"` (a `--set` argument) as `(KEY, value)`: VALUE read as a TOML value
    (`150`, `1e-3`, `true`, `"text"`, `[1, 2]`), or as the text itself where it is not one
    (`sort`, `runs/x`, `hf:DIR`)."""
    if not isinstance(text, str):
        raise ConfigError(f"an override must be a string KEY=VALUE, got {text!r}")
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"`--set` {text!r} is not KEY=VALUE with a dotted KEY; write e.g. "
            "--set optim.steps=150"
        )
    raw = raw.strip()
    try:
        doc = tomllib.loads(f"value = {raw}")
    except tomllib.TOMLDecodeError:
        return key, raw
    # a value followed by more TOML (`1\nx = 2`) is text, not a value and a stray key
    return (key, doc["value"]) if set(doc) == {"value"} else (key, raw)


def override(cls: type, table: dict, overrides: Sequence[str],
             renamed: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """A copy of the config table `table` with each `KEY=VALUE` of `overrides` set in it,
    in order (a later one wins): the key checked against the schema of the dataclass
    `cls` (an unknown key names the nearest known one; `renamed` maps old keys to new),
    the value parsed by `parse_override` and checked against the key's type (for a
    string key, a value that reads as another TOML type is taken as its text: `2024`).
    The whole config is validated afterwards, as a file's is (`from_dict`)."""
    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides must be a list of KEY=VALUE strings, got the string {overrides!r}; "
            f"write [{overrides!r}]"
        )
    table = copy.deepcopy(table)
    for text in overrides:
        key, value = parse_override(text)
        try:
            tp = _key_type(cls, key, renamed or {})
            if _takes_text(tp) and not isinstance(value, str):
                value = text.partition("=")[2].strip()
            _coerce(value, tp, key)
        except ConfigError as e:
            raise ConfigError(f"`--set` {text!r}: {e}") from None
        *tables, leaf = key.split(".")
        here = table
        for name in tables:
            if not isinstance(here.get(name), dict):
                here[name] = {}
            here = here[name]
        here[leaf] = value
    return table


SEED_MAX = 2**32 - 1  # jax.random.PRNGKey takes a uint32 seed: a wider one would be truncated


def choices(name: str, value, names) -> None:
    """Raise `ConfigError` unless `value` is one of `names` (a registry's keys)."""
    names = sorted(names)
    if value not in names:
        raise ConfigError(f"`{name}`={value!r} is not known; choose one of {names}")


def seed(name: str, value: int) -> None:
    """Raise `ConfigError` unless `value` is a seed in [0, 2**32 - 1], exactly representable."""
    if not 0 <= value <= SEED_MAX:
        raise ConfigError(f"`{name}`={value} must be an integer in [0, {SEED_MAX}]")


def positive(name: str, value):
    """Raise `ConfigError` unless `value` is a positive finite number."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"`{name}` must be positive, got {value!r}")
