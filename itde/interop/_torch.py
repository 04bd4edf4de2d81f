"""Exact conversion between PyTorch's Transformer encoder (post-LN and pre-LN) and
`TransformerIDE`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._blocks import PostNorm, PreNorm
from .._checks import check_bool
from .._controls import Block, PiecewiseConstant, stack
from .._equation import TransformerIDE
from .._operators._attention import Attention
from .._operators._feedforward import FeedForward
from .._operators._layernorm import LayerNormProjection
from .._quadrature._rules import Grid, Midpoint


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "itde.from_torch / itde.to_torch need PyTorch: pip install 'itde[torch]'."
        ) from e
    return torch


def _np(t) -> np.ndarray | None:
    """A torch tensor as a NumPy array of the same dtype (bfloat16 via ml_dtypes), sharing
    the tensor's memory where it is on the CPU (no copy: conversion reads the weights
    in place, and copies each only once, into its JAX array)."""
    if t is None:
        return None
    torch = _torch()
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: the same bits as ml_dtypes'
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


def _jax(x) -> jax.Array:
    """A host array (NumPy, any strides) as a JAX array of the same dtype, holding one copy.

    `jnp.asarray` of a NumPy array holds two copies of it at its peak on the CPU backend;
    DLPack hands JAX one contiguous buffer to copy once. NumPy gives no DLPack capsule for
    ml_dtypes' bfloat16, so its bits go through torch's bfloat16 (a view, not a copy)."""
    x = np.ascontiguousarray(x)
    if x.dtype == jnp.bfloat16:
        torch = _torch()
        x = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return jnp.from_dlpack(x, copy=True)  # never an alias of the torch weights


def check_x64(module, what: str) -> None:
    """A float64 module converted while JAX's float64 is off would silently become float32
    (every `jnp.asarray` of a float64 array is cast): refuse it, naming the switch."""
    import jax

    params = getattr(module, "parameters", None)
    if params is None or jax.config.jax_enable_x64:
        return
    if any(p.dtype == _torch().float64 for p in params()):
        raise ValueError(
            f"`{what}` has float64 parameters, but JAX's float64 is off: the converted model "
            "would silently be float32. Enable it first, `jax.config.update("
            '"jax_enable_x64", True)`, or convert a float32 model (`model.float()`).'
        )


def _torch_dtype(dtype):
    torch = _torch()
    table = {
        np.dtype("float64"): torch.float64,
        np.dtype("float32"): torch.float32,
        np.dtype("float16"): torch.float16,
        np.dtype(jnp.bfloat16): torch.bfloat16,
    }
    if np.dtype(dtype) not in table:
        raise ValueError(
            f"`to_torch(model)`: parameters of dtype {dtype} have no PyTorch equivalent here; "
            "cast the model to float32 first."
        )
    return table[np.dtype(dtype)]


def _tensor(x):
    """A parameter as a float64 tensor: `copy_` then casts it to the module's dtype (every
    supported dtype converts to float64 and back exactly)."""
    return _torch().as_tensor(np.asarray(x, dtype=np.float64))


def _activation_name(layer) -> str:
    torch = _torch()
    code = getattr(layer, "activation_relu_or_gelu", 0)
    if code == 1:
        return "relu"
    if code == 2:
        return "gelu"
    act = layer.activation
    if isinstance(act, torch.nn.ReLU):
        return "relu"
    if isinstance(act, torch.nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    raise ValueError(
        f"`module.activation`={act!r} is not supported; use 'relu', 'gelu' or "
        "nn.GELU(approximate='tanh')."
    )


def _norm(ln) -> LayerNormProjection:
    w, b = _np(ln.weight), _np(ln.bias)
    dtype = w.dtype if w is not None else np.float32
    return LayerNormProjection(
        jnp.zeros((), dtype),
        jnp.ones((), dtype),
        None if w is None else jnp.asarray(w),
        None if b is None else jnp.asarray(b),
        float(ln.eps),
    )


def _block(layer) -> Block:
    mha = layer.self_attn
    if not mha._qkv_same_embed_dim:
        raise ValueError(
            "`module.self_attn` with kdim/vdim different from d_model is not supported."
        )
    d, h = mha.embed_dim, mha.num_heads
    dh = d // h
    w_in = _np(mha.in_proj_weight)
    b_in = _np(mha.in_proj_bias)
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("`module.self_attn` with add_bias_kv or add_zero_attn is not supported.")

    def heads_in(w):  # torch [d_out, d_in] -> ours [heads, d_in, head_dim]
        return jnp.asarray(np.ascontiguousarray(w.T.reshape(d, h, dh).transpose(1, 0, 2)))

    def heads_bias(b):
        return None if b is None else jnp.asarray(b.reshape(h, dh))

    attention = Attention(
        wq=heads_in(w_in[:d]),
        wk=heads_in(w_in[d : 2 * d]),
        wv=heads_in(w_in[2 * d :]),
        wo=jnp.asarray(np.ascontiguousarray(_np(mha.out_proj.weight).T.reshape(h, dh, d))),
        bq=None if b_in is None else heads_bias(b_in[:d]),
        bk=None if b_in is None else heads_bias(b_in[d : 2 * d]),
        bv=None if b_in is None else heads_bias(b_in[2 * d :]),
        bo=None if mha.out_proj.bias is None else jnp.asarray(_np(mha.out_proj.bias)),
    )
    l1, l2 = layer.linear1, layer.linear2
    feedforward = FeedForward(
        w1=jnp.asarray(np.ascontiguousarray(_np(l1.weight).T)),
        w2=jnp.asarray(np.ascontiguousarray(_np(l2.weight).T)),
        b1=None if l1.bias is None else jnp.asarray(_np(l1.bias)),
        b2=None if l2.bias is None else jnp.asarray(_np(l2.bias)),
        activation=_activation_name(layer),
    )
    return Block(attention, _norm(layer.norm1), feedforward, _norm(layer.norm2))


def from_torch(module: Any, *, causal: bool = False, relaxation: bool = False) -> TransformerIDE:
    """Convert a PyTorch Transformer encoder into an equivalent `TransformerIDE`.

    `module` is an `nn.TransformerEncoderLayer` or an `nn.TransformerEncoder`: post-LN
    (`norm_first=False`, the paper's equation, `block=PostNorm(relaxation=relaxation)`:
    the relaxation form equals the module when its `layer_norm_eps` is 0) or pre-LN
    (`norm_first=True`, `block=PreNorm()`; `relaxation` must then be False),
    either `batch_first`, ReLU or GELU, any `nhead`, `dim_feedforward`,
    `layer_norm_eps`, with or without biases, with or without a final `norm`, in float64,
    float32, float16 or bfloat16). Pass `causal=True` to reproduce the module called with a
    square causal `mask` (or `is_causal=True`). Parameters keep PyTorch's dtype.

    **Layout.** The returned model `m` acts on one sequence `[tokens, d_model]`; `m(x)`
    equals the module's output in eval mode (dropout off) to round-off. For a batch:

    - `batch_first=True` modules take `[batch, tokens, d_model]`: use `m.batch(x)` or
      `jax.vmap(m)(x)`.
    - `batch_first=False` modules (PyTorch's default) take `[tokens, batch, d_model]`: the
      converted model records it (`m.batch_axis == 1`) and `m.batch(x)` takes that
      layout, returning the same layout. `jax.vmap(m)` always maps over axis 0, which
      would be the tokens here: use `jax.vmap(m, in_axes=1, out_axes=1)` instead.
    """
    torch = _torch()
    norm = None
    if isinstance(module, torch.nn.TransformerEncoder):
        layers = list(module.layers)
        if getattr(module, "norm", None) is not None:
            norm = _norm(module.norm)
    elif isinstance(module, torch.nn.TransformerEncoderLayer):
        layers = [module]
    else:
        raise TypeError(
            "`module` must be a torch.nn.TransformerEncoderLayer or TransformerEncoder, got "
            f"{type(module).__name__}."
        )
    check_bool("causal", causal)
    check_bool("relaxation", relaxation)
    check_x64(module, "module")
    firsts = {bool(getattr(layer, "norm_first", False)) for layer in layers}
    if len(firsts) != 1:
        raise ValueError(
            "`module` mixes pre-LN and post-LN layers (`norm_first` differs between layers); "
            "one equation has one block form."
        )
    if firsts.pop():
        if relaxation:
            raise ValueError(
                "`relaxation=True` is a form of the post-LN feed-forward substep; a pre-LN "
                "module (norm_first=True) converts with relaxation=False."
            )
        block = PreNorm()
    else:
        block = PostNorm(relaxation=relaxation)
    blocks = [_block(layer) for layer in layers]
    d = blocks[0].attention.n_features
    batch_first = bool(getattr(layers[0].self_attn, "batch_first", False))
    return TransformerIDE(
        PiecewiseConstant(stack(blocks)),
        Grid.unit(d),
        causal=causal,
        final_norm=norm,
        batch_axis=0 if batch_first else 1,
        block=block,
    )


def _torch_norm(norm: LayerNormProjection, d: int, bias: bool, dtype):
    torch = _torch()
    ln = torch.nn.LayerNorm(d, eps=norm.eps, bias=bias, dtype=dtype)
    g = np.ones(d) if norm.gain is None else np.asarray(norm.gain, dtype=np.float64)
    s1, s2 = float(norm.sigma1), float(norm.sigma2)
    shift = np.zeros(d) if norm.shift is None else np.asarray(norm.shift, dtype=np.float64)
    with torch.no_grad():
        ln.weight.copy_(_tensor(s2 * g))
        if bias:
            ln.bias.copy_(_tensor(s1 * g + shift))
    return ln


def to_torch(model: TransformerIDE, *, batch_first: bool = True):
    """The `nn.TransformerEncoder` (eval mode) equal to a discrete `TransformerIDE`:
    post-LN for `block=PostNorm()`, pre-LN (`norm_first=True`) for `block=PreNorm()`.

    Needs the unit grid (the standard Transformer's), per-layer (piecewise-constant)
    controls with matrix kernels, LayerNorm normalisations, a plain (not gated)
    feed-forward with ReLU or GELU, attention PyTorch can hold (as many key/value heads
    as query heads, head size `d_model / nhead`, no RoPE, no score bias), and the
    residual feed-forward form (the relaxation form only when $\\varepsilon = 0$, where
    the two agree). A causal
    model's module must be called with a causal mask, as PyTorch's own API requires.
    """
    torch = _torch()
    if not isinstance(model, TransformerIDE):
        raise TypeError(
            f"`to_torch(model)` needs an itde.TransformerIDE, got {type(model).__name__}."
        )
    batch_first = check_bool("batch_first", batch_first)
    if not isinstance(model.controls, PiecewiseConstant):
        raise TypeError(
            "`to_torch(model)` needs per-layer (PiecewiseConstant) controls, the discrete "
            f"Transformer; this model has {type(model.controls).__name__}, smooth in depth. "
            "Sample it where the paper's scheme reads it first: the attention and "
            "feed-forward of layer n at its start t = n, its norms (projections) at its end "
            "t = n + 1, and stack them into PiecewiseConstant controls."
        )
    if model.controls.n_features is None:
        raise TypeError(
            "`to_torch(model)` needs discrete kernels (matrices); this model holds kernel "
            "functions (FunctionBlock): PyTorch has no such module."
        )
    d = model.n_features
    if not (
        isinstance(model.grid.tokens, Midpoint)
        and model.grid.tokens.interval is None
        and model.grid.features.is_unit(d)
    ):
        raise ValueError(
            "`to_torch(model)` needs the unit grid (Grid.unit(d)); resample the model onto "
            "it first."
        )
    if model.rope is not None:
        raise ValueError("`to_torch(model)`: PyTorch's encoder layer has no rotary embedding.")
    if model.score_bias is not None:
        raise ValueError(
            f"`to_torch(model)`: the model's score bias ({type(model.score_bias).__name__}) has "
            "no place in nn.TransformerEncoderLayer (its attention adds no bias to the scores); "
            "PyTorch's module would silently compute another network."
        )
    if model.window is not None:
        raise ValueError(
            f"`to_torch(model)`: the model attends within {model.window!r}; "
            "nn.TransformerEncoderLayer attends to every token, so PyTorch's module would "
            "silently compute another network."
        )
    v = model.controls.values
    if v.affine1 is not None or v.affine2 is not None or model.readout is not None:
        raise ValueError(
            "`to_torch(model)`: the model has affine fields or a readout (it is a continuum "
            "form, in normalised coordinates); PyTorch's encoder layer has no such terms. "
            "Convert the network it was taken from."
        )
    for name in ("norm1", "norm2"):
        if not isinstance(getattr(v, name), LayerNormProjection):
            raise ValueError(
                f"`to_torch(model)`: `{name}` is {type(getattr(v, name)).__name__}; PyTorch's "
                "encoder layer holds LayerNorm only."
            )
    if model.final_norm is not None and not isinstance(model.final_norm, LayerNormProjection):
        raise ValueError("`to_torch(model)`: the final norm must be a LayerNormProjection.")
    if not isinstance(v.feedforward, FeedForward):
        raise ValueError(
            f"`to_torch(model)`: the feed-forward is {type(v.feedforward).__name__}; PyTorch's "
            "encoder layer has the plain two-layer form only."
        )
    if v.feedforward.activation not in ("relu", "gelu", "gelu_tanh"):
        raise ValueError(
            f"`to_torch(model)`: activation {v.feedforward.activation!r} is not one PyTorch's "
            "encoder layer holds; it takes relu, gelu or gelu_tanh."
        )
    a0 = v.attention
    if getattr(a0, "qk_norm", None) is not None:
        raise ValueError(
            f"`to_torch(model)`: the attention normalises its queries and keys "
            f"({type(a0.qk_norm).__name__}); nn.MultiheadAttention has no query/key norm. "
            "Write it back to its Hugging Face class with itde.interop.to_hf instead."
        )
    if a0.n_kv_heads != a0.n_heads or a0.head_dim * a0.n_heads != d or a0.value_dim != a0.head_dim:
        raise ValueError(
            "`to_torch(model)`: nn.MultiheadAttention needs as many key/value heads as query "
            f"heads and head size d_model / nhead; this model has {a0.n_heads} heads, "
            f"{a0.n_kv_heads} key/value heads, head size {a0.head_dim}, value size "
            f"{a0.value_dim} for d_model {d}."
        )
    eps = v.norm1.eps
    layer_options = model.block.torch_layer_options(eps)
    if v.norm2.eps != eps:
        raise ValueError("`to_torch(model)`: both LayerNorms of a layer must share eps.")
    att, ff = v.attention, v.feedforward
    dtype = _torch_dtype(att.wq.dtype)
    s1 = np.concatenate([np.ravel(v.norm1.sigma1), np.ravel(v.norm2.sigma1)])
    bias = not (
        all(b is None for b in (att.bq, att.bk, att.bv, att.bo, ff.b1, ff.b2))
        and v.norm1.shift is None
        and v.norm2.shift is None
        and np.all(s1 == 0)  # exact: `from_torch` writes the number 0; bias=True is right too
    )
    h, dh = att.n_heads, att.head_dim
    layer = torch.nn.TransformerEncoderLayer(
        d,
        h,
        dim_feedforward=ff.w1.shape[-1],
        dropout=0.0,
        activation={"relu": "relu", "gelu": "gelu"}.get(ff.activation)
        or torch.nn.GELU(approximate="tanh"),
        layer_norm_eps=eps,
        batch_first=batch_first,
        bias=bias,
        **layer_options,
        dtype=dtype,
    )
    final = None
    if model.final_norm is not None:
        fn = model.final_norm
        final = _torch_norm(fn, d, fn.shift is not None or float(fn.sigma1) != 0, dtype)
    enc = torch.nn.TransformerEncoder(layer, model.n_layers, norm=final, enable_nested_tensor=False)

    with torch.no_grad():
        for n, tl in enumerate(enc.layers):
            b = model.controls.layer(n)
            a = b.attention
            w_in = np.concatenate(
                [np.array(w).transpose(1, 0, 2).reshape(d, d).T for w in (a.wq, a.wk, a.wv)]
            )
            tl.self_attn.in_proj_weight.copy_(_tensor(w_in))
            tl.self_attn.out_proj.weight.copy_(_tensor(np.array(a.wo).reshape(h * dh, d).T))
            if bias:
                zero = np.zeros((h, dh))
                b_in = np.concatenate(
                    [np.ravel(zero if x is None else np.array(x)) for x in (a.bq, a.bk, a.bv)]
                )
                tl.self_attn.in_proj_bias.copy_(_tensor(b_in))
                tl.self_attn.out_proj.bias.copy_(
                    _tensor(np.zeros(d) if a.bo is None else np.array(a.bo))
                )
            f = b.feedforward
            tl.linear1.weight.copy_(_tensor(np.array(f.w1).T))
            tl.linear2.weight.copy_(_tensor(np.array(f.w2).T))
            if bias:
                tl.linear1.bias.copy_(
                    _tensor(np.zeros(f.w1.shape[-1]) if f.b1 is None else np.array(f.b1))
                )
                tl.linear2.bias.copy_(_tensor(np.zeros(d) if f.b2 is None else np.array(f.b2)))
            for name, norm in (("norm1", b.norm1), ("norm2", b.norm2)):
                src = _torch_norm(norm, d, bias, dtype)
                getattr(tl, name).load_state_dict(src.state_dict())
    enc.eval()
    return enc
