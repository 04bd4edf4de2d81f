"""Timing shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

import statistics
import time


def median_time(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls of `fn` (which must block until done)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
