r"""A Hugging Face model family as a module: how its models become an equation and back.

A family is a subclass of [`AbstractHFFamily`][itde.interop.AbstractHFFamily] in its own
file (`_hf_<family>.py`) plus one entry per model class in `itde.interop.HF_FAMILIES`;
`from_hf` and `to_hf` only look the class up and call the family's methods.

**No silent routing.** A family converts the model classes it lists in `classes` and
nothing else, and refuses any config field it does not know (`fields`: the fields it reads,
refuses by value, or that leave the hidden states unchanged) whose value is set: a Gemma
model handed to the Llama converter, or a Llama config carrying Mistral's
`sliding_window`, fails with the class or the field named, never with a model that
computes something else.
"""

from __future__ import annotations

import abc
import json
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx

if TYPE_CHECKING:
    from ._hf_model import HFTransformer

# Fields of every `PretrainedConfig` (names, labels, output switches): none changes the
# hidden states.
_BASE_FIELDS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "is_encoder_decoder", "label2id", "model_type", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
    "_attn_implementation_autoset", "use_return_dict", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "cross_attention_hidden_size",
    "tf_legacy_loss", "torchscript", "pruned_heads", "decoder_start_token_id",
    "sep_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "initializer_range", "gradient_checkpointing", "layer_norm_eps_is_set", "_commit_hash",
})  # fmt: skip

# Values of an unknown field that switch nothing on.
_OFF = (None, False)


class AbstractHFFamily(eqx.Module):
    """How the models of one Hugging Face family become an equation, and back.

    A subclass declares `classes` (the `transformers` model classes it converts exactly)
    and `fields` (every config field its converter reads, refuses by value, or knows to
    leave the hidden states unchanged), and implements `convert` and `write`.
    """

    classes: ClassVar[tuple[str, ...]]
    fields: ClassVar[frozenset[str]]

    @abc.abstractmethod
    def convert(self, model: Any, name: str) -> HFTransformer:
        """The equation of `model` (an instance of the class `name`, one of `classes`)."""

    @abc.abstractmethod
    def write(self, m: HFTransformer, model: Any) -> None:
        """Write the weights of `m` into `model`, a freshly built module of `m`'s class and
        config (the inverse of `convert`)."""

    def build_kwargs(self, name: str, m: Any = None) -> dict:
        """Keyword arguments of the model class's constructor besides the config, for
        `to_hf` of the converted model `m`."""
        return {}

    def window(self, config: Any) -> Any:
        """The sliding window (`itde.SlidingWindow`) a model of this config attends within,
        or None (full attention); `to_hf` refuses a model whose window is not this."""
        return None

    def float64_patches(self) -> tuple[tuple[Any, str, Any], ...]:
        """`(owner, attribute, replacement)` triples that make this family's Hugging Face
        code compute in the model's dtype where it computes in float32 (RMSNorm, rotary
        angles), for [`hf_float64`][itde.interop.hf_float64]. Softmax is patched once for
        every family."""
        return ()

    def check(self, model: Any, name: str) -> None:
        """Refuse a model class or a config field this family does not convert."""
        if name not in self.classes:
            raise TypeError(
                f"`model` is a {name}, which {type(self).__name__} does not convert (it "
                f"converts {', '.join(self.classes)}): another family's forward is not this "
                "one's even where their configs look alike."
            )
        unknown = sorted(
            (k, v)
            for k, v in config_fields(model.config).items()
            if k not in _BASE_FIELDS and k not in self.fields and not _off(k, v)
        )
        if unknown:
            k, v = unknown[0]
            raise ValueError(
                f"`config.{k}`={v!r} is not a field {type(self).__name__} converts (the "
                f"converted model would ignore it){_more(unknown)}; it reads "
                f"{', '.join(sorted(self.fields))}."
            )


def config_fields(config) -> dict:
    return config.to_dict()


def config_json(config) -> str:
    """A model's config as JSON (kept by the converted model, for `to_hf`)."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


# Fields whose False switches something off that is on by default: `is_causal=False` makes
# Hugging Face's `create_causal_mask` bidirectional.
_ON_BY_DEFAULT = frozenset({"is_causal"})


def _off(key: str, v) -> bool:
    if key in _ON_BY_DEFAULT:
        return v is None or v is True
    return any(v is o for o in _OFF) or v == {} or v == []


def _more(unknown) -> str:
    if len(unknown) == 1:
        return ""
    return " (also " + ", ".join(f"`{k}`" for k, _ in unknown[1:]) + ")"
