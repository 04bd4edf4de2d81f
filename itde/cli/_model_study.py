"""`itde converge --checkpoint DIR` and `itde converge --hf DIR`: the depth study of a
trained or converted model (see `itde.studies.model_depth_study`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .._internal import check_output_dir

#: The steps per layer of the study (`--steps` overrides). With `DEFAULT_INPUTS` and
#: `DEFAULT_REFINEMENT` a first run on a small encoder (all-MiniLM-L6-v2) takes minutes on a
#: CPU; its orders are printed with a verdict (a real network is pre-asymptotic there).
DEFAULT_STEPS = (1, 2, 4, 8, 16)
#: The inputs of the default study (`--inputs` overrides).
DEFAULT_INPUTS = 4
#: The default Dopri8 reference takes steps this many times finer than the finest studied
#: one (32 per layer); its own error, against twice its step, is printed and checked.
DEFAULT_REFINEMENT = 2
#: The steps per layer of `--full`: the study refined to 32 steps per layer (its Dopri8
#: reference at 128 steps per layer), on `FULL_INPUTS` inputs.
FULL_STEPS = (1, 2, 4, 8, 16, 32)
FULL_INPUTS = 8
FULL_REFINEMENT = 4


def _sentences(path: str | None, n: int) -> list[str]:
    """`n` sentences: the lines of `path`, or the sentences of the built-in text."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(
                f"`--text`={path!r} is not a file; give a text file, one input a line."
            )
        data = p.read_bytes()
        try:
            decoded = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"`--text`={path!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                f"{e.start} is not valid UTF-8); give a UTF-8 text file, one input a line."
            ) from None
        lines = [s.strip() for s in decoded.splitlines() if s.strip()]
        where = f"`--text`={path!r}"
    else:
        from ..data import builtin_text_path

        flat = " ".join(builtin_text_path().read_text(encoding="utf-8").split())
        lines = [s.strip() for s in re.split(r"(?<=[.!?])\s+", flat) if len(s.split()) >= 4]
        where = "the built-in text"
    if len(lines) < n:
        raise ValueError(f"{where} has {len(lines)} inputs, fewer than `--inputs`={n}.")
    return lines[:n]


def _hf_problem(directory: str, text: str | None, n: int, *, continuum: bool = True):
    """A Hugging Face model directory (loaded offline), converted (in its continuum form,
    or as the network itself with `continuum=False`); its embeddings of `n` sentences and
    their mask."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not Path(directory, "config.json").is_file():
        raise ValueError(
            f"`--hf`={directory!r} is not a Hugging Face model directory (no config.json in it)."
        )
    sentences = _sentences(text, n)  # a bad --text is said before the model loads
    from ..interop._internal import check_safetensors

    check_safetensors(directory, "--hf")
    import jax
    import jax.numpy as jnp

    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a test dependency
        raise ValueError("`--hf` needs Hugging Face transformers: pip install 'itde[hf]'") from e
    from ..interop import from_hf

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory).eval().double()
    batch = tok(sentences, padding=True, return_tensors="np")
    vocab = model.get_input_embeddings().num_embeddings
    top = int(batch["input_ids"].max())
    if top >= vocab:  # another model's tokenizer: named here, not as a run-time check in JAX
        raise ValueError(
            f"`--hf`={directory!r}: its tokenizer gives token id {top} for these inputs, but "
            f"the model embeds only {vocab} ids (config.json vocab_size); the tokenizer is not "
            "this model's: save the model's own tokenizer in the directory "
            "(tokenizer.save_pretrained(DIR))."
        )
    m = from_hf(getattr(model, "base_model", model))
    m = m.continuum_form() if continuum else m
    ids = jnp.asarray(batch["input_ids"])
    mask = jnp.asarray(batch["attention_mask"]).astype(bool)
    return m.equation, jax.vmap(m.embed)(ids), mask, None, ("lie", None), type(model).__name__


def _checkpoint_problem(directory: str, n: int):
    """A training checkpoint: its model (in float64) and `n` held-out inputs."""
    import jax
    import jax.numpy as jnp

    from ._train import _restore

    run, model, meta = _restore(directory, spread=True)  # with the held-out batches
    model = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, model
    )
    x = run.eval_chunks(n)[0][0][:n]
    u0 = model.initial_state(x)

    def readout(y, mask):
        return model.head(y)

    name = f"{run.cfg.task.name} model, step {meta['step']}"
    return model.equation, u0, None, readout, (model.scheme, model.dt), name


def cmd_model_study(args) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)
    from ..studies import format_model_study, model_depth_study, write_model_study

    if args.inputs is None:
        args.inputs = FULL_INPUTS if args.full else DEFAULT_INPUTS
    if args.inputs < 1:
        raise ValueError(f"`--inputs`={args.inputs} must be a positive number of inputs.")
    if args.full and args.steps is not None:
        raise ValueError(
            f"`--full` and `--steps`={' '.join(map(str, args.steps))}: give one (--full is "
            f"--steps {' '.join(map(str, FULL_STEPS))})."
        )
    out = check_output_dir(args.out if args.out is not None else "runs/converge_model", "--out")
    if args.checkpoint is not None:
        if args.text is not None:
            raise ValueError("`--text` is for --hf; a checkpoint's inputs are its held-out data.")
        eq, u0, mask, readout, network, name = _checkpoint_problem(args.checkpoint, args.inputs)
        source = args.checkpoint
    else:
        eq, u0, mask, readout, network, name = _hf_problem(args.hf, args.text, args.inputs)
        source = args.hf
    if args.steps is not None:
        steps = tuple(args.steps)
    else:
        steps = FULL_STEPS if args.full else DEFAULT_STEPS
    result = model_depth_study(
        eq, u0, mask=mask, readout=readout, steps=steps, network=network,
        reference_refinement=FULL_REFINEMENT if args.full else DEFAULT_REFINEMENT,
        progress=not args.no_progress,
        advice="refine further: run with --full" if not args.full
        else "refine further: --steps with more, smaller steps",
    )  # fmt: skip
    result["source"] = {"path": str(source), "model": name}
    print(f"itde converge ({source}): {name}")
    print(format_model_study(result))
    js, png = write_model_study(result, out)
    print(f"wrote {js} and {png} ({result['wall_s']:.1f} s)")
    sys.stdout.flush()
    return 0
