"""Variants are modules: block forms, norms, attention cores, score biases and parameter
roles, each checked against an independent statement of what it must be."""

import dataclasses

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde._blocks import block_from_names
from itde._solve import terms_kind
from itde.train._optim import _decay_mask, _labels
from itde_solvers import LieTrotter, Projected, SplitTerm, Strang

KEY = jax.random.key(0)


# ------------------------------------------------------------------ block forms
def test_every_block_form_is_named_once_and_resolves_to_its_module():
    assert {k: type(v()) for k, v in itde.BLOCK_FORMS.items()} == {
        "post_norm": itde.PostNorm,
        "pre_norm": itde.PreNorm,
        "parallel": itde.Parallel,
        "sandwich_norm": itde.SandwichNorm,
        "output_norm": itde.OutputNorm,
    }
    for name, cls in itde.BLOCK_FORMS.items():
        m = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, block=name)
        assert type(m.block) is cls
    assert block_from_names("post_norm", "relaxation") == itde.PostNorm(relaxation=True)
    with pytest.raises(ValueError, match="ffn_form.*post-norm"):
        block_from_names("parallel", "relaxation")
    with pytest.raises(TypeError, match="block"):
        itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, block=3)


class _NormFirstByHand(itde.AbstractBlockForm):
    """A block form written outside the library: the pre-norm equation, stated here from
    its definition (normalise, then the operator; two sub-flows; no constraint)."""

    has_constraint = False

    def attention_input(self, eq, t, u):
        return eq.controls(t, "right", "norm1")(u, eq.feature_weights())

    def feedforward_input(self, eq, t, u):
        return eq.controls(t, "right", "norm2")(u, eq.feature_weights())

    def paper_flows(self, eq):
        return (diffrax.ODETerm(eq.attention_field), diffrax.ODETerm(eq.feedforward_field))

    split_flows = paper_flows

    def tangent_flows(self, eq):
        return (diffrax.ODETerm(eq.field),)

    def torch_layer_options(self, eps):
        return {"norm_first": True}


def test_a_block_form_defined_outside_the_library_is_one_class_and_matches_torch():
    """Adding a block form is one class: the equation, `solve`, `to_torch` ask the module
    and never its name. Checked against PyTorch's pre-LN layer written out in NumPy."""
    pre = itde.TransformerIDE.init(KEY, n_layers=2, n_features=8, n_heads=2, block="pre_norm")
    mine = dataclasses.replace(pre, block=_NormFirstByHand())
    u = np.asarray(jax.random.normal(jax.random.key(1), (5, 8)))

    def ln(x, n):  # nn.LayerNorm with gain and shift, written out
        c = x - x.mean(-1, keepdims=True)
        return c / np.sqrt((c * c).mean(-1, keepdims=True) + n.eps) * np.asarray(
            n.gain
        ) + np.asarray(n.shift)

    ref = u
    for layer in range(2):
        b = pre.controls.layer(layer)
        ref = ref + np.asarray(b.attention(jnp.asarray(ln(ref, b.norm1))))
        ref = ref + np.asarray(b.feedforward(jnp.asarray(ln(ref, b.norm2))))
    np.testing.assert_allclose(mine(jnp.asarray(u)), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(pre(jnp.asarray(u)), ref, rtol=0, atol=1e-12)
    assert not mine.has_constraint and mine.project(0.0, u) is u
    assert itde.to_torch(mine).layers[0].norm_first


def test_relaxation_is_the_papers_half_step_and_residual_is_the_plain_one():
    """PostNorm's feed-forward sub-flow: F(u) (residual) or (F(u) - u)/2 (relaxation), so
    that one Euler step of length 1 gives u + F(u) or (u + F(u))/2."""
    m = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2)
    u = jax.random.normal(jax.random.key(2), (4, 8))
    f = m.controls.layer(0).feedforward(u)
    np.testing.assert_allclose(m.feedforward_field(0.0, u), f, rtol=0, atol=1e-14)
    rel = dataclasses.replace(m, block=itde.PostNorm(relaxation=True))
    np.testing.assert_allclose(rel.feedforward_field(0.0, u), (f - u) / 2, rtol=0, atol=1e-14)


def test_each_block_form_gives_its_sub_flows_for_each_kind_of_terms():
    expected = {  # (paper, split, tangent) numbers of sub-flows, from the definitions
        itde.PostNorm(): (4, 4, 2),
        itde.PreNorm(): (2, 2, 1),
        itde.Parallel(): (1, 2, 1),
    }
    base = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, eps=0.0)
    for form, counts in expected.items():
        m = dataclasses.replace(base, block=form)
        got = tuple(len(m.terms(k).terms) for k in ("paper", "split", "tangent"))
        assert got == counts, form
    with pytest.raises(ValueError, match="not known"):
        base.terms("exact")


def test_solve_and_the_scheme_registry_take_the_terms_kind_from_one_rule():
    assert terms_kind(LieTrotter()) == "paper"
    assert terms_kind(Strang()) == "split"
    assert terms_kind(Projected(diffrax.Heun())) == "tangent"
    for name, scheme in itde.SCHEMES.items():
        assert scheme.terms == terms_kind(scheme.make()), name


# ------------------------------------------------------------------ norms
@pytest.mark.parametrize("name", sorted(itde.NORMS))
def test_every_norm_has_the_full_interface_checked_against_numpy(name):
    cls = itde.NORMS[name]
    d = 6
    u = np.random.default_rng(0).normal(size=(5, d)) * 2 + 0.7
    ident = cls.identity(d, eps=1e-5, dtype=jnp.float64)
    mean = u.mean(-1, keepdims=True) if name == "layer" else 0.0
    c = u - mean
    ref = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ident(jnp.asarray(u)), ref, rtol=0, atol=1e-13)
    assert not ident.is_exact and ident.gain is not None
    exact = cls.exact(jnp.asarray(0.3), jnp.asarray(1.7))
    assert exact.is_exact and exact.gain is None and exact.shift is None and exact.eps == 0
    p = np.asarray(exact(jnp.asarray(u)))
    # on the set: zero residuals; off the set (u itself): the residual is the deviation
    assert float(exact.residual(jnp.asarray(p))) < 1e-12
    ms = (u**2).mean(-1) if name == "rms" else ((u - u.mean(-1, keepdims=True)) ** 2).mean(-1)
    want = np.max(np.abs(ms - 1.7**2))
    res = exact.residuals(jnp.asarray(u))
    key = "mean_square" if name == "rms" else "var"
    np.testing.assert_allclose(float(res[key]), want, rtol=1e-12)
    if name == "layer":
        np.testing.assert_allclose(float(res["mean"]), np.max(np.abs(u.mean(-1) - 0.3)))
        np.testing.assert_allclose(p.mean(-1), 0.3, atol=1e-12)
    scalar = cls.scalar(jnp.asarray(0.0), jnp.asarray(1.0), eps=1e-3)
    assert scalar.eps == 1e-3 and scalar.gain is None


def test_a_block_takes_a_norm_class_or_its_name():
    a = itde.Block.init(KEY, n_features=8, n_heads=2, n_hidden=16, norm="rms")
    b = itde.Block.init(KEY, n_features=8, n_heads=2, n_hidden=16, norm=itde.RMSNormProjection)
    assert type(a.norm1) is itde.RMSNormProjection
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), a, b)))
    with pytest.raises(ValueError, match="norm"):
        itde.Block.init(KEY, n_features=8, n_heads=2, n_hidden=16, norm="batch")
    f = itde.FunctionBlock.init(
        KEY, n_heads=2, feature_basis=itde.LegendreBasis(3), head_basis=itde.LegendreBasis(2),
        hidden_basis=itde.LegendreBasis(3), head_rule=itde.GaussLegendre(interval=(0, 1)),
        n_head_nodes=3,
        hidden_rule=itde.GaussLegendre(interval=(0, 1)), n_hidden_nodes=4, norm="rms",
    )  # fmt: skip
    assert isinstance(f, itde.AbstractBlock) and type(f.norm1) is itde.RMSNormProjection
    with pytest.raises(ValueError, match="per-feature gain"):
        dataclasses.replace(f, norm1=itde.LayerNormProjection.identity(8, eps=1e-5))


# ------------------------------------------------------------------ attention cores
def test_attention_cores_are_modules_named_once():
    assert {k: v for k, v in itde.ATTENTION_CORES.items()} == {
        "dense": itde.Dense,
        "blocked": itde.Blocked,
        "fused": itde.Fused,
    }
    m = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2)
    assert dataclasses.replace(m, attention_core="blocked").attention_core == itde.Blocked()
    with pytest.raises(TypeError, match="core"):
        m.controls.layer(0).attention(jnp.ones((3, 8)), core="dense")
    assert not itde.Fused.signed_weights and itde.Dense.signed_weights
    with pytest.raises(ValueError, match="implementation"):
        itde.Fused(implementation="flash")


# ------------------------------------------------------------------ score biases
def test_every_score_bias_is_an_abstract_score_bias_with_its_head_count_checked():
    m = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, causal=True)
    d = itde.DiscreteBias(jnp.zeros((2, 5, 5)))
    for b in (itde.ALiBi.init(2), d):
        assert isinstance(b, itde.AbstractScoreBias)
    assert not d.needs_positions and itde.ALiBi.needs_positions
    with pytest.raises(ValueError, match="3 heads but the attention has 2"):
        dataclasses.replace(m, score_bias=itde.ALiBi.init(3))
    with pytest.raises(ValueError, match="DiscreteBias for 5 tokens.*has 4"):
        dataclasses.replace(m, score_bias=d)(jnp.ones((4, 8)) * jnp.arange(8.0))
    # swapped in with eqx.tree_at (no __check_init__): named when the model is called
    swapped = eqx.tree_at(lambda e: e.score_bias, m, itde.ALiBi.init(3),
                          is_leaf=lambda x: x is None)  # fmt: skip
    for call in (swapped, lambda u: itde.solve(swapped, u)):
        with pytest.raises(ValueError, match="3 heads but the attention has 2"):
            call(jnp.ones((4, 8)))


# ------------------------------------------------------------------ parameter roles
# the kernels and embeddings of every module, named here (not read from the modules)
KERNELS = {"wq", "wk", "wv", "wo", "w1", "w2", "w_gate", "embedding", "position", "readout"}


def _by_name(tree, roles):
    out = {}
    for (path, _), role in zip(
        jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(roles), strict=True
    ):
        names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
        out.setdefault(role, set()).add(".".join(names))
    return out


@pytest.mark.parametrize("gated", [False, True])
def test_weight_decay_falls_on_every_kernel_and_only_on_kernels(gated):
    """Gated feed-forward kernels decay too (`w_gate` was once left out by a name list)."""
    m = itde.TransformerIDE.init(
        KEY, n_layers=2, n_features=8, n_heads=2, gated=gated, norm="rms" if gated else "layer",
        activation="silu" if gated else "relu", final_norm=True,
    )  # fmt: skip
    p = eqx.filter(m, eqx.is_inexact_array)
    roles = _by_name(p, _decay_mask(p))
    decayed = {path.rsplit(".", 1)[-1] for path in roles[True]}
    kept = {path.rsplit(".", 1)[-1] for path in roles[False]}
    assert decayed == {"wq", "wk", "wv", "wo", "w1", "w2"} | ({"w_gate"} if gated else set())
    assert decayed <= KERNELS and not (kept & KERNELS)


def test_layernorm_scalars_are_frozen_only_where_a_gain_makes_them_redundant():
    m = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, final_norm=True)
    p = eqx.filter(m, eqx.is_inexact_array)
    frozen = _by_name(p, _labels(p))["frozen"]
    assert frozen == {
        "controls.values.norm1.sigma1", "controls.values.norm1.sigma2",
        "controls.values.norm2.sigma1", "controls.values.norm2.sigma2",
        "final_norm.sigma1", "final_norm.sigma2",
    }  # fmt: skip
    smooth = itde.LegendreControls.init(KEY, n_modes=2, n_features=8, n_heads=2, n_hidden=8, eps=0)
    s = eqx.filter(itde.TransformerIDE(smooth, itde.Grid.unit(8)), eqx.is_inexact_array)
    assert "frozen" not in set(jax.tree.leaves(_labels(s)))  # sigma(t) is the constraint


def test_a_training_step_decays_gated_kernels():
    """An AdamW step with zero gradient moves exactly the decayed parameters."""
    import optax

    m = itde.TransformerIDE.init(
        KEY, n_layers=1, n_features=8, n_heads=2, gated=True, activation="silu"
    )
    p = eqx.filter(m, eqx.is_inexact_array)
    opt = optax.adamw(0.1, weight_decay=0.5, mask=_decay_mask)
    zero = jax.tree.map(jnp.zeros_like, p)
    upd, _ = opt.update(zero, opt.init(p), p)
    ff = upd.controls.values.feedforward
    np.testing.assert_allclose(ff.w_gate, -0.1 * 0.5 * p.controls.values.feedforward.w_gate)
    assert float(jnp.max(jnp.abs(upd.controls.values.norm1.gain))) == 0.0


def test_a_user_split_term_is_accepted_by_solve():
    m = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2)
    u = jax.random.normal(jax.random.key(3), (4, 8))
    a = itde.solve(m, u, terms=SplitTerm(m.terms("paper").terms)).ys[-1]
    np.testing.assert_allclose(a, m(u), rtol=0, atol=1e-14)


# ------------------------------------------------------------------ continuum sub-flows
def _smooth_model():
    ctrl = itde.LegendreControls.init(
        KEY, n_modes=3, n_features=8, n_heads=2, n_hidden=8, activation="gelu", eps=0.0
    )
    return itde.TransformerIDE(ctrl, itde.Grid.unit(8))


def test_split_sub_flows_are_tangent_to_the_moving_constraint_set():
    """On S1(sigma1(t), sigma2(t)), u = sigma1 + sigma2 z with mean z = 0 and mean z^2 = 1,
    so a velocity w keeps u on the moving set iff mean(w) = sigma1' and mean(w z) = sigma2'.
    The attention sub-flow carries no drift (both 0), the feed-forward sub-flow all of it,
    and their sum is the whole tangent field. sigma' is differentiated here by finite
    differences of the controls, independently of the library's jvp."""
    m = _smooth_model()
    t, h = 0.37, 1e-6
    u = m.project(t, jax.random.normal(jax.random.key(4), (5, 8)) * 2 + 1)
    n = m.constraint(t)
    s1p = (float(m.constraint(t + h).sigma1) - float(m.constraint(t - h).sigma1)) / (2 * h)
    s2p = (float(m.constraint(t + h).sigma2) - float(m.constraint(t - h).sigma2)) / (2 * h)
    z = (np.asarray(u) - float(n.sigma1)) / float(n.sigma2)
    flows = m.terms("split").terms
    att = np.asarray(flows[0].vector_field(t, u, None))
    ff = np.asarray(flows[2].vector_field(t, u, None))
    np.testing.assert_allclose(att.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose((att * z).mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(ff.mean(-1), s1p, atol=1e-7)
    np.testing.assert_allclose((ff * z).mean(-1), s2p, atol=1e-7)
    assert abs(s1p) + abs(s2p) > 0.1  # the set really moves
    np.testing.assert_allclose(att + ff, m.tangent_field(t, u), rtol=0, atol=1e-12)


@pytest.mark.parametrize("solver", [Strang(), Projected(diffrax.Heun())], ids=["split", "tangent"])
def test_continuum_solves_start_from_the_projection_of_the_initial_state(solver):
    """`solve` with continuum terms starts from P_{S1(t0)}(u0) (the equation lives on the
    set): the same result from u0 off the set as from its projection."""
    m = _smooth_model()
    u0 = jax.random.normal(jax.random.key(5), (5, 8)) * 3 + 2
    p0 = m.project(m.t0, u0)
    assert float(jnp.max(jnp.abs(p0 - u0))) > 0.5
    a = itde.solve(m, u0, solver=solver, dt0=0.25).ys[-1]
    b = itde.solve(m, p0, solver=solver, dt0=0.25).ys[-1]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


class _Inner(eqx.Module):
    w: jax.Array = eqx.field(metadata={"role": "frozen"})
    b: jax.Array


class _Outer(eqx.Module):
    inner: _Inner = eqx.field(metadata={"role": "decay"})
    c: jax.Array


def test_parameter_roles_pass_down_and_the_innermost_declaration_wins():
    tree = _Outer(_Inner(jnp.ones(2), jnp.ones(2)), jnp.ones(2))
    roles = itde.parameter_roles(tree)
    assert (roles.inner.w, roles.inner.b, roles.c) == ("frozen", "decay", "train")
