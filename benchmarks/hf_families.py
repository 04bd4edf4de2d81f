"""The table of the Hugging Face families page: for every family `itde.from_hf` converts,
the relative max error of its output against Hugging Face's, on the real tokens, worst over
padding (none, right, left) and attention implementation (eager, sdpa), in float64 (Hugging
Face run inside `itde.interop.hf_float64()`) and float32 (Hugging Face unpatched).

The models are the default suite's own (tiny configs, random weights moved away from their
initialisation), built by the test modules' helpers, so the table measures exactly what the
tests check.

    python benchmarks/hf_families.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import itde  # noqa: E402


def _worst(errors) -> float:
    return float(max(errors.values()))


def _text_rows():
    import test_hf as base
    import test_hf_rotary as rotary
    import test_hf_variants as variants

    cases = [
        ("BertModel", lambda d: base._errors("bert", d)[0]),
        ("RobertaModel", lambda d: base._errors("roberta", d)[0]),
        ("DistilBertModel", lambda d: base._errors("distilbert", d)[0]),
        ("GPT2Model", lambda d: base._errors("gpt2", d)[0]),
        ("LlamaModel (GQA, head_dim 6, biases)", lambda d: base._errors("llama", d)[0]),
        ("Qwen2Model", lambda d: rotary._errors("qwen2", d)),
        ("MistralModel (no window)", lambda d: rotary._errors("mistral", d)),
        ("GemmaModel", lambda d: rotary._errors("gemma", d)),
        ("GPTNeoXModel (parallel, rotary 25%)", lambda d: rotary._errors("neox", d)),
        ("GPTNeoXModel (sequential, rotary 50%)", lambda d: rotary._errors("neox_sequential", d)),
        ("LlamaModel rope linear", lambda d: rotary._errors("llama_linear", d)),
        ("LlamaModel rope llama3", lambda d: rotary._errors("llama3", d)),
        ("BertModel is_decoder", lambda d: variants._errors("bert_decoder", d)[0]),
        ("RobertaModel is_decoder", lambda d: variants._errors("roberta_decoder", d)[0]),
        ("GPT2Model scaled by 1/(i+1), reordered", lambda d: variants._errors("gpt2_scaled", d)[0]),
        ("T5EncoderModel (ReLU)", lambda d: variants._errors("t5", d)[0]),
        ("T5EncoderModel (gated-gelu)", lambda d: variants._errors("t5_gated", d)[0]),
        ("MistralModel sliding_window=3 (7 tokens)", lambda d: rotary._errors("mistral_window", d)),
    ]
    yield from cases


def _lm_errors(name, dtype):
    import test_hf_lm as lm_tests

    model = lm_tests._model(name, dtype)
    lm = itde.from_hf(model)
    worst = 0.0
    for impl in ("eager", "sdpa"):
        ref, _ = lm_tests._hf(model, impl, lm_tests.MASKS, lm_tests._labels(lm_tests.MASKS))
        for i, k, r in zip(lm_tests.IDS, lm_tests.MASKS, ref, strict=True):
            o = np.asarray(lm_tests.LOGITS(lm, jnp.asarray(i), jnp.asarray(k)))
            real = k == 1
            worst = max(worst, np.max(np.abs(o[real] - r[real])) / np.max(np.abs(r[real])))
    return {"logits": worst}


def _vit_errors(dtype):
    import test_hf_vit as vit

    kwargs = {"add_pooling_layer": False, "use_mask_token": True}
    model = vit._model(dtype, **kwargs)
    return vit._native_errors(model, itde.from_hf(model))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = list(_text_rows())
    rows += [
        ("GPT2LMHeadModel (tied head): logits", lambda d: _lm_errors("gpt2", d)),
        ("LlamaForCausalLM (untied head): logits", lambda d: _lm_errors("llama", d)),
        ("ViTModel (native size, masked patches)", _vit_errors),
    ]
    table = []
    print("| model | float64 | float32 |\n|---|---|---|")
    for name, errors in rows:
        with itde.interop.hf_float64():
            e64 = _worst(errors(torch.float64))
        e32 = _worst(errors(torch.float32))
        table.append({"model": name, "float64": e64, "float32": e32})
        print(f"| {name} | {e64:.1e} | {e32:.1e} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
