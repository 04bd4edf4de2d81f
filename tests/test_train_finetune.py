"""Fine-tuning a Hugging Face causal LM through `itde train` (`[model] init = "hf:DIR"`).

A tiny random GPT-2 (head tied to the word embeddings) built from a `transformers` config
and saved with `save_pretrained`, with a byte-level BPE trained by `tokenizers` on the
built-in text saved beside it as `tokenizer.json` (nothing is downloaded). Checked: the
step-0 logits are Hugging Face's (the conversion is the starting point); the loss goes
down; a run stopped and resumed ends where the whole run ends; the completed run's
`OUT/hf`, reloaded by `AutoModelForCausalLM.from_pretrained`, gives the fine-tuned itde
model's logits; smooth controls with `n_modes` = the layers are the network when solved
by Lie at one step per layer; bad input is refused by name.
"""

import dataclasses
import json
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import itde
from itde.data import builtin_text_path
from itde.train import (
    CheckpointError,
    ConfigError,
    Run,
    TrainExperiment,
    export_hf_dir,
    from_dict,
    load,
    train,
    with_depth,
)

TOL = dict(rtol=1e-4, atol=2e-5)  # float32 round-off of a 2-layer width-16 network
PREDICT = eqx.filter_jit(lambda m, x: m.batched(x))


def _tokenizer(path, vocab_size=300):
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=alphabet
    )
    tok.train([str(builtin_text_path())], trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def _spread(model, seed=0):
    """Weights away from Hugging Face's near-identity initialisation (std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    vocab = _tokenizer(path)
    config = tf.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    _spread(tf.GPT2LMHeadModel(config)).save_pretrained(path)
    return path


def _table(path, cache, **model):
    init = f"hf:{path}"
    return {
        "task": {"name": "textlm", "tokenizer": init, "context": 16, "eval_size": 8,
                 "cache_dir": str(cache)},
        "model": {"init": init, **model},
        "optim": {"steps": 20, "batch_size": 8, "warmup": 0, "lr": 3e-3, "weight_decay": 0.0},
        "run": {"log_every": 1, "eval_every": 20, "checkpoint_every": 10, "progress": False},
    }  # fmt: skip


def _hf_logits(hf, x):
    with torch.no_grad():
        return hf(torch.from_numpy(np.asarray(x, np.int64))).logits.numpy()


@pytest.fixture(scope="module")
def cfg(gpt2_dir, tmp_path_factory):
    return from_dict(TrainExperiment, _table(gpt2_dir, tmp_path_factory.mktemp("cache")))


def test_step_zero_is_the_hugging_face_model(cfg, gpt2_dir):
    run = Run(cfg)
    model, _ = run.init_state()
    assert model.tied and model.readout_bias is None  # GPT-2's lm_head is wte, no bias
    x, _ = run.batch(0)
    hf = tf.AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    np.testing.assert_allclose(PREDICT(model, jnp.asarray(x)), _hf_logits(hf, x), **TOL)
    # the task reads the directory's own tokenizer: its ids are the model's
    assert run.task.vocab == hf.config.vocab_size
    text = "Shall I compare thee"
    want = tf.PreTrainedTokenizerFast(tokenizer_file=str(gpt2_dir / "tokenizer.json"))(text)
    assert run.task.encode(text) == want["input_ids"]


def test_finetune_learns_resumes_and_exports_to_transformers(cfg, gpt2_dir, tmp_path):
    whole = train(cfg, out=tmp_path / "whole")
    rows = [json.loads(r) for r in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.2, losses
    last = rows[-1]
    assert last["eval_nats_per_char"] == pytest.approx(
        last["eval_nats_per_token"] * Run(cfg, task=whole_task(tmp_path)).task.tokens_per_char
    )
    # stopped at its checkpoint and resumed: the same parameters, bit for bit
    train(cfg, out=tmp_path / "part", stop_at=10)
    resumed = train(resume=tmp_path / "part")
    for a, b in zip(_leaves(whole.model), _leaves(resumed.model), strict=True):
        np.testing.assert_array_equal(a, b)
    # the completed per-layer run wrote OUT/hf, which transformers reloads
    out = tmp_path / "whole" / "hf"
    assert str(out / "config.json") in whole.files
    hf = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    model, _, _ = load(tmp_path / "whole")
    x, _ = Run(cfg).batch(3)
    ours = np.asarray(PREDICT(model, jnp.asarray(x)))
    np.testing.assert_allclose(ours, _hf_logits(hf, x), **TOL)
    assert hf.lm_head.weight is hf.transformer.wte.weight  # still tied
    before = tf.AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    assert np.max(np.abs(_hf_logits(before, x) - ours)) > 1e-2  # it was fine-tuned
    assert (out / "tokenizer.json").read_bytes() == (gpt2_dir / "tokenizer.json").read_bytes()
    # export_hf_dir as a function, elsewhere: the same weights
    written = export_hf_dir(tmp_path / "whole", tmp_path / "e")
    again = tf.AutoModelForCausalLM.from_pretrained(written)
    np.testing.assert_array_equal(_hf_logits(again.eval(), x), _hf_logits(hf, x))


def whole_task(tmp_path):
    from itde.train import TASKS

    _, cfg, meta = load(tmp_path / "whole")
    return TASKS["textlm"].from_checkpoint(cfg.task, meta["task"])


def _leaves(model):
    import jax

    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def test_smooth_controls_from_the_layers_start_at_the_network(cfg, gpt2_dir):
    """`scheme = "rk4"` with n_modes = the 2 layers: Legendre controls through the layers.
    Solved by Lie at one step per layer they are the network (to round-off); RK4 at
    `dt` = 1 solves the continuum limit of that interpolant, another function."""
    smooth = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scheme="rk4"))
    run = Run(smooth)
    model, _ = run.init_state()
    assert isinstance(model.equation.controls, itde.LegendreControls)
    assert model.equation.controls.n_modes == 2
    network, _ = Run(cfg).init_state()
    x = jnp.asarray(run.batch(0)[0])
    want = np.asarray(PREDICT(network, x))
    np.testing.assert_allclose(PREDICT(with_depth(model, "lie", 1.0), x), want, **TOL)
    # a smooth model has no layers to write back
    from itde.train import lm_from_token_model
    from itde.train._internal import HFInit

    with pytest.raises(ValueError, match="smooth in depth"):
        lm_from_token_model(model, HFInit(gpt2_dir).lm())


def test_a_changed_directory_is_refused_on_resume(cfg, gpt2_dir, tmp_path):
    """The checkpoint records the SHA-256 of the directory's files."""
    from itde.train._internal import _checkpoint as ckpt

    copy = tmp_path / "model"
    shutil.copytree(gpt2_dir, copy)
    c = from_dict(TrainExperiment, _table(copy, tmp_path / "cache"))
    run = Run(c)
    ckpt.save(tmp_path / "run", 10, run.init_state(), run.meta())
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    with pytest.raises(CheckpointError, match="have changed since"):
        train(resume=tmp_path / "run")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"model": {"n_layers": 4}}, "`model.n_layers`=4 is set, but with `model.init`"),
        ({"model": {"init": "gpt2"}}, "`model.init`='gpt2' must be 'hf:DIR'"),
        ({"task": {"tokenizer": "char"}}, "`task.tokenizer`='char': `model.init`="),
        ({"model": {"n_modes": 2}}, "`model.n_modes` applies to continuous-depth schemes"),
        ({"model": {"dt": 2.0}}, "`model.dt`=2.0 is longer than one layer"),
    ],
)
def test_bad_finetune_configs_are_refused(gpt2_dir, tmp_path, change, said):
    table = _table(gpt2_dir, tmp_path)
    for section, values in change.items():
        table[section] = {**table[section], **values}
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        from_dict(TrainExperiment, table)


def test_a_directory_without_tokenizer_or_weights_is_named(gpt2_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(gpt2_dir, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"`task.tokenizer`='hf:.*tokenizer.json' does not exist"):
        Run(from_dict(TrainExperiment, _table(bare, tmp_path / "cache")))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(gpt2_dir / "tokenizer.json", empty)
    with pytest.raises(ValueError, match=r"`model.init`='hf:.*' holds no config.json"):
        Run(from_dict(TrainExperiment, _table(empty, tmp_path / "cache")))


@pytest.mark.parametrize(
    ("model", "said"),
    [
        (None, "the run was trained from scratch (`model.init` is empty)"),
        ({"scheme": "rk4"}, "the model has controls smooth in depth (scheme 'rk4')"),
        ({"dt": 0.5}, "the model was trained with `model.dt`=0.5: each layer split into 2"),
    ],
)
def test_export_hf_dir_refuses_a_run_it_cannot_write_back(gpt2_dir, tmp_path, model, said):
    """`export_hf_dir` says why a run's model has no Hugging Face class to be written into,
    naming the run's directory, before it reads the source model (the same decision that
    keeps a completed run from writing OUT/hf: `export_refusal`)."""
    from itde.train._internal import _checkpoint as ckpt

    if model is None:  # from scratch: a tiny sort model
        table = {"model": {"n_layers": 1, "n_features": 4, "n_heads": 1, "n_hidden": 4},
                 "optim": {"batch_size": 2}}  # fmt: skip
    else:
        table = _table(gpt2_dir, tmp_path / "cache", **model)
    run = Run(from_dict(TrainExperiment, table))
    directory = tmp_path / "run"
    ckpt.save(directory, 1, run.init_state(), run.meta())
    pattern = rf"^`directory`='.*run' holds a run that cannot be exported: {re.escape(said)}"
    with pytest.raises(ValueError, match=pattern):
        export_hf_dir(directory)
    assert not (directory / "hf").exists()


@pytest.mark.slow
def test_smooth_finetune_trains_from_the_layers(cfg, tmp_path):
    """RK4 on the Legendre controls through the layers: it trains (the loss goes down) and
    writes no OUT/hf (a smooth model has no layers to export)."""
    model = dataclasses.replace(cfg.model, scheme="rk4", dt=0.5)
    smooth = dataclasses.replace(cfg, model=model)
    result = train(smooth, out=tmp_path)
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.2, losses
    assert not (tmp_path / "hf").exists() and "eval_continuum_distance" in rows[-1]
    assert isinstance(result.model.equation.controls, itde.LegendreControls)


@pytest.mark.slow
def test_llama_starts_at_the_hugging_face_model_and_exports(tmp_path):
    """A tiny Llama (RoPE inside the attention: no position table, untied head)."""
    path = tmp_path / "llama"
    path.mkdir()
    vocab = _tokenizer(path)
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
                            max_position_embeddings=32, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    _spread(tf.LlamaForCausalLM(config)).save_pretrained(path)
    table = _table(path, tmp_path / "cache")
    table["optim"] = {**table["optim"], "steps": 2}
    c = from_dict(TrainExperiment, table)
    run = Run(c)
    model, _ = run.init_state()
    assert model.position is None and not model.tied
    x, _ = run.batch(0)
    hf = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    np.testing.assert_allclose(PREDICT(model, jnp.asarray(x)), _hf_logits(hf, x), **TOL)
    result = train(c, out=tmp_path / "run")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").eval()
    ours = PREDICT(result.model, jnp.asarray(x))
    np.testing.assert_allclose(ours, _hf_logits(back, x), **TOL)


def test_the_model_directory_is_read_without_a_deprecated_argument(gpt2_dir):
    """transformers 5 renamed `from_pretrained`'s `torch_dtype` to `dtype` and logs
    "`torch_dtype` is deprecated" on each fine-tuning run that passes it (a logged warning,
    once per process: its `warning_once` cache is emptied here, and Python warnings are
    errors). The model is read in float32."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from itde.train._internal import HFInit, _converted, _stamp

    logging.Logger.warning_once.cache_clear()  # transformers' lru_cache of said warnings
    records = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = records.append
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(catch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # not the cached one
            lm = _converted.__wrapped__(str(gpt2_dir), _stamp(HFInit(gpt2_dir)))
    finally:
        logger.removeHandler(catch)
    said = [r.getMessage() for r in records]
    assert not [m for m in said if "deprecated" in m], said
    assert {a.dtype for a in jax.tree.leaves(eqx.filter(lm, eqx.is_array))} == {np.dtype("float32")}


def test_a_run_from_a_relative_directory_loads_from_any_folder(gpt2_dir, tmp_path, monkeypatch):
    """`init = "hf:base"` relative to the working directory: the run's sidecar stores the
    directory (and its other paths) absolute, so `load` reads the run from another folder
    (it failed: "`model.init`='hf:base' is not a directory"). A sidecar written before
    held the paths as given; it still loads, from the folder it was trained in and from
    elsewhere (the folders above the run directory, the one whose files have the recorded
    SHA-256: not a changed copy of the same name in the working directory)."""
    from itde.train._internal import _checkpoint as ckpt

    home, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(gpt2_dir, home / "base")
    shutil.copytree(gpt2_dir, elsewhere / "base")  # the same name, another model
    (elsewhere / "base" / "config.json").write_text((gpt2_dir / "config.json").read_text() + "\n")
    monkeypatch.chdir(home)
    run = Run(from_dict(TrainExperiment, _table("base", "cache")))
    saved, _ = state = run.init_state()
    directory = home / "runs" / "ft"
    ckpt.save(directory, 2, state, run.meta())
    want = f"hf:{home / 'base'}"
    written = json.loads((directory / ckpt.SIDECAR).read_text())
    assert written["config"]["model"]["init"] == written["config"]["task"]["tokenizer"] == want
    monkeypatch.chdir(elsewhere)
    model, cfg, meta = load(directory)
    assert (cfg.model.init, cfg.task.tokenizer) == (want, want)
    assert cfg.task.cache_dir == str(home / "cache") and meta["init"]["path"] == str(home / "base")
    for a, b in zip(_leaves(model), _leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    # a sidecar of an earlier itde: the paths as they were given
    sidecar = directory / ckpt.SIDECAR
    meta = json.loads(sidecar.read_text())
    meta["config"]["model"]["init"] = meta["config"]["task"]["tokenizer"] = "hf:base"
    meta["config"]["task"]["cache_dir"] = "cache"
    meta["init"]["path"] = "base"
    meta["config_sha256"] = ckpt.config_digest(meta["config"])
    sidecar.write_text(json.dumps(meta))
    for folder in (home, elsewhere):
        monkeypatch.chdir(folder)
        _, cfg, _ = load(directory)
        assert (cfg.model.init, cfg.task.cache_dir) == (want, str(home / "cache")), folder
