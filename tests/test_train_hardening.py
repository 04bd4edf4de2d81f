"""Bad numbers, bad paths and damaged files given to `itde train / eval / sample`: each is an
error that names the flag or file and the fix (exit status 2), never a silent wrong run.
One tiny charlm run (trained once for the module) serves most checks."""

import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from itde.cli import main
from itde.train import (
    TASKS,
    CheckpointError,
    TrainExperiment,
    from_dict,
    read_checkpoint_meta,
    train,
)

TEXT = "the quick brown fox jumps over the lazy dog. " * 6

CHARLM_TOML = """
[task]
name = "charlm"
text_path = "{text}"
context = 8
eval_size = 4
[model]
n_layers = 1
n_features = 8
n_heads = 2
n_hidden = 8
[optim]
steps = 2
batch_size = 4
warmup = 0
[run]
log_every = 1
eval_every = 2
checkpoint_every = 2
"""

TINY_CHARLM = {
    "task": {"name": "charlm", "context": 8, "eval_size": 4},
    "model": {"n_layers": 1, "n_features": 8, "n_heads": 2, "n_hidden": 8},
    "optim": {"steps": 2, "batch_size": 4, "warmup": 0},
    "run": {"log_every": 1, "eval_every": 2, "checkpoint_every": 2, "progress": False},
}


@pytest.fixture(scope="module")
def charlm(tmp_path_factory):
    """A finished 2-step charlm run of `itde train` on a text file of its own; returns (out
    dir, text path, the final held-out nats/char)."""
    root = tmp_path_factory.mktemp("charlm")
    text = root / "corpus.txt"
    text.write_text(TEXT)
    cfg = root / "charlm.toml"
    cfg.write_text(CHARLM_TOML.format(text=text))
    out = root / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return out, text, rows[-1]["eval_nats_per_char"]


@pytest.mark.runs("train charlm")
def test_charlm_run_writes_metrics_plot_and_checkpoint(charlm):
    out, _, _ = charlm
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"loss", "lr", "wall_s", "eval_nats_per_char", "eval_bits_per_char"} <= set(rows[-1])
    assert 0 < rows[-1]["eval_nats_per_char"] < 10
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    meta = read_checkpoint_meta(out)
    assert meta["step"] == 2 and meta["format"] == 2
    assert meta["task"]["itos"] == sorted(set(TEXT)) and TEXT.endswith(meta["task"]["val_text"])


@pytest.mark.runs("eval", "sample")
def test_eval_and_sample_of_the_run(charlm, capsys):
    out, _, trained = charlm
    assert main(["eval", "--checkpoint", str(out)]) == 0
    said = capsys.readouterr()
    row = json.loads(said.out)
    assert row["eval_nats_per_char"] == pytest.approx(trained)
    assert row["step"] == 2 and row["examples"] == 4
    # stderr says what the command is doing while it loads and compiles, each stage timed
    _stages(said.err, "eval", f"loading {out}", "compiling, then evaluating 4 held-out examples")
    sample = ["sample", "--checkpoint", str(out), "--prompt", "the ", "--length", "12"]
    assert main(sample) == 0
    said = capsys.readouterr()
    text = said.out.rstrip("\n")
    assert text.startswith("the ") and len(text) == 4 + 12
    _stages(said.err, "sample", f"loading {out}",
            "compiling the sampler, then drawing the first token")  # fmt: skip
    assert main([*sample, "--no-progress"]) == 0
    said = capsys.readouterr()
    assert said.out.rstrip("\n") == text and said.err == ""
    _fail(capsys, ["sample", "--checkpoint", str(out), "--prompt", "\u00e9"], "vocabulary")
    # a per-layer (Transformer-regime) model cannot be integrated by a continuum scheme
    _fail(capsys, ["eval", "--checkpoint", str(out), "--scheme", "rk4"], "scheme 'lie'")


def _stages(err: str, command: str, *stages: str) -> None:
    """`err` is, line by line, each stage's start (`itde COMMAND: stage ...`) and end
    (`itde COMMAND: stage took 1.2 s`), in order, and nothing else."""
    want = [f"itde {command}: {what}{end}" for what in stages for end in (" ...", " took")]
    lines = err.splitlines()
    assert len(lines) == len(want), err
    for line, start in zip(lines, want, strict=True):
        assert line.startswith(start), err


def _fail(capsys, argv, *needles):
    """Run the CLI, expect exit status 2 and every needle in the one-line error."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------ numbers out of range
@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**63 - 1)])
def test_sample_seed_out_of_range(charlm, capsys, seed):
    out, _, _ = charlm
    _fail(capsys, ["sample", "--checkpoint", str(out), "--seed", seed], "`--seed`", "4294967295")


def test_sample_largest_seed_is_honoured(charlm, capsys):
    out, _, _ = charlm
    texts = []
    for seed in ("0", str(2**32 - 1)):
        argv = ["sample", "--checkpoint", str(out), "--seed", seed, "--length", "12"]
        assert main(argv) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] != texts[1]  # not truncated to the same 32 bits


@pytest.mark.parametrize("size", ["-5", "0"])
def test_eval_size_out_of_range(charlm, capsys, size):
    out, _, _ = charlm
    _fail(capsys, ["eval", "--checkpoint", str(out), "--size", size], "`--size`", "positive")


@pytest.mark.parametrize("dt", ["2", "1e6", "0", "-0.5", "nan", "inf"])
def test_eval_dt_out_of_range(charlm, capsys, dt):
    out, _, _ = charlm
    _fail(capsys, ["eval", "--checkpoint", str(out), "--dt", dt], "`--dt`")


def test_eval_dt_within_a_layer_is_honoured(charlm, capsys):
    out, _, trained = charlm
    rows = {}
    for dt in ("1", "0.5"):
        assert main(["eval", "--checkpoint", str(out), "--dt", dt]) == 0
        res = capsys.readouterr()
        rows[dt] = json.loads(res.out)
        # a per-layer model at another step is another network: said on stderr, once
        warned = "per-layer model" in res.err and "different network" in res.err
        assert warned == (dt == "0.5"), res.err
    assert rows["1"]["eval_nats_per_char"] == pytest.approx(trained, rel=1e-6)
    assert rows["0.5"]["dt"] == 0.5
    assert rows["0.5"]["eval_nats_per_char"] != rows["1"]["eval_nats_per_char"]


def test_grid_on_a_token_task_is_refused(charlm, capsys):
    out, _, _ = charlm
    _fail(capsys, ["eval", "--checkpoint", str(out), "--grid", "16"], "`--grid`", "burgers")


def test_sample_length_negative(charlm, capsys):
    out, _, _ = charlm
    _fail(capsys, ["sample", "--checkpoint", str(out), "--length", "-1"], "`--length`")


# ------------------------------------------------------------------ paths of the wrong kind
def test_checkpoint_that_is_a_file_or_not_a_run(charlm, tmp_path, capsys):
    out, _, _ = charlm
    err = _fail(capsys, ["eval", "--checkpoint", str(out / "checkpoint.json")], "is a file")
    assert "does not exist" not in err
    _fail(capsys, ["sample", "--checkpoint", str(tmp_path)], "holds no checkpoint")
    _fail(capsys, ["eval", "--checkpoint", str(tmp_path / "nowhere")], "does not exist")


def test_out_that_is_a_file_is_refused_before_set_up(tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    _fail(capsys, ["train", "--out", str(target)], "`--out`", "existing file")
    assert target.read_text() == "keep me"


# ------------------------------------------------------------------ damaged checkpoints
def test_sidecar_with_an_edited_step_is_refused(charlm, tmp_path, capsys):
    out, _, _ = charlm
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta = json.loads((bad / "checkpoint.json").read_text())
    assert meta["step"] == 2
    meta["step"] = 1
    (bad / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"holds step 2 but checkpoint\.json says step 1"):
        train(resume=bad)
    _fail(capsys, ["eval", "--checkpoint", str(bad)], "step 2", "step 1")


def test_old_checkpoint_format_is_refused_with_what_to_do(charlm, tmp_path):
    out, _, _ = charlm
    old = tmp_path / "old"
    shutil.copytree(out, old)
    meta = json.loads((old / "checkpoint.json").read_text())
    meta["format"] = 1
    (old / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"format-1 checkpoint .* reads format 2.*train"):
        read_checkpoint_meta(old)


def test_torn_metrics_tail_does_not_block_resume(charlm, tmp_path):
    out, _, _ = charlm
    run = tmp_path / "run"
    shutil.copytree(out, run)
    path = run / "metrics.jsonl"
    complete = path.read_text().splitlines()
    assert [json.loads(r)["step"] for r in complete] == [1, 2]
    torn = path.read_text() + '{"step": 3, "loss": 0.5'  # killed mid-append
    path.write_text(torn)
    done = train(resume=run)  # the run was complete: nothing left to do, nothing written
    assert (done.step, done.complete, done.files) == (2, True, [])
    assert done.metrics == json.loads(complete[-1])  # every complete row, not the torn one
    assert path.read_text() == torn
    # (a resume that trains rewrites the file without the torn line: test_train_resume.py)
    # damage before the last line is not a torn tail: an error naming the line
    path.write_text("{oops\n" + path.read_text())
    with pytest.raises(ValueError, match=r"metrics\.jsonl' line 1 is damaged"):
        train(resume=run)


# ------------------------------------------------------------------ charlm without its corpus
@pytest.mark.runs("train --resume")
def test_resume_of_a_finished_run_says_so_and_writes_nothing(charlm, tmp_path, capsys):
    out, _, _ = charlm
    run = tmp_path / "run"
    shutil.copytree(out, run)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.iterdir()}
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "already complete at step 2" in said and "nothing written" in said, said
    assert f"the config of {run / 'checkpoint.json'}" in said  # not "<built-in default>"
    assert "wrote" not in said and "{}" not in said
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.iterdir()}
    assert after == before


def test_eval_and_sample_need_no_corpus(charlm, tmp_path, capsys):
    out, text, trained = charlm
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    original = text.read_text()
    try:
        text.write_text("an edited text with other characters: XYZ!")
        assert main(["eval", "--checkpoint", str(moved)]) == 0
        row = json.loads(capsys.readouterr().out)
        assert row["eval_nats_per_char"] == pytest.approx(trained, rel=1e-6)
        text.unlink()
        argv = ["sample", "--checkpoint", str(moved), "--prompt", "the ", "--length", "12"]
        assert main(argv) == 0
        printed = capsys.readouterr().out
        assert printed.startswith("the ") and len(printed.rstrip("\n")) == 4 + 12
        # resuming (training) does need the text, and says so
        with pytest.raises(FileNotFoundError, match="No text file at"):
            train(resume=moved)
    finally:
        text.write_text(original)


# ------------------------------------------------------------------ sampling
@eqx.filter_jit
def _next(model, window, last, key, temperature):
    logits = model(window)[last].astype(jnp.float32)
    drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits))


def _reference_sample(model, itos, prompt, length, temperature, seed):
    """The former generator: one jitted call and one host round trip per character."""
    stoi = {c: i for i, c in enumerate(itos)}
    ids = [stoi[c] for c in prompt]
    context = model.position.shape[0]
    key = jax.random.key(seed)
    for i in range(length):
        window = ids[-context:]
        padded = np.zeros((context,), np.int32)
        padded[: len(window)] = window
        # the position as an array: one compile of `_next`, not one per window length
        ids.append(int(_next(model, jnp.asarray(padded), jnp.int32(len(window) - 1),
                           jax.random.fold_in(key, i), jnp.float32(temperature))))  # fmt: skip
    return "".join(itos[i] for i in ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_sampler_equals_per_character_loop(temperature):
    """Equal, character for character, to the per-character loop, past the point where the
    window slides (prompt 3 + 20 characters > context 8), in chunks of 7."""
    from itde.train import sample_stream

    cfg = from_dict(TrainExperiment, TINY_CHARLM)
    task = TASKS["charlm"](cfg.task)
    model = task.init_model(cfg.model, jax.random.key(3), dtype=jnp.float32)
    itos = task.itos
    ref = _reference_sample(model, itos, "the", 20, temperature, 5)
    pieces = list(sample_stream(model, itos, "the", 20, temperature=temperature, seed=5, chunk=7))
    assert [len(p) for p in pieces] == [7, 7, 6]
    assert "the" + "".join(pieces) == ref


def test_interrupted_sample_keeps_what_was_printed(charlm, capsys, monkeypatch):
    import itde.train

    def interrupted(*args, **kwargs):
        yield "abc"
        yield "def"
        raise KeyboardInterrupt

    monkeypatch.setattr(itde.train, "sample_stream", interrupted)
    out, _, _ = charlm
    assert main(["sample", "--checkpoint", str(out), "--prompt", "the "]) == 130
    captured = capsys.readouterr()
    assert captured.out.startswith("the abcdef")
    # after the stage lines (loading, compiling), one line and no traceback
    *stages, last = captured.err.splitlines()
    assert last == "itde sample: error: interrupted after 6 characters"
    _stages("\n".join(stages), "sample", f"loading {out}",
            "compiling the sampler, then drawing the first token")  # fmt: skip


# ------------------------------------------------------------------ bfloat16
@pytest.mark.slow  # the default-suite budget; same property at small size: see note
def test_bfloat16_training_step_agrees_with_float32():
    """One training step from the same parameters and batch, in bfloat16 and in float32.

    bfloat16 keeps 8 significant bits (unit round-off $u = 2^{-8} \\approx 3.9 \\cdot
    10^{-3}$). The loss is a mean of O(1) terms each computed through ~10 rounded
    operations (embedding, attention, LayerNorm, feed-forward, readout), so we bound its
    relative difference by $8u \\approx 0.03$ and the gradient's relative $L^2$ difference
    by 0.1 (back-propagation through softmax and the LayerNorm projection loses about one
    more digit). After AdamW's first step, whose update is $lr \\cdot g / (|g| + \\epsilon)$
    elementwise, parameters move by at most `lr` in either dtype, so they differ by at most
    $2\\,lr$ (master parameters and optimiser state stay float32)."""
    from itde.train import Run, loss_fn

    table = {
        "task": {"name": "sort", "length": 4, "vocab": 5},
        "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 16},
        "optim": {"steps": 2, "batch_size": 8, "warmup": 0, "lr": 1e-2},
    }
    run = Run(from_dict(TrainExperiment, table))
    model, opt = run.init_state()
    batch = run.batch(0)
    grads = {}
    losses = {}
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    for name, dtype in (("f32", None), ("bf16", jnp.bfloat16)):
        loss, g = value_and_grad(model, batch, run.task, dtype)
        losses[name], grads[name] = float(loss), g
    assert abs(losses["bf16"] - losses["f32"]) <= 0.03 * abs(losses["f32"])
    g32 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads["f32"])])
    g16 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads["bf16"])])
    assert g16.dtype == np.float32  # gradients of the float32 master parameters
    rel = np.linalg.norm(g16 - g32) / np.linalg.norm(g32)
    assert 0 < rel <= 0.1, rel
    lr = table["optim"]["lr"]
    params = eqx.filter(model, eqx.is_inexact_array)
    new = {}
    for name in ("f32", "bf16"):  # the update of `make_step`, applied to each gradient
        updates, _ = run.optimizer.update(grads[name], opt, params)
        new[name] = eqx.apply_updates(model, updates)
    for a, b, p0 in zip(*(jax.tree.leaves(eqx.filter(t, eqx.is_inexact_array))
                          for t in (new["f32"], new["bf16"], model)), strict=True):  # fmt: skip
        assert a.dtype == b.dtype == p0.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(a - b))) <= 2 * lr * (1 + 1e-3)


def test_diverged_training_names_the_learning_rate(tmp_path):
    """`lr = 1e6` used to blame the data ("check the embedding or the data") when the
    parameters went non-finite: the run now says they diverged and names `optim.lr`."""
    table = {
        "task": {"name": "sort", "length": 5, "vocab": 6, "eval_size": 16},
        "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 16},
        "optim": {"steps": 30, "batch_size": 8, "warmup": 0, "lr": 1e6, "clip_norm": 1e9},
        "run": {"log_every": 1, "eval_every": 30, "checkpoint_every": 30, "progress": False},
    }
    with pytest.raises(FloatingPointError, match=r"training stopped at step \d+.*last logged "
                       r"loss.*diverged: lower `optim.lr` \(now 1e\+06\)"):  # fmt: skip
        train(from_dict(TrainExperiment, table), out=tmp_path / "run")


def test_on_eval_that_is_not_a_function_is_named_before_training(tmp_path):
    with pytest.raises(TypeError, match=r"`on_eval`='print' must be a function of one metrics"):
        train(from_dict(TrainExperiment, {}), out=tmp_path / "run", on_eval="print")
    assert not (tmp_path / "run").exists()
