"""`to_hf`: a converted model written back into its Hugging Face class (the family of the
model decides how; this module knows no family, so every family's model may call it)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from . import _hf_glue as g
from ._hf_family import AbstractHFFamily


def to_hf(m: Any) -> Any:
    """The Hugging Face model of a converted (and perhaps trained) `m`: the class `m` came
    from, built from its config, with `m`'s weights written in (exactly: a transpose or
    reshape of each parameter), in `m`'s dtype, in eval mode.

    `m` is any model `from_hf` returns ([`HFTransformer`][itde.HFTransformer], a vision or
    language-model head model): `to_hf(from_hf(model))` has the state of `model`;
    `save_pretrained` / `from_pretrained` round trip it. `m` must be per-layer (as `from_hf`
    gives it): a continuum form or a model with continuous controls is refused by name.
    """
    family = getattr(m, "family", None)
    if not isinstance(m, eqx.Module) or not hasattr(m, "family"):
        raise TypeError(
            f"`m` must be a model converted by itde.from_hf (e.g. an itde.HFTransformer), "
            f"got {type(m).__name__}."
        )
    if not isinstance(family, AbstractHFFamily) or not getattr(m, "config", ""):
        raise ValueError(
            "`m` carries no Hugging Face family and config (it was not built by itde.from_hf); "
            "convert the source model with itde.from_hf first."
        )
    floats = jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array))
    model = g.new_model(m.source, m.config, floats[0].dtype, **family.build_kwargs(m.source, m))
    _check_window(m, family.window(model.config))
    family.write(m, model)
    return model


def _check_window(m, theirs) -> None:
    """The window the written class computes (from its config) must be the model's own:
    otherwise the Hugging Face model would attend elsewhere, silently."""
    equation = getattr(m, "equation", None) or getattr(getattr(m, "base", None), "equation", None)
    ours = getattr(equation, "window", None)
    same = (ours is None and theirs is None) or (
        ours is not None and theirs is not None and ours.length == theirs.length
    )
    if not same:
        raise ValueError(
            f"`to_hf`: the model attends within {ours!r}, but the {m.source} its config builds "
            f"attends within {theirs!r}; set the config's sliding window to match (or remove "
            "the model's window)."
        )
