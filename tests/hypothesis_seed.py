"""The property tests' Hypothesis seed (read by `conftest.py`).

Locally (no `CI`, no `ITDE_HYPOTHESIS_SEED`) the draws are random and Hypothesis keeps the
failures it finds in `.hypothesis/`. Under CI a run draws from a seed of its own, the tested
commit's, so that every commit tries other inputs while a run stays reproducible: a failure
is drawn again with `ITDE_HYPOTHESIS_SEED=<the seed the run printed> python -m pytest ...`.
Each property test draws from a seed derived from the run's and the test's name, so that
tests that share a strategy draw different inputs."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
from pathlib import Path

import hypothesis
import pytest

SEED_VAR = "ITDE_HYPOTHESIS_SEED"


def run_seed(environ=None, head: str | None = None) -> int | None:
    """The run's seed: `ITDE_HYPOTHESIS_SEED` where set; else, under CI, the commit `head`
    (default: `git rev-parse HEAD` of this checkout) read as the integer of its first 8 hex
    digits, or today's UTC date as the integer YYYYMMDD where there is no commit; else None
    (random draws)."""
    environ = os.environ if environ is None else environ
    given = environ.get(SEED_VAR, "").strip()
    if given:
        if not given.isdigit():
            raise pytest.UsageError(
                f"{SEED_VAR}={given!r} must be a non-negative integer (the seed a run prints "
                "in its header), or unset"
            )
        return int(given)
    if not environ.get("CI"):
        return None
    if head is None:
        try:
            head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                                  capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            head = ""
    head = head.strip().lower()
    if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", head):
        return int(head[:8], 16)
    return int(time.strftime("%Y%m%d", time.gmtime()))


def property_test_seed(seed: int, name: str) -> int:
    """The seed of the property test `name` (module and function) in a run of `seed`."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def seed_property_tests(items, seed: int | None) -> None:
    """Give each collected property test its own seed (`hypothesis.seed`) in a run of
    `seed`; None leaves them as they are."""
    if seed is None:
        return
    for item in items:
        fn = getattr(item, "obj", None)
        if fn is not None and hypothesis.is_hypothesis_test(fn):
            hypothesis.seed(property_test_seed(seed, f"{fn.__module__}.{fn.__qualname__}"))(fn)


def header(seed: int | None) -> str:
    """The line of pytest's header that says how this run draws."""
    if seed is None:
        return f"itde: Hypothesis draws at random (no CI, no {SEED_VAR})"
    return f"itde: Hypothesis seed {seed} (replay: {SEED_VAR}={seed} python -m pytest ...)"


def replay(seed: int, nodeid: str) -> str:
    """Under a failed property test: the seed and the command that draws its inputs again."""
    again = f"{SEED_VAR}={seed} python -m pytest -q {nodeid}"
    return f"drawn in a run of {SEED_VAR}={seed}; replay: {again}"
