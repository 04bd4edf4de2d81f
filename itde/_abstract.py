r"""The abstract equation that `itde.solve` integrates.

`itde.solve` depends on this interface, not on a concrete model (the way diffrax's
integrator depends on `AbstractTerm` and `AbstractSolver`): an equation has controls on a
depth interval, sub-flows for a solver, and the exact projection onto its constraint set.
"""

from __future__ import annotations

import abc

import equinox as eqx

from itde_solvers import SplitTerm

from ._controls import AbstractControls


class AbstractEquation(eqx.Module):
    """An equation in depth-time $t \\in [t_0, T]$ for a state `[tokens, features]`.

    **Fields:**

    - `controls`: the per-depth parameters $\\theta(t)$ on $[t_0, T]$
      ([`AbstractControls`][itde.AbstractControls]); `t0` and `depth` are read from them.
    """

    controls: eqx.AbstractVar[AbstractControls]

    @property
    def t0(self) -> float:
        """The initial depth."""
        return self.controls.t0

    @property
    def depth(self) -> float:
        """The final depth $T$ up to which the controls are defined."""
        return self.controls.t1

    @property
    def has_constraint(self) -> bool:
        """Whether the solution lives on a constraint set (then a solver must project onto
        it: a splitting solver or `itde_solvers.Projected`); without one, any diffrax
        solver integrates the equation directly."""
        return True

    @property
    def discontinuity(self) -> str | None:
        """None when the vector fields are continuous in the state; else which operator
        jumps and where, in words: the feed-forward's `discontinuity` (a routed mixture of
        experts) where the controls' blocks have one (an `AbstractBlock`), else None."""
        ff = getattr(self.controls.blocks, "feedforward", None)
        where = None if ff is None else ff.discontinuity
        if where is None:
            return None
        return f"its feed-forward, a {type(ff).__name__}, is discontinuous in the state {where}"

    def refuse_discontinuous(self, what: str, fix: str) -> None:
        """Refuse `what` (a solver option or a form that assumes a field smooth in the state)
        for an equation with a `discontinuity`, naming it and `fix`."""
        why = self.discontinuity
        if why is not None:
            raise ValueError(
                f"{what} assumes a vector field smooth in the state, but {why}. {fix}"
            )

    @property
    @abc.abstractmethod
    def n_features(self) -> int:
        """The number of feature nodes of the state."""

    @abc.abstractmethod
    def terms(self, kind: str = "paper", batched: bool = False) -> SplitTerm:
        """The sub-flows of the right-hand side for a solver."""

    def padded_tokens(self, n_tokens: int, n_padded: int) -> AbstractEquation | None:
        """The same equation for states of `n_tokens` real tokens padded to `n_padded`
        (the padded tokens masked), with everything that depends on the token count held
        as data, so that one compiled program serves every count up to `n_padded`; or
        None where the equation's structure depends on the count (then an eager solve
        runs at the count itself). This default is None."""
        return None

    @abc.abstractmethod
    def project(self, t, u):
        """The exact projection onto the constraint set at depth `t`."""

    def check_state(self, u0, name: str = "u0") -> None:
        """Trace-time check of one state `[tokens, features]`, naming `name` and the fix."""
        if type(u0).__module__.startswith("torch"):
            raise TypeError(
                f"`{name}` is a torch tensor; convert it first: "
                f"`jnp.asarray({name}.detach().cpu().numpy())`."
            )
        shape = getattr(u0, "shape", None)
        if shape is None or len(shape) != 2:
            raise ValueError(
                f"`{name}` must be one sequence of shape [tokens, {self.n_features}], got "
                f"shape {shape}; for a batch use `model.batch(x)` or `jax.vmap(model)`."
            )
        if shape[1] != self.n_features:
            raise ValueError(
                f"`{name}` has {shape[1]} features but the model has {self.n_features}; "
                f"give a state of shape [tokens, {self.n_features}]."
            )
        if shape[0] < 1:
            raise ValueError(f"`{name}` has no tokens (shape {shape}).")
        import jax.numpy as jnp

        if not jnp.issubdtype(u0.dtype, jnp.floating):
            raise TypeError(
                f"`{name}` must be a floating-point array, got dtype {u0.dtype}; "
                f"e.g. `{name}.astype(jnp.float32)`."
            )
