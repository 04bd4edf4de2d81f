"""`export_hf_dir`: the fine-tuned model of a run started from a Hugging Face directory,
written back as one (above `_load`, which `_finetune` must not import)."""

from __future__ import annotations

from pathlib import Path

from .._io import check_output_location
from ._finetune import export, export_refusal
from ._load import load

__all__ = ["export_hf_dir"]


def export_hf_dir(directory, out=None) -> Path:
    """Write the fine-tuned model of an `itde train` run whose config has
    `[model] init = "hf:DIR"` as a Hugging Face directory: `save_pretrained` of the source
    class ([`itde.to_hf`][itde.interop.to_hf]) plus the tokenizer files of `DIR`, so that
    `AutoModelForCausalLM.from_pretrained(out)` gives the itde model's logits (to float32
    round-off) and `AutoTokenizer.from_pretrained(out)` its tokenizer.

    **Arguments:**

    - `directory`: the run's output directory (it holds `checkpoint.json`).
    - `out`: where to write (default `directory/hf`).

    **Returns:** the path written. **Raises** `ValueError` for a run not started from a
    Hugging Face model, or one that cannot be written back (controls smooth in depth, or a
    depth step other than one layer).
    """
    if out is not None:  # a file in the way, or nowhere to write: said before loading
        check_output_location(out, "out")
    model, cfg, _ = load(directory)
    init = cfg.model.hf_init
    refusal = export_refusal(model, from_hf=init is not None)
    if refusal is not None:
        raise ValueError(f"`directory`={str(directory)!r} holds a run that cannot be exported: "
                         f"{refusal}")  # fmt: skip
    return export(model, init, Path(directory) / "hf" if out is None else out)
