"""Shared plumbing of the gallery scripts: argument parsing, the claim-vs-measured table,
JSON output and figures. Not part of the library."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

T0 = time.perf_counter()


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (the tests)")
    p.add_argument("--out", default=f"runs/examples/{name}", help="output folder")
    return p


def positive_int(text: str) -> int:
    """An argparse `type` for a positive integer flag (argparse names the flag in the error:
    "argument --layers: must be a positive integer, got '0'")."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def check_out(p: argparse.ArgumentParser, args) -> Path:
    """`--out` as a folder: a clear error naming the flag when it is an existing file."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"argument --out: {str(out)!r} is a file, not a folder")
    return out


def stages(desc: str, costs, *, compiles=None, enabled: bool = True):
    """A line per stage of an experiment on stderr, with an estimate of the whole after the
    first (`itde`'s progress lines): `costs` the relative cost of each stage (e.g. its
    steps), `compiles` whether each compiles first (default: none). Use as
    `for stage in plan: with st.stage(name, cost, compiles, remaining): ...`, or through
    `each_stage`."""
    from itde._progress import Stages

    costs = list(costs)
    return Stages(desc, len(costs), float(sum(costs)), enabled=enabled)


def each_stage(desc: str, items, costs, names, compiles=None, enabled: bool = True):
    """Yield each of `items` inside its stage (see `stages`): its line before the work, its
    time and the estimate of the whole after it."""
    items, costs, names = list(items), list(costs), list(names)
    compiles = [False] * len(items) if compiles is None else list(compiles)
    st = stages(desc, costs, enabled=enabled)
    for k, item in enumerate(items):
        rest = list(zip(costs[k + 1 :], compiles[k + 1 :], strict=True))
        with st.stage(names[k], costs[k], compiles[k], remaining=rest):
            yield item


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def verdict(claims: list[dict], tiny: bool = False) -> None:
    """Print each claim against what was measured: `claim`, `measured`, the `criterion` it
    is judged by, and whether it `holds`. A `tiny` run (the smoke test of `--tiny`) is too
    small to test any claim: it says so instead of a verdict, and each claim's `judged`
    becomes False (in the JSON too)."""
    print("\n" + "=" * 78)
    for c in claims:
        c["judged"] = not tiny
        print(f"claim:     {c['claim']}")
        print(f"measured:  {c['measured']}")
        print(f"criterion: {c.get('criterion', 'see the claim')}")
        if tiny:
            print("-> not judged: a --tiny run is a smoke test of the pipeline, too small to "
                  "test the claim; the full run decides\n")  # fmt: skip
        else:
            print(f"-> {'holds' if c['holds'] else 'does not hold'}\n")
    print("=" * 78)


def _plain(v):
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if hasattr(v, "tolist"):
        return _plain(v.tolist())
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def write_json(out: Path, name: str, payload: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(_plain(payload), indent=2) + "\n", encoding="utf-8")
    log(f"wrote {path}")
    return path


def save(fig, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")
    return path


def slope(xs, ys) -> float:
    """Least-squares slope of log(ys) against log(xs)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    num = sum((a - mx) * (b - my) for a, b in zip(lx, ly))
    den = sum((a - mx) ** 2 for a in lx)
    return num / den
