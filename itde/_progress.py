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
