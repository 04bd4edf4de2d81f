"""What every operator does with the feature domain's discretisation: integrate against
its quadrature weights, and check that a grid has the operator's width.

The operators (attention, the feed-forward forms, the mixture of experts) and the
attention-weight analysis share these two; they live here so that no operator reaches
into another's module for them."""

from __future__ import annotations

import jax.numpy as jnp


def weighted(u, weights):
    """Multiply the last axis by quadrature weights (skipped for the unit grid: None)."""
    if weights is None:
        return u
    return u * jnp.asarray(weights, dtype=u.dtype)


def check_width(name: str, n_features: int, grid) -> None:
    """Raise unless `grid` has the `n_features` feature nodes of the discrete operator `name`."""
    if grid.n_features != n_features:
        raise ValueError(
            f"`grid.n_features`={grid.n_features} does not match the discrete {name}'s "
            f"{n_features} feature nodes; use a grid with n_features={n_features}."
        )
