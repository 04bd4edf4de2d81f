r"""The weight glue shared by the Hugging Face converters: `nn.Linear` and friends read
into the equation's per-head parameters, and written back.

Every function here is exact (a reshape or transpose); no family logic lives here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._controls import Block, PiecewiseConstant, check_stackable
from .._equation import TransformerIDE
from .._operators._attention import Attention
from .._operators._feedforward import FeedForward, GatedFeedForward
from .._operators._layernorm import LayerNormProjection
from .._operators._rmsnorm import RMSNormProjection
from .._quadrature._rules import Grid
from ._torch import _jax, _np, _torch

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


# ------------------------------------------------------------------------ reading
# The per-layer readers below return NumPy views of the torch weights (a transpose or a
# reshape copies nothing); `equation` copies each parameter once, into its stacked JAX
# array, so converting a model holds about one copy of it besides the model itself.
def a(t):
    """A torch tensor (or None) as a JAX array of the same dtype (one copy)."""
    return None if t is None else _jax(_np(t))


def lin(layer) -> np.ndarray:
    """An `nn.Linear` weight as `[in, out]` (Conv1D stores it that way already)."""
    return _np(layer.weight).T


def heads_in(w: np.ndarray, heads: int) -> np.ndarray:
    """`[features, heads * head_dim]` -> `[heads, features, head_dim]` (a view)."""
    d = w.shape[0]
    return w.reshape(d, heads, -1).transpose(1, 0, 2)


def heads_bias(b, heads: int):
    return None if b is None else np.asarray(_np(b) if not isinstance(
        b, np.ndarray) else b).reshape(heads, -1)  # fmt: skip


def heads_out(w: np.ndarray, heads: int) -> np.ndarray:
    """`[heads * value_dim, features]` -> `[heads, value_dim, features]` (a view)."""
    return w.reshape(heads, -1, w.shape[-1])


def _scaled(w, scale: float):
    # multiplying by 1 would only copy the weight (the product is the weight exactly)
    return w if scale == 1.0 else w * np.asarray(scale, w.dtype)


def attention(
    q, k, v, o, h: int, hkv: int | None = None, q_scale: float = 1.0, qk_norm=None
) -> Attention:
    """From four `nn.Linear` (Q, K, V, output projection). `q_scale` multiplies the query
    (weight and bias): a family whose score scaling is not $1/\\sqrt{d_\\mathrm{head}}$
    folds the ratio into $W^Q$, or, with a query/key norm `qk_norm` (an
    `AbstractQueryKeyNorm`, see `qk_norm`), into the queries' gain (the projection would undo
    it on $W^Q$)."""
    hkv = h if hkv is None else hkv
    if qk_norm is not None:
        qk_norm, q_scale = qk_norm.scale_queries(q_scale), 1.0
    bq = heads_bias(q.bias, h)
    return Attention(
        qk_norm=qk_norm,
        wq=heads_in(_scaled(lin(q), q_scale), h),
        wk=heads_in(lin(k), hkv),
        wv=heads_in(lin(v), hkv),
        wo=heads_out(lin(o), h),
        bq=None if bq is None else _scaled(bq, q_scale),
        bk=heads_bias(k.bias, hkv),
        bv=heads_bias(v.bias, hkv),
        bo=a(o.bias),
    )


def qk_norm(kind, q_norm, k_norm, gain_offset: float = 0.0):
    """The query/key norm of class `kind` (`PerHeadQKNorm`, `JointQKNorm`) from a
    family's two RMSNorm modules (`self_attn.q_norm`, `self_attn.k_norm`); `gain_offset` as
    in `rms_norm`."""
    return kind(rms_norm(q_norm, gain_offset), rms_norm(k_norm, gain_offset))


def layer_norm(ln, eps=None) -> LayerNormProjection:
    w = _np(ln.weight)
    return LayerNormProjection(
        jnp.zeros((), w.dtype),
        jnp.ones((), w.dtype),
        jnp.asarray(w),
        a(getattr(ln, "bias", None)),
        float(ln.eps if eps is None else eps),
    )


def rms_norm(norm, gain_offset: float = 0.0) -> RMSNormProjection:
    """An RMSNorm; `gain_offset` is added to the stored weight (Gemma's gain is `1 + w`)."""
    w = _np(norm.weight)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    gain = jnp.asarray(w) + jnp.asarray(gain_offset, w.dtype) if gain_offset else jnp.asarray(w)
    return RMSNormProjection(jnp.ones((), w.dtype), gain, float(eps))


def feedforward(lin1, lin2, activation: str) -> FeedForward:
    return FeedForward(
        w1=lin(lin1),
        w2=lin(lin2),
        b1=_np(lin1.bias),
        b2=_np(lin2.bias),
        activation=activation,
    )


def gated_feedforward(gate, up, down, activation: str) -> GatedFeedForward:
    return GatedFeedForward(
        w_gate=lin(gate),
        w1=lin(up),
        w2=lin(down),
        b_gate=_np(gate.bias),
        b1=_np(up.bias),
        b2=_np(down.bias),
        activation=activation,
    )


def equation(blocks, *, causal, block, final_norm=None, rope=None, **fields) -> TransformerIDE:
    """The per-layer equation of a converted model (unit grid: $\\Delta t = 1$ is the
    network). The layers' parameters are stacked on the host, one parameter at a time, and
    each copied once into JAX: the per-layer arrays may be views of the torch weights."""
    d = blocks[0].attention.n_features
    return TransformerIDE(
        PiecewiseConstant(stack_host(blocks)),
        Grid.unit(d),
        causal=causal,
        final_norm=final_norm,
        block=block,
        rope=rope,
        **fields,
    )


def stack_host(blocks: list[Block]) -> Block:
    """`itde.stack(blocks)` computed in NumPy, leaf by leaf: each parameter's layers are
    copied into one host array, then into JAX once, and the host array freed before the
    next parameter (the transient is one stacked parameter, not a second model)."""
    blocks = list(blocks)
    check_stackable(blocks)
    return jax.tree.map(lambda *xs: _jax(np.stack([np.asarray(x) for x in xs])), *blocks)


def activation(field: str, value) -> str:
    """The `itde.ACTIVATIONS` name of a Hugging Face activation, or a named refusal."""
    if not isinstance(value, str) or value not in HF_ACTIVATIONS:
        raise ValueError(
            f"`config.{field}`={value!r} is not supported; the equation's feed-forward takes "
            f"{sorted(HF_ACTIVATIONS)}."
        )
    return HF_ACTIVATIONS[value]


def refuse(config, field: str, ok, why: str) -> None:
    """Raise when `config.<field>` asks for something the equation cannot express."""
    value = getattr(config, field, None)
    if not ok(value):
        raise ValueError(f"`config.{field}`={value!r} is not supported: {why}")


# ------------------------------------------------------------------------ writing
def new_model(source: str, config: str, dtype, **kwargs):
    """A freshly built `transformers` model of the class named `source`, from a config kept
    as JSON, with its parameters created in `dtype` (float32 or float64; others are cast
    after building), in eval mode: what a family's `write` fills in."""
    import json

    import transformers

    from ._torch import _torch_dtype

    torch = _torch()
    cls = getattr(transformers, source)
    dtype = _torch_dtype(dtype)
    old = torch.get_default_dtype()
    if dtype in (torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
    try:
        model = cls(cls.config_class.from_dict(json.loads(config)), **kwargs)
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype).eval()


def layers(m) -> list[Block]:
    """The per-layer blocks of a converted model's equation (its `PiecewiseConstant`
    controls), in depth order, or a named refusal for a continuum model."""
    controls = m.equation.controls
    if not isinstance(controls, PiecewiseConstant):
        raise TypeError(
            f"`to_hf` writes a per-layer model (PiecewiseConstant controls); this model's "
            f"controls are {type(controls).__name__}. Sample its layers first."
        )
    values = controls.values
    if values.affine1 is not None or values.affine2 is not None or m.equation.readout is not None:
        raise ValueError(
            "`to_hf`: this model carries feature affines between its layers (a continuum form, "
            "whose norms' gains moved into the next layer); Hugging Face has no module for "
            "them. Write the per-layer model `from_hf` gives, not its continuum form."
        )
    return [controls.layer(i) for i in range(controls.n_layers)]


def put(param, value, transpose: bool = False) -> None:
    """Copy `value` into the torch parameter `param` (exactly: float64 and back)."""
    torch = _torch()
    x = np.asarray(value, dtype=np.float64)
    if transpose:
        x = x.T
    if tuple(param.shape) != x.shape:
        raise ValueError(
            f"`to_hf`: a parameter of shape {x.shape} does not fit the module's "
            f"{tuple(param.shape)}; the model's config does not describe these weights."
        )
    with torch.no_grad():
        param.copy_(torch.tensor(x))


def put_linear(layer, w_in_out, b=None) -> None:
    """Write `[in, out]` weights (and a bias) into an `nn.Linear`."""
    put(layer.weight, w_in_out, transpose=True)
    if b is not None or layer.bias is not None:
        _bias_fits(layer, b)
        put(layer.bias, b)


def _bias_fits(layer, b) -> None:
    if (b is None) != (layer.bias is None):
        raise ValueError(
            "`to_hf`: the itde model has "
            f"{'no bias' if b is None else 'a bias'} where the module has "
            f"{'one' if layer.bias is not None else 'none'}; the config's bias switch does "
            "not match the weights."
        )


def heads_flat_in(w) -> np.ndarray:
    """`[heads, features, head_dim]` -> `[features, heads * head_dim]`."""
    w = np.asarray(w)
    return w.transpose(1, 0, 2).reshape(w.shape[1], -1)


def put_attention(
    att: Attention, q, k, v, o, q_scale: float = 1.0, qk_norm=None, gain_offset: float = 0.0
) -> None:
    """Write an `Attention` into four `nn.Linear` (the inverse of `attention`), and its
    query/key norm into `qk_norm`, the family's `(q_norm, k_norm)` modules (None: the
    family has none)."""
    if (att.qk_norm is None) != (qk_norm is None):
        raise ValueError(
            "`to_hf`: the itde attention has "
            f"{'no query/key norm' if att.qk_norm is None else 'a query/key norm'} where the "
            f"module has {'one' if qk_norm is not None else 'none'}; the model's family does "
            "not match its weights."
        )
    if qk_norm is not None:
        qn = att.qk_norm.q_norm
        if q_scale != 1.0:  # exact: 1.0 is the number a family passes when nothing is folded
            gain = np.asarray(qn.gain, np.float64) / q_scale
            qn = RMSNormProjection(qn.sigma, gain, qn.eps)
        put_rms_norm(qn, qk_norm[0], gain_offset)
        put_rms_norm(att.qk_norm.k_norm, qk_norm[1], gain_offset)
        q_scale = 1.0
    put_linear(q, heads_flat_in(att.wq) / q_scale,
               None if att.bq is None else np.asarray(att.bq).reshape(-1) / q_scale)  # fmt: skip
    put_linear(k, heads_flat_in(att.wk), None if att.bk is None else np.asarray(att.bk).reshape(-1))
    put_linear(v, heads_flat_in(att.wv), None if att.bv is None else np.asarray(att.bv).reshape(-1))
    put_linear(o, np.asarray(att.wo).reshape(-1, att.wo.shape[-1]), att.bo)


def put_layer_norm(norm: LayerNormProjection, ln) -> None:
    """Write a `LayerNormProjection` with mean 0 and radius 1 (the form `from_hf` builds)
    into an `nn.LayerNorm`."""
    # exact: `from_hf` writes the numbers 0 and 1 (frozen beside a gain); any other is refused
    _check_plain_norm(norm, norm.sigma1 == 0.0, norm.sigma2 == 1.0)
    put(ln.weight, norm.gain if norm.gain is not None else np.ones(ln.weight.shape))
    if getattr(ln, "bias", None) is not None:
        put(ln.bias, norm.shift if norm.shift is not None else np.zeros(ln.bias.shape))
    elif norm.shift is not None:
        raise ValueError("`to_hf`: the itde norm has a shift where the module has no bias.")


def put_rms_norm(norm: RMSNormProjection, module, gain_offset: float = 0.0) -> None:
    """Write an `RMSNormProjection` with radius 1 into an RMSNorm module whose gain is
    `gain_offset + weight`."""
    _check_plain_norm(norm, norm.sigma == 1.0)  # exact: `from_hf` writes the number 1
    gain = np.ones(module.weight.shape) if norm.gain is None else np.asarray(norm.gain, np.float64)
    put(module.weight, gain - gain_offset)


def _check_plain_norm(norm, *plain) -> None:
    """A norm written to Hugging Face must be the network's own: the unit set's radius and
    mean as `from_hf` builds them (a continuum form moves gains into the next layer)."""
    if not all(bool(np.all(np.asarray(p))) for p in plain):
        raise ValueError(
            f"`to_hf`: a {type(norm).__name__} whose radius or mean is not the network's "
            "(radius 1, mean 0) has no Hugging Face module; write the per-layer model "
            "`from_hf` gives, not its continuum form."
        )


def put_feedforward(ff: FeedForward, lin1, lin2) -> None:
    put_linear(lin1, ff.w1, ff.b1)
    put_linear(lin2, ff.w2, ff.b2)


def put_gated_feedforward(ff: GatedFeedForward, gate, up, down) -> None:
    put_linear(gate, ff.w_gate, ff.b_gate)
    put_linear(up, ff.w1, ff.b1)
    put_linear(down, ff.w2, ff.b2)


def check_rope(rope, rotary) -> None:
    """`to_hf` rebuilds the rotary frequencies from the config: refuse a model whose own
    frequencies differ from them (they would be lost silently)."""
    ours = np.asarray(rope.inv_freq, np.float64)
    theirs = _np(rotary.inv_freq).astype(np.float64)
    # a tolerance on purpose: Hugging Face keeps `inv_freq` in float32 (a check, not a path)
    if ours.shape != theirs.shape or not np.allclose(ours, theirs, rtol=1e-6, atol=0.0):
        raise ValueError(
            "`to_hf`: the model's RoPE frequencies (`equation.rope.inv_freq`) are not the ones "
            "its config gives; set the config's rope parameters to match them."
        )
