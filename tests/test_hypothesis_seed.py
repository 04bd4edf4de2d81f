"""The property tests' draws under CI (`tests/hypothesis_seed.py`, read by `conftest.py`):
reproducible from a seed that changes with the tested commit, each test its own, where
derandomised runs drew the same inputs on every commit."""

import datetime
import types

import hypothesis_seed as hs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

COMMIT = "0123abcd" + "f" * 32


def test_the_run_seed_is_the_commits_under_ci():
    assert hs.run_seed({"CI": "true"}, head=COMMIT + "\n") == 0x0123ABCD
    assert hs.run_seed({"CI": "1"}, head="89ABCDEF" + "0" * 32) == 0x89ABCDEF
    # no commit (not a git checkout): the UTC date, YYYYMMDD
    today = datetime.datetime.now(datetime.UTC)
    assert hs.run_seed({"CI": "true"}, head="") in {
        int((today + datetime.timedelta(days=d)).strftime("%Y%m%d")) for d in (0, 1)
    }
    # a seed given replays a run, with or without CI; no CI and none given: random draws
    assert hs.run_seed({"CI": "true", hs.SEED_VAR: "42"}, head=COMMIT) == 42
    assert hs.run_seed({hs.SEED_VAR: " 7 "}) == 7
    assert hs.run_seed({}, head=COMMIT) is None
    with pytest.raises(pytest.UsageError, match=f"{hs.SEED_VAR}='0x12' must be a non-negative"):
        hs.run_seed({hs.SEED_VAR: "0x12"})


def test_this_checkout_under_ci_seeds_from_its_head():
    """Without a `head` given, under CI: this checkout's commit (a git checkout) or the date."""
    seed = hs.run_seed({"CI": "true"})
    assert isinstance(seed, int) and 0 <= seed < 16**8


def _drawn(seed: int | None, name: str) -> list[int]:
    """The integers a property test draws when collected in a run of `seed`."""
    seen = []

    @settings(max_examples=8, database=None)
    @given(st.integers(0, 10**9))
    def probe(x):
        seen.append(x)

    probe.__qualname__ = name
    others = [types.SimpleNamespace(), types.SimpleNamespace(obj=lambda: None)]  # not Hypothesis'
    hs.seed_property_tests([*others, types.SimpleNamespace(obj=probe)], seed)
    probe()
    return seen


def test_draws_repeat_with_the_seed_and_change_with_it_and_the_test():
    a = _drawn(0x0123ABCD, "test_a")
    assert len(a) == 8 and _drawn(0x0123ABCD, "test_a") == a
    assert _drawn(0x89ABCDEF, "test_a") != a  # another commit, other inputs
    assert _drawn(0x0123ABCD, "test_b") != a  # another test, other inputs
    assert len({hs.property_test_seed(s, n) for s in (1, 2) for n in ("a", "b")}) == 4


def test_the_run_says_its_seed():
    assert hs.header(None).startswith("itde: Hypothesis draws at random")
    assert f"{hs.SEED_VAR}=123 python -m pytest" in hs.header(123)
    line = hs.replay(123, "tests/test_x.py::test_y")
    assert line.endswith(f"{hs.SEED_VAR}=123 python -m pytest -q tests/test_x.py::test_y")
