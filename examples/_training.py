"""Training helpers for the gallery: one compiled step shared by every seed of a config.

`itde.train.train` builds a new optimiser (new closures, so a new compile) per call; here
the optimiser and task of the first seed's `Run` serve every seed, so a config compiles
its step once. Only public names of `itde.train` are used."""

from __future__ import annotations

import time

import equinox as eqx
import jax

from itde.train import (
    Run,
    TrainExperiment,
    evaluate,
    from_dict,
    load,
    make_step,
    place,
    to_dict,
)


def config(
    path: str, *, task: dict | None = None, model: dict | None = None, optim: dict | None = None
) -> TrainExperiment:
    """A shipped config (e.g. configs/burgers.toml) with some keys replaced."""
    d = to_dict(load(TrainExperiment, path))
    if model and model.get("scheme", d["model"]["scheme"]) != "lie":
        d["model"].update(n_modes=None, eps=None)  # let the continuous defaults apply
    for table, new in (("task", task), ("model", model), ("optim", optim)):
        d[table].update(new or {})
    d["run"].update(progress=False)
    return from_dict(TrainExperiment, d, f"{path} (gallery)")


def n_params(model) -> int:
    return sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


class Trainer:
    """Train one config for several seeds with one compiled step."""

    def __init__(self, cfg: TrainExperiment):
        self.cfg = cfg
        self.first = Run(cfg)
        self.step = make_step(self.first.optimizer, self.first.task, self.first.compute_dtype)

    def run(self, seed: int, log=None):
        d = to_dict(self.cfg)
        d["optim"]["seed"] = seed
        run = Run(from_dict(TrainExperiment, d, "gallery seed"), task=self.first.task)
        model, opt_state = run.init_state()
        # replicated over the mesh as `train` does (else the second step recompiles for
        # the new input sharding)
        model, opt_state = place(model, run.replicated), place(opt_state, run.replicated)
        t0 = time.perf_counter()
        loss = None
        from itde._progress import progress_bar

        bar = progress_bar(self.cfg.optim.steps, f"seed {seed}", leave=False)
        for i in range(self.cfg.optim.steps):
            model, opt_state, loss = self.step(model, opt_state, run.batch(i))
            bar.update()
            if i == 0:
                jax.block_until_ready(loss)
                t1 = time.perf_counter()
        jax.block_until_ready(loss)
        bar.close()
        t2 = time.perf_counter()
        timing = {
            "first_step_s": t1 - t0,
            "steps_s": t2 - t1,
            "s_per_step": (t2 - t1) / max(1, self.cfg.optim.steps - 1),
        }
        metrics = evaluate(model, run.eval_chunks(), self.first.task)
        if log:
            log(
                f"  seed {seed}: loss {float(loss):.4g}, {self.first.task.metric} "
                f"{metrics[self.first.task.metric]:.4g} ({timing['s_per_step'] * 1e3:.1f} ms/step)"
            )
        return model, metrics, timing, run
