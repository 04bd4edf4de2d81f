r"""Multi-host bookkeeping: process 0 alone touches the output directory, and every process
learns what it read, or how it failed.

In a run of several processes (after `jax.distributed.initialize`) the training step is
the same SPMD program everywhere, but files are not: the checkpoint, its sidecar and the
metrics live on a filesystem that only process 0 is promised to see. So every read or
write of such a file goes through [`on_main`][]: process 0 calls the function, then
broadcasts its JSON-able result, or its bytes, or its error, to every process
(`jax.experimental.multihost_utils.broadcast_one_to_all`, a collective). Hence

- a resumed run's sidecar (step, data key, config, wall time) and its verified leaves file
  (parameters and optimiser state) reach the other processes by broadcast, bit for bit;
- an error process 0 finds (a missing, damaged or foreign checkpoint, a config that does
  not match it) is raised on every process with the same message, rather than killing
  process 0 while the others wait forever in the next collective;
- the broadcast after a save is a barrier: no process passes it before process 0 has
  committed the checkpoint, or learnt that it could not.

With one process, `on_main(fn)` is `fn()`: no collective, no copy, the original exception.

The function given to `on_main` must not itself run a collective (it runs on process 0
only; a collective there would wait for processes that never join it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def is_main() -> bool:
    """Whether this is process 0, the one that reads and writes the run's files."""
    return jax.process_index() == 0


def _broadcast_bytes(data: bytes | None) -> bytes:
    """`data` of process 0 on every process (the others pass `None`)."""
    from jax.experimental.multihost_utils import broadcast_one_to_all

    n = len(data) if data is not None else 0
    # the length as two uint32 words: int64 would be narrowed without jax_enable_x64
    hi, lo = broadcast_one_to_all(np.array([n >> 32, n & 0xFFFFFFFF], dtype=np.uint32))
    n = (int(hi) << 32) | int(lo)
    if n == 0:
        return b""
    buf = np.frombuffer(data, np.uint8) if data is not None else np.zeros(n, np.uint8)
    return np.asarray(broadcast_one_to_all(buf), dtype=np.uint8).tobytes()


def on_main(fn: Callable[[], Any], *, errors: tuple[type[Exception], ...] = ()) -> Any:
    """Call `fn()` on process 0 and give its result to every process.

    **Arguments:**

    - `fn`: no arguments; returns `bytes`, or a JSON-serialisable value (lists, dicts,
      strings, numbers, `None`). It must not run a collective.
    - `errors`: exception classes that are raised again, with process 0's message, on the
      other processes; any other exception of process 0 becomes a `RuntimeError` there
      that names its class. Process 0 raises its own exception.

    **Returns:** `fn()`'s bytes, or its value after a JSON round trip (so that every
    process holds the identical value: tuples become lists), the same on every process.
    All processes must call `on_main` at the same point of the program.
    """
    if jax.process_count() == 1:
        return fn()
    if is_main():
        failure = None
        blob = b""
        try:
            value = fn()
            if isinstance(value, bytes):
                header, blob = {"bytes": True}, value
            else:
                header = {"value": value}
            text = json.dumps(header)
        except Exception as e:
            failure = e
            text = json.dumps({"error": type(e).__name__, "message": str(e)})
        _broadcast_bytes(text.encode() + b"\n" + blob)
        if failure is not None:
            raise failure
    else:
        message = _broadcast_bytes(None)
        text, _, blob = message.partition(b"\n")
        header = json.loads(text)
        if "error" in header:
            kind, msg = header["error"], header["message"]
            for cls in errors:
                if cls.__name__ == kind:
                    raise cls(msg)
            raise RuntimeError(f"process 0 failed with {kind}: {msg}")
    return blob if header.get("bytes") else json.loads(text)["value"]
