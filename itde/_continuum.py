r"""The continuum form of a per-layer post-norm network: an exact change of variables onto
the unit constraint set, with the normalisations' gains and shifts as operators.

**Why normalised coordinates.** A converted LayerNorm is $N(v) = g \circ P(v) + \beta$:
the projection $P$ onto $S_1(0, 1)$ (regularised by $\varepsilon$), then a per-feature
affine map. $N$ is not a projection ($N(N(v)) \ne N(v)$), so sub-stepping the network's
own scheme applies it again and again and computes another network; and in the network's
coordinates the state lies on a different affine image $g \circ S_1 + \beta$ after each
of the two norms of a layer, so no single constrained equation holds it. In the
coordinates $z = P(\cdot)$ of the projections, every norm of every layer projects onto
the same set $S_1(0, 1)$, and the gains move into the operators:
the network's state is $u = g \circ z + \beta$ with the last norm's $g, \beta$, and

$$u + A(u) = z + \big[A(g \circ z + \beta) + (g - 1) \circ z + \beta\big],$$

so the attention sub-flow of layer $n$ is $\tilde A_n(z) + E_n(z)$: the attention with
$g, \beta$ folded into the rows and biases of $W^Q, W^K, W^V$
([`with_input_affine`][itde.Attention.with_input_affine]) plus the affine field
$E_n(z) = (g - 1) \circ z + \beta$ ([`FeatureAffine`][itde.FeatureAffine], `affine1`),
which no attention or feed-forward can express. The feed-forward sub-flow likewise, with
the first norm's $g, \beta$ (`affine2`). The last norm's $g, \beta$ become the `readout`
$z \mapsto g \circ z + \beta$ applied before any `final_norm`.

**Exactness.** With the network's scheme ($\Delta t = 1$, Lie–Trotter, the regularised
projections) the continuum form computes the network: every Lie sub-step is the same
arithmetic on $z$ that the network does on $u$, up to the order of floating-point
operations. At any step and with `Strang` or `Projected(any diffrax solver)` it is an
equation on the fixed set $S_1(0, \sqrt{1 - \varepsilon})$ (the fixed points of the
regularised projection; $S_1(0, 1)$ when $\varepsilon = 0$), with layer-wise constant
operators: the solvers converge at their orders to its flow, and the Lie steps with
$\Delta t \to 0$ converge to the same flow (each regularised projection contracts the
distance to the fixed set by a factor of order $\varepsilon$).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ._controls import Block, PiecewiseConstant, stack
from ._operators._affine import FeatureAffine


def _is_unit(norm) -> bool:
    """No gain or shift, and the unit set: already a norm of a continuum form. Exact
    equality: `fold_norms` builds the unit set from the numbers 0 and 1 (`unit_and_affine`);
    a norm whose parameters differ at all, trained or given, is another set and is folded
    (or refused) as one."""
    if norm.gain is not None or norm.shift is not None:
        return False
    s1 = getattr(norm, "sigma1", 0.0)
    s2 = getattr(norm, "sigma2", getattr(norm, "sigma", 1.0))
    return bool(np.all(np.asarray(s1) == 0.0) and np.all(np.asarray(s2) == 1.0))


def continuum_form(model, **kwargs):
    """The continuum form of a model: `model.continuum_form(**kwargs)` for an
    [`itde.TransformerIDE`][itde.TransformerIDE.continuum_form] or a converted
    [`itde.HFTransformer`][itde.interop.HFTransformer.continuum_form]."""
    method = getattr(model, "continuum_form", None)
    if method is None:
        raise TypeError(
            f"`model` is a {type(model).__name__}; continuum_form takes an itde.TransformerIDE "
            "or an itde.HFTransformer (convert a PyTorch or Hugging Face model first with "
            "itde.from_torch / itde.from_hf)."
        )
    return method(**kwargs)


def refuse_not_smooth(equation) -> None:
    """Refuse the continuum form of an equation whose field jumps in the state (a routed
    mixture of experts): the form promises any solver at any step at its order."""
    equation.refuse_discontinuous(
        "`continuum_form` (a form any solver integrates at any step, at its order)",
        "Solve the network itself at one step per layer (`itde.solve(model, u0)`, LieTrotter "
        "with dt0 = one layer: the converted model exactly), or keep every expert (top_k = "
        "the number of experts: a smooth field, but another network).",
    )


def fold_norms(model, input_affine: FeatureAffine | None = None):
    """The continuum form of a per-layer model (see the module's text): for a post-norm
    model, the same network in normalised coordinates, exact at $\\Delta t = 1$ and
    integrable at any step by any solver; a pre-norm or parallel model is returned as it
    is (its norms are maps inside the operators, never re-applied by sub-stepping: it is
    its own continuum form).

    **Arguments:**

    - `model`: a `TransformerIDE` with per-layer (`PiecewiseConstant`) discrete controls.
    - `input_affine`: when the model's input is itself the output of a normalisation
      $g_0 \\circ P_0(e) + \\beta_0$ (BERT's embedding LayerNorm), that map's
      `FeatureAffine(g_0, beta_0)`: the continuum form then takes $P_0(e)$, which lies on
      the constraint set from the start. None: the input as it is.

    **Returns:** a `TransformerIDE` whose `model(u0)` equals the original's (to
    round-off) on `u0` (on $P_0(e)$ with `input_affine`).
    """
    refuse_not_smooth(model)
    if input_affine is not None:
        if not isinstance(input_affine, FeatureAffine):
            raise TypeError(
                f"`input_affine` must be an itde.FeatureAffine(scale, shift) or None, got "
                f"{type(input_affine).__name__}."
            )
        input_affine.check_width(model.n_features, "input_affine")
    if not model.block.has_constraint:
        if input_affine is not None:
            raise ValueError(
                f"`input_affine` is for post-norm models; this `block`={model.block!r} model "
                "is its own continuum form."
            )
        return model
    controls = model.controls
    if not isinstance(controls, PiecewiseConstant):
        norms = (controls.blocks.norm1, controls.blocks.norm2)
        if input_affine is None and all(n.gain is None and n.shift is None for n in norms):
            return model  # smooth controls with projections: already a continuum
        raise TypeError(
            "`continuum_form` changes the variables of a per-layer network "
            f"(PiecewiseConstant controls); this model has {type(controls).__name__} "
            "controls with per-feature norm gains or an `input_affine`, which it cannot fold."
        )
    layers = [controls.layer(n) for n in range(controls.n_layers)]
    if model.readout is not None or any(
        b.affine1 is not None or b.affine2 is not None for b in layers
    ):
        if input_affine is None and all(_is_unit(b.norm1) and _is_unit(b.norm2) for b in layers):
            return model  # a continuum form already
        raise ValueError(
            "`model` already has affine fields or a readout and norms that are not unit "
            "projections; folding again would drop them. Take the continuum form of the "
            "network it came from."
        )
    if input_affine is None and all(
        _is_unit(b.norm1) and _is_unit(b.norm2) for b in layers
    ):
        return model  # already normalised (e.g. a continuum form itself)
    d = model.n_features
    fw = model.feature_weights()
    affines = [b.norm2.unit_and_affine(d) for b in layers]
    with_shift = affines[0][2] is not None or (
        input_affine is not None and input_affine.shift is not None
    )

    def affine(scale, shift, like):
        if with_shift and shift is None:
            shift = jnp.zeros_like(like)
        return scale, shift

    ref = affines[0][1]
    if input_affine is None:
        incoming = affine(jnp.ones_like(ref), None, ref)
    else:
        incoming = affine(input_affine.scale.astype(ref.dtype), input_affine.shift, ref)
    blocks = []
    for b, (unit2, g2, s2) in zip(layers, affines, strict=True):
        unit1, g1, s1 = b.norm1.unit_and_affine(d)
        g1, s1 = affine(g1, s1, ref)
        blocks.append(
            Block(
                b.attention.with_input_affine(*incoming, fw),
                unit1,
                b.feedforward.with_input_affine(g1, s1, fw),
                unit2,
                affine1=FeatureAffine(incoming[0] - 1, incoming[1]),
                affine2=FeatureAffine(g1 - 1, s1),
            )
        )
        incoming = affine(g2, s2, ref)
    return dataclasses.replace(
        model,
        controls=PiecewiseConstant(stack(blocks), controls.t0, controls.layer_length),
        readout=FeatureAffine(*incoming),
    )
