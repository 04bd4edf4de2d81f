r"""Block forms: where the normalisations of a Transformer block sit, read as equations.

A block form is a variant of the equation, as a diffrax solver is a variant of the
integrator: [`TransformerIDE`][itde.TransformerIDE] holds one as `block` and asks it for
the inputs of the two operators, the sub-flows a solver integrates, the constraint set of
the continuum (if any) and the PyTorch layer it corresponds to; it never asks which form
it holds. A new block form is a subclass of
[`AbstractBlockForm`][itde.AbstractBlockForm] plus an entry in `BLOCK_FORMS` (for configs
and the CLI).

- [`PostNorm`][itde.PostNorm] (the paper; BERT, the 2017 Transformer): the normalisations
  are projections onto constraint sets, sub-flows of their own,
  $u_t = A(u) + \partial I_{S^{(1)}}(u) + F(u) + \partial I_{S^{(2)}}(u)$.
- [`PreNorm`][itde.PreNorm] (GPT-2, Llama, ViT): maps inside the operators,
  $u_t = A(N_1 u) + F(N_2 u)$, an ODE with no constraint.
- [`Parallel`][itde.Parallel] (GPT-J, PaLM): the same field taken as one sub-flow.
- [`SandwichNorm`][itde.SandwichNorm] (Gemma 2, Gemma 3): norms before and after each
  sublayer, $u_t = M_1 A(N_1 u) + M_2 F(N_2 u)$: each sublayer's output projected by its
  own norm before it joins the residual.
- [`OutputNorm`][itde.OutputNorm] (OLMo 2): norms after each sublayer only,
  $u_t = N_1 A(u) + N_2 F(u)$.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import diffrax
import equinox as eqx

from itde_solvers import ProjectionTerm

from ._checks import check_bool, check_variant

if TYPE_CHECKING:
    from ._equation import TransformerIDE


class AbstractBlockForm(eqx.Module):
    r"""Where the normalisations of a block sit, and so which equation the block is.

    `has_constraint`: whether the solution lives on the constraint set of the second
    normalisation (then every solver must project onto it: a splitting solver or
    `itde_solvers.Projected`).

    `projected_parts`: the block parts the scheme reads at the END of a step, as
    projections (`controls(t, "left", part)`); every other part is read at the step's
    start (`controls(t, "right", part)`). With one Lie step per layer, layer $n$ is read at
    $t_n$ and its projections at $t_{n+1}$; a fit through a network's layers
    (`LegendreControls.from_layers`, `SplineControls.from_layers`) interpolates each part
    at those times.

    The sub-flows for a solver, one method per kind of terms (see
    [`TransformerIDE.terms`][itde.TransformerIDE.terms]): `paper_flows` (Lie with
    $\Delta t = 1$ is the block itself), `split_flows` (for higher-order splittings) and
    `tangent_flows` (the whole field, for any diffrax solver)."""

    has_constraint: ClassVar[bool]
    projected_parts: ClassVar[tuple[str, ...]] = ()
    #: Whether the form reads the controls' `out_norm1`, `out_norm2` (norms of the
    #: sublayers' outputs): `TransformerIDE.init` then builds them.
    output_norms: ClassVar[bool] = False

    def attention_input(self, eq: TransformerIDE, t, u):
        """The state the attention acts on at depth `t`: `u`, or its normalisation."""
        return u

    def feedforward_input(self, eq: TransformerIDE, t, u):
        """The state the feed-forward acts on at depth `t`."""
        return u

    def attention_output(self, eq: TransformerIDE, t, a):
        """The attention sub-flow's vector field at depth `t` from the attention's output
        `a`: `a`, or its normalisation (a norm after the sublayer)."""
        return a

    def feedforward_output(self, eq: TransformerIDE, t, f, u):
        """The feed-forward sub-flow's vector field at depth `t` from $F$ of the input `f`
        and the state `u`."""
        return f

    def check_controls(self, controls) -> None:
        """Raise unless `controls` hold every part this form reads (called when an
        equation is built); every part of a `Block` is there by default."""

    @abc.abstractmethod
    def paper_flows(self, eq: TransformerIDE) -> tuple:
        """The block's own sub-flows (Lie–Trotter with $\\Delta t = 1$ is the block)."""

    @abc.abstractmethod
    def split_flows(self, eq: TransformerIDE) -> tuple:
        """Sub-flows for higher-order splittings (Strang, parallel splitting)."""

    @abc.abstractmethod
    def tangent_flows(self, eq: TransformerIDE) -> tuple:
        """The whole field (and the projection, if any): for a wrapped diffrax solver."""

    @abc.abstractmethod
    def torch_layer_options(self, eps: float) -> dict:
        """The keywords of `nn.TransformerEncoderLayer` that make it this block (for
        `itde.to_torch`), or a `ValueError` naming why PyTorch has no such layer."""


def _two_fields(eq):
    return (diffrax.ODETerm(eq.attention_field), diffrax.ODETerm(eq.feedforward_field))


def _one_field(eq):
    return (diffrax.ODETerm(eq.field),)


class PostNorm(AbstractBlockForm):
    r"""The paper's block: attention, the projection onto $S^{(1)}$, the feed-forward, the
    projection onto $S^{(2)}$ (PyTorch's `norm_first=False`).

    `relaxation`: the feed-forward sub-flow as the paper's relaxation
    $u_5 = \tfrac12(u_4 + u_2)$, $u_4 = F(u_2)$ (its vector field $\tfrac12(F(u) - u)$),
    instead of the residual $u_5 = u_2 + F(u_2)$ (PyTorch's block for any $\varepsilon$).
    The two give the same block when $\varepsilon = 0$ (the projection forgets the factor
    $\tfrac12$) and slightly different ones when $\varepsilon > 0$."""

    relaxation: bool = eqx.field(static=True, default=False)
    has_constraint: ClassVar[bool] = True
    projected_parts: ClassVar[tuple[str, ...]] = ("norm1", "norm2")

    def __check_init__(self):
        check_bool("relaxation", self.relaxation)

    def feedforward_output(self, eq, t, f, u):
        return 0.5 * (f - u) if self.relaxation else f

    def paper_flows(self, eq):
        return (
            diffrax.ODETerm(eq.attention_field),
            ProjectionTerm(eq.project1),
            diffrax.ODETerm(eq.feedforward_field),
            ProjectionTerm(eq.project2),
        )

    def split_flows(self, eq):
        return (
            diffrax.ODETerm(eq.attention_tangent),
            ProjectionTerm(eq.project),
            diffrax.ODETerm(eq.feedforward_tangent),
            ProjectionTerm(eq.project),
        )

    def tangent_flows(self, eq):
        return (diffrax.ODETerm(eq.tangent_field), ProjectionTerm(eq.project))

    def torch_layer_options(self, eps):
        if self.relaxation and eps > 0:
            raise ValueError(
                "`to_torch(model)`: PostNorm(relaxation=True) with eps > 0 has no PyTorch "
                "equivalent; use PostNorm() (the residual form) or eps=0."
            )
        return {"norm_first": False}


class _AbstractNormInside(AbstractBlockForm):
    """Normalisations as maps inside the operators: no constraint on the state (every
    part, the norms too, is read at the start of a step)."""

    has_constraint: ClassVar[bool] = False

    def attention_input(self, eq, t, u):
        return eq.controls(t, "right", "norm1")(u, eq.feature_weights())

    def feedforward_input(self, eq, t, u):
        return eq.controls(t, "right", "norm2")(u, eq.feature_weights())

    def split_flows(self, eq):
        return _two_fields(eq)

    def tangent_flows(self, eq):
        return _one_field(eq)


class PreNorm(_AbstractNormInside):
    r"""Normalisations inside the operators, $u_t = A(N_1 u) + F(N_2 u)$ (GPT-2, Llama,
    ViT; PyTorch's `norm_first=True`). Lie splitting with Euler sub-steps and
    $\Delta t = 1$ is the pre-norm block $u \mapsto v + F(N_2 v)$, $v = u + A(N_1 u)$; its
    continuum limit is integrated by any diffrax solver directly."""

    def paper_flows(self, eq):
        return _two_fields(eq)

    def torch_layer_options(self, eps):
        return {"norm_first": True}


class Parallel(_AbstractNormInside):
    r"""The field $A(N_1 u) + F(N_2 u)$ as one sub-flow (GPT-J, PaLM): one Euler step with
    $\Delta t = 1$ is the parallel block $u + A(N_1 u) + F(N_2 u)$ (GPT-J shares one norm:
    $N_1 = N_2$). Splittings (`"split"` terms) take the two fields apart."""

    def paper_flows(self, eq):
        return _one_field(eq)

    def torch_layer_options(self, eps):
        raise ValueError(
            "`to_torch(model)`: a Parallel block has no nn.TransformerEncoderLayer equivalent "
            "(PyTorch's layer is post-LN or pre-LN)."
        )


class _AbstractNormAfter(_AbstractNormInside):
    r"""Each sublayer's output projected by a norm of its own before it joins the residual:
    $u_t = M_1 A(\cdot) + M_2 F(\cdot)$, $M_i$ the normalisation (an RMSNorm's or
    LayerNorm's map, with its gain) of the sublayer's output. As an operator $M_i$ is the
    projection of the output onto the norm's set (the sphere of radius $\sqrt{d}$, then
    the gain), a map inside the vector field, not a constraint on the state: the state
    itself is never normalised, so the equation is an ODE with no constraint set
    (`has_constraint` False). Lie splitting with Euler sub-steps and $\Delta t = 1$ is the
    block (and the key/value cache steps it as the pre-norm block); its continuum limit is
    the same field at any step, so the solvers that take [`PreNorm`][itde.PreNorm] take it
    (Strang splitting and wrapped diffrax solvers such as Heun are checked), smooth
    controls (`LegendreControls.from_layers`) fit its norms as any other part, and
    [`continuum_form`][itde.TransformerIDE.continuum_form] returns the model unchanged
    (it is its own continuum form: its norms are not projections of the state, so there
    is no change of variables to make). A per-layer window (`Block.window`) has no smooth
    form and is refused under smooth controls. PyTorch's `nn.TransformerEncoderLayer` has
    no such layer (`itde.to_torch` refuses it by name)."""

    def paper_flows(self, eq):
        return _two_fields(eq)

    def torch_layer_options(self, eps):
        raise ValueError(
            f"`to_torch(model)`: a {type(self).__name__} block (a norm after each sublayer) "
            "has no nn.TransformerEncoderLayer equivalent (PyTorch's layer is post-LN or "
            "pre-LN)."
        )


class SandwichNorm(_AbstractNormAfter):
    r"""Norms before and after each sublayer (Gemma 2, Gemma 3):
    $u_t = M_1 A(N_1 u) + M_2 F(N_2 u)$. `norm1`, `norm2` are the maps $N_1, N_2$ before
    the sublayers (as in [`PreNorm`][itde.PreNorm]); the controls' `out_norm1`,
    `out_norm2` are the projections $M_1, M_2$ of the attention's and the feed-forward's
    outputs (Gemma's `post_attention_layernorm` and `post_feedforward_layernorm`). See
    the base's notes for the solvers and continuum forms that accept it."""

    output_norms: ClassVar[bool] = True

    def attention_output(self, eq, t, a):
        return eq.controls(t, "right", "out_norm1")(a, eq.feature_weights())

    def feedforward_output(self, eq, t, f, u):
        return eq.controls(t, "right", "out_norm2")(f, eq.feature_weights())

    def check_controls(self, controls):
        blocks = controls.blocks
        missing = [p for p in ("out_norm1", "out_norm2") if getattr(blocks, p, None) is None]
        if missing:
            raise ValueError(
                f"`block`=SandwichNorm() projects each sublayer's output by the controls' "
                f"`out_norm1` and `out_norm2`, but these controls ({type(blocks).__name__}) "
                f"have no {' and no '.join(missing)}; give Block(..., out_norm1=..., "
                "out_norm2=...) (itde.RMSNormProjection or itde.LayerNormProjection), or use "
                "block=PreNorm()."
            )


class OutputNorm(_AbstractNormAfter):
    r"""Norms after each sublayer only, inside the residual (OLMo 2):
    $u_t = N_1 A(u) + N_2 F(u)$, i.e. the block $v = u + N_1(A(u))$,
    $v + N_2(F(v))$. Here `norm1` and `norm2` are the projections of the attention's and
    the feed-forward's outputs (OLMo 2's `post_attention_layernorm` and
    `post_feedforward_layernorm`), and the sublayers read the state itself. See the base's
    notes for the solvers and continuum forms that accept it."""

    def attention_input(self, eq, t, u):
        return u

    def feedforward_input(self, eq, t, u):
        return u

    def attention_output(self, eq, t, a):
        return eq.controls(t, "right", "norm1")(a, eq.feature_weights())

    def feedforward_output(self, eq, t, f, u):
        return eq.controls(t, "right", "norm2")(f, eq.feature_weights())


#: Block forms by name, for configs, the CLI and `TransformerIDE.init(block=...)`.
BLOCK_FORMS: dict[str, type[AbstractBlockForm]] = {
    "post_norm": PostNorm,
    "pre_norm": PreNorm,
    "parallel": Parallel,
    "sandwich_norm": SandwichNorm,
    "output_norm": OutputNorm,
}
"""Block forms by name, for configs, the CLI and `TransformerIDE.init(block=...)`."""


#: The post-norm feed-forward forms by name, for configs (`ffn_form = "relaxation"`):
#: the value is `PostNorm`'s `relaxation`.
FFN_FORMS: dict[str, bool] = {"residual": False, "relaxation": True}
"""The post-norm feed-forward forms by name, for configs (`ffn_form = "relaxation"`): the value
is `PostNorm`'s `relaxation`."""


def block_from_names(block: str, ffn_form: str = "residual") -> AbstractBlockForm:
    """The block form a config names: `block` in `BLOCK_FORMS`, and the post-norm
    feed-forward form `ffn_form` in `FFN_FORMS` (`"relaxation"` for `"post_norm"` only)."""
    form = as_block_form(block)
    if ffn_form not in FFN_FORMS:
        raise ValueError(f"`ffn_form`={ffn_form!r} is not known; choose one of {list(FFN_FORMS)}.")
    if FFN_FORMS[ffn_form]:
        if not isinstance(form, PostNorm):
            raise ValueError(
                f"`ffn_form`={ffn_form!r} is a form of the post-norm block's feed-forward "
                f"substep; a `block`={block!r} model needs ffn_form='residual'."
            )
        form = PostNorm(relaxation=True)
    return form


def as_block_form(block) -> AbstractBlockForm:
    """A block form from an instance or a name of `BLOCK_FORMS` (the edge where a config's
    or the CLI's string becomes a module)."""
    return check_variant(
        "block", block, AbstractBlockForm, BLOCK_FORMS,
        "an itde block form (itde.PostNorm(), itde.PreNorm(), itde.Parallel())",
    )  # fmt: skip
