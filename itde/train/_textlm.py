"""The `textlm` task: next-token prediction on a local text of any size, character-level or
BPE, its token ids memory-mapped (`itde.data.TokenCorpus`)."""

from __future__ import annotations

import math
import pathlib
import typing
from typing import Any

import jax
import jax.numpy as jnp

from .._config import ConfigError, positive
from ..data import TokenCorpus, builtin_text_path, tokenizer_from_json
from ..data._tokenizers import HF_TOKENIZER, TOKENIZER_KINDS, HFTokenizer
from ._model import cross_entropy
from ._abstract_task import AbstractTokenTask


def _check_cache_dir(path: str) -> None:
    """`task.cache_dir` is a directory, or can become one (no file at it or above it)."""
    existing = pathlib.Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ValueError(
            f"`task.cache_dir`={path!r} cannot be a directory: {str(existing)!r} is a file; "
            "give a directory for the encoded corpus (created if missing), or leave "
            "`task.cache_dir` empty for the default cache."
        )


@typing.final
class TextLM(AbstractTokenTask):
    """Next-token prediction on a local UTF-8 file or folder (`itde.data.TokenCorpus`):
    a causal (Volterra) [`TokenModel`][itde.train.TokenModel], next-token cross-entropy,
    validation loss in nats per token and per character.

    `[task]` keys: `text_path` (a file, a folder, or `"package:NAME/sub/path"`; empty = the
    built-in tiny text; relative to the config file), `text_glob` (the files of a folder),
    `tokenizer` (`"char"`, `"bpe"`, or `"hf:DIR"`: a Hugging Face model directory's
    `tokenizer.json`, as it is; required with `[model] init = "hf:DIR"`), `vocab_size`
    (BPE tokens; 0 otherwise),
    `cache_dir` (where the encoded ids are kept; empty = `itde.data.default_cache_dir()`),
    `context`, `val_fraction` (the last fraction of the characters is validation).

    Per character: the validation windows' mean nats per token times the validation
    split's tokens per character (its token count over its character count). The
    checkpoint stores the tokenizer and the counts, so sampling needs no text file;
    evaluation reads the validation split again (from the cache) and checks its SHA-256."""

    name = "textlm"
    options: dict[str, Any] = {
        "text_path": "",
        "text_glob": "**/*.txt",
        "tokenizer": "char",
        "vocab_size": 0,
        "cache_dir": "",
        "context": 64,
        "val_fraction": 0.1,
    }
    metric = "eval_nats_per_token"
    tokens_key = "context"
    causal = True
    metric_label = "validation nats/token"
    can_sample = True

    def __init__(self, config, *, stored: dict | None = None):
        super().__init__(config)
        self._corpus: TokenCorpus | None = None
        self._stored = stored
        if stored is None:
            self._read()
        else:
            self.tokenizer = tokenizer_from_json(stored["tokenizer"])

    def _read(self) -> TokenCorpus:
        if self._corpus is not None:
            return self._corpus
        c = self.config
        if c.tokenizer.startswith(HF_TOKENIZER):  # a missing tokenizer.json, named by its key
            HFTokenizer.file(c.tokenizer[len(HF_TOKENIZER) :], name="task.tokenizer")
        if c.cache_dir:  # a file in the way: named by its key, not "[Errno 20] Not a directory"
            _check_cache_dir(c.cache_dir)
        corpus = TokenCorpus.from_path(
            c.text_path or builtin_text_path(), tokenizer=c.tokenizer, vocab_size=c.vocab_size,
            val_fraction=c.val_fraction, glob=c.text_glob, cache_dir=c.cache_dir or None,
        )  # fmt: skip
        if self._stored is not None and corpus.sha256 != self._stored["data_sha256"]:
            raise ValueError(
                f"the text at `task.text_path`={c.text_path!r} is not the text this checkpoint "
                "was trained on (its SHA-256 differs): evaluate with the same text."
            )
        for split in ("train", "val"):
            n = len(getattr(corpus, split))
            if n < c.context + 1:
                raise ValueError(
                    f"the {split!r} split of {corpus.source!r} has {n} tokens, too short for "
                    f"`task.context`={c.context} (needs {c.context + 1}); use a smaller "
                    "context, a longer text, or another `task.val_fraction`."
                )
        self._corpus = corpus
        self.tokenizer = corpus.tokenizer
        return corpus

    @classmethod
    def check_options(cls, config) -> None:
        positive("task.context", config.context)
        if config.tokenizer.startswith(HF_TOKENIZER):
            if not config.tokenizer[len(HF_TOKENIZER) :].strip() or config.vocab_size:
                raise ConfigError(
                    f"`task.tokenizer`={config.tokenizer!r} (with `task.vocab_size`="
                    f"{config.vocab_size}): 'hf:DIR' names a Hugging Face directory whose "
                    "tokenizer.json is used as it is; give the directory and leave "
                    "`task.vocab_size` out"
                )
        elif config.tokenizer not in TOKENIZER_KINDS:
            raise ConfigError(
                f"`task.tokenizer`={config.tokenizer!r} is not known; choose one of "
                f"{list(TOKENIZER_KINDS)} (characters, or byte-pair merges of characters) or "
                "'hf:DIR' (the tokenizer.json of a Hugging Face model's directory)"
            )
        if config.vocab_size < 0:
            raise ConfigError(f"`task.vocab_size` must be >= 0, got {config.vocab_size}")
        if config.tokenizer == "char" and config.vocab_size:
            raise ConfigError(
                f"`task.vocab_size`={config.vocab_size} applies to tokenizer 'bpe' only (the "
                "'char' vocabulary is the text's own characters); remove it or set "
                '`task.tokenizer = "bpe"`'
            )
        if config.tokenizer == "bpe" and config.vocab_size < 2:
            raise ConfigError(
                f"`task.vocab_size`={config.vocab_size}: tokenizer 'bpe' needs the number of "
                "tokens to learn, e.g. `vocab_size = 1024` (at least the text's distinct "
                "characters)"
            )
        if not config.text_glob:
            raise ConfigError("`task.text_glob` must be a glob pattern such as '**/*.txt'")
        if not (math.isfinite(config.val_fraction) and 0 < config.val_fraction < 1):
            raise ConfigError(
                f"`task.val_fraction` must be in (0, 1), got {config.val_fraction!r} (the last "
                "fraction of the characters is held out, e.g. 0.1)"
            )

    @classmethod
    def from_checkpoint(cls, config, meta: dict):
        return cls(config, stored=dict(meta))

    def checkpoint_meta(self) -> dict:
        if self._stored is not None:
            return dict(self._stored)
        c = self._read()
        return {
            "tokenizer": self.tokenizer.to_json(),
            "data_sha256": c.sha256,
            "train_tokens": len(c.train),
            "val_tokens": len(c.val),
            "val_chars": c.val_chars,
        }

    @property
    def corpus(self) -> TokenCorpus:
        """The corpus (read from the cache, or encoded, on first use)."""
        return self._read()

    @property
    def vocab(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def itos(self) -> tuple[str, ...]:
        """Token id -> its text."""
        return self.tokenizer.itos

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (for a sampling prompt)."""
        return self.tokenizer.encode(text).tolist()

    @property
    def tokens_per_char(self) -> float:
        """Validation tokens per validation character."""
        if self._stored is not None:
            return self._stored["val_tokens"] / self._stored["val_chars"]
        return self._read().tokens_per_char

    def train_batch(self, key, n):
        return self._read().batch(key, "train", n, self.config.context)

    def eval_batch(self, key, n):
        return self._read().batch(key, "val", n, self.config.context)

    def init_model(self, model_config, key, *, dtype=jnp.float32):
        if model_config.hf_init is not None:  # the converted model: `key` draws nothing
            from ._finetune import init_from_hf_dir

            return init_from_hf_dir(
                model_config, vocab=self.vocab, context=self.config.context, dtype=dtype
            )
        return super().init_model(model_config, key, dtype=dtype)

    def metric_sums(self, out, y):
        return {"eval_nats_per_token": jnp.sum(jax.vmap(cross_entropy)(out, y))}

    def finish_metrics(self, means):
        out = dict(means)
        out["eval_nats_per_char"] = out["eval_nats_per_token"] * self.tokens_per_char
        out["eval_bits_per_char"] = out["eval_nats_per_char"] / math.log(2.0)
        return out
