"""Registries shared by the conformance tests: every rule added here is covered."""

import numpy as np

import itde

QUADRATURES = dict(itde.RULES)  # name -> rule class

# name -> polynomial degree integrated exactly with n nodes (from the theory of each rule,
# written here, not read from the rules under test)
EXACT_DEGREE = {
    "midpoint": lambda n: 1,
    "trapezoid": lambda n: 1,
    "simpson": lambda n: 3,
    "gauss-legendre": lambda n: 2 * n - 1,
}
# rules that are not exact on algebraic polynomials, each with the reason
NOT_POLYNOMIAL_EXACT = {
    "periodic-trapezoid": "exact on trigonometric polynomials of a periodic interval",
}

_uncovered = set(QUADRATURES) - set(EXACT_DEGREE) - set(NOT_POLYNOMIAL_EXACT)
if _uncovered:
    raise RuntimeError(
        f"quadrature rules {sorted(_uncovered)} are in itde.RULES but not in "
        "tests/helpers.py: give each its exact polynomial degree (EXACT_DEGREE) or the "
        "reason it has none (NOT_POLYNOMIAL_EXACT)."
    )


def spread_hf_weights(model):
    """Move a Hugging Face model's weights away from their initialisation, in place (the
    current torch seed): matrices drawn with std 0.5, vectors shifted by N(0, 0.3²). With
    HF's std 0.02 every block is close to the identity and a comparison nearly trivial.
    Returns the model."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.5)
            else:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _layer_solvers():
    """name -> a factory of a solver whose steps end on the points of its step grid, so on
    every layer boundary of a per-layer model. The flow maps of each compose exactly on
    the layer grid (`tests/test_flow_maps.py`), forward and backward. `frozen-*` are
    wrapped by the caller: one without jumps, one with jumps that are not the layers'.
    Every solver class `itde_solvers` exports is in at least one entry (checked below);
    diffrax's explicit Runge–Kutta methods by kind: two stages (Heun), first-same-as-last
    of orders 3, 4 (RK4's fifth stage), 5 and 8."""
    import diffrax

    import itde_solvers as S

    return {
        "lie": S.LieTrotter,
        "strang": S.Strang,
        "parallel": S.ParallelSplitting,
        "strang-rk4": lambda: S.Strang(S.RK4()),
        "heun": diffrax.Heun,
        "bosh3": diffrax.Bosh3,
        "rk4": S.RK4,
        "projected-rk4": lambda: S.Projected(S.RK4()),
        "tsit5": diffrax.Tsit5,
        "dopri5": diffrax.Dopri5,
        "dopri8": diffrax.Dopri8,
        "frozen-tsit5": lambda: S.FrozenTime(diffrax.Tsit5()),
        "frozen-dopri8": lambda: S.FrozenTime(diffrax.Dopri8(), jump_ts=(0.5, 1.5)),
    }


LAYER_SOLVERS = _layer_solvers()


def _check_layer_solvers() -> None:
    import diffrax

    import itde_solvers

    exported = {
        name
        for name in itde_solvers.__all__
        if isinstance(getattr(itde_solvers, name), type)
        and issubclass(getattr(itde_solvers, name), diffrax.AbstractSolver)
        and not name.startswith("Abstract")
    }
    seen = " ".join(repr(make()) for make in LAYER_SOLVERS.values())
    missing = sorted(n for n in exported if f"{n}(" not in seen)
    if missing:
        raise RuntimeError(
            f"itde_solvers exports the solvers {missing}, which tests/helpers.py's "
            "LAYER_SOLVERS does not hold: add each (the flow-map semigroup tests cover it)."
        )


_check_layer_solvers()


def padding_masks(n: int, rows) -> np.ndarray:
    """Attention masks `[len(rows), n]` of 0/1: each row `(kind, k)` is unpadded
    (`"none"`), or has its first (`"left"`) or last (`"right"`) `min(k, n - 1)` tokens
    padded."""
    import numpy as np

    masks = np.ones((len(rows), n), np.int64)
    for mask, (kind, k) in zip(masks, rows, strict=True):
        k = min(k, n - 1)
        if kind == "left":
            mask[:k] = 0
        elif kind == "right":
            mask[n - k :] = 0
    return masks


def padding_rows(max_n: int):
    """The Hypothesis strategy of one row's padding for `padding_masks`."""
    from hypothesis import strategies as st

    return st.tuples(st.sampled_from(["none", "left", "right"]), st.integers(1, max_n))


def check_causal_lm_logits(model, lm, n, rows, *, vocab: int, tol: float, seed=0) -> float:
    """A converted causal LM's logits (`lm.project(lm.base.batch(...))`) against the
    transformers `model`'s in float64, on the real tokens of `n` random ids per row padded
    as `rows` say: the error relative to the largest reference logit, asserted <= `tol`."""
    import jax.numpy as jnp
    import torch

    masks = padding_masks(n, rows)
    ids = np.random.RandomState(seed).randint(4, vocab, size=masks.shape)
    ours = np.asarray(lm.project(lm.base.batch(jnp.asarray(ids), jnp.asarray(masks))))
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(masks)).logits.numpy()
    real = masks == 1
    err = np.max(np.abs(ours[real] - ref[real])) / np.max(np.abs(ref[real]))
    assert err <= tol, (n, rows, err)
    return err


def hf_logits(model, ids, mask) -> np.ndarray:
    """A transformers causal LM's logits of a batch `ids` with attention `mask`, float64
    (inside `itde.interop.hf_float64()`)."""
    import torch

    with torch.no_grad(), itde.interop.hf_float64():
        out = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask))
    return out.logits.numpy()


def relative_error(ours, ref) -> float:
    """The largest absolute difference relative to the largest reference value."""
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def padded_window(ids, n: int, side: str, length: int):
    """`ids` (length >= n) as a window of `length` tokens: n real ones, padded left or right;
    returns (row, mask)."""
    row = np.zeros(length, np.int64)
    mask = np.zeros(length, np.int64)
    real = slice(length - n, length) if side == "left" else slice(0, n)
    row[real], mask[real] = ids[:n], 1
    return row, mask
