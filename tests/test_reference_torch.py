"""`from_torch` and `to_torch` against PyTorch itself, in the default run, at tiny width.

One parametrised test covers every option of `nn.TransformerEncoder` that the converters
read: post-LN and pre-LN (`norm_first`), ReLU and GELU, with and without a final norm,
causal or not, `batch_first` both ways, with and without biases, LayerNorm eps zero and
positive. Six cases cover every pair of values of those six switches (a strength-2
covering array, checked below), so an option that breaks only in combination with another
one is still met. Each case pads one sequence (a key padding mask), compares the converted
model with PyTorch on the real tokens in float64, and converts back (`to_torch`) to
compare again. The larger and float32 pairs of `test_torch_equivalence.py` run with
`-m slow`.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import itde

D, HEADS, D_FF, LAYERS, TOKENS, BATCH = 8, 2, 12, 2, 5, 2
TOL = 1e-11  # float64, relative to the output's size

# norm_first, gelu, final norm, causal, batch_first, bias; eps
CASES = [
    (False, False, False, False, False, False, 1e-5),
    (False, False, False, False, True, True, 0.0),
    (False, True, True, True, False, False, 1e-6),
    (True, False, True, True, False, True, 1e-5),
    (True, True, False, True, True, False, 0.0),
    (True, True, True, False, True, True, 1e-5),
]
SWITCHES = ("pre", "gelu", "final", "causal", "batch_first", "bias")

# every pair of switches takes all four combinations of values in some case
for i, j in itertools.combinations(range(len(SWITCHES)), 2):
    assert {(c[i], c[j]) for c in CASES} == set(itertools.product((False, True), repeat=2)), (
        SWITCHES[i], SWITCHES[j],
    )  # fmt: skip


def _encoder(pre, gelu, final, bias, eps, seed):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        D, HEADS, D_FF, dropout=0.0, activation="gelu" if gelu else "relu",
        layer_norm_eps=eps, batch_first=True, norm_first=pre, bias=bias, dtype=torch.float64,
    )  # fmt: skip
    norm = torch.nn.LayerNorm(D, eps=eps, bias=bias, dtype=torch.float64) if final else None
    enc = torch.nn.TransformerEncoder(layer, LAYERS, norm=norm, enable_nested_tensor=False)
    with torch.no_grad():  # norms and biases away from their identity initialisation
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc.eval()


def _set_batch_first(enc, batch_first):
    """The same weights laid out for `batch_first` (only the attention reads the flag)."""
    for layer in enc.layers:
        layer.self_attn.batch_first = batch_first
    return enc


def _torch_out(enc, x, keep, causal):
    """`enc` on `x` (in the module's own layout), padding where `keep` is False."""
    kwargs = dict(src_key_padding_mask=torch.as_tensor(~keep))  # True: padding
    if causal:  # True: not allowed to attend (the same mask type as the padding's)
        later = torch.triu(torch.ones(TOKENS, TOKENS, dtype=torch.bool), diagonal=1)
        kwargs |= dict(mask=later, is_causal=True)
    with torch.no_grad():
        return enc(torch.as_tensor(x), **kwargs).numpy()


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        "-".join([n for n, v in zip(SWITCHES, c[:-1], strict=True) if v] or ["post"])
        + f"-eps{c[-1]}"
        for c in CASES
    ],
)
def test_from_torch_and_to_torch_equal_pytorch(case):
    pre, gelu, final, causal, batch_first, bias, eps = case
    enc = _set_batch_first(_encoder(pre, gelu, final, bias, eps, seed=len(CASES)), batch_first)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, TOKENS, D))  # [batch, tokens, features]
    keep = np.ones((BATCH, TOKENS), bool)
    keep[1, -2:] = False  # the second sequence has two padded tokens at the end
    xl = x if batch_first else np.swapaxes(x, 0, 1)  # the module's layout

    ref = _torch_out(enc, xl, keep, causal)
    ref = ref if batch_first else np.swapaxes(ref, 0, 1)
    scale = max(1.0, float(np.max(np.abs(ref))))

    m = itde.from_torch(enc, causal=causal)
    assert m.block == (itde.PreNorm() if pre else itde.PostNorm())
    assert m.batch_axis == (0 if batch_first else 1)
    assert (m.final_norm is not None) == final
    out = np.asarray(m.batch(jnp.asarray(xl), jnp.asarray(keep)))
    assert out.shape == xl.shape and out.dtype == np.float64
    out = out if batch_first else np.swapaxes(out, 0, 1)
    err = np.max(np.abs(out - ref)[keep])
    assert err <= TOL * scale, err

    back = itde.to_torch(m, batch_first=batch_first)
    assert back.layers[0].norm_first == pre and back.layers[0].self_attn.batch_first == batch_first
    y = _torch_out(back, xl, keep, causal)
    y = y if batch_first else np.swapaxes(y, 0, 1)
    err = np.max(np.abs(y - ref)[keep])
    assert err <= TOL * scale, err
