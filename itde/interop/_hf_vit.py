r"""ViT: a pre-norm encoder over an image's patches and a class token, exact against Hugging
Face's `ViTModel`, and the same model read on the image domain.

The patch embedding (a `Conv2d` with stride = kernel = patch size: a linear map of each
flattened patch), the class token and the learned positions are the initial condition;
the pre-norm layers (LayerNorm, GELU feed-forward, `qkv_bias`) the equation's controls;
the final `layernorm` its output map. The tokens live on a 2-D token domain
([`ClassTokenGrid2D`][itde.interop.ClassTokenGrid2D]): the patch grid on the image and the
class token beside it.

At another image size the positions are sampled at the new patch grid, as Hugging Face
does or as a function on the image domain: see
[`HFVisionTransformer`][itde.interop.HFVisionTransformer].
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._blocks import PreNorm
from .._checks import check_bool
from .._controls import Block, PiecewiseConstant, stack
from .._equation import TransformerIDE
from .._operators._mask import key_mask
from .._quadrature._rules import Grid, Midpoint
from .._roles import kernel
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_vit_domain import (
    AbstractImageTokenWeights,
    AbstractPositionInterpolant,
    AreaTokenWeights,
    HFBicubic,
    KeysCubic,
    UnitTokenWeights,
    check_pixels,
    patch_overlaps,
    resample,
)


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


class HFVisionTransformer(eqx.Module):
    r"""A Hugging Face ViT as an equation on an image's tokens: the patch embedding, the
    class token and the positions, then a pre-norm `TransformerIDE` on a
    [`ClassTokenGrid2D`][itde.interop.ClassTokenGrid2D] token domain. Built by
    [`from_hf`][itde.from_hf] from a `ViTModel`.

    `m(pixel_values)` acts on one image `[channels, height, width]` (Hugging Face's layout)
    and returns `[1 + patches, features]`, the class token first, equal to
    `model(pixel_values[None]).last_hidden_state[0]`; batch with `jax.vmap(m)`. At another
    image size, `interpolate_pos_encoding=True` samples the positions at the new patch
    grid through `interpolant` and weighs the tokens by `token_weights`: by default as
    Hugging Face does (`HFBicubic()`, `UnitTokenWeights()`), exactly;
    [`function_view`][itde.interop.HFVisionTransformer.function_view] reads the image as
    one domain at every size.

    **Another image size.** The position table's patch rows are samples of a function on the
    unit square at the native patch centres $((i + \frac12)/N_1, (j + \frac12)/N_2)$. A grid of
    $n_1 \times n_2$ patches samples that function at its own centres; Hugging Face's
    `interpolate_pos_encoding=True` (bicubic, `align_corners=False`) samples at those same
    centres. The default view (`HFBicubic()`, `UnitTokenWeights()`) is Hugging Face's, exactly;
    `m.function_view()` (`KeysCubic()`, `AreaTokenWeights()`) differs in:

    | | Hugging Face | function view |
    |---|---|---|
    | samples at | the new patch centres | the same |
    | interpolant | cubic convolution, $a = -0.75$ | $a = -\frac12$ (Keys) |
    | its order | 1 | 3 |
    | border half patches | edge samples repeated | edge cubic continued |
    | native grid | square only, integer patch | any |
    | patch token weight | 1 (the domain grows) | its area, $1/(n_1 n_2)$ |
    | class token weight | 1 | one native patch, $1/(N_1 N_2)$ |

    With unit weights a larger image is read as showing more (every patch keeps its weight,
    the class token's share of the attention mass falls as the patches multiply), while the
    positions are stretched over it as if it showed the same square: the two halves of Hugging
    Face's reading disagree; the function view reads the same square at every size. So, for
    one: an image of constant colour under constant positions gives the same class and patch
    states at every grid with area weights (the class token's and the patches' total masses
    are fixed), and states that change with the grid with unit weights.

    Measured (`pytest tests/test_hf_vit.py -m slow -k measure -s`). Interpolating
    $\sin(2\pi x_1 + 1)\sin(2\pi x_2 + 1)$ from $N \times N$ centres to $2N \times 2N$, max
    error for $N$ = 4, 8, 16, 32: Hugging Face's bicubic 2.5e-1, 1.4e-1, 6.0e-2, 2.8e-2 (first
    order, in the interior too: with $a \ne -\frac12$ it reproduces constants, not lines),
    `KeysCubic` 8.3e-1, 8.1e-2, 9.5e-3, 1.0e-3 (third order; at four samples a period its
    border extrapolation overshoots). A ViT with native 8 x 8 patches, smooth positions and
    random weights, read at 16 x 16 patches: the interpolated position rows are off the
    function by 1.4e-1 (Hugging Face) and 4.8e-2 (`KeysCubic`), relative max; the last hidden
    state against the model given the exact positions by 2.6e-2 and 8.8e-3. The function view
    differs from Hugging Face by 3.4e-2 (class token 5.4e-3, patch tokens 3.4e-2); the
    interpolant alone by 3.4e-2, the token weights alone by 2.5e-2.

    **Arguments:**

    - `patch_embedding`: the patch kernel `[features, channels, patch_h, patch_w]`.
    - `patch_bias`: `[features]`, or None.
    - `class_token`: `[features]`.
    - `position_embeddings`: `[1 + N1 N2, features]`: the class token's row, then the
      native patch grid's in raster order.
    - `equation`: the layers and the final norm, on the native grid's token domain.
    - `image_size`, `patch_size`: the native image and patch, `(height, width)` each.
    - `mask_token`: `[features]` (`bool_masked_pos` replaces patches by it), or None.
    - `interpolant`: how the positions extend to the image domain
      ([`HFBicubic`][itde.interop.HFBicubic] or [`KeysCubic`][itde.interop.KeysCubic]).
    - `token_weights`: the tokens' quadrature weights at any grid
      ([`UnitTokenWeights`][itde.interop.UnitTokenWeights] or
      [`AreaTokenWeights`][itde.interop.AreaTokenWeights]).
    - `source`, `family`, `config`: the converted class, its family and config (JSON), for
      [`to_hf`][itde.interop.HFVisionTransformer.to_hf].
    """

    patch_embedding: Float[Array, "features channels patch_h patch_w"] = kernel()
    patch_bias: Float[Array, " features"] | None
    class_token: Float[Array, " features"]
    position_embeddings: Float[Array, "positions features"]
    equation: TransformerIDE
    image_size: tuple[int, int] = eqx.field(static=True, converter=_pair)
    patch_size: tuple[int, int] = eqx.field(static=True, converter=_pair)
    mask_token: Float[Array, " features"] | None = None
    interpolant: AbstractPositionInterpolant = HFBicubic()
    token_weights: AbstractImageTokenWeights = UnitTokenWeights()
    source: str = eqx.field(static=True, default="")
    family: Any = None
    config: str = eqx.field(static=True, default="")

    def __check_init__(self):
        if not isinstance(self.equation, TransformerIDE):
            raise TypeError(
                f"`equation` must be an itde.TransformerIDE, got {type(self.equation).__name__}."
            )
        if not isinstance(self.interpolant, AbstractPositionInterpolant):
            raise TypeError(
                f"`interpolant`={self.interpolant!r} must be HFBicubic(), KeysCubic() or "
                "another AbstractPositionInterpolant."
            )
        if not isinstance(self.token_weights, AbstractImageTokenWeights):
            raise TypeError(
                f"`token_weights`={self.token_weights!r} must be UnitTokenWeights(), "
                "AreaTokenWeights() or another AbstractImageTokenWeights."
            )
        (h, w), (p1, p2) = self.image_size, self.patch_size
        if min(h, w, p1, p2) < 1 or h % p1 or w % p2:
            raise ValueError(
                f"`image_size`={self.image_size} must be a positive multiple of `patch_size`="
                f"{self.patch_size} in each axis (the patches tile the image)."
            )
        d = self.equation.grid.n_features
        if self.patch_embedding.shape[0] != d or self.patch_embedding.shape[2:] != (p1, p2):
            raise ValueError(
                f"`patch_embedding` has shape {self.patch_embedding.shape}, expected "
                f"[{d}, channels, {p1}, {p2}] (features, channels, patch)."
            )
        rows = 1 + (h // p1) * (w // p2)
        if self.position_embeddings.shape != (rows, d):
            raise ValueError(
                f"`position_embeddings` has shape {self.position_embeddings.shape}, expected "
                f"({rows}, {d}): the class token's row and one per native patch."
            )

    # ------------------------------------------------------------ the image domain
    @property
    def grid_size(self) -> tuple[int, int]:
        """The native patch grid $(N_1, N_2)$ the position table holds."""
        return (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])

    @property
    def n_channels(self) -> int:
        return self.patch_embedding.shape[1]

    @property
    def dtype(self):
        return self.patch_embedding.dtype

    def function_view(self) -> HFVisionTransformer:
        """The same model read as one image domain at every size: positions through
        [`KeysCubic`][itde.interop.KeysCubic], tokens weighted by their area
        ([`AreaTokenWeights`][itde.interop.AreaTokenWeights]). Equal to the network at the
        native size; at another size it differs from Hugging Face's interpolation as the
        class's table states."""
        return dataclasses.replace(self, interpolant=KeysCubic(), token_weights=AreaTokenWeights())

    def continuum_form(self) -> HFVisionTransformer:
        """The same model with its equation in normalised coordinates
        ([`TransformerIDE.continuum_form`][itde.TransformerIDE.continuum_form]); a pre-norm
        ViT is its own continuum form and is returned unchanged."""
        if not self.equation.block.has_constraint:
            return self
        return dataclasses.replace(self, equation=self.equation.continuum_form())

    def positions_at(self, grid: tuple[int, int]) -> Float[Array, "tokens features"]:
        """The position rows `[1 + n1 n2, features]` the model adds at a patch `grid`: the
        class token's row, then the position function sampled at the grid's centres."""
        n1, n2 = _pair(grid)
        if (n1, n2) == self.grid_size:
            return self.position_embeddings
        self.interpolant.check(self.grid_size, self.patch_size, (n1, n2))
        d = self.position_embeddings.shape[1]
        table = self.position_embeddings[1:].reshape(*self.grid_size, d)
        patches = resample(self.interpolant, table, (n1, n2)).reshape(n1 * n2, d)
        return jnp.concatenate([self.position_embeddings[:1], patches])

    def equation_at(self, grid: tuple[int, int]) -> TransformerIDE:
        """The equation on the token domain of a patch `grid` (its `token_weights`)."""
        domain = self.token_weights.domain(_pair(grid), self.grid_size)
        old = self.equation.grid
        return dataclasses.replace(self.equation, grid=Grid(domain, old.features, old.n_features))

    # ------------------------------------------------------------ the forward
    def embed(
        self,
        pixel_values: Float[Array, "channels height width"],
        bool_masked_pos: Bool[Array, " patches"] | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> Float[Array, "tokens features"]:
        r"""The initial condition $u(\cdot, \cdot, 0)$ of one image: `[1 + patches,
        features]`, the class token then the patches in raster order."""
        check_bool("interpolate_pos_encoding", interpolate_pos_encoding)
        x = check_pixels(pixel_values, self.n_channels, self.patch_size, self.dtype)
        (c, h, w), (p1, p2) = x.shape, self.patch_size
        n1, n2 = h // p1, w // p2
        patches = x.reshape(c, n1, p1, n2, p2)
        e = jnp.einsum("cipjq,dcpq->ijd", patches, self.patch_embedding.astype(x.dtype))
        e = e.reshape(n1 * n2, -1)
        if self.patch_bias is not None:
            e = e + self.patch_bias.astype(x.dtype)
        if bool_masked_pos is not None:
            e = jnp.where(self._masked(bool_masked_pos, n1 * n2)[:, None], self.mask_token, e)
        u = jnp.concatenate([self.class_token[None].astype(e.dtype), e])
        if (h, w) == self.image_size:
            if interpolate_pos_encoding and h != w:  # Hugging Face resamples even then
                self.interpolant.check(self.grid_size, self.patch_size, (n1, n2))
            return u + self.position_embeddings
        if not interpolate_pos_encoding:
            raise ValueError(
                f"`pixel_values` is {h} x {w} but the model's image is {self.image_size[0]} x "
                f"{self.image_size[1]} (config.image_size); pass interpolate_pos_encoding=True "
                f"to sample the positions at the {n1} x {n2} patch grid."
            )
        return u + self.positions_at((n1, n2))

    def __call__(
        self,
        pixel_values: Float[Array, "channels height width"],
        bool_masked_pos: Bool[Array, " patches"] | None = None,
        interpolate_pos_encoding: bool = False,
        attention_mask: Bool[Array, " tokens"] | None = None,
    ) -> Float[Array, "tokens features"]:
        """The last hidden state of one image, `[1 + patches, features]`.

        **Arguments:**

        - `pixel_values`: `[channels, height, width]`, height and width multiples of the
          patch size.
        - `bool_masked_pos`: `[patches]` booleans (or 0/1): patches replaced by the mask
          token (a model built with `use_mask_token=True`); None: none.
        - `interpolate_pos_encoding`: allow an image size other than the native one (the
          positions sampled at the new patch grid).
        - `attention_mask`: `[1 + patches]`, 0 on tokens removed from the token domain;
          None: every token.
        """
        u0 = self.embed(pixel_values, bool_masked_pos, interpolate_pos_encoding)
        n = u0.shape[0]
        mask = None if attention_mask is None else key_mask(attention_mask, n, "attention_mask")
        if mask is not None and mask.ndim != 1:
            raise ValueError(
                f"`attention_mask` must be [tokens] for one image, got shape {mask.shape}; for a "
                "batch use jax.vmap."
            )
        (_, h, w), (p1, p2) = np.shape(pixel_values), self.patch_size
        return self.equation_at((h // p1, w // p2))(u0, mask)

    def _masked(self, pos, n):
        if self.mask_token is None:
            raise ValueError(
                "`bool_masked_pos` given, but this model has no mask token (its ViTModel was "
                "built without use_mask_token=True); leave it out."
            )
        pos = jnp.asarray(pos)
        if pos.shape != (n,):
            raise ValueError(
                f"`bool_masked_pos` must have one entry per patch, shape ({n},), got {pos.shape}."
            )
        if pos.dtype != jnp.bool_ and not jnp.issubdtype(pos.dtype, jnp.integer):
            raise TypeError(f"`bool_masked_pos` must be boolean or 0/1, got dtype {pos.dtype}.")
        return pos != 0

    # ------------------------------------------------------------ another patch size
    def with_patch_size(self, patch_size) -> HFVisionTransformer:
        r"""The model for patches of `patch_size` pixels covering the same part of the image:
        the same patch grid and positions, the patch kernel resampled.

        The kernel is read as a density on the patch square, constant on each native
        pixel: a pixel of the new patch gets the kernel integrated over it,
        $K'_{ab} = \sum_{ij} K_{ij}\,|c'_a \cap c_i|\,|c'_b \cap c_j| / (|c_i| |c_j|)$
        (per channel and feature), so a constant image gives the same tokens. Exact for an
        image whose pixels are the native image's repeated: `with_patch_size(2 * P)` on
        `jnp.repeat(jnp.repeat(x, 2, 1), 2, 2)` equals the model on `x`. `image_size`
        becomes the grid times the new patch (and `to_hf` writes that config).
        """
        new = _pair(patch_size)
        if min(new) < 1:
            raise ValueError(f"`patch_size`={patch_size!r} must be positive.")
        o1 = patch_overlaps(self.patch_size[0], new[0])
        o2 = patch_overlaps(self.patch_size[1], new[1])
        k = np.einsum("ai,bj,dcij->dcab", o1, o2, np.asarray(self.patch_embedding, np.float64))
        image = (self.grid_size[0] * new[0], self.grid_size[1] * new[1])
        config = self.config
        if config:
            c = json.loads(config)
            c["patch_size"] = new[0] if new[0] == new[1] else list(new)
            c["image_size"] = image[0] if image[0] == image[1] else list(image)
            config = json.dumps(c, sort_keys=True)
        return dataclasses.replace(
            self,
            patch_embedding=jnp.asarray(k, self.dtype),
            image_size=image,
            patch_size=new,
            config=config,
        )

    # ------------------------------------------------------------ back to Hugging Face
    def to_hf(self):
        """The Hugging Face `ViTModel` of this (perhaps trained) model, with its weights
        written in exactly, in its dtype, in eval mode; `save_pretrained` /
        `from_pretrained` round trip it. (The view options, `interpolant` and
        `token_weights`, have no Hugging Face counterpart: its model interpolates as
        `HFBicubic` and weighs as `UnitTokenWeights`.)"""
        from ._hf_export import to_hf

        return to_hf(self)


class ViTFamily(AbstractHFFamily):
    """`ViTModel`: patch embedding, class token, learned positions, pre-norm encoder, final
    `layernorm` (the pooler, if any, is not converted: `last_hidden_state` is)."""

    classes: ClassVar[tuple[str, ...]] = ("ViTModel",)
    fields: ClassVar[frozenset[str]] = frozenset({
        "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "hidden_act", "layer_norm_eps", "image_size", "patch_size", "num_channels",
        "qkv_bias", "head_dim",
        # dropout, the masked-image-modelling decoder's stride and the pooler leave the
        # last hidden state unchanged
        "hidden_dropout_prob", "attention_probs_dropout_prob", "encoder_stride",
        "pooler_output_size", "pooler_act",
    })  # fmt: skip

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        g.activation("hidden_act", config.hidden_act)
        image, patch = _pair(config.image_size), _pair(config.patch_size)
        if image[0] % patch[0] or image[1] % patch[1]:
            raise ValueError(
                f"`config.image_size`={config.image_size!r} is not supported with "
                f"`config.patch_size`={config.patch_size!r}: Hugging Face's patch convolution "
                "drops the pixels past the last whole patch, which is no quadrature of the "
                "image domain; give an image size that is a multiple of the patch size."
            )

    def build_kwargs(self, name, m=None):
        mask = m is not None and getattr(m, "mask_token", None) is not None
        return {"add_pooling_layer": False, "use_mask_token": mask}

    def convert(self, model, name):  # pyright: ignore[reportIncompatibleMethodOverride]
        config = model.config
        act = g.activation("hidden_act", config.hidden_act)
        h = config.num_attention_heads
        blocks = [
            Block(
                g.attention(
                    layer.attention.q_proj,
                    layer.attention.k_proj,
                    layer.attention.v_proj,
                    layer.attention.o_proj,
                    h,
                ),
                g.layer_norm(layer.layernorm_before),
                g.feedforward(layer.mlp.fc1, layer.mlp.fc2, act),
                g.layer_norm(layer.layernorm_after),
            )
            for layer in model.layers
        ]
        emb = model.embeddings
        image, patch = _pair(config.image_size), _pair(config.patch_size)
        grid = (image[0] // patch[0], image[1] // patch[1])
        d = blocks[0].attention.n_features
        equation = TransformerIDE(
            PiecewiseConstant(stack(blocks)),
            Grid(UnitTokenWeights().domain(grid, grid), Midpoint(), d),
            causal=False,
            block=PreNorm(),
            final_norm=g.layer_norm(model.layernorm),
        )
        conv = emb.patch_embeddings.projection
        mask = getattr(emb, "mask_token", None)
        return HFVisionTransformer(
            patch_embedding=g.a(conv.weight),
            patch_bias=g.a(conv.bias),
            class_token=g.a(emb.cls_token)[0, 0],
            position_embeddings=g.a(emb.position_embeddings)[0],
            equation=equation,
            image_size=image,
            patch_size=patch,
            mask_token=None if mask is None else g.a(mask)[0, 0],
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m: Any, model: Any) -> None:
        emb = model.embeddings
        conv = emb.patch_embeddings.projection
        g.put(conv.weight, m.patch_embedding)
        bias = m.patch_bias if m.patch_bias is not None else np.zeros(conv.bias.shape)
        g.put(conv.bias, bias)  # no bias is a zero bias for the Conv2d
        g.put(emb.cls_token, np.asarray(m.class_token)[None, None])
        g.put(emb.position_embeddings, np.asarray(m.position_embeddings)[None])
        if m.mask_token is not None:
            g.put(emb.mask_token, np.asarray(m.mask_token)[None, None])
        g.put_layer_norm(m.equation.final_norm, model.layernorm)
        for block, layer in zip(g.layers(m), model.layers, strict=True):
            at = layer.attention
            g.put_attention(block.attention, at.q_proj, at.k_proj, at.v_proj, at.o_proj)
            g.put_layer_norm(block.norm1, layer.layernorm_before)
            g.put_feedforward(block.feedforward, layer.mlp.fc1, layer.mlp.fc2)
            g.put_layer_norm(block.norm2, layer.layernorm_after)
