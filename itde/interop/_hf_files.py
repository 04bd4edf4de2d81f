"""The files of a Hugging Face model directory, checked before `from_pretrained` reads them:
a truncated or corrupted weights file is named with the fix, instead of the safetensors
library's own traceback from deep inside the load."""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["check_safetensors"]


def _problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (8-byte header length, JSON header, and
    the tensors' bytes exactly filling the rest), or None."""
    size = path.stat().st_size
    if size < 8:
        return f"{size} bytes, shorter than the 8-byte header length"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            return f"its header claims {n} bytes, more than the file's {size - 8} after it"
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - n
    ends = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):  # fmt: skip
            return f"tensor {key!r} has no valid data_offsets"
        begin, end = offsets
        if not 0 <= begin <= end <= data:
            return f"tensor {key!r} lies at bytes {begin}..{end} of {data} data bytes"
        ends.append(end)
    if max(ends, default=0) != data:
        return f"its tensors fill {max(ends, default=0)} of its {data} data bytes"
    return None


def check_safetensors(directory: str | Path, name: str) -> None:
    """Raise `ValueError` naming `name` (the argument, flag or config key that gave
    `directory`) and the file, if a `*.safetensors` file of `directory` is truncated or
    corrupted."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        why = _problem(path)
        if why is not None:
            raise ValueError(
                f"`{name}`: the weights file {path.name} in {directory} is not a whole "
                f"safetensors file ({why}): it is truncated or corrupted; save the model "
                "there again with `model.save_pretrained(DIR)`."
            )
