"""The classical fourth-order Runge–Kutta method as a diffrax Butcher tableau."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
from diffrax import (
    AbstractERK,
    ButcherTableau,
    LocalLinearInterpolation,
    ThirdOrderHermitePolynomialInterpolation,
)

# Classical RK4 (stages 1-4) plus a fifth, first-same-as-last stage $f(t_1, y_1)$. The
# fifth stage has weight zero in the solution, so `y1` is exactly the classical RK4
# update; it is reused as the first stage of the next step (4 evaluations a step after the
# first) and feeds the embedded third-order solution
# $\hat b = (1/6, 1/3, 1/3, 0, 1/6)$, whose difference from RK4 is the error estimate
# $\Delta t\,(k_4 - k_5)/6$ (local order 4).
_rk4_tableau = ButcherTableau(
    a_lower=(
        np.array([1 / 2]),
        np.array([0.0, 1 / 2]),
        np.array([0.0, 0.0, 1.0]),
        np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6]),
    ),
    b_sol=np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6, 0.0]),
    b_error=np.array([0.0, 0.0, 0.0, 1 / 6, -1 / 6]),
    c=np.array([1 / 2, 1 / 2, 1.0, 1.0]),
)

# The same method without the fifth stage: four evaluations every step, no error estimate.
_rk4_stages_tableau = ButcherTableau(
    a_lower=_rk4_tableau.a_lower[:3],
    b_sol=_rk4_tableau.b_sol[:4],
    b_error=np.zeros(4),
    c=_rk4_tableau.c[:3],
)


def _linear(*, t0, t1, y0, y1, k):
    del k
    return LocalLinearInterpolation(t0=t0, t1=t1, y0=y0, y1=y1)


class RK4(AbstractERK):
    r"""The classical fourth-order Runge–Kutta method ("the" RK4).

    Stages $k_1 = f(t_0, y_0)$, $k_2 = f(t_0 + \tfrac{h}{2}, y_0 + \tfrac{h}{2} k_1)$,
    $k_3 = f(t_0 + \tfrac{h}{2}, y_0 + \tfrac{h}{2} k_2)$, $k_4 = f(t_1, y_0 + h k_3)$ and
    $y_1 = y_0 + \tfrac{h}{6}(k_1 + 2k_2 + 2k_3 + k_4)$.

    **Order:** 4 (global) for a vector field that is $C^4$ in $(t, y)$. For
    time-dependent fields with jumps, put the jump times on the step grid (or pass
    `made_jump`), as for any Runge–Kutta method.

    **Implementation:** the tableau carries a fifth, first-same-as-last stage
    $k_5 = f(t_1, y_1)$ with zero solution weight, so `y1` is exactly classical RK4 and a
    step costs four vector-field evaluations after the first. $k_5$ gives an embedded
    third-order solution with weights $(1/6, 1/3, 1/3, 0, 1/6)$; the error estimate
    $h(k_4 - k_5)/6$ (local order 4) makes `RK4` usable with
    `diffrax.PIDController`. Dense output is the cubic Hermite interpolant through
    $(y_0, f(t_0, y_0))$ and $(y_1, f(t_1, y_1))$ (third order).

    **Arguments:** None.

    `scan_kind`: diffrax's field of every Runge–Kutta solver, how the loop over the stages
    of a step is run: None (the default: diffrax's checkpointed loop), `"lax"` (a plain
    `lax` loop, which forward-mode differentiation needs; `diffrax.ForwardMode` sets it)
    or `"bounded"` (`diffrax.DirectAdjoint` sets it). `itde.solve` sets it likewise on a
    solver wrapped in `Projected` or `FrozenTime`, where diffrax cannot reach it.
    """

    tableau: ClassVar[ButcherTableau] = _rk4_tableau
    interpolation_cls: ClassVar[Callable[..., ThirdOrderHermitePolynomialInterpolation]] = (
        ThirdOrderHermitePolynomialInterpolation.from_k
    )

    def order(self, terms):
        del terms
        return 4

    def without_error_estimate(self) -> _RK4Stages:
        """The same four stages without the fifth: `y1` identical, no error estimate,
        linear dense output. For fixed steps that restart every step (`Projected`
        re-evaluates the first stage at the projected state), where the fifth stage is
        evaluated and never used: 4 evaluations a step instead of 5."""
        return _RK4Stages(scan_kind=self.scan_kind)


class _RK4Stages(AbstractERK):
    """Classical RK4's four stages alone (see `RK4.without_error_estimate`)."""

    tableau: ClassVar[ButcherTableau] = _rk4_stages_tableau
    interpolation_cls: ClassVar[Callable[..., LocalLinearInterpolation]] = staticmethod(_linear)

    def order(self, terms):
        del terms
        return 4


__all__ = ["RK4"]
