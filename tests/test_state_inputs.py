"""States and affine maps as users bring them: a nested Python list, an empty batch under
`jax.vmap`, a `FeatureAffine` of the wrong width. Each gives the model's answer (checked
against NumPy / the array it stands for) or one error naming the argument, the width and
the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde

D = 8


@pytest.fixture(scope="module")
def model():
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=2, n_features=D, n_heads=2,
                                 n_hidden=16, dtype=jnp.float64)  # fmt: skip
    x = np.random.default_rng(0).normal(size=(5, D))
    return m, x, np.asarray(m(jnp.asarray(x)))


def test_a_nested_list_is_the_state_it_spells(model):
    m, x, want = model
    np.testing.assert_array_equal(np.asarray(m(x.tolist())), want)
    np.testing.assert_array_equal(np.asarray(itde.solve(m, x.tolist()).ys[-1]),
                                  np.asarray(itde.solve(m, jnp.asarray(x)).ys[-1]))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(m.batch([x.tolist()])[0]), want)
    np.testing.assert_array_equal(np.asarray(m.trajectory(x.tolist())[-1]),
                                  np.asarray(m.trajectory(jnp.asarray(x))[-1]))  # fmt: skip
    ragged = [x[0].tolist(), x[1, :5].tolist()]
    with pytest.raises(ValueError, match=r"`u0` is a nested list that is not a rectangular .*"
                       r"`jnp.asarray\(u0\)`"):  # fmt: skip
        m(ragged)


def test_vmap_over_an_empty_batch_is_an_empty_batch(model):
    """A regression: `jax.vmap(m)` over 0 sequences returned an empty result, then the
    solve's overflow check reduced a message index over the empty batch ("zero-size
    array to reduction operation max")."""
    m, x, want = model
    out = jax.vmap(m)(jnp.zeros((0, 5, D)))
    assert out.shape == (0, 5, D) and out.dtype == jnp.float64
    # and the check still speaks for a non-empty batch: the overflow of a finite input
    big = jnp.full((1, 5, D), 1e200)  # (the shape of the batch below: one compilation)
    with pytest.raises(Exception, match=r"itde.solve: the state overflowed .*`u0` is finite"):
        jax.block_until_ready(jax.vmap(m)(big))
    # `want` is an eager call, padded to its bucket (8 tokens): the same to round-off
    np.testing.assert_allclose(np.asarray(jax.vmap(m)(jnp.asarray(x)[None]))[0], want,
                               rtol=1e-13, atol=1e-14)  # fmt: skip


def test_batch_of_no_sequence_is_what_vmap_gives(model):
    """`model.batch` is `jax.vmap(model)` as one solve: on an empty batch too, an empty
    output of the input's shape and dtype (with or without a mask), not an error; a width
    that is not the model's is named as for a batch of one."""
    m, _, _ = model
    empty = jnp.zeros((0, 5, D))
    want = jax.vmap(m)(empty)
    for mask in (None, jnp.ones((0, 5), bool)):
        out = m.batch(empty, mask)
        assert (out.shape, out.dtype) == (want.shape, want.dtype) == ((0, 5, D), jnp.float64)
    with pytest.raises(ValueError, match=r"`u0\[i\]` has 7 features but the model has 8"):
        m.batch(jnp.zeros((0, 5, 7)))
    with pytest.raises(ValueError, match=r"`mask` must have shape \[batch, tokens\] = \(0, 5\)"):
        m.batch(empty, jnp.ones((1, 5), bool))


def test_a_feature_affine_of_the_wrong_width_is_named(model):
    m, x, _ = model
    said = r"is a FeatureAffine of width 6 \(`scale` shape \(6,\)\), but the state has 8 " \
           r"features; give `scale` and `shift` one value per feature, shape \(8,\)"
    wrong = itde.FeatureAffine(jnp.ones(6), jnp.zeros(6))
    with pytest.raises(ValueError, match="`input_affine` " + said):
        m.continuum_form(input_affine=wrong)
    with pytest.raises(ValueError, match="`readout` " + said):
        itde.TransformerIDE(m.controls, m.grid, readout=wrong)
    with pytest.raises(ValueError, match="`FeatureAffine` " + said):
        wrong(jnp.ones((3, D)))
    with pytest.raises(TypeError, match=r"`input_affine` must be an itde.FeatureAffine"):
        m.continuum_form(input_affine=(jnp.ones(D), jnp.zeros(D)))
    # the right width: the map z -> a z + b, against NumPy
    a, b = np.linspace(0.5, 2.0, D), np.linspace(-1.0, 1.0, D)
    np.testing.assert_allclose(np.asarray(itde.FeatureAffine(jnp.asarray(a), jnp.asarray(b))(
        jnp.asarray(x))), x * a + b, rtol=1e-15)  # fmt: skip
