"""Test configuration, the one place that sets the numeric mode of the suite.

- float64: `jax_enable_x64` is on for the whole session, set here before any test module
  is imported. Tests never toggle it; float32 and bfloat16 tests pass their dtypes
  explicitly (training runs in float32).
- torch is a test dependency (`pip install -e ".[test,torch]"`), the reference that
  several equivalence tests compare with. The session stops before collecting anything
  when it is missing: a missing reference fails loudly instead of turning tests into
  skips or into a scatter of import errors. Test modules import torch plainly.
"""

import importlib.util
import os
import subprocess
import sys

import cli_coverage
import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
# The `itde` command keeps JAX's persistent compilation cache in the user's cache directory
# (`itde._compilation_cache`); the suite writes nothing there and compiles every program
# afresh, in this process (`itde.cli.main`) and in the subprocesses that copy os.environ.
# tests/test_compilation_cache.py points it at temporary directories.
os.environ["ITDE_COMPILATION_CACHE"] = "off"

# XLA's CPU compile flags for the tests. Most of the suite's time is XLA compiling small
# programs that then run for milliseconds, so the tests compile with LLVM's optimisation
# off and XLA's older loop emitters (the fusion emitters' MLIR pipeline is the slower one
# to compile): measured on 2 cores, the default suite's compile-bound tests take about half
# the time. The programs are the same (same HLO passes, no fast math); another code
# generator rounds differently, so results move by a few ulps (measured: 7e-16 on a float64
# model's output, 4e-7 in float32), far inside every test's tolerance, and a bitwise check
# compares two runs made with the same flags. Set before JAX starts a backend, so every test
# and the subprocesses that copy os.environ compile the same way (the multi-host workers
# drop XLA_FLAGS: they compare only with each other).
# ITDE_TEST_XLA_DEFAULTS=1 runs the suite with XLA's own defaults (a flag already in
# XLA_FLAGS is kept as given).
# XLA aborts the process on a flag it does not know, and these are debug options that come
# and go between jaxlib versions (pyproject allows a range of jaxlib versions): each set is
# tried once in a short subprocess, largest first, and the first that starts a CPU backend
# is used (none: XLA's defaults). The first process to check (pytest-xdist's controller)
# leaves the result in the environment, so its workers and subprocesses inherit it.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_CHECKED = "ITDE_TEST_XLA_FLAGS_CHECKED"


def _test_xla_flags() -> None:
    if os.environ.get("ITDE_TEST_XLA_DEFAULTS") or os.environ.get(_CHECKED):
        return
    os.environ[_CHECKED] = "1"
    given = os.environ.get("XLA_FLAGS", "")
    added = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in given]
    for n in range(len(added), 0, -1):
        flags = " ".join([given, *added[:n]]).strip()
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        probe = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"
        try:
            ok = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                timeout=120).returncode == 0  # fmt: skip
        except subprocess.TimeoutExpired:
            ok = False
        if ok:
            os.environ["XLA_FLAGS"] = flags
            return


_test_xla_flags()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

# Hypothesis (the property tests): few examples, since each new shape is an XLA compile; no
# deadline (a first call compiles). Locally the examples are random and the failures
# Hypothesis finds are kept in .hypothesis/. Where the environment variable CI is set
# (`.ci/run` sets it) the draws are reproducible but not fixed (tests/hypothesis_seed.py):
# the run's seed is the tested commit's (its first 8 hex digits; the UTC date outside a git
# checkout) and each property test draws from a seed of its own, derived from the run's and
# its name. So each commit draws other inputs (derandomised runs replayed the same ones
# forever), the run prints its seed in its header and under a failed property test, and
# ITDE_HYPOTHESIS_SEED=N draws a run's inputs again (with or without CI). The controller
# leaves the seed in the environment, so its workers and subprocesses draw from the same one.
import hypothesis  # noqa: E402
import hypothesis_seed  # noqa: E402
from hypothesis import settings  # noqa: E402

HYPOTHESIS_SEED = hypothesis_seed.run_seed()
if HYPOTHESIS_SEED is not None:
    os.environ[hypothesis_seed.SEED_VAR] = str(HYPOTHESIS_SEED)
settings.register_profile("itde", max_examples=12, deadline=None, print_blob=True)
settings.register_profile("itde-ci", parent=settings.get_profile("itde"), database=None)
settings.load_profile("itde" if HYPOTHESIS_SEED is None else "itde-ci")


def pytest_report_header(config):
    return hypothesis_seed.header(HYPOTHESIS_SEED)


def pytest_collection_modifyitems(config, items):
    hypothesis_seed.seed_property_tests(items, HYPOTHESIS_SEED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed property test's report says the seed its inputs were drawn from."""
    outcome = yield
    report = outcome.get_result()
    fn = getattr(item, "obj", None)
    if (report.failed and HYPOTHESIS_SEED is not None and fn is not None
            and hypothesis.is_hypothesis_test(fn)):  # fmt: skip
        report.sections.append(("itde: Hypothesis seed",
                                hypothesis_seed.replay(HYPOTHESIS_SEED, item.nodeid)))  # fmt: skip


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "runs(*commands): the test runs these `itde` commands (keys of tests/cli_coverage.py) "
        "to completion; it fails if one did not run, and test_commands.py requires every "
        "command to be run so by a default-tier test",
    )
    cli_coverage.start_recording()
    if importlib.util.find_spec("torch") is None:
        raise pytest.UsageError(
            "torch is not installed, but it is a test dependency (the PyTorch reference of "
            'the equivalence tests): install it with `pip install -e ".[test,torch]"`.'
        )


@pytest.fixture(autouse=True)
def _commands_the_test_says_it_runs(request):
    """A test marked `@pytest.mark.runs(KEY, ...)` must have completed each command (in
    this process, its fixtures included): the marker is what `test_commands.py` counts."""
    marker = request.node.get_closest_marker("runs")
    yield
    if marker is not None:
        missing = [k for k in marker.args if k not in cli_coverage.README_KEYS
                   and k not in cli_coverage.RAN]  # fmt: skip
        assert not missing, (
            f"marked as running {missing}, which did not complete; ran {sorted(cli_coverage.RAN)}"
        )


def pytest_sessionfinish(session, exitstatus):
    """At the end of a worker's session, drop JAX's garbage-collection callback.

    pytest-xdist ends a worker through execnet, which interrupts the worker's main thread
    (`_thread.interrupt_main`) if it is still busy. When that `KeyboardInterrupt` arrives
    while Python runs a gc callback, here JAX's `_xla_gc_callback` (it frees device buffers
    after each collection), Python reports it as an exception "ignored in" the callback and
    pytest prints a `PytestUnraisableExceptionWarning` traceback before the summary. With
    the callback gone the interrupt lands in ordinary code and the worker ends quietly; at
    this point nothing needs device buffers freed early."""
    import gc

    gc.callbacks[:] = [c for c in gc.callbacks if getattr(c, "__name__", "") != "_xla_gc_callback"]


# Compiled programs are freed when a worker's memory mappings near Linux's limit. Every
# program XLA compiles for the CPU holds memory mappings of its own (about a dozen for a small
# program, some 130 for the forward pass of a converted model), and JAX keeps what it compiles
# (its caches are bounded in entries, not in memory). A worker of the slow tier compiles
# thousands of programs: one reached `vm.max_map_count` (65,530) in the sweep of every length
# in tests/test_property_inputs.py (900 programs, about 119,000 mappings in all) and LLVM's
# JIT, failing to map the next program, aborted it. So after a test, when the worker holds
# more mappings than a third of the limit, every compiled program is freed (the library's
# program cache, JAX's caches): tests share compiled programs across tests and modules until
# memory demands otherwise, and no test brings a worker near the limit on its own (the
# largest adds about 7,000). Counting the mappings reads /proc/self/maps (some 30 ms at
# 20,000), so a worker counts at most once every 2 s of testing; without /proc (not Linux),
# nothing is freed.
def _map_count_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65_530


_FREE_ABOVE_MAPPINGS = min(20_000, _map_count_limit() // 3)
_COUNT_EVERY_S = 2.0
_last_count = [float("-inf")]


def _mappings() -> int:
    """The number of memory mappings of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test and its fixtures' teardown: free every compiled program when the
    worker's memory mappings are above `_FREE_ABOVE_MAPPINGS`."""
    import time

    now = time.monotonic()
    if now - _last_count[0] < _COUNT_EVERY_S:
        return
    _last_count[0] = now
    if _mappings() > _FREE_ABOVE_MAPPINGS:
        import gc

        import itde

        itde.programs.clear()
        jax.clear_caches()
        gc.collect()
