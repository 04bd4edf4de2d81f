r"""Training a continuous-depth model that stays a discretisation of its equation.

A model trained at one depth step $h$ is only asked to be good at $h$: nothing stops the
optimiser from finding controls whose solution at $h$ is far from the equation's (a `sort`
model trained with RK4 at $h = 1$ reached 0.990 accuracy with logits 1.09, relative, away
from the same equation solved at $h = 1/256$). Two terms in the objective, and a metric:

- **Consistency** (`[continuity] consistency` $= \mu$): $\mu\,\|y_h - y_{h/2}\|^2 /
  \|y_{h/2}\|^2$, the squared relative distance between the outputs at the training step
  and at half of it (means over the batch). For a scheme of order $p$ the distance is the
  global error's leading term times $(1 - 2^{-p})$, so the term penalises exactly what
  makes the trained network differ from its limit, at the cost of one extra solve with
  twice the steps (the training step costs about three solves). We chose it over a
  random step per batch (which also reaches this goal) because it is deterministic (the
  same batch gives the same gradient, as checkpoint resumption requires), measures the
  quantity it controls, and keeps the training step at the step one deploys.
- **Transport cost** (`[continuity] transport` $= \lambda$): $\lambda \int_0^T
  \|\partial_t u\|^2\,dt$, as in the OT-Transformer papers (Kan, Li, Osher et al.),
  discretised along the training solve as $\sum_k \|u_{k+1} - u_k\|^2 / h_k$ (mean over
  the batch and the tokens, the feature quadrature's inner product). Straighter,
  slower trajectories are the ones a coarse step integrates well.
- **The distance to the refined solve** (`[continuity] refine` $= r$, default 8): at every
  evaluation, the relative distance $\|y_h - y_{h/r}\| / \|y_{h/r}\|$ of the held-out
  outputs (the first evaluation batch) for models with controls smooth in depth, logged
  as `eval_continuum_distance`, with `eval_transport`, the transport cost of that batch.

The per-layer network (`scheme = "lie"`) is a network, not a discretisation; the options
are refused for it (there is no equation it should be close to unless its norms are
projections, see `itde.continuum_form`).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ._model import in_compute_dtype, integrate, param_dtype

__all__ = ["DepthRegularisation", "continuity_metrics", "regularised_loss", "transport_cost"]


class DepthRegularisation(eqx.Module):
    r"""The continuity terms of the training objective (see the module's note).

    **Fields:**

    - `consistency`: $\mu \ge 0$, the weight of the relative distance between the outputs
      at the training step $h$ and at $h/2$.
    - `transport`: $\lambda \ge 0$, the weight of the transport cost
      $\int \|\partial_t u\|^2\,dt$ along the training solve.
    """

    consistency: float = eqx.field(static=True, default=0.0)
    transport: float = eqx.field(static=True, default=0.0)

    @property
    def active(self) -> bool:
        return self.consistency > 0 or self.transport > 0


def _path(model, u0, dt: float, steps: bool):
    """The batched solve of `model`'s equation with its scheme at step `dt`: the states at
    every step (with the start) if `steps`, else the final state."""
    return integrate(model.equation, u0, model.scheme, dt, batched=True, path=steps)


def transport_cost(model, path) -> jax.Array:
    r"""$\sum_k \|u_{k+1} - u_k\|_w^2 / h_k$ of a saved path `[steps + 1, batch, tokens,
    features]` (the start and every step of a fixed-step solve at `model.dt`), averaged
    over the batch and the tokens: the discrete $\int \|\partial_t u\|^2\,dt$."""
    du = jnp.diff(path, axis=0)
    sq = du * du
    fw = model.equation.feature_weights()
    if fw is None:
        per = jnp.sum(sq, axis=-1)
    else:
        per = sq @ jnp.asarray(fw, sq.dtype)
    return jnp.sum(jnp.mean(per, axis=(1, 2))) / model.dt


def _relative_sq(a, b):
    a = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    b = b.astype(a.dtype)
    return jnp.sum((a - b) ** 2) / jnp.maximum(jnp.sum(b * b), jnp.finfo(a.dtype).tiny)


def regularised_loss(model, batch, task, compute_dtype, reg: DepthRegularisation):
    """The task's loss of `batch` plus the continuity terms of `reg` (one solve saving its
    path, and with consistency one more at half the step)."""
    x, y = batch
    out_dtype = param_dtype(model)
    m, x = in_compute_dtype(model, x, compute_dtype)
    u0 = m.initial_state(x)
    path = _path(m, u0, m.dt, steps=reg.transport > 0)
    uT = path[-1] if reg.transport > 0 else path
    pred = m.head(uT).astype(out_dtype)
    loss = task.loss(pred, y)
    if reg.transport > 0:
        loss = loss + reg.transport * transport_cost(m, path).astype(loss.dtype)
    if reg.consistency > 0:
        fine = m.head(_path(m, u0, m.dt / 2, steps=False)).astype(out_dtype)
        loss = loss + reg.consistency * _relative_sq(pred, fine).astype(loss.dtype)
    return loss


@eqx.filter_jit
def _metrics(model, x, refine: int):
    u0 = model.initial_state(x)
    path = _path(model, u0, model.dt, steps=True)
    coarse = model.head(path[-1])
    fine = model.head(_path(model, u0, model.dt / refine, steps=False))
    return jnp.sqrt(_relative_sq(coarse, fine)), transport_cost(model, path)


def continuity_metrics(model, x, refine: int) -> dict[str, float]:
    """`eval_continuum_distance`: the relative distance of the outputs of the inputs `x` at
    the model's step and at `1/refine` of it; `eval_transport`: the transport cost of the
    solve at the model's step."""
    distance, transport = _metrics(model, x, int(refine))
    return {"eval_continuum_distance": float(distance), "eval_transport": float(transport)}
