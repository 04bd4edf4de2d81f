"""Progress of a long command: a tqdm bar on a terminal, a few whole lines in a log.

Every progress report of the library (training, the convergence studies, encoding a
corpus) goes through `progress_bar`. On a terminal (or in a notebook) it is tqdm's bar,
redrawn in place. When the stream is not a terminal (a log file, a pipe, a CI job) a bar
would be one line of carriage returns, thousands of characters long, that a log viewer
shows as one line or as noise; there `LogLines` writes a whole line each tenth of the work
instead (each unit of work when there are ten or fewer: one line per stage).
"""

from __future__ import annotations

import math
import sys

from tqdm import std

#: How many lines a `LogLines` report writes at most (one per tenth of the total).
LOG_LINES = 10


class LogLines(std.tqdm):
    """A tqdm bar for a stream that is not a terminal: a line (ending in a newline, never
    a carriage return) each time the count passes another tenth of `total`, and one where
    it ends; rate, elapsed and remaining time and the postfix as tqdm computes them. With
    no `total`, a line at most every `interval` seconds."""

    interval = 30.0

    def __init__(self, *args, **kwargs):
        self._shown = None  # the stage of the last line (tqdm displays from __init__)
        self._shown_n = None
        kwargs.update(mininterval=0, miniters=1, leave=False, dynamic_ncols=False)
        kwargs.setdefault(
            "bar_format",
            "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} "
            "[{elapsed}<{remaining}, {rate_fmt}{postfix}]",
        )
        super().__init__(*args, **kwargs)
        if self.total is None:
            self.bar_format = None  # tqdm's own format for an open-ended count

    def _stage(self) -> int:
        if self.total:
            return math.floor(LOG_LINES * min(self.n, self.total) / self.total)
        return math.floor((self._time() - self.start_t) / self.interval)

    def display(self, msg=None, pos=None):
        if msg is not None:  # a request to clear the line: a log keeps its lines
            return False
        stage = self._stage()
        if self._shown is None:  # the start: no line yet
            self._shown = stage
            return False
        if stage < self._shown:  # the count set back (a clock restarted): said already
            return False
        if stage > self._shown:
            self._line(stage)
        return True

    def _line(self, stage: int) -> None:
        self._shown, self._shown_n = stage, self.n
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()

    def close(self):
        if not self.disable and self._shown_n != self.n and hasattr(self, "last_print_t"):
            self._line(self._stage())  # where it stopped, if no line says so yet
        super().close()


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


def _notebook() -> bool:
    """Whether tqdm draws its bars as notebook widgets here (tqdm.auto in IPython)."""
    from tqdm import auto

    return any(c.__module__ == "tqdm.notebook" for c in auto.tqdm.__mro__)


def progress_bar(total: int | float | None, desc: str, *, enabled: bool = True, file=None,
                 **kwargs) -> std.tqdm:  # fmt: skip
    """A progress report of `total` units of work, labelled `desc`: tqdm's bar (`tqdm.auto`)
    when `file` (default `sys.stderr`) is a terminal or in a notebook, else `LogLines`
    (about ten whole lines); nothing shown when `enabled` is false. `kwargs` are tqdm's
    (`initial`, `unit`, `unit_scale`, ...); the result has tqdm's methods (`update`,
    `set_postfix`, `close`)."""
    stream = sys.stderr if file is None else file
    if not enabled:
        return std.tqdm(total=total, desc=desc, disable=True, file=stream, **kwargs)
    if _notebook():
        from tqdm import auto

        return auto.tqdm(total=total, desc=desc, file=file, **kwargs)
    cls = std.tqdm if _is_terminal(stream) else LogLines
    return cls(total=total, desc=desc, file=stream, **kwargs)


def format_duration(seconds: float) -> str:
    """A duration for a person: `0.42 s`, `12 s`, `2 min 05 s`, `1 h 03 min`."""
    s = float(seconds)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"`seconds`={seconds!r} must be a finite duration >= 0.")
    if s < 10:
        return f"{s:.2g} s" if s < 1 else f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    m = int(round(s)) // 60
    if m < 60:
        return f"{m} min {int(round(s)) % 60:02d} s"
    return f"{m // 60} h {m % 60:02d} min"


def estimate_line(elapsed: float, total: float) -> str:
    """`about 3 min 10 s in all, 2 min 40 s left`: the estimate of a whole `total` seconds
    long, `elapsed` seconds into it."""
    if not 0 <= elapsed <= total:
        raise ValueError(f"`elapsed`={elapsed!r} must be in [0, `total`={total!r}].")
    return f"about {format_duration(total)} in all, {format_duration(total - elapsed)} left"


class Stages:
    """A line per stage of a long computation (a solve, a resolution, a fit) on `file`
    (default `sys.stderr`), whether or not it is a terminal: the stage's name when it
    starts, so the first line comes before any work, and when it ends its time and an
    estimate of the whole.

    Each `stage(what, cost, compiles)` is a context manager; `cost` is its share of the
    work (e.g. solver steps x stages), `total_cost` that of all stages, and `compiles`
    says the stage compiles something first. The estimate extrapolates by cost: the time
    per unit of cost of the stages that compiled nothing, plus for each stage still to
    compile the mean compilation time measured so far (a compiling stage's time less its
    cost at that rate); before a stage without compilation has run, the time per unit of
    cost of all the stages so far. Nothing is written when `enabled` is false."""

    def __init__(self, desc: str, n_stages: int, total_cost: float, *, enabled: bool = True,
                 file=None, clock=None):  # fmt: skip
        if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
            raise ValueError(f"`n_stages`={n_stages!r} must be a positive integer.")
        if not total_cost > 0:
            raise ValueError(f"`total_cost`={total_cost!r} must be > 0 (the cost of all stages).")
        import time

        self.desc, self.n_stages, self.total_cost = desc, n_stages, total_cost
        self.enabled, self.file = enabled, file
        self._clock = time.perf_counter if clock is None else clock
        self.done, self.done_cost = 0, 0.0
        self._warm = [0.0, 0.0]  # time and cost of the stages that compiled nothing
        self._compiling = []  # (time, cost) of the stages that compiled
        self._t0 = self._clock()

    def write(self, text: str) -> None:
        if self.enabled:
            stream = sys.stderr if self.file is None else self.file
            stream.write(f"{self.desc}: {text}\n")
            stream.flush()

    def estimate(self, remaining: list[tuple[float, bool]] | None = None) -> float:
        """The estimated total time in seconds, from the stages done: `remaining` lists the
        (cost, compiles) of the stages to come (default: their cost, no compilation)."""
        elapsed = self._clock() - self._t0
        if remaining is None:
            remaining = [(self.total_cost - self.done_cost, False)]
        if self._warm[1] > 0:
            rate = self._warm[0] / self._warm[1]
            extra = [t - c * rate for t, c in self._compiling]
            compile_s = max(0.0, sum(extra) / len(extra)) if extra else 0.0
        else:
            rate, compile_s = elapsed / self.done_cost, 0.0
        return elapsed + sum(c * rate + (compile_s if comp else 0.0) for c, comp in remaining)

    def stage(self, what: str, cost: float, compiles: bool = False, remaining=None):
        """A context manager around one stage of `cost` (> 0); `remaining` as `estimate`'s,
        for the stages after this one."""
        import contextlib

        if not cost > 0:
            raise ValueError(f"stage {what!r}: `cost`={cost!r} must be > 0.")
        if self.done_cost + cost > self.total_cost * (1 + 1e-9):
            raise ValueError(
                f"stage {what!r}: the stages cost more than `total_cost`={self.total_cost!r}."
            )

        @contextlib.contextmanager
        def run():
            k = f"[{self.done + 1}/{self.n_stages}]"
            self.write(f"{k} {what} ...")
            t = self._clock()
            yield
            took = self._clock() - t
            self.done += 1
            self.done_cost += cost
            if compiles:
                self._compiling.append((took, cost))
            else:
                self._warm[0] += took
                self._warm[1] += cost
            elapsed = self._clock() - self._t0
            if self.done < self.n_stages:
                est = estimate_line(elapsed, max(elapsed, self.estimate(remaining)))
                self.write(f"{k} took {format_duration(took)}; {est}")
            else:
                self.write(f"{k} took {format_duration(took)}; "
                           f"done in {format_duration(elapsed)}")  # fmt: skip

        return run()


def stage_line(desc: str, what: str, *, enabled: bool = True, file=None):
    """A context manager writing `desc: what ...` on `file` (default `sys.stderr`) before
    the work it wraps and `desc: what took 12 s` after: a stage of unknown cost (a
    reference solve before a study's bar) seen from its first second."""
    import contextlib
    import time

    @contextlib.contextmanager
    def run():
        stream = sys.stderr if file is None else file

        def say(text):
            if enabled:
                stream.write(f"{desc}: {text}\n")
                stream.flush()

        say(f"{what} ...")
        t = time.perf_counter()
        yield
        say(f"{what} took {format_duration(time.perf_counter() - t)}")

    return run()
