r"""Compiled programs that a session keeps, bounded, and the count of what it compiles.

A session brings many shapes: a new prompt length, a new token count $N$. JAX keeps every
program it compiles in caches that grow with each new shape (bounded in entries, not in
memory; on the CPU each program holds about a dozen memory mappings of its own, and a
process that reaches Linux's `vm.max_map_count` dies). The library's entry points that a
session calls with many shapes therefore (1) pad into a bounded set of shapes (buckets),
and (2) run through [`ProgramCache`][itde.ProgramCache]: each program is compiled ahead
of time from a function of its own, held by the cache and nowhere else, and freed (its
executable and its mappings) when the cache evicts it, least recently used first.

[`count_compilations`][itde.count_compilations] counts the programs XLA compiles inside a
`with` block (JAX's monitoring events): tests use it to hold a workload to its number of
programs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.extend.core import get_opaque_trace_state

#: The environment variable that sets the capacity of the library's program cache.
CAPACITY_VARIABLE = "ITDE_PROGRAM_CACHE"
_DEFAULT_CAPACITY = 32

_ERROR_MARK = "_EquinoxRuntimeError: "


class _Hush(logging.Filter):
    """Drops JAX's log of a failed callback: an `eqx.error_if` raised inside a program is
    re-raised below with its own message (as `eqx.filter_jit` does)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "jax._src.callback"
                    and record.getMessage() == "jax.pure_callback failed")  # fmt: skip


def _signature(args):
    """The cache key of `args` (its tree structure, its static leaves, the shape, dtype
    and weak type of its arrays), its leaves and which of them are arrays; None when a
    leaf is a tracer (the caller is being traced: the function is inlined into the
    caller's program, nothing is compiled)."""
    leaves, treedef = jtu.tree_flatten(args)
    static, avals, dynamic = [], [], []
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            return None
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            dynamic.append(True)
            static.append(None)
            avals.append((leaf.shape, leaf.dtype, bool(getattr(leaf, "weak_type", False))))
        else:
            dynamic.append(False)
            static.append(leaf)
    return (treedef, tuple(static), tuple(avals)), leaves, dynamic


class ProgramCache:
    """A bounded cache of compiled programs: `cache(fn, *args)` is `fn(*args)`, run by a
    program compiled once for `fn` and the shapes, dtypes and static values of `args`
    (as `eqx.filter_jit` splits them: arrays are inputs, everything else is part of the
    program), and kept for the next call with the same.

    At most `capacity` programs are held; a new one evicts the least recently used, whose
    executable is freed with it (it is compiled from a function object of its own, so no
    cache of JAX's keeps it alive). Called under a trace (inside a caller's `jax.jit`,
    `grad` or `vmap`), `fn` is traced into the caller's program instead.

    A failed `eqx.error_if` inside a program raises `equinox.EquinoxRuntimeError` with
    its message, as under `eqx.filter_jit`.

    **Arguments:** `capacity`: the number of programs held (default: the environment
    variable `ITDE_PROGRAM_CACHE`, else 32).

    [`prepare`][itde.ProgramCache.prepare] compiles a program in a background thread from
    the shapes of its arguments, before they exist (XLA compiles with the interpreter's
    lock released: a program compiles on one core while the caller works on another).

    **Attributes** (counters since creation or [`clear`][itde.ProgramCache.clear]):
    `compiled` (programs compiled), `hits` (calls served by a held program), `evicted`,
    `compile_seconds` (time spent tracing, lowering and compiling).
    """

    def __init__(self, capacity: int | None = None):
        if capacity is None:
            capacity = int(os.environ.get(CAPACITY_VARIABLE, _DEFAULT_CAPACITY))
        self._lock = threading.RLock()
        self._programs: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._pending: dict[Any, concurrent.futures.Future] = {}
        self.capacity = capacity
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.compiled = 0
        self.hits = 0
        self.evicted = 0
        self.compile_seconds = 0.0

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"`capacity`={value!r} must be an integer >= 1 (the number of compiled "
                f"programs held; the environment variable {CAPACITY_VARIABLE} sets it too)."
            )
        with self._lock:
            self._capacity = value
            self._evict()

    def __len__(self) -> int:
        return len(self._programs)

    def _evict(self) -> None:
        while len(self._programs) > self._capacity:
            self._programs.popitem(last=False)
            self.evicted += 1

    def clear(self) -> None:
        """Drop every program (their executables are freed) and reset the counters."""
        with self._lock:
            self._programs.clear()
            self._reset_counts()

    def _held(self, key):
        with self._lock:
            program = self._programs.get(key)
            if program is not None:
                self._programs.move_to_end(key)
            return program

    def _compile_and_hold(self, fn, key, leaves, dynamic, lowered=None) -> _Program:
        start = time.perf_counter()
        if lowered is None:
            lowered = _lower(fn, key[1], leaves, dynamic)
        program = _Program(lowered[0].compile(), *lowered[1])
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            self.compiled += 1
            self._programs[key] = program
            self._evict()
        return program

    def holds(self, fn: Callable, *args) -> bool:
        """Whether the program of `fn` for `args` is held or under way."""
        sig = _signature(args)
        if sig is None:
            return False
        key = (fn, *sig[0])
        with self._lock:
            return key in self._programs or key in self._pending

    def prepare(self, fn: Callable, *args, trace_here: bool = False) -> None:
        """Start compiling the program of `fn` for `args` in a background thread, unless
        it is held or under way: array leaves of `args` may be `jax.ShapeDtypeStruct`s
        (the shapes of arguments not computed yet). The next call `cache(fn, *args)` with
        arrays of those shapes waits for it instead of compiling. A compilation that
        fails here is tried again, in the caller's thread, by that call.

        `trace_here`: trace and lower `fn` in the caller's thread first, and leave only
        XLA's compile (which runs without the interpreter's lock) to the background: the
        program's compile then starts before the caller traces anything else (tracing
        holds the lock, so two programs traced in two threads take turns)."""
        sig = _signature(args)
        if sig is None:
            return
        key = (fn, *sig[0])
        with self._lock:
            if key in self._programs or key in self._pending:
                return
        lowered = None
        if trace_here:
            start = time.perf_counter()
            try:
                lowered = _lower(fn, key[1], sig[1], sig[2])
            except Exception:  # said again by the call that needs the program
                return
            with self._lock:
                self.compile_seconds += time.perf_counter() - start
        with self._lock:
            if key in self._programs or key in self._pending:
                return
            self._pending[key] = _background.submit(
                self._compile_and_hold, fn, key, sig[1], sig[2], lowered
            )

    def __call__(self, fn: Callable, *args):
        sig = _signature(args)
        if sig is None:
            return fn(*args)
        key = (fn, *sig[0])
        leaves, dynamic = sig[1], sig[2]
        program = self._held(key)
        if program is None:
            with self._lock:
                pending = self._pending.pop(key, None)
            if pending is not None and pending.exception() is None:
                program = self._held(key) or pending.result()
        if program is None:
            program = self._compile_and_hold(fn, key, leaves, dynamic)
        else:
            self.hits += 1
        return _run(program, [x for x, d in zip(leaves, dynamic) if d])

    def __repr__(self) -> str:
        return (
            f"ProgramCache(capacity={self._capacity}, held={len(self._programs)}, "
            f"compiled={self.compiled}, hits={self.hits}, evicted={self.evicted})"
        )


class _Program:
    """A compiled program, the static part of its output and the messages of the checks
    it returns as flags (see [`check`][itde._programs.check])."""

    __slots__ = ("compiled", "out_static", "messages")

    def __init__(self, compiled, out_static, messages):
        self.compiled = compiled
        self.out_static = out_static
        self.messages = messages


# ------------------------------------------------------------------ checks as data
_sink = threading.local()


def _top_level() -> list | None:
    """The flags of the program being traced in this thread, where the caller is at its
    top level (not inside a loop, a branch or a map of it); else None."""
    state = getattr(_sink, "state", None)
    if state is None or get_opaque_trace_state(convention="flax") != state[0]:
        return None
    return state[1]


def check(x, pred, message: str):
    """`x`, failing with `message` where `pred` (a boolean array) holds: `eqx.error_if`,
    except at the top level of a [`ProgramCache`][itde.ProgramCache] program, where the
    flag is returned with the program's output and raised on the host
    (`equinox.EquinoxRuntimeError`, the same message) after the program ran. Such a
    program calls back into Python for no check, so JAX's persistent compilation cache
    can write it (a program with a callback is compiled again in every process)."""
    flags = _top_level()
    if flags is None:
        return eqx.error_if(x, pred, message)
    flags.append((jnp.any(pred), message))
    return x


def checks_on_host() -> bool:
    """Whether [`check`][itde._programs.check] called here returns its flag to the host
    (the top level of a program being compiled) rather than calling back."""
    return _top_level() is not None


def _lower(fn: Callable, treedef, leaves: list, dynamic: list[bool]):
    """`fn` traced and lowered for these leaves (`jax.stages.Lowered`, and the static
    part of its output and its checks' messages): the arrays are the program's inputs,
    the other leaves are closed over (not passed as static arguments, which JAX's global
    caches would keep alive); the function lowered is a closure of its own, so JAX's
    caches, keyed weakly on it, free the executable with the `_Program`."""
    static = [None if d else leaf for leaf, d in zip(leaves, dynamic)]
    out_static = []

    def program(arrays):
        it = iter(arrays)
        full = [next(it) if d else s for d, s in zip(dynamic, static)]
        flags: list = []
        previous = getattr(_sink, "state", None)
        _sink.state = (get_opaque_trace_state(convention="flax"), flags)
        try:
            out = fn(*jtu.tree_unflatten(treedef, full))
        finally:
            _sink.state = previous
        arrays_out, static_out = eqx.partition(out, eqx.is_array)
        out_static.append((static_out, tuple(m for _, m in flags)))
        return arrays_out, [f for f, _ in flags]

    program.__name__ = getattr(fn, "__name__", "program")
    program.__qualname__ = getattr(fn, "__qualname__", program.__name__)
    arrays = [leaf for leaf, d in zip(leaves, dynamic) if d]
    lowered = jax.jit(program).lower(arrays)
    return lowered, out_static[0]


def _run(program: _Program, arrays: list):
    hush = _Hush()
    logger = logging.getLogger("jax._src.callback")
    logger.addFilter(hush)
    try:
        out, flags = program.compiled(arrays)
    except jax.errors.JaxRuntimeError as e:
        text = str(e)
        if _ERROR_MARK not in text:
            raise
        message = text.split(_ERROR_MARK, 1)[1].split("\n\n\n", 1)[0].strip()
        raise eqx.EquinoxRuntimeError(message) from None
    finally:
        logger.removeFilter(hush)
    for flag, message in zip(flags, program.messages, strict=True):
        if bool(np.asarray(flag)):
            raise eqx.EquinoxRuntimeError(message)
    return eqx.combine(out, program.out_static)


_background = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="itde-compile")

programs = ProgramCache()
"""The library's [`ProgramCache`][itde.ProgramCache]: generation, eager solves and the
studies and analyses over many shapes run through it. `itde.programs.capacity = 64`
holds more programs (the environment variable `ITDE_PROGRAM_CACHE` sets the capacity at
start-up); `itde.programs.clear()` frees them all; `itde.programs.compiled` counts what
it compiled."""


# ------------------------------------------------------------------ counting compilations
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # compiled or loaded
_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # loaded from the persistent cache
_counters: list[list[int]] = []
_listening = False
_listen_lock = threading.Lock()


def _on_duration(event: str, duration: float, **_) -> None:
    if event == _COMPILE_EVENT:
        for counter in list(_counters):
            counter[0] += 1


def _on_event(event: str, **_) -> None:
    if event == _HIT_EVENT:
        for counter in list(_counters):
            counter[1] += 1


class Compilations:
    """What [`count_compilations`][itde.count_compilations] counted: `count`, the
    programs XLA compiled in the block, and `loaded`, those read from JAX's persistent
    compilation cache instead (not compiled, not in `count`)."""

    def __init__(self, counter: list[int]):
        self._counter = counter

    @property
    def count(self) -> int:
        return self._counter[0] - self._counter[1]

    @property
    def loaded(self) -> int:
        return self._counter[1]

    def __repr__(self) -> str:
        return f"Compilations(count={self.count}, loaded={self.loaded})"


@contextlib.contextmanager
def count_compilations() -> Iterator[Compilations]:
    """Count the programs XLA compiles while the block runs, in every thread (JAX's
    monitoring events for a backend compilation and for a persistent-cache hit, so small
    programs of eager operations count as well as the library's):

        with itde.count_compilations() as c:
            lm.generate(prompt, 8)
        print(c.count, c.loaded)
    """
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
    counter = [0, 0]
    _counters.append(counter)
    try:
        yield Compilations(counter)
    finally:
        _counters.remove(counter)


__all__ = ["CAPACITY_VARIABLE", "Compilations", "ProgramCache", "count_compilations", "programs"]
