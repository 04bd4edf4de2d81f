r"""Exact conversion of Hugging Face `transformers` models into equations.

The embeddings of a model are its initial condition $u(x, y, 0) = f(x, y)$; its layers are
the equation's per-layer controls, solved with $\Delta t = 1$; its final norm is the output
map.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._blocks import PostNorm, PreNorm
from .._controls import Block, PiecewiseConstant, stack
from .._equation import TransformerIDE
from .._operators._affine import FeatureAffine
from .._operators._attention import Attention
from .._operators._feedforward import FeedForward, GatedFeedForward
from .._operators._layernorm import LayerNormProjection
from .._operators._mask import key_mask
from .._operators._rmsnorm import RMSNormProjection
from .._operators._rope import Rope
from .._quadrature._rules import Grid
from .._roles import kernel
from ._positions import AbsolutePositions, AbstractPositions, NoPositions, RobertaPositions
from ._torch import _np, check_x64

# Hugging Face activation names (`config.hidden_act`, `activation_function`, `activation`)
# and the `itde.ACTIVATIONS` entry computing the same function.
HF_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
    "quick_gelu": "quick_gelu",
}


class HFTransformer(eqx.Module):
    r"""A Hugging Face Transformer as an equation: embeddings, then a `TransformerIDE`.

    The token embeddings (plus learned absolute positions and token type 0, then the
    embedding LayerNorm, where the model has them) are the initial condition $u(x, y, 0)$;
    `equation` carries the layers as piecewise-constant controls and the final norm.
    Built by [`from_hf`][itde.from_hf].

    `m(input_ids, attention_mask=mask)` acts on one sequence `[tokens]` and returns
    `[tokens, features]`, equal to the source model's
    `model(input_ids[None], attention_mask=mask[None]).last_hidden_state[0]` on the real
    tokens. Batch with `jax.vmap(m)(ids, mask)`.

    **Padding.** `attention_mask` (`[tokens]`, booleans or 0/1, 0 on padding) removes the
    padded tokens from every sequence's token domain: real tokens never see them. The rows of
    padded tokens are defined and finite but carry no meaning (Hugging Face's rows there
    differ, and differ between its attention implementations); a padded token before every
    real one in a causal model attends to nothing and gets attention output 0. Positions
    are those of the source model: `0, 1, ..., N-1` whatever the mask (BERT, DistilBERT,
    GPT-2, Llama: left padding shifts the real tokens' positions, as in Hugging Face),
    and for RoBERTa counted from `padding_idx + 1` over the tokens that are not
    `padding_idx`.

    **Arguments:**

    - `word_embeddings`: `[vocab, features]`.
    - `position_embeddings`: learned absolute positions `[max_positions, features]`, or None.
    - `token_type_embeddings`: `[types, features]`, or None.
    - `embedding_norm`: the embeddings' LayerNorm, or None.
    - `equation`: the layers and final norm.
    - `positions`: the position scheme: `AbsolutePositions()` (`0..N-1`),
      `RobertaPositions(padding_idx)` or `NoPositions()`.
    - `source`: the name of the converted class, for messages.
    """

    word_embeddings: Float[Array, "vocab features"] = kernel()
    position_embeddings: Float[Array, "positions features"] | None = kernel()
    token_type_embeddings: Float[Array, "types features"] | None = kernel()
    embedding_norm: LayerNormProjection | None
    equation: TransformerIDE
    positions: AbstractPositions = AbsolutePositions()
    source: str = eqx.field(static=True, default="")

    def __check_init__(self):
        if not isinstance(self.positions, AbstractPositions):
            raise TypeError(
                f"`positions`={self.positions!r} must be a position scheme: "
                "AbsolutePositions(), RobertaPositions(padding_idx) or NoPositions()."
            )
        self.positions.check(self.position_embeddings)
        if not isinstance(self.equation, TransformerIDE):
            raise TypeError(
                f"`equation` must be an itde.TransformerIDE, got {type(self.equation).__name__}."
            )

    def continuum_form(self) -> HFTransformer:
        """The same model with its equation in normalised coordinates
        ([`TransformerIDE.continuum_form`][itde.TransformerIDE.continuum_form]), whose
        depth any solver refines at any step.

        For a post-norm model (BERT, RoBERTa, DistilBERT) the embedding LayerNorm's gain and
        shift are folded into the first layer too, so the initial condition
        $P_0(e)$ lies on the constraint set; `m.continuum_form()(ids)` equals `m(ids)` (the
        source model) to round-off. A pre-norm model (GPT-2, Llama) is its own continuum
        form and is returned unchanged."""
        if not self.equation.block.has_constraint:
            return self
        norm, affine = self.embedding_norm, None
        if norm is not None:
            norm, scale, shift = norm.unit_and_affine(self.equation.n_features)
            affine = FeatureAffine(scale, shift)
        return dataclasses.replace(
            self, embedding_norm=norm, equation=self.equation.continuum_form(affine)
        )

    @property
    def max_tokens(self) -> int | None:
        """The longest sequence the position table holds (None: no limit)."""
        return self.positions.max_tokens(self.position_embeddings)

    def embed(
        self,
        input_ids: Int[Array, " tokens"],
        token_type_ids: Int[Array, " tokens"] | None = None,
    ) -> Float[Array, "tokens features"]:
        """The initial condition $u(\\cdot, \\cdot, 0)$ for one sequence of token ids."""
        ids = _ids("input_ids", input_ids, self.word_embeddings.shape[0])
        n = ids.shape[0]
        if self.max_tokens is not None and n > self.max_tokens:
            rows = self.position_embeddings.shape[0]  # type: ignore[union-attr]
            reserved = (
                ""
                if rows == self.max_tokens
                else f", {rows - self.max_tokens} of whose rows are reserved: positions count "
                "from padding_idx + 1"
            )
            raise ValueError(
                f"`input_ids` has {n} tokens, more than the {self.max_tokens} this "
                f"{self.source or 'model'} takes (config.max_position_embeddings = {rows}"
                f"{reserved}); split the sequence."
            )
        u = self.word_embeddings[ids]
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                u = u + self.token_type_embeddings[0]
            else:
                tt = _ids("token_type_ids", token_type_ids, self.token_type_embeddings.shape[0])
                if tt.shape != ids.shape:
                    raise ValueError(
                        f"`token_type_ids` must have the shape of `input_ids` {ids.shape}, got "
                        f"{tt.shape}."
                    )
                u = u + self.token_type_embeddings[tt]
        elif token_type_ids is not None:
            raise ValueError(
                f"`token_type_ids` given, but this {self.source or 'model'} has no token type "
                "embeddings; leave it out."
            )
        u = self.positions.embed(u, ids, self.position_embeddings)
        if self.embedding_norm is not None:
            u = self.embedding_norm(u)
        return u

    def __call__(
        self,
        input_ids: Int[Array, " tokens"],
        attention_mask: Int[Array, " tokens"] | None = None,
        token_type_ids: Int[Array, " tokens"] | None = None,
    ) -> Float[Array, "tokens features"]:
        """The last hidden state of one sequence, `[tokens, features]`.

        **Arguments:**

        - `input_ids`: `[tokens]` integer token ids.
        - `attention_mask`: `[tokens]`, 1 (True) on real tokens and 0 (False) on padding;
          None: every token is real.
        - `token_type_ids`: `[tokens]` segment ids (BERT, RoBERTa); None: type 0.
        """
        n = np.shape(input_ids)[0] if np.ndim(input_ids) == 1 else None
        mask = None
        if attention_mask is not None and n is not None:
            mask = key_mask(attention_mask, n, "attention_mask")
            if mask.ndim != 1:
                raise ValueError(
                    f"`attention_mask` must be [tokens] for one sequence, got shape {mask.shape}; "
                    "for a batch use jax.vmap(m)(input_ids, attention_mask)."
                )
        return self.equation(self.embed(input_ids, token_type_ids), mask)

    def batch(
        self,
        input_ids: Int[Array, "batch tokens"],
        attention_mask: Int[Array, "batch tokens"] | None = None,
    ) -> Float[Array, "batch tokens features"]:
        """`jax.vmap(m)(input_ids, attention_mask)` computed as one solve over the batch
        ([`TransformerIDE.batch`][itde.TransformerIDE.batch]): the same numbers, and a
        training step about twice as fast as through `jax.vmap` of the solve
        (`benchmarks/bench_gpt2.py`)."""
        if type(input_ids).__module__.startswith("torch"):
            _ids("input_ids", input_ids, 0)  # names the conversion
        if np.ndim(input_ids) != 2:
            raise ValueError(
                f"`input_ids` must be a batch [batch, tokens], got shape {np.shape(input_ids)}; "
                "for one sequence call the model itself."
            )
        u0 = jax.vmap(self.embed)(jnp.asarray(input_ids))
        return self.equation.batch(u0, attention_mask)


def _ids(name: str, ids, n_rows: int):
    """Token ids `[tokens]`, checked against the embedding table (with NumPy when the ids are
    concrete, with `eqx.error_if` under `jax.jit`)."""
    if type(ids).__module__.startswith("torch"):
        raise TypeError(
            f"`{name}` is a torch tensor; convert it first: `jnp.asarray({name}.numpy())`."
        )
    traced = isinstance(ids, jax.core.Tracer)
    ids = ids if traced else np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(
            f"`{name}` must be one sequence [tokens], got shape {ids.shape}; for a batch use "
            "jax.vmap(m)(input_ids, attention_mask)."
        )
    if ids.shape[0] == 0:
        raise ValueError(f"`{name}` is empty (shape {ids.shape}); give at least one token id.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"`{name}` must hold integer ids, got dtype {ids.dtype}.")
    if traced:
        bad = (ids < 0) | (ids >= n_rows)
        return eqx.error_if(ids, jnp.any(bad), f"`{name}` holds ids outside [0, {n_rows}).")
    bad = (ids < 0) | (ids >= n_rows)
    if bad.any():
        raise ValueError(
            f"`{name}` holds ids outside [0, {n_rows}) (the embedding table's rows), e.g. "
            f"{int(ids[np.argmax(bad)])}."
        )
    return jnp.asarray(ids)


# ------------------------------------------------------------------------ weight glue
def _a(t):
    return None if t is None else jnp.asarray(np.ascontiguousarray(_np(t)))


def _lin(lin) -> np.ndarray:
    """An `nn.Linear` weight as `[in, out]` (Conv1D stores it that way already)."""
    return _np(lin.weight).T


def _heads_in(w: np.ndarray, heads: int) -> Array:
    """`[features, heads * head_dim]` -> `[heads, features, head_dim]`."""
    d = w.shape[0]
    return jnp.asarray(np.ascontiguousarray(w.reshape(d, heads, -1).transpose(1, 0, 2)))


def _heads_bias(b, heads: int):
    return None if b is None else jnp.asarray(_np(b).reshape(heads, -1))


def _heads_out(w: np.ndarray, heads: int) -> Array:
    """`[heads * value_dim, features]` -> `[heads, value_dim, features]`."""
    return jnp.asarray(np.ascontiguousarray(w.reshape(heads, -1, w.shape[-1])))


def _attention(q, k, v, o, h: int, hkv: int | None = None) -> Attention:
    """From four `nn.Linear` (Q, K, V, output projection)."""
    hkv = h if hkv is None else hkv
    return Attention(
        wq=_heads_in(_lin(q), h),
        wk=_heads_in(_lin(k), hkv),
        wv=_heads_in(_lin(v), hkv),
        wo=_heads_out(_lin(o), h),
        bq=_heads_bias(q.bias, h),
        bk=_heads_bias(k.bias, hkv),
        bv=_heads_bias(v.bias, hkv),
        bo=_a(o.bias),
    )


def _layer_norm(ln, eps=None) -> LayerNormProjection:
    w = _np(ln.weight)
    return LayerNormProjection(
        jnp.zeros((), w.dtype),
        jnp.ones((), w.dtype),
        jnp.asarray(w),
        _a(getattr(ln, "bias", None)),
        float(ln.eps if eps is None else eps),
    )


def _rms_norm(norm) -> RMSNormProjection:
    w = _np(norm.weight)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return RMSNormProjection(jnp.ones((), w.dtype), jnp.asarray(w), float(eps))


def _feedforward(lin1, lin2, activation: str) -> FeedForward:
    return FeedForward(
        w1=jnp.asarray(np.ascontiguousarray(_lin(lin1))),
        w2=jnp.asarray(np.ascontiguousarray(_lin(lin2))),
        b1=_a(lin1.bias),
        b2=_a(lin2.bias),
        activation=activation,
    )


def _activation(field: str, value) -> str:
    if not isinstance(value, str) or value not in HF_ACTIVATIONS:
        raise ValueError(
            f"`config.{field}`={value!r} is not supported; the equation's feed-forward takes "
            f"{sorted(HF_ACTIVATIONS)}."
        )
    return HF_ACTIVATIONS[value]


def _refuse(config, field: str, ok, why: str) -> None:
    """Raise when `config.<field>` asks for something the equation cannot express."""
    value = getattr(config, field, None)
    if not ok(value):
        raise ValueError(f"`config.{field}`={value!r} is not supported: {why}")


def _encoder_checks(config, name: str) -> None:
    _refuse(
        config, "position_embedding_type", lambda v: v in (None, "absolute"),
        f"{name} converts with learned absolute positions only ('absolute').",
    )  # fmt: skip
    _refuse(
        config, "is_decoder", lambda v: not v,
        f"the {name} decoder (causal self-attention with a cache) is not converted; use the "
        "encoder (is_decoder=False).",
    )  # fmt: skip
    _refuse(
        config, "add_cross_attention", lambda v: not v,
        "cross-attention reads a second sequence, which the equation does not have.",
    )  # fmt: skip


def _equation(blocks, *, causal, block, final_norm=None, rope=None) -> TransformerIDE:
    d = blocks[0].attention.n_features
    return TransformerIDE(
        PiecewiseConstant(stack(blocks)),
        Grid.unit(d),
        causal=causal,
        final_norm=final_norm,
        block=block,
        rope=rope,
    )


# ------------------------------------------------------------------------ families
def _bert(model, name: str) -> HFTransformer:
    config = model.config
    _encoder_checks(config, name)
    act = _activation("hidden_act", config.hidden_act)
    h = config.num_attention_heads
    blocks = []
    for layer in model.encoder.layer:
        sa, out = layer.attention.self, layer.attention.output
        blocks.append(
            Block(
                _attention(sa.query, sa.key, sa.value, out.dense, h),
                _layer_norm(out.LayerNorm),
                _feedforward(layer.intermediate.dense, layer.output.dense, act),
                _layer_norm(layer.output.LayerNorm),
            )
        )
    emb = model.embeddings
    roberta = name == "RobertaModel"
    return HFTransformer(
        word_embeddings=_a(emb.word_embeddings.weight),
        position_embeddings=_a(emb.position_embeddings.weight),
        token_type_embeddings=_a(emb.token_type_embeddings.weight),
        embedding_norm=_layer_norm(emb.LayerNorm),
        equation=_equation(blocks, causal=False, block=PostNorm()),
        positions=RobertaPositions(int(emb.padding_idx)) if roberta else AbsolutePositions(),
        source=name,
    )


def _distilbert(model, name: str) -> HFTransformer:
    config = model.config
    act = _activation("activation", config.activation)
    h = config.n_heads
    blocks = []
    for layer in model.transformer.layer:
        a = layer.attention
        blocks.append(
            Block(
                _attention(a.q_lin, a.k_lin, a.v_lin, a.out_lin, h),
                _layer_norm(layer.sa_layer_norm),
                _feedforward(layer.ffn.lin1, layer.ffn.lin2, act),
                _layer_norm(layer.output_layer_norm),
            )
        )
    emb = model.embeddings
    return HFTransformer(
        word_embeddings=_a(emb.word_embeddings.weight),
        position_embeddings=_a(emb.position_embeddings.weight),
        token_type_embeddings=None,
        embedding_norm=_layer_norm(emb.LayerNorm),
        equation=_equation(blocks, causal=False, block=PostNorm()),
        positions=AbsolutePositions(),
        source=name,
    )


def _gpt2(model, name: str) -> HFTransformer:
    config = model.config
    _refuse(
        config, "scale_attn_weights", lambda v: v is None or bool(v),
        "the equation's attention scales scores by 1/sqrt(head_dim) (scale_attn_weights=True).",
    )  # fmt: skip
    _refuse(
        config, "scale_attn_by_inverse_layer_idx", lambda v: not v,
        "the equation's attention scales scores by 1/sqrt(head_dim) in every layer.",
    )  # fmt: skip
    _refuse(
        config, "reorder_and_upcast_attn", lambda v: not v,
        "the converted attention computes in the model's dtype; set it to False.",
    )  # fmt: skip
    _refuse(
        config, "add_cross_attention", lambda v: not v,
        "cross-attention reads a second sequence, which the equation does not have.",
    )  # fmt: skip
    act = _activation("activation_function", config.activation_function)
    h = config.num_attention_heads
    blocks = []
    for layer in model.h:
        c_attn = _np(layer.attn.c_attn.weight)  # Conv1D: [features, 3 * features]
        b_attn = _np(layer.attn.c_attn.bias)
        wq, wk, wv = np.split(c_attn, 3, axis=1)
        bq, bk, bv = np.split(b_attn, 3)
        mlp = layer.mlp
        blocks.append(
            Block(
                Attention(
                    wq=_heads_in(wq, h),
                    wk=_heads_in(wk, h),
                    wv=_heads_in(wv, h),
                    wo=_heads_out(_np(layer.attn.c_proj.weight), h),
                    bq=jnp.asarray(bq.reshape(h, -1)),
                    bk=jnp.asarray(bk.reshape(h, -1)),
                    bv=jnp.asarray(bv.reshape(h, -1)),
                    bo=_a(layer.attn.c_proj.bias),
                ),
                _layer_norm(layer.ln_1),
                FeedForward(
                    w1=_a(mlp.c_fc.weight),
                    w2=_a(mlp.c_proj.weight),
                    b1=_a(mlp.c_fc.bias),
                    b2=_a(mlp.c_proj.bias),
                    activation=act,
                ),
                _layer_norm(layer.ln_2),
            )
        )
    return HFTransformer(
        word_embeddings=_a(model.wte.weight),
        position_embeddings=_a(model.wpe.weight),
        token_type_embeddings=None,
        embedding_norm=None,
        equation=_equation(
            blocks, causal=True, block=PreNorm(), final_norm=_layer_norm(model.ln_f)
        ),
        positions=AbsolutePositions(),
        source=name,
    )


def _rope_checks(config, name: str) -> None:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"`config.rope_parameters['rope_type']`={rope_type!r} is not supported: {name} "
            "converts with the default RoPE frequencies only ('default')."
        )
    _refuse(
        config, "rope_scaling", lambda v: not v or v.get("rope_type", v.get("type")) == "default",
        "the equation's RoPE has no frequency scaling; use rope_scaling=None.",
    )  # fmt: skip


def _llama(model, name: str) -> HFTransformer:
    config = model.config
    _rope_checks(config, name)
    act = _activation("hidden_act", config.hidden_act)
    h = config.num_attention_heads
    hkv = config.num_key_value_heads or h
    blocks = []
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        blocks.append(
            Block(
                _attention(a.q_proj, a.k_proj, a.v_proj, a.o_proj, h, hkv),
                _rms_norm(layer.input_layernorm),
                GatedFeedForward(
                    w_gate=jnp.asarray(np.ascontiguousarray(_lin(mlp.gate_proj))),
                    w1=jnp.asarray(np.ascontiguousarray(_lin(mlp.up_proj))),
                    w2=jnp.asarray(np.ascontiguousarray(_lin(mlp.down_proj))),
                    b_gate=_a(mlp.gate_proj.bias),
                    b1=_a(mlp.up_proj.bias),
                    b2=_a(mlp.down_proj.bias),
                    activation=act,
                ),
                _rms_norm(layer.post_attention_layernorm),
            )
        )
    rope = Rope(_a(model.rotary_emb.inv_freq))
    return HFTransformer(
        word_embeddings=_a(model.embed_tokens.weight),
        position_embeddings=None,
        token_type_embeddings=None,
        embedding_norm=None,
        equation=_equation(
            blocks, causal=True, block=PreNorm(), final_norm=_rms_norm(model.norm), rope=rope
        ),
        positions=NoPositions(),
        source=name,
    )


CONVERTERS = {
    "BertModel": _bert,
    "RobertaModel": _bert,
    "DistilBertModel": _distilbert,
    "GPT2Model": _gpt2,
    "LlamaModel": _llama,
}


def _family(model) -> str:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "itde.from_hf needs Hugging Face transformers: pip install transformers"
        ) from e
    for name in CONVERTERS:
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            return name
    what = type(model).__name__
    hint = ""
    base = getattr(model, "base_model", None)
    if base is not None and base is not model and type(base).__name__ in CONVERTERS:
        hint = " For a model with a head, convert its base model: `itde.from_hf(model.base_model)`."
    raise TypeError(
        f"`model` is a {what}; itde.from_hf converts transformers {', '.join(CONVERTERS)}.{hint}"
    )


def from_hf(model: Any) -> HFTransformer:
    """Convert a Hugging Face `transformers` model into an equivalent equation.

    Supported: `BertModel`, `RobertaModel`, `DistilBertModel` (post-LN encoders:
    `block=PostNorm()`; word + position (+ token type) embeddings and their LayerNorm are
    the initial condition), `GPT2Model` (pre-LN, causal, final `ln_f`) and `LlamaModel`
    (pre-norm with RMSNorm, RoPE, SwiGLU, grouped-query attention, any `head_dim`,
    `attention_bias`, `mlp_bias`). Parameters keep the model's dtype (float32, float64).

    Returns an [`HFTransformer`][itde.HFTransformer] `m` such that for one sequence
    `m(input_ids, attention_mask=mask)` equals
    `model(input_ids[None], attention_mask=mask[None]).last_hidden_state[0]` on the real
    tokens (dropout off); `jax.vmap(m)` for a batch. The layers are `m.equation`, a
    [`TransformerIDE`][itde.TransformerIDE] whose continuum limit the depth solvers integrate.

    A config option the equation cannot express (e.g. relative position embeddings,
    `rope_scaling`, GPT-2's `scale_attn_by_inverse_layer_idx`, cross-attention, an
    activation outside `itde.ACTIVATIONS`) raises `ValueError` naming the config field and
    its value; a model class not listed above raises `TypeError` naming it.
    """
    name = _family(model)
    check_x64(model, "model")
    return CONVERTERS[name](model, name)
