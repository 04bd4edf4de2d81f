"""Qwen2: the Llama equation with biases on the query, key and value projections (none on
the output projection); a sliding window in every layer or in none."""

from __future__ import annotations

from typing import ClassVar

from .._operators._window import SlidingWindow
from . import _hf_glue as g
from ._hf_llama import AbstractLlamaLike, causal_checks

QWEN2_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "is_causal", "use_sliding_window", "sliding_window", "max_window_layers",
    "layer_types",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class Qwen2Family(AbstractLlamaLike):
    """`Qwen2Model` (grouped-query attention, q/k/v biases), whose layers attend as
    `config.layer_types` says, the list `Qwen2Attention` and `Qwen2Model` read: every layer
    `"full_attention"` (to every token before), or every layer `"sliding_attention"` (within
    `config.sliding_window` tokens, as Mistral: the causal `SlidingWindow` of the equation).
    `Qwen2Config` fills the list from `use_sliding_window`, `sliding_window` and
    `max_window_layers` (layers from `max_window_layers` on slide, when
    `use_sliding_window`): so `use_sliding_window` with `max_window_layers` equal to the
    number of layers is full attention everywhere, and `max_window_layers=0` a window
    everywhere. A list of both kinds is refused: the equation has one window for its whole
    depth. `config.sliding_window` is inert in `"full_attention"` layers."""

    classes: ClassVar[tuple[str, ...]] = ("Qwen2Model",)
    module: ClassVar[str] = "qwen2"
    prefix: ClassVar[str] = "Qwen2"
    fields: ClassVar[frozenset[str]] = QWEN2_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)
        check_layer_types(model.config, "Qwen2")

    def window(self, config):
        """The causal `SlidingWindow(config.sliding_window)` when every layer is a
        `"sliding_attention"` layer (Hugging Face's mask `kv_idx > q_idx - W`, as
        Mistral's); None (full attention) otherwise."""
        return layer_window(config)


def check_layer_types(config, family: str) -> None:
    """Refuse a `config.layer_types` of both kinds, and a window that is not a length, in
    a family whose layers attend as Qwen2's (Qwen2, Qwen3)."""
    g.refuse(
        config, "layer_types",
        lambda v: v is None or len(set(v)) <= 1 and set(v) <= set(_KINDS),
        f"{family} attends within config.sliding_window tokens in its 'sliding_attention' "
        "layers (from config.max_window_layers on, with config.use_sliding_window) and "
        "to every token in its 'full_attention' layers; the converted equation has one "
        "attention window for its whole depth, so every layer must be 'full_attention' "
        "or every layer 'sliding_attention'.",
    )  # fmt: skip
    if _sliding(config):
        w = getattr(config, "sliding_window", None)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(
                f"`config.sliding_window`={w!r} is not supported: every layer is a "
                "'sliding_attention' layer, which reads the config.sliding_window tokens "
                "up to the query (itself included), so it must be an integer >= 1."
            )


def layer_window(config):
    """The equation's window of a config whose layers attend as `config.layer_types`
    says (Qwen2, Qwen3): `SlidingWindow(config.sliding_window)` when every layer slides,
    None when none does."""
    return SlidingWindow(float(config.sliding_window)) if _sliding(config) else None


_KINDS = ("full_attention", "sliding_attention")


def _sliding(config) -> bool:
    """Whether every layer of `config` is a `"sliding_attention"` layer."""
    kinds = getattr(config, "layer_types", None)
    return bool(kinds) and all(k == "sliding_attention" for k in kinds)
