r"""The training loop, [`train`][itde.train.train] (`itde train`): the steps of
[`make_step`][itde.train.make_step] on the [`Run`][itde.train.Run] of a config, with
logging, evaluation, checkpoints, resuming, and the export of a fine-tuned model.

**Multi-host.** Call `jax.distributed.initialize()` (arguments or the cluster's
environment: coordinator address, process count and id) in every process before anything
else touches JAX, then run the same `itde train` command on every host. `jax.devices()`
is then the global device list, so the mesh spans all hosts; every process computes the
same global batch from `(seed, step)` and `jax.make_array_from_callback` places only its
own shards on its devices. Only process 0 reads or writes the output directory (sidecar,
checkpoint, metrics, plot): on `--resume` it checks the checkpoint and broadcasts the
sidecar and the state file to the other processes, and an error it finds stops every
process with the same message; after each save every process waits for process 0's
outcome, so none runs ahead of a checkpoint that failed. The exception is the sharded
checkpoint (`[run] checkpoint_format`, `itde.train._formats`; the default of a run of
several processes or `fsdp > 1`): each process writes and reads its own shards, in a
directory every process must see.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from .._io import check_output_location
from . import _checkpoint as ckpt
from . import _distributed as dist
from . import _formats as formats
from . import _sharding as shd
from ._config import RESUMABLE_KEYS, ConfigError, TrainExperiment, differences, from_dict, to_dict
from ._continuity import continuity_metrics
from ._evaluate import evaluate
from ._finetune import export, export_refusal
from ._run import _ERRORS, Run, check_batch


def scalar(x) -> float:
    """A replicated scalar as a Python float (on any host of a multi-host mesh)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return float(x)


def config_for_resume(directory, cfg: TrainExperiment | None, source: str, meta=None):
    """The config of a resumed run: the checkpoint's, or `cfg` if it agrees with it on
    everything but the keys in `RESUMABLE_KEYS`. `meta`: the sidecar, if already read."""
    meta = ckpt.read_meta(directory) if meta is None else meta
    stored = from_dict(TrainExperiment, meta["config"], f"{directory}/{ckpt.SIDECAR}")
    if cfg is None:
        return stored, meta
    # against the stored config read again, so that a key added since (at its default)
    # is no difference
    diff = [k for k in differences(to_dict(cfg), to_dict(stored)) if k not in RESUMABLE_KEYS]
    if diff:
        raise ConfigError(
            f"{source}: cannot resume {str(directory)!r} with this config: it differs from the "
            f"checkpoint's in {diff} (only {sorted(RESUMABLE_KEYS)} may change); omit "
            "--config to resume with the checkpoint's own config"
        )
    return cfg, meta


def _refuse_existing(out: Path) -> None:
    if (out / ckpt.SIDECAR).is_file():
        raise ckpt.CheckpointError(
            f"{str(out)!r} already holds a checkpoint (step "
            f"{ckpt.read_meta(out)['step']}); continue it (`itde train --resume {out}`, or "
            f"`itde.train.train(resume={str(out)!r})`), write elsewhere (`--out` / `out=`), "
            "or replace it (`--overwrite` / `overwrite=True`)"
        )


def _save(run, out: Path, step: int, state, meta: dict) -> None:
    """A collective: every process calls it (`itde.train._formats`)."""
    formats.writer(run.cfg.run.checkpoint_format, run.mesh).save(out, step, state, meta)


def restart_clock(bar) -> None:
    """Restart a tqdm bar's clock and rate averages at its current count, so that its rate
    and ETA come from the steps after this point (not from a step that compiled)."""
    n = bar.n
    bar.reset()  # count 0, clock and moving averages restarted
    bar.initial = bar.n = bar.last_print_n = n
    bar.refresh()


def _read_metrics(path: Path, upto: int, run_id: str | None = None) -> list[dict]:
    """The rows of `metrics.jsonl` up to step `upto`. A torn last line (a crash while it was
    appended) is dropped; every complete row is kept; damage elsewhere is an error, and so
    is a row of another run than `run_id` (the checkpoint's)."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a row with an integer `step`")
        except ValueError as e:
            if all(not rest.strip() for rest in lines[i + 1 :]):
                break  # the torn tail of an interrupted write
            raise ValueError(
                f"{str(path)!r} line {i + 1} is damaged ({e}); remove that line to resume"
            ) from None
        if run_id is not None and row.get("run", run_id) != run_id:
            raise ValueError(
                f"{str(path)!r} line {i + 1} belongs to run {row['run']!r}, the checkpoint "
                f"beside it to run {run_id!r}: another run's checkpoint or metrics were copied "
                "into this directory. Resume each run from its own directory (or remove the "
                "rows that are not the checkpoint's run)"
            )
        rows.append(row)
    return [r for r in rows if r["step"] <= upto]


def _open(cfg, out, resume, devices, source, overwrite):
    """A run's configuration, output directory, `Run` and starting state (fresh, or
    restored from `resume`): `(cfg, out, run, model, opt_state, start, wall0, rows)`, with
    the metrics rows logged up to the restored step."""
    if cfg is not None and not isinstance(cfg, TrainExperiment):
        raise TypeError(
            f"`cfg` must be an itde.train.TrainExperiment, got {type(cfg).__name__}; read a "
            "TOML file with `itde.train.load_config(TrainExperiment, path)`."
        )
    meta = None
    if resume is not None:
        meta = dist.on_main(lambda: ckpt.read_meta(resume), errors=_ERRORS)
        cfg, meta = config_for_resume(resume, cfg, source, meta)
    cfg = TrainExperiment() if cfg is None else cfg
    if out is not None and not str(out).strip():
        raise ValueError(
            "`out`='' names no directory (it would write the run into the working "
            "directory); give a directory for metrics.jsonl, loss_curve.png and checkpoints."
        )
    out_name = "out"  # the argument, or the key it came from, named in errors
    if out is None:
        out_name = "resume" if resume is not None else "run.out"
        out = resume if resume is not None else (cfg.run.out or f"runs/{cfg.task.name}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"`out`={str(out)!r} is an existing file, not a directory; give a directory "
            "(new or one of an earlier run) for metrics.jsonl, loss_curve.png and checkpoints"
        )
    if resume is None and not overwrite:
        dist.on_main(lambda: _refuse_existing(out), errors=_ERRORS)
    # under a file, not writable, or a system path (/sys, /proc): said before any work
    dist.on_main(lambda: check_output_location(out, out_name), errors=_ERRORS)
    run = Run(cfg, devices)
    check_batch(cfg.optim.batch_size, run.mesh.size, k=cfg.optim.accumulate)
    if resume is not None:
        dist.on_main(lambda: run.check_init(meta, resume), errors=_ERRORS)
        model, opt_state, meta = run.restore(resume, meta)
        run.run_id = meta.get("run_id") or run.run_id  # checkpoints before run ids: a new one
        start, wall0 = int(meta["step"]), float(meta.get("wall_s", 0.0))
        path = Path(resume) / "metrics.jsonl"
        rows = _read_metrics(path, start, meta.get("run_id")) if dist.is_main() else []
    else:
        model, opt_state = run.place_state(*run.init_state())
        start, wall0, rows = 0, 0.0, []
    return cfg, out, run, model, opt_state, start, wall0, rows


def _diverged(error, step: int, last: dict, cfg) -> FloatingPointError:
    """A run-time check failed inside a training step: almost always the parameters grew
    non-finite (a learning rate too large). Say so, name `optim.lr`, and keep the check's own
    message."""
    fired = re.search(r"itde\.solve: [^\n]*", str(error))
    said = f" The check that fired: {fired.group(0)}" if fired else ""
    loss = f"{last['loss']:.4g} at step {last['step']}" if "loss" in last else "not logged yet"
    return FloatingPointError(
        f"training stopped at step {step + 1}: the state of the model's solve is not finite "
        f"(last logged loss: {loss}). The parameters most likely diverged: lower `optim.lr` "
        f"(now {cfg.optim.lr:g}) or `optim.clip_norm` (now {cfg.optim.clip_norm:g}), or "
        f"lengthen `optim.warmup` (now {cfg.optim.warmup}); the last checkpoint is kept.{said}"
    )


def _finish(out: Path, total: int, task, saved: bool) -> list[str]:
    """The loss curve of the run's metrics, and every file the run wrote."""
    from ._loss_plot import plot_metrics

    plot_metrics(_read_metrics(out / "metrics.jsonl", total), out / "loss_curve.png", task)
    files = [out / "metrics.jsonl", out / "loss_curve.png"]
    if saved:
        files += [out / ckpt.SIDECAR, out / ckpt.read_meta(out)["leaves"]]
    return [str(f) for f in files]


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What [`train`][itde.train.train] returns.

    **Fields:** `step` (the last step taken), `metrics` (the last logged row: loss, lr,
    evaluation metrics), `wall_s` (training time, resumed runs included), `out` (the output
    directory), `files` (every file written, the checkpoint's state file included; empty
    when a resumed run was already complete), `complete` (the run reached `optim.steps`),
    `model` and `opt_state` (the trained model and optimiser state)."""

    step: int
    metrics: dict
    wall_s: float
    out: str
    files: list[str]
    complete: bool
    model: Any
    opt_state: Any


def train(
    cfg: TrainExperiment | None = None,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    devices=None,
    source: str = "<built-in default>",
    stop_at: int | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
    on_eval: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train a model; write `metrics.jsonl`, `loss_curve.png` and checkpoints into `out`.

    **Arguments:**

    - `cfg`: the experiment (default: the built-in sort task); with `resume` it may be
      None (use the checkpoint's config) or must agree with the checkpoint's.
    - `out`: output directory (default `resume`, else `cfg.run.out`).
    - `resume`: a checkpoint directory to continue from, exactly.
    - `devices`: the devices of the mesh (default all; `[parallel] fsdp` must divide
      their number).
    - `source`: the config's file name, for error messages.
    - `stop_at`: stop after this step (after its checkpoint, if one is due), as if the
      run were killed there; for tests and time-sliced jobs.
    - `progress`: show the progress (default `cfg.run.progress`): a tqdm bar on a
      terminal, a line each tenth of the run in a log.
    - `overwrite`: start afresh even if `out` holds a checkpoint (otherwise an error).
    - `on_eval`: called (on process 0) with each evaluated metrics row as it is logged, e.g.
      to print progress without a bar (`itde train --no-progress` prints one line each).

    A run started from a Hugging Face model (`[model] init = "hf:DIR"`) that completes as
    a per-layer network at `dt = 1` also writes the fine-tuned model to `out/hf`
    ([`export_hf_dir`][itde.train.export_hf_dir]).

    **Returns:** a [`TrainResult`][itde.train.TrainResult].
    """
    if on_eval is not None and not callable(on_eval):
        raise TypeError(
            f"`on_eval`={on_eval!r} must be a function of one metrics row (a dict) or None."
        )
    cfg, out, run, model, opt_state, start, wall0, rows = _open(
        cfg, out, resume, devices, source, overwrite
    )
    is_main = dist.is_main()
    total, r, bs = cfg.optim.steps, cfg.run, cfg.optim.batch_size
    if start >= total:  # a finished run: nothing to train, nothing is written
        return TrainResult(
            step=start,
            metrics=rows[-1] if rows else {},
            wall_s=wall0,
            out=str(out),
            files=[],
            complete=True,
            model=model,
            opt_state=opt_state,
        )
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write(
            out / "metrics.jsonl",
            lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()),
        )
    step_fn = run.make_step()
    refine = cfg.continuity.refine if cfg.model.continuous else 0
    chunks = run.eval_chunks()
    show = r.progress if progress is None else progress
    from .._progress import progress_bar

    bar = progress_bar(total, "itde train", initial=start, enabled=show and is_main)
    t_start, t_log, n_log = time.perf_counter(), time.perf_counter(), 0
    done, saved = start, False
    last: dict = {}
    levels, ends = run.levels, () if run.levels is None else run.levels.ends
    for s in range(start, total):
        # JAX runs asynchronously: a check that fires in the step surfaces where its result
        # is first read (the loss, the evaluation, the checkpoint), so all of it is covered
        try:
            model, opt_state = run.at_level(model, opt_state, s)  # a multilevel switch
            model, opt_state, loss = step_fn(model, opt_state, run.batch(s))
            done, n_log = s + 1, n_log + 1
            evaluating = done % r.eval_every == 0 or done == total
            if done % r.log_every == 0 or evaluating or done in ends:
                loss_v = scalar(loss)
                now = time.perf_counter()
                rate = n_log * bs / max(now - t_log, 1e-9)
                t_log, n_log = now, 0
                row = {
                    "run": run.run_id,
                    "step": done,
                    "loss": loss_v,
                    "lr": float(run.schedule(s)),
                    "wall_s": wall0 + now - t_start,
                    "examples_per_s": rate,
                }
                if levels is not None:  # what each step of the interval ran at, and cost
                    depth = run.cfg.model.n_layers
                    row.update(level=levels.phase(s), dt=model.dt,
                               depth_steps=round(depth / model.dt), step_s=bs / rate)  # fmt: skip
                if evaluating:
                    row.update(evaluate(model, chunks, run.task, run.compute_dtype))
                    if refine:  # how far the model is from its own equation, refined
                        row.update(continuity_metrics(model, chunks[0][0], refine))
                last = row
                if is_main:
                    with open(out / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(row) + "\n")
                    if evaluating and on_eval is not None:
                        on_eval(row)
                bar.set_postfix(loss=f"{loss_v:.4g}", ex_s=f"{rate:.0f}")
            if done % r.checkpoint_every == 0 or done == total:
                m = run.meta()
                m["wall_s"] = wall0 + time.perf_counter() - t_start
                _save(run, out, done, (model, opt_state), m)  # every process; a barrier
                saved = True
            bar.update(1)
            if s == start:
                restart_clock(bar)  # the first step compiled: its time says nothing of the rest
            if stop_at is not None and done >= stop_at:
                break
        except eqx.EquinoxRuntimeError as e:
            raise _diverged(e, s, last, cfg) from e
    bar.close()
    files = _finish(out, total, run.task, saved) if is_main else []
    init = cfg.model.hf_init
    if is_main and done >= total and export_refusal(model, from_hf=init is not None) is None:
        hf = export(shd.to_host(model), init, out / "hf", name="out/hf")
        files += sorted(str(f) for f in hf.iterdir())
    return TrainResult(
        step=done,
        metrics=last,
        wall_s=wall0 + time.perf_counter() - t_start,
        out=str(out),
        files=files,
        complete=done >= total,
        model=model,
        opt_state=opt_state,
    )
