"""The bounded cache of compiled programs (`itde.ProgramCache`, `itde.programs`) and the
count of compilations (`itde.count_compilations`).

A program is compiled once per function and shapes, dtypes and static values of its
arguments; at most `capacity` are held, the least recently used evicted, and an evicted
program's executable is freed (the process's memory mappings come back); under a trace
the function is inlined; a failed `eqx.error_if` raises with its own message; a program
prepared in the background from shapes serves the call that comes with arrays.
"""

import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde


def _f(x, scale):
    return jnp.tanh(x @ x.T).sum() * scale + jnp.sin(x).mean()


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_one_program_per_shape_and_static_value():
    cache = itde.ProgramCache(8)
    x3, x4 = np.ones((3, 5), np.float32), np.ones((4, 5), np.float32)
    with itde.count_compilations() as c:
        a = cache(_f, x3, 2.0)
        b = cache(_f, x3 + 1, 2.0)  # other values, same shapes: the same program
        cache(_f, x4, 2.0)  # another shape
        cache(_f, x3, 3.0)  # another static value
    assert (cache.compiled, cache.hits, c.count) == (3, 1, 3)
    np.testing.assert_allclose(a, _f(jnp.asarray(x3), 2.0), rtol=1e-6)
    np.testing.assert_allclose(b, _f(jnp.asarray(x3 + 1), 2.0), rtol=1e-6)
    assert cache(_f, x3.astype(np.float64), 2.0).dtype == jnp.float64  # another dtype
    assert cache.compiled == 4


def test_the_least_recently_used_program_is_evicted():
    cache = itde.ProgramCache(2)
    xs = [np.ones((n, 3), np.float32) for n in (2, 3, 4)]
    cache(_f, xs[0], 1.0)
    cache(_f, xs[1], 1.0)
    cache(_f, xs[0], 1.0)  # the first is now the most recently used
    cache(_f, xs[2], 1.0)  # evicts the second
    assert (len(cache), cache.evicted) == (2, 1)
    compiled = cache.compiled
    cache(_f, xs[0], 1.0)
    assert cache.compiled == compiled
    cache(_f, xs[1], 1.0)
    assert cache.compiled == compiled + 1
    with pytest.raises(ValueError, match=r"`capacity`=0 must be an integer >= 1"):
        cache.capacity = 0


def test_evicted_programs_give_their_memory_mappings_back():
    """Sixty shapes through a cache of four: the mappings of the evicted programs are
    freed (JAX's own caches would keep every one: about a dozen mappings each)."""
    cache = itde.ProgramCache(4)
    for n in range(2, 6):
        cache(_f, np.ones((n, 7), np.float32), 1.0)
    gc.collect()
    before = _maps()
    for n in range(6, 66):
        cache(_f, np.ones((n, 7), np.float32), 1.0)
    gc.collect()
    assert _maps() - before < 100  # 60 programs held forever: about 700
    cache.clear()
    assert (len(cache), cache.compiled) == (0, 0)


def test_under_a_trace_the_function_is_inlined():
    cache = itde.ProgramCache(4)
    out = jax.jit(lambda x: cache(_f, x, 2.0))(jnp.ones((3, 5)))
    assert cache.compiled == 0 and np.isfinite(out)
    g = jax.grad(lambda x: cache(_f, x, 2.0))(jnp.ones((3, 5)))
    np.testing.assert_allclose(g, jax.grad(lambda x: _f(x, 2.0))(jnp.ones((3, 5))))


def _checked(x):
    return eqx.error_if(x, x > 0, "itde: a positive entry")


def test_a_failed_check_raises_its_own_message():
    with pytest.raises(eqx.EquinoxRuntimeError, match="itde: a positive entry"):
        itde.ProgramCache(2)(_checked, jnp.ones(()))


def test_a_program_prepared_from_shapes_serves_the_call():
    cache = itde.ProgramCache(4)
    cache.prepare(_f, jax.ShapeDtypeStruct((6, 5), jnp.float32), 2.0)
    assert cache.holds(_f, np.ones((6, 5), np.float32), 2.0)
    out = cache(_f, np.ones((6, 5), np.float32), 2.0)
    assert cache.compiled == 1 and cache.hits == 1
    np.testing.assert_allclose(out, _f(jnp.ones((6, 5)), 2.0), rtol=1e-6)
    cache.prepare(_checked, jax.ShapeDtypeStruct((), jnp.int32))
    with pytest.raises(eqx.EquinoxRuntimeError):  # runs, and its check fails as usual
        cache(_checked, jnp.ones((), jnp.int32))
    # traced here, compiled in the background: the same program, one compilation
    cache.prepare(_f, jax.ShapeDtypeStruct((3, 5), jnp.float32), 1.5, trace_here=True)
    assert cache.holds(_f, np.ones((3, 5), np.float32), 1.5)
    out = cache(_f, np.full((3, 5), 0.5, np.float32), 1.5)
    assert cache.compiled == 3 and cache.hits == 3  # served by the prepared program
    np.testing.assert_allclose(out, _f(jnp.full((3, 5), 0.5), 1.5), rtol=1e-6)
    # a function that fails to trace: nothing is prepared, the call says why
    cache.prepare(_f, jax.ShapeDtypeStruct((3, 4, 2), jnp.float32), 1.0, trace_here=True)
    assert not cache.holds(_f, np.ones((3, 4, 2), np.float32), 1.0)
    with pytest.raises(ValueError, match="Incompatible types for matmul"):
        cache(_f, np.ones((3, 4, 2), np.float32), 1.0)


def test_count_compilations_counts_eager_operations_too():
    with itde.count_compilations() as c:
        jnp.arange(17.0).reshape(1, 17) * 3.5  # shapes no other test uses
    assert c.count >= 1 and c.loaded == 0
