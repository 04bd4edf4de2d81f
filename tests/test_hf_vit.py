"""ViT against Hugging Face's `ViTModel`, and images as a two-dimensional token domain.

Exactness at the native resolution (float64 inside `itde.interop.hf_float64()`, float32
unpatched; eager and sdpa; masked patches and an attention mask), Hugging Face's
`interpolate_pos_encoding=True` reproduced at other image sizes, the function view (Keys'
cubic positions, area token weights) and what it keeps that Hugging Face's does not, the
round trip back to Hugging Face, and the named refusals.

Models are built from a tiny config (8 x 8 images, 4 x 4 patches, width 8, two layers)
with random weights moved away from their initialisation. Every jitted function takes the
model as an argument, so models of one structure share a compilation.
"""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import spread_hf_weights

import itde
from itde.interop import (
    AreaTokenWeights,
    ClassTokenGrid2D,
    HFBicubic,
    KeysCubic,
    UnitTokenWeights,
)
from itde.interop._hf_family import _BASE_FIELDS
from itde.interop._hf_vit import ViTFamily

TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
IMAGE, PATCH, CHANNELS, WIDTH = 8, 4, 3, 8
PATCHES = (IMAGE // PATCH) ** 2


def _config(**fields):
    base = dict(
        image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, hidden_size=WIDTH,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
    )  # fmt: skip
    return tf.ViTConfig(**{**base, **fields})


def _model(dtype, seed=0, config=None, **kwargs):
    torch.manual_seed(seed)
    model = tf.ViTModel(config or _config(), **kwargs)
    spread_hf_weights(model)
    return model.to(dtype).eval()


def _images(n, size, seed=0):
    return np.random.RandomState(seed).randn(n, CHANNELS, *size)


def _hf(model, x, impl="eager", **kwargs):
    model.set_attn_implementation(impl)
    kwargs = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with torch.no_grad(), itde.interop.hf_float64():
        return model(torch.as_tensor(x), **kwargs).last_hidden_state.numpy()


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


# one compilation per structure and shape: the model is an argument
NATIVE = jax.jit(
    lambda m, x, pos, mask: jax.vmap(lambda x, p, k: m(x, p, attention_mask=k))(x, pos, mask)
)
RESIZED = jax.jit(lambda m, x: jax.vmap(lambda x: m(x, interpolate_pos_encoding=True))(x))

# three images: nothing masked; patches 0 and 3 replaced by the mask token; token 3 (patch
# 2) removed from the token domain by the attention mask
POS = np.array([[0, 0, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0]], bool)
MASK = np.array([[1] * 5, [1] * 5, [1, 1, 1, 0, 1]])


@pytest.fixture(scope="module")
def hf64():
    return _model(torch.float64, add_pooling_layer=False, use_mask_token=True)


@pytest.fixture(scope="module")
def m64(hf64):
    return itde.from_hf(hf64)


def _native_errors(model, m):
    x = _images(3, (IMAGE, IMAGE))
    ours = np.asarray(NATIVE(m, jnp.asarray(x), jnp.asarray(POS), jnp.asarray(MASK)))
    errors = {}
    for impl in ("eager", "sdpa"):
        ref = _hf(model, x, impl, bool_masked_pos=POS, attention_mask=MASK)
        errors[impl] = max(_rel(o[k == 1], r[k == 1]) for o, r, k in zip(ours, ref, MASK))
    return errors


def test_native_float64(hf64, m64):
    """Float64, Hugging Face inside `hf_float64()`: equal to round-off, eager and sdpa, with
    masked patches and an attention mask, batched by `jax.vmap`."""
    errors = _native_errors(hf64, m64)
    assert max(errors.values()) <= TOL[torch.float64], errors
    assert isinstance(m64.equation.grid.tokens, ClassTokenGrid2D)
    assert m64.equation.grid.tokens.shape == (2, 2)
    assert m64.continuum_form() is m64  # pre-norm: its own continuum form


def test_native_float32_with_pooler():
    """Float32, Hugging Face unpatched; a model with a pooler converts (the pooler is not
    part of `last_hidden_state`)."""
    model = _model(torch.float32)
    assert model.pooler is not None
    m = itde.from_hf(model)
    forward = jax.jit(lambda m, x, k: jax.vmap(lambda x, k: m(x, attention_mask=k))(x, k))
    x = _images(3, (IMAGE, IMAGE)).astype(np.float32)
    ours = np.asarray(forward(m, jnp.asarray(x), jnp.asarray(MASK)))
    assert ours.dtype == np.float32
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            ref = model(torch.as_tensor(x), attention_mask=torch.as_tensor(MASK))
        ref = ref.last_hidden_state.numpy()
        err = max(_rel(o[k == 1], r[k == 1]) for o, r, k in zip(ours, ref, MASK))
        assert err <= TOL[torch.float32], (impl, err)


# ---------------------------------------------------------------- other image sizes
@pytest.mark.parametrize("size", [(12, 12), (16, 16), (4, 4), (16, 8), (8, 20)])
def test_positions_equal_hugging_face_interpolation(hf64, m64, size):
    """`positions_at` is Hugging Face's `interpolate_pos_encoding` (bicubic) to round-off:
    up, down, to non-square grids."""
    grid = (size[0] // PATCH, size[1] // PATCH)
    shape = torch.zeros(1, 1 + grid[0] * grid[1], WIDTH, dtype=torch.float64)
    with torch.no_grad():
        ref = hf64.embeddings.interpolate_pos_encoding(shape, *size)[0].numpy()
    assert _rel(m64.positions_at(grid), ref) <= 1e-14


def _constant(m):
    """`m` with every patch's position row the first patch's (a constant function)."""
    table = m.position_embeddings
    return eqx.tree_at(lambda m: m.position_embeddings, m, table.at[2:].set(table[1]))


def test_larger_image_equals_hugging_face_and_the_function_view_keeps_the_domain(hf64, m64):
    """At 16 x 16 (4 x 4 patches from a 2 x 2 table): the default view is Hugging Face's
    `interpolate_pos_encoding=True` to round-off; the function view differs from it; at the
    native size the function view is the network (uniform weights, the table itself).

    What the area weights keep: a constant image with constant positions has one class
    state and one patch state at every grid, and its evolution depends only on the class
    token's weight and the patches' total weight. Area weights fix both (the class token
    one native patch, the patches the unit square), so the output does not depend on the
    grid; Hugging Face's weights (every token 1) give 16 patches four times the mass of 4,
    and the output changes."""
    x16 = np.concatenate([_images(1, (16, 16)), np.full((1, CHANNELS, 16, 16), 0.7)])
    ours = np.asarray(RESIZED(m64, jnp.asarray(x16)))
    ref = _hf(hf64, x16, interpolate_pos_encoding=True)
    assert _rel(ours, ref) <= TOL[torch.float64]

    fv = m64.function_view()
    assert _rel(RESIZED(fv, jnp.asarray(x16))[0], ref[0]) > 1e-2
    x8 = np.concatenate([np.full((1, CHANNELS, 8, 8), 0.7), _images(2, (IMAGE, IMAGE))])
    assert fv.equation_at((2, 2)).grid.token_log_weights(5) is None
    np.testing.assert_array_equal(fv.embed(jnp.asarray(x8[1])), m64.embed(jnp.asarray(x8[1])))

    const = _constant(m64)
    native = np.asarray(
        NATIVE(const, jnp.asarray(x8), jnp.zeros((3, 4), bool), jnp.asarray(MASK * 0 + 1))
    )
    fine = np.asarray(RESIZED(const.function_view(), jnp.asarray(x16)))[1]
    assert np.max(np.abs(fine - fine[1])[1:]) <= 1e-12  # one patch state
    np.testing.assert_allclose(fine[:2], native[0, :2], rtol=0, atol=1e-12)
    hf_fine = np.asarray(RESIZED(const, jnp.asarray(x16)))[1]
    assert np.max(np.abs(hf_fine[:2] - native[0, :2])) > 1e-2


def test_token_weights():
    """Unit weights: 1 everywhere. Area weights: each patch its area on the unit square,
    the class token one native patch's area, equal to the patches' at the native grid
    (then the log-bias vanishes: the network)."""
    unit = UnitTokenWeights().domain((3, 3), (2, 2))
    assert unit.token_log_weights() is None and unit.n_tokens == 10
    area = AreaTokenWeights().domain((3, 3), (2, 2))
    x, w = area.nodes_weights(10)
    np.testing.assert_allclose(w, [1 / 4] + [1 / 9] * 9, rtol=1e-15)
    assert np.isnan(x[0]).all() and np.allclose(x[1:4, 1], [1 / 6, 1 / 2, 5 / 6])
    assert AreaTokenWeights().domain((2, 2), (2, 2)).token_log_weights() is None
    assert AreaTokenWeights(0.5).domain((3, 3), (2, 2)).token_weights()[0] == 0.5
    with pytest.raises(ValueError, match=r"1 \+ 3 x 3 = 10"):
        area.token_weights(9)
    with pytest.raises(ValueError, match=r"`class_weight`=0.0"):
        ClassTokenGrid2D(area.patches, 0.0)


def test_interpolants():
    """`HFBicubic` is torch's bicubic (`align_corners=False`); `KeysCubic` interpolates,
    reproduces quadratics from three samples (lines from two) and is third order, where
    Hugging Face's is first order."""
    for n_old, n_new in [(2, 3), (3, 7), (5, 2), (1, 4), (4, 4)]:
        t = torch.randn(1, 1, n_old, n_old, dtype=torch.float64)
        ref = torch.nn.functional.interpolate(t, size=(n_new, n_new), mode="bicubic")[0, 0]
        a = HFBicubic().matrix(n_old, n_new)
        np.testing.assert_allclose(a @ t[0, 0].numpy() @ a.T, ref.numpy(), atol=1e-14)
    keys = KeysCubic()
    for n in (2, 3, 5):
        np.testing.assert_allclose(keys.matrix(n, n), np.eye(n), atol=1e-15)
        x = np.linspace(0.0, 1.0, 11)
        for degree in range(2 if n < 3 else 3):
            f = ((np.arange(n) + 0.5) / n) ** degree
            np.testing.assert_allclose(keys.basis(n, x) @ f, x**degree, atol=1e-14)

    def error(interp, n):
        f = lambda x: np.sin(2 * np.pi * x + 1.0)  # noqa: E731
        centres = lambda k: (np.arange(k) + 0.5) / k  # noqa: E731
        return np.max(np.abs(interp.matrix(n, 2 * n) @ f(centres(n)) - f(centres(2 * n))))

    keys_order = np.log2(error(keys, 16) / error(keys, 32))
    hf_order = np.log2(error(HFBicubic(), 16) / error(HFBicubic(), 32))
    assert 2.7 < keys_order < 3.3 and 0.8 < hf_order < 1.2, (keys_order, hf_order)


def test_another_patch_size_keeps_the_grid(m64):
    """`with_patch_size(8)` reads 8 x 8 patches of a 16 x 16 image as the same 2 x 2 grid:
    on an image whose pixels are the 8 x 8 image's repeated it gives the same initial
    condition (so the same output), and `to_hf` writes a ViT of patch 8 on 16 x 16 images
    that Hugging Face runs to the same hidden states."""
    big = m64.with_patch_size(8)
    assert big.image_size == (16, 16) and big.grid_size == (2, 2)
    x = _images(1, (IMAGE, IMAGE))[0]
    x2 = np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)
    assert _rel(big.embed(jnp.asarray(x2)), np.asarray(m64.embed(jnp.asarray(x)))) <= 1e-14
    hf_big = big.to_hf()
    assert hf_big.config.patch_size == 8 and hf_big.config.image_size == 16
    assert _rel(_hf(hf_big, x2[None]), _hf(m64.to_hf(), x[None])) <= 1e-13


@pytest.mark.slow
def test_head_dim_forward():
    """`qkv_bias=False` and `head_dim` 6 (width 8, two heads): equal to Hugging Face in
    float64."""
    config = _config(qkv_bias=False)
    config.head_dim = 6
    model = _model(torch.float64, config=config, add_pooling_layer=False, use_mask_token=True)
    errors = _native_errors(model, itde.from_hf(model))
    assert max(errors.values()) <= TOL[torch.float64], errors


@pytest.mark.slow
def test_float32_larger_image():
    """Float32, Hugging Face unpatched (its bicubic in float32) at 12 x 12 and 16 x 8."""
    model = _model(torch.float32, add_pooling_layer=False)
    m = itde.from_hf(model)
    for size in ((12, 12), (16, 8)):
        x = _images(2, size).astype(np.float32)
        with torch.no_grad():
            ref = model(torch.as_tensor(x), interpolate_pos_encoding=True).last_hidden_state
        assert _rel(RESIZED(m, jnp.asarray(x)), ref.numpy()) <= TOL[torch.float32], size


# ---------------------------------------------------------------- refusals and bad input
def test_fields_cover_vit_config():
    """Every field of `ViTConfig` is one the family reads, refuses or knows to be inert
    (a field added to `ViTConfig` fails here until it is sorted), and names no field that
    does not exist (`head_dim` is read by Hugging Face's attention through `getattr`)."""
    fields = set(tf.ViTConfig().to_dict()) - _BASE_FIELDS
    assert fields <= ViTFamily.fields, fields - ViTFamily.fields
    assert ViTFamily.fields - fields == {"head_dim"}


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hidden_act", "gelu_fast", r"`config\.hidden_act`='gelu_fast'"),
        ("image_size", 10, r"`config\.image_size`=10.*`config\.patch_size`=4"),
        # read by transformers' shared attention code, not converted (a field no ViT code
        # defines or reads, such as DINOv2's `layer_scale_init_value`, is metadata: accepted)
        ("attention_chunk_size", 4, r"`config\.attention_chunk_size`=4 .*ViTFamily.*reads it"),
    ],
)
def test_unsupported_config_names_the_field(field, value, match):
    model = tf.ViTModel(_config(), add_pooling_layer=False)
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=match):
        itde.from_hf(model)


def test_head_dim_and_no_qkv_bias(hf64):
    """`qkv_bias=False` and a `head_dim` other than width / heads: read (no query bias,
    heads of 6) and written back exactly; the forward is `test_head_dim_forward` (slow)."""
    config = _config(qkv_bias=False)
    config.head_dim = 6
    model = _model(torch.float64, config=config, add_pooling_layer=False)
    m = itde.from_hf(model)
    att = m.equation.controls.values.attention
    assert att.bq is None and att.wq.shape == (2, 2, WIDTH, 6)
    back = m.to_hf()
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_bad_inputs_name_the_argument(m64):
    x = jnp.asarray(_images(1, (IMAGE, IMAGE))[0])
    with pytest.raises(ValueError, match=r"`pixel_values` has 1 channels.*config\.num_channels"):
        m64(x[:1])
    with pytest.raises(ValueError, match=r"`pixel_values` is 8 x 10, not a positive multiple"):
        m64(jnp.zeros((CHANNELS, 8, 10)), interpolate_pos_encoding=True)
    with pytest.raises(ValueError, match=r"one image.*jax\.vmap"):
        m64(x[None])
    with pytest.raises(TypeError, match=r"`pixel_values` is a torch tensor"):
        m64(torch.zeros(CHANNELS, IMAGE, IMAGE))
    with pytest.raises(ValueError, match=r"12 x 12 but the model's image is 8 x 8.*interpolate"):
        m64(jnp.zeros((CHANNELS, 12, 12)))
    with pytest.raises(TypeError, match=r"`interpolate_pos_encoding`='yes'"):
        m64(x, interpolate_pos_encoding="yes")
    with pytest.raises(ValueError, match=r"`bool_masked_pos`.*shape \(4,\)"):
        m64(x, jnp.zeros(3, bool))
    no_token = dataclasses.replace(m64, mask_token=None)
    with pytest.raises(ValueError, match=r"no mask token.*use_mask_token=True"):
        no_token(x, jnp.zeros(4, bool))
    with pytest.raises(ValueError, match=r"`attention_mask`.*\[\.\.\., 5\]"):
        m64(x, attention_mask=jnp.ones(4, int))


def test_hugging_face_interpolation_refuses_what_hugging_face_cannot_do():
    """A non-square native grid: Hugging Face reads the table as a square, so `HFBicubic`
    refuses by name; `KeysCubic` resamples it."""
    model = _model(torch.float64, config=_config(image_size=[8, 12]), add_pooling_layer=False)
    m = itde.from_hf(model)
    assert m.grid_size == (2, 3)
    with pytest.raises(ValueError, match=r"square grid.*2 x 3.*KeysCubic"):
        m.embed(jnp.zeros((CHANNELS, 12, 12)), interpolate_pos_encoding=True)
    u = m.function_view().embed(jnp.zeros((CHANNELS, 12, 12)), interpolate_pos_encoding=True)
    assert u.shape == (10, WIDTH)


def test_other_classes_are_refused_by_name():
    assert isinstance(itde.interop.HF_FAMILIES["ViTModel"], ViTFamily)
    with pytest.raises(TypeError, match=r"ViTForImageClassification.*model\.base_model"):
        itde.from_hf(tf.ViTForImageClassification(_config()))


# ---------------------------------------------------------------- back to Hugging Face
def test_to_hf_round_trip(hf64, m64, tmp_path):
    """`from_hf(model).to_hf()` has exactly `model`'s state (mask token included); a model
    changed in itde goes back with its change, and survives `save_pretrained` /
    `from_pretrained` bit for bit."""
    back = itde.to_hf(m64)  # the public function takes every converted model
    assert type(back) is type(hf64) and back.pooler is None
    assert set(back.state_dict()) == set(hf64.state_dict())
    for k, v in hf64.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k

    wv = m64.equation.controls.values.attention.wv
    changed = eqx.tree_at(lambda m: m.equation.controls.values.attention.wv, m64, wv * 1.5)
    changed = eqx.tree_at(lambda m: m.class_token, changed, -changed.class_token)
    hf = changed.to_hf()
    x = _images(3, (IMAGE, IMAGE))
    ref = _hf(hf, x, bool_masked_pos=POS)
    out = np.asarray(NATIVE(changed, jnp.asarray(x), jnp.asarray(POS), jnp.ones((3, 5), int)))
    assert _rel(out, ref) <= TOL[torch.float64]
    assert _rel(_hf(hf64, x, bool_masked_pos=POS), ref) > 1e-3  # the change reached HF

    hf.save_pretrained(tmp_path)
    # the constructor's switches are not in the config: from_pretrained takes them again
    loaded = (
        type(hf)
        .from_pretrained(
            tmp_path, dtype=torch.float64, add_pooling_layer=False, use_mask_token=True
        )
        .eval()
    )
    for k, v in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert json.loads(changed.config)["image_size"] == loaded.config.image_size
    with pytest.raises(ValueError, match=r"no Hugging Face family and config"):
        dataclasses.replace(m64, family=None).to_hf()


# ---------------------------------------------------------------- measurements
def _smooth(x1, x2, d, seed=0):
    """Position rows `[points, d]` of smooth functions of the patch centre (trained ViTs'
    positions are smooth in the centre; random rows would make any interpolation a guess)."""
    rng = np.random.RandomState(seed)
    a, b, phase = rng.uniform(0.5, 2.0, d), rng.uniform(0.5, 2.0, d), rng.uniform(0, 6, d)
    return 0.5 * np.sin(np.pi * (a * x1[:, None] + b * x2[:, None]) + phase)


def _with_positions(m, grid, image_size):
    """`m` with the smooth positions sampled at the centres of `grid` (its native grid)."""
    c1, c2 = ((np.arange(n) + 0.5) / n for n in grid)
    x1, x2 = np.meshgrid(c1, c2, indexing="ij")
    rows = _smooth(x1.ravel(), x2.ravel(), WIDTH)
    table = jnp.concatenate([m.position_embeddings[:1], jnp.asarray(rows, m.dtype)])
    return dataclasses.replace(m, position_embeddings=table, image_size=image_size)


@pytest.mark.slow
def test_measure_function_view_against_hugging_face():
    r"""The numbers in `itde/interop/_hf_vit.py`'s docstring (run with `-s` to print them).

    1. The interpolation error of the two interpolants on $\sin(2\pi x_1 + 1)\sin(2\pi
       x_2 + 1)$ sampled at $N \times N$ centres and read at $2N \times 2N$.
    2. A ViT (native 8 x 8 patches of 4 pixels, smooth positions, random weights) read at
       16 x 16 patches (64 x 64 images): the position rows of each interpolant against the
       smooth function itself, the last hidden state of each against the model given the
       exact positions (unit weights), and the function view's difference from Hugging
       Face split into its interpolant and token-weight parts."""
    f = lambda x: np.sin(2 * np.pi * x + 1.0)  # noqa: E731
    centres = lambda k: (np.arange(k) + 0.5) / k  # noqa: E731
    print("\nN   HF bicubic   KeysCubic")
    rows = {}
    for n in (4, 8, 16, 32):
        errors = []
        for interp in (HFBicubic(), KeysCubic()):
            a = interp.matrix(n, 2 * n)
            g = np.outer(f(centres(n)), f(centres(n)))
            errors.append(np.max(np.abs(a @ g @ a.T - np.outer(*[f(centres(2 * n))] * 2))))
        rows[n] = errors
        print(f"{n:<3} {errors[0]:.1e}      {errors[1]:.1e}")
    assert rows[32][0] > 0.3 * rows[16][0] and rows[32][1] < 0.2 * rows[16][1]

    model = _model(torch.float64, config=_config(image_size=32), add_pooling_layer=False)
    m = _with_positions(itde.from_hf(model), (8, 8), (32, 32))
    exact = _with_positions(m, (16, 16), (64, 64))
    x = jnp.asarray(_images(4, (64, 64)))
    truth = np.asarray(exact.position_embeddings)
    ref = np.asarray(RESIZED(exact, x))
    hf = np.asarray(RESIZED(m, x))
    keys = dataclasses.replace(m, interpolant=KeysCubic())
    hf_rows, keys_rows = m.positions_at((16, 16)), keys.positions_at((16, 16))
    print(
        f"positions: HF bicubic {_rel(hf_rows, truth):.1e}, KeysCubic {_rel(keys_rows, truth):.1e}"
    )
    fv = np.asarray(RESIZED(m.function_view(), x))
    cls, patches = _rel(fv[:, 0], hf[:, 0]), _rel(fv[:, 1:], hf[:, 1:])
    print(f"function view against HF: class token {cls:.2e}, patch tokens {patches:.2e}")
    diffs = {
        "HF view against exact positions": _rel(hf, ref),
        "KeysCubic (unit weights) against exact positions": _rel(RESIZED(keys, x), ref),
        "function view against HF": _rel(RESIZED(m.function_view(), x), hf),
        "  interpolant only (KeysCubic, unit weights)": _rel(RESIZED(keys, x), hf),
        "  token weights only (HFBicubic, area weights)": _rel(
            RESIZED(dataclasses.replace(m, token_weights=AreaTokenWeights()), x), hf
        ),
    }
    for name, d in diffs.items():
        print(f"{name}: {d:.2e}")
    assert all(d > 1e-4 for d in diffs.values()), diffs
