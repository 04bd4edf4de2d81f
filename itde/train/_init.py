"""`[model] init`: the Hugging Face directory a run starts from, read in one place.

[`HFInit.parse`][] turns the config's string (`"hf:DIR"`, or `""` for a random
initialisation) into an `HFInit` once; everything that needs the directory asks it: its
check (`config.json` and weights), its converted model, its sizes (for the memory
estimate), and the SHA-256 of its files that a checkpoint records and `--resume` checks.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path

from .._config import ConfigError
from ..data._tokenizers import HF_TOKENIZER

__all__ = ["HF_PREFIX", "HFInit", "hf_directory"]

#: The prefix of `[model] init` (and of `[task] tokenizer`) naming a local Hugging Face
#: directory: the tokenizers' own.
HF_PREFIX = HF_TOKENIZER

_WEIGHTS = ("*.safetensors", "*.bin")


def hf_directory(text: str) -> str | None:
    """`DIR` of a string `"hf:DIR"`; None for any other string."""
    return text[len(HF_PREFIX) :] if text.startswith(HF_PREFIX) else None


@dataclasses.dataclass(frozen=True)
class HFInit:
    """The Hugging Face directory of `[model] init = "hf:DIR"`.

    - `directory`: `DIR`, as the config gives it.
    - `name`: the key named in errors (default `"model.init"`).
    """

    directory: Path
    name: str = "model.init"

    @classmethod
    def parse(cls, text, name: str = "model.init") -> HFInit | None:
        """The `HFInit` of the config string `text`; None for `""` (a random
        initialisation). Raises `ConfigError` naming `name` for any other string."""
        if not isinstance(text, str):
            raise ConfigError(f"`{name}` must be a string such as 'hf:DIR', got {text!r}")
        if not text:
            return None
        directory = hf_directory(text)
        if directory is None or not directory.strip():
            raise ConfigError(
                f"`{name}`={text!r} must be 'hf:DIR', a local directory holding a "
                "Hugging Face causal language model (config.json and weights, as "
                "`save_pretrained` writes them), or '' for a random initialisation"
            )
        return cls(Path(directory), name)

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.directory}"

    def files(self) -> list[Path]:
        """The files that define the model (sorted): `config.json`, `tokenizer.json` and
        the weights, those of them the directory holds."""
        path = self.directory
        found = [path / "config.json", path / "tokenizer.json"]
        for pattern in _WEIGHTS:
            found += sorted(path.glob(pattern))
        return [f for f in found if f.is_file()]

    def check(self) -> Path:
        """The directory; raise naming `name` unless it holds a `config.json` and whole
        weights."""
        path, what = self.directory, f"`{self.name}`='{self}'"
        fix = "save the model there with `model.save_pretrained(DIR)` (config.json and weights)"
        if not path.is_dir():
            raise ValueError(f"{what} is not a directory; {fix}.")
        if not (path / "config.json").is_file():
            raise ValueError(f"{what} holds no config.json; {fix}.")
        if not any(any(path.glob(p)) for p in _WEIGHTS):
            raise ValueError(f"{what} holds no weights (*.safetensors or *.bin); {fix}.")
        from ..interop._hf_files import check_safetensors

        check_safetensors(path, self.name)  # a truncated file: named here, not by safetensors
        return path

    def sha256(self) -> str:
        """The SHA-256 of the directory's `config.json`, weights and `tokenizer.json`
        (names and contents): a checkpoint records it, and `--resume` refuses a directory
        that changed."""
        digest = hashlib.sha256()
        for f in self.files():
            digest.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(block)
        return digest.hexdigest()

    def record(self) -> dict:
        """What a checkpoint's sidecar records of the directory: its absolute `path` and
        the `sha256` of its files."""
        return {"path": str(self.directory.absolute()), "sha256": self.sha256()}

    def lm(self):
        """The [`HFCausalLM`][itde.HFCausalLM] of the directory, in float32 (read once per
        state of its files)."""
        path = self.check()
        try:
            return _converted(str(path.resolve()), _stamp(self))
        except (ValueError, TypeError) as e:
            raise ValueError(f"`{self.name}`='{self}': {e}") from None

    def dims(self) -> dict[str, int]:
        """`n_layers`, `n_features`, `n_heads`, `n_hidden` of the model (from its
        `config.json`), for the memory estimate made before a run starts."""
        import transformers

        c = transformers.AutoConfig.from_pretrained(str(self.check()), local_files_only=True)
        d = int(c.hidden_size)
        hidden = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d
        return {"n_layers": int(c.num_hidden_layers), "n_features": d,
                "n_heads": int(c.num_attention_heads), "n_hidden": int(hidden)}  # fmt: skip


def _stamp(init: HFInit) -> tuple:
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in init.files())


@functools.lru_cache(maxsize=4)
def _converted(path: str, stamp: tuple):
    import torch
    import transformers

    from ..interop import from_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    )
    return from_hf(model.eval())
