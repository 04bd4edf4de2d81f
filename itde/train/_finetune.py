r"""Fine-tuning a Hugging Face causal language model with `itde train`, and writing it back.

`[model] init = "hf:DIR"` starts a `textlm` run from the model saved in the local
directory `DIR` (`config.json` and its weights, as `save_pretrained` writes them; nothing
is downloaded), read in float32 and converted by [`itde.from_hf`][itde.from_hf]: its
token (and learned position) embeddings become the [`TokenModel`][itde.train.TokenModel]'s
`embedding` and `position`, its layers and final norm the equation, its head the readout
(a tied head stays tied: `readout = None`). `[task] tokenizer = "hf:DIR"` encodes the text
with the directory's own `tokenizer.json`, so the token ids are the model's.

**Per layer** (`scheme = "lie"`, `dt = 1`) the model *is* the converted network: its step-0
logits are Hugging Face's to float32 round-off, and [`export_hf_dir`][itde.train.export_hf_dir]
(run automatically into `OUT/hf` when such a run completes) writes the fine-tuned weights
back into the source class with [`itde.to_hf`][itde.interop.to_hf], with the tokenizer
files beside them, for `AutoModelForCausalLM.from_pretrained`.

**Smooth in depth** (`scheme = "rk4"`, `"strang"`, ... with `n_modes`): the per-layer
controls become `LegendreControls.from_layers(controls, n_modes, block=...)`, a Legendre
series in depth fitted through the layers at the depths the Lie scheme reads them. With
`n_modes` = the number of layers it interpolates: solved by `"lie"` at `dt = 1`
(`itde.train.with_depth(model, "lie", 1.0)`) it is the network, to round-off; the
training scheme starts from the continuum limit of that interpolant instead, at a
distance from the network that the run's first evaluation shows. Only models whose norms
act inside the operators (pre-norm, parallel: GPT-2, Llama, Mistral, Qwen2, NeoX) are
their own continuum form (`itde.continuum_form` returns them unchanged); a post-norm
model's LayerNorm gains are not projections and would need its continuum form's extra
fields, so it is refused. A smooth model has no layers to write back: `export_hf_dir`
refuses it.

**Resuming.** The run's config records `init`, and its checkpoints the SHA-256 of the
directory's `config.json`, weights and `tokenizer.json`: `--resume` refuses a directory
that changed. `itde.train.load`, `itde eval` and `itde sample` read the directory's model
again for its structure (the checkpoint's arrays replace its weights), so it must stay
where the config says.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax.numpy as jnp

from .._controls import LegendreControls, PiecewiseConstant
from .._io import check_output_dir
from ._init import HFInit
from ._model import TokenModel, check_depth

__all__ = [
    "export",
    "export_refusal",
    "init_from_hf_dir",
    "lm_from_token_model",
    "token_model_from_lm",
]

#: Tokenizer files copied next to an exported model, where the source directory has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")  # fmt: skip


def token_model_from_lm(lm, m, *, vocab: int, context: int, name: str = "model.init"):
    """The [`TokenModel`][itde.train.TokenModel] of a converted causal LM `lm` for the
    `[model]` table `m` (its `scheme`, `dt`, `n_modes`): the same embeddings, equation and
    head, per layer (`"lie"`) or through `LegendreControls.from_layers` (continuous).

    `vocab`: the tokenizer's size (at most the model's rows); `context`: the task's window
    (at most the model's positions). `name` is the key named in errors."""
    from ..interop._positions import AbsolutePositions, NoPositions

    base = lm.base
    what = f"`{name}`={m.init!r} ({base.source})"
    if (
        base.embedding_norm is not None
        or base.token_type_embeddings is not None
        or (base.embedding_scale is not None)
    ):
        raise ValueError(
            f"{what} embeds tokens with a norm, token types or a scale, which itde train's "
            "TokenModel (token plus learned position embeddings) does not; fine-tune the "
            "converted model with itde.from_hf and your own loop instead."
        )
    if not isinstance(base.positions, AbsolutePositions | NoPositions):
        raise ValueError(
            f"{what} counts positions with {type(base.positions).__name__}, which itde "
            "train's TokenModel does not (absolute positions 0..n-1, or none)."
        )
    rows = base.word_embeddings.shape[0]
    if vocab > rows:
        raise ValueError(
            f"{what} has {rows} token embeddings but its tokenizer (`task.tokenizer`) has "
            f"{vocab} tokens; save the model's own tokenizer in the directory."
        )
    most = base.max_tokens
    if most is not None and context > most:
        raise ValueError(
            f"`task.context`={context} is longer than the {most} positions of {what}; "
            f"choose task.context <= {most}."
        )
    ide = base.equation
    if m.continuous:
        if ide.block.has_constraint:
            raise ValueError(
                f"{what} is a post-norm network: its LayerNorm gains are not projections, so "
                "its layers are not one equation's controls (itde.continuum_form would move "
                f"them into extra fields); `model.scheme`={m.scheme!r} cannot start from it. "
                "Fine-tune it per layer (scheme = 'lie')."
            )
        L = ide.controls.n_layers
        n_modes = L if m.n_modes is None else m.n_modes
        if not 1 <= n_modes <= L:
            raise ValueError(
                f"`model.n_modes`={n_modes} must be between 1 and the {L} layers of {what} "
                f"(n_modes = {L} interpolates them)."
            )
        ide = dataclasses.replace(
            ide, controls=LegendreControls.from_layers(ide.controls, n_modes, block=ide.block)
        )
    check_depth(ide, m.scheme, float(m.dt), name="model.dt")
    return TokenModel(
        embedding=base.word_embeddings,
        position=base.position_embeddings,
        equation=ide,
        readout=None if lm.head is None else lm.head.T,
        readout_bias=lm.head_bias,
        scheme=m.scheme,
        dt=float(m.dt),
    )


def init_from_hf_dir(m, *, vocab: int, context: int, dtype=jnp.float32) -> TokenModel:
    """The initial [`TokenModel`][itde.train.TokenModel] of `[model] init = "hf:DIR"`: the
    Hugging Face model of `DIR` converted (float32, cast to `dtype`) and put in the form of
    the `[model]` table `m` ([`token_model_from_lm`][itde.train.token_model_from_lm])."""
    from ._model import cast

    lm = m.hf_init.lm()
    return cast(token_model_from_lm(lm, m, vocab=vocab, context=context), dtype)


def export_refusal(model, *, from_hf: bool = True) -> str | None:
    """Why the trained `model` of a run cannot be written back as its Hugging Face class
    (`from_hf`: whether the run started from one, `[model] init`), or None if it can.

    The one decision: a completed run writes `OUT/hf` exactly when this is None, and
    [`export_hf_dir`][itde.train.export_hf_dir] and
    [`lm_from_token_model`][itde.train.lm_from_token_model] raise what it says."""
    if not from_hf:
        return (
            "the run was trained from scratch (`model.init` is empty); only a model started "
            "from a Hugging Face directory has a class to be written back into."
        )
    if not isinstance(model.equation.controls, PiecewiseConstant) or model.scheme != "lie":
        return (
            f"the model has controls smooth in depth (scheme {model.scheme!r}); a Hugging "
            "Face model is a per-layer network, so it has no layers to write. Fine-tune with "
            "`model.scheme` = 'lie' to export (or sample its controls at the layers "
            "yourself: `model.equation.controls` is an itde.LegendreControls)."
        )
    # exact: `dt` is the number the config gives; 1 means one step per layer
    if model.dt != 1.0:
        return (
            f"the model was trained with `model.dt`={model.dt:g}: each layer split into "
            f"{1 / model.dt:g} steps is another network than the Hugging Face class computes "
            "(one step per layer); fine-tune with dt = 1 to export."
        )
    return None


def lm_from_token_model(model: TokenModel, template):
    """The [`HFCausalLM`][itde.HFCausalLM] `template` (the converted source model) with the
    weights of the per-layer `model` built from it: what `to_hf` writes back."""
    refusal = export_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    if (template.head is None) != model.tied:
        raise ValueError("the model's head is tied where the source model's is not (or the "
                         "reverse); it was not built from this source model.")  # fmt: skip
    base = dataclasses.replace(
        template.base,
        word_embeddings=model.embedding,
        position_embeddings=model.position,
        equation=model.equation,
    )
    head = None if model.readout is None else model.readout.T
    return dataclasses.replace(template, base=base, head=head, head_bias=model.readout_bias)


def export(model: TokenModel, init: HFInit, out, *, name: str = "out") -> Path:
    """Write the trained `model` of a run started from `init` into `out` as a Hugging Face
    directory: the source class with `model`'s weights
    ([`lm_from_token_model`][itde.train.lm_from_token_model], `to_hf`, `save_pretrained`)
    and the tokenizer files of `init`'s directory. The one writer of an export: a completed
    run's `OUT/hf` and [`export_hf_dir`][itde.train.export_hf_dir]. `name`: what `out` is
    called in errors, checked first (a file there: named, not a bare FileExistsError)."""
    out = check_output_dir(out, name)
    lm_from_token_model(model, init.lm()).to_hf().save_pretrained(out)
    for file in TOKENIZER_FILES:
        if (init.directory / file).is_file():
            shutil.copyfile(init.directory / file, out / file)
    return out
