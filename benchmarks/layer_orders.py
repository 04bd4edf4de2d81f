"""Observed orders of fixed-step solvers on per-layer (piecewise-constant) controls, with and
without the frozen clock (`itde_solvers.FrozenTime`, which `itde.solve` applies).

A 3-layer pre-norm model (8 features, 2 heads, GELU, float64, distinct random layers) is
solved from one input with each solver at depth steps 1/4, 1/8, 1/16 and compared with
Tsit5 at 1/1024. Without the frozen clock a Runge–Kutta stage at a step's end reads the
next layer's controls and every method is first order.

    python benchmarks/layer_orders.py
"""

from __future__ import annotations

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import itde
import itde_solvers as S
from itde._internal import _solve as solve_module

STEPS = (1 / 4, 1 / 8, 1 / 16)


def _errors(model, x, solver, ref):
    return [
        float(jnp.max(jnp.abs(itde.solve(model, x, solver=solver, dt0=h).ys[-1] - ref)))
        for h in STEPS
    ]


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    model = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=3, n_features=8, n_heads=2, block="pre_norm",
        activation="gelu", dtype=jnp.float64,
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (5, 8), jnp.float64)
    ref = itde.solve(model, x, solver=diffrax.Tsit5(), dt0=1 / 1024).ys[-1]
    solvers = [diffrax.Heun(), S.Strang(), S.RK4(), diffrax.Tsit5(), diffrax.Dopri5()]
    frozen = solve_module._freeze_layers
    print(f"{'solver':<8} {'order':>5}  {'frozen clock (errors, rates)':<52} without")
    for solver in solvers:
        rows = []
        for freeze in (True, False):
            solve_module._freeze_layers = frozen if freeze else (lambda c, s, a, b: s)
            try:
                e = _errors(model, x, solver, ref)
            finally:
                solve_module._freeze_layers = frozen
            rates = np.log2(np.asarray(e[:-1]) / np.asarray(e[1:]))
            errs, fits = (" ".join(f"{v:.1e}" for v in e), " ".join(f"{r:.2f}" for r in rates))
            rows.append(f"{errs}  {fits}")
        order = {"Heun": 2, "Strang": 2, "RK4": 4, "Tsit5": 5, "Dopri5": 5}[type(solver).__name__]
        print(f"{type(solver).__name__:<8} {order:>5}  {rows[0]:<52} {rows[1]}")


if __name__ == "__main__":
    main()
