"""Bad input on the command line and the run-time paths behind it (issue 33, section 6): one
line on stderr naming the flag or key, the value and the fix, exit status 2, no traceback.

Each case here once ended otherwise: a 40-line JAX traceback (a tokenizer whose ids exceed
the model's vocabulary; a learning rate of 1e6), a bare UTF-8 decode error (a binary
`--text`), a bare `FileExistsError` (`export_hf_dir(run, out=<a file>)`), "[Errno 20] Not a
directory" without the key (`task.cache_dir` a file), "[Errno 1] Operation not permitted"
without `--out` (an output directory under /sys or /proc, where root may not write
either)."""

import pytest

from itde.cli import main

SORT = """
[task]
name = "sort"
length = 4
vocab = 5
eval_size = 4
[model]
n_layers = 1
n_features = 8
n_heads = 2
n_hidden = 8
[optim]
steps = 4
batch_size = 4
warmup = 0
{optim}
[run]
log_every = 1
eval_every = 2
checkpoint_every = 2
"""


def _one_line(capsys) -> str:
    """stderr of the command: exactly one line (returned), no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def foreign_tokenizer_dir(tmp_path_factory):
    """A BERT directory whose tokenizer has 16 words and whose model embeds only 8 ids."""
    import torch
    import transformers as tf

    path = tmp_path_factory.mktemp("hf")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "river", "is", "a", "clock",
             "that", "nobody", "wound", "it", "keeps", "time"]  # fmt: skip
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    torch.manual_seed(0)
    for vocab in (8, 15):  # 15: the largest id (15, "time") just one past the last row
        config = tf.BertConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=12,
                               max_position_embeddings=32)  # fmt: skip
        tf.BertModel(config, add_pooling_layer=False).save_pretrained(path / f"bert{vocab}")
        tf.BertTokenizer(str(path / "vocab.txt")).save_pretrained(path / f"bert{vocab}")
    text = path / "inputs.txt"
    text.write_text("the river is a clock\nit keeps time\n")
    return path / "bert8", text


@pytest.mark.parametrize(("command", "vocab"), [("analyze", 8), ("converge", 15)])
def test_hf_tokenizer_ids_beyond_the_vocabulary(foreign_tokenizer_dir, tmp_path, capsys,
                                                command, vocab):  # fmt: skip
    directory, text = foreign_tokenizer_dir
    directory = directory.with_name(f"bert{vocab}")
    argv = [command, "--hf", str(directory), "--text", str(text), "--inputs", "2",
            "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv + (["--no-lyapunov"] if command == "analyze" else [])) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "EquinoxRuntimeError" not in err, err
    last = err.strip().splitlines()[-1]  # transformers may report its loading above
    assert last.startswith(f"itde {command}: error: `--hf`=") and str(directory) in last, last
    assert "token id 15" in last and f"embeds only {vocab} ids" in last, last
    assert "save the model's own tokenizer" in last, last


def test_binary_text_is_named_before_the_model_loads(foreign_tokenizer_dir, tmp_path, capsys):
    directory, _ = foreign_tokenizer_dir
    binary = tmp_path / "inputs.bin"
    binary.write_bytes(b"the river\n" + bytes(range(128, 256)))
    argv = ["analyze", "--hf", str(directory), "--text", str(binary), "--no-lyapunov",
            "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 2
    line = _one_line(capsys)  # said before transformers loads (and reports) anything
    assert f"`--text`={str(binary)!r} is not UTF-8 text" in line, line
    assert "byte 0x80 at offset 10" in line and "give a UTF-8 text file" in line, line


def test_export_hf_dir_into_a_file_names_out(tmp_path):
    from itde.train import export_hf_dir

    blocker = tmp_path / "model.bin"
    blocker.write_text("x")
    with pytest.raises(FileExistsError, match=r"`out` '.*model.bin' cannot be created as a "
                       r"directory \('.*model.bin' is a file\); give another path"):  # fmt: skip
        export_hf_dir(tmp_path / "run", out=blocker)  # said before the run is read


def test_export_writes_into_a_named_directory(tmp_path):
    """`export` (what `export_hf_dir` and a completed fine-tuning run call) names its `out`
    before it reads the model."""
    from itde.train._internal import export

    blocker = tmp_path / "hf"
    blocker.write_text("x")
    with pytest.raises(FileExistsError, match=r"`out/hf` '.*hf' is an existing file"):
        export(None, None, blocker, name="out/hf")


def test_cache_dir_that_is_a_file_names_the_key(tmp_path, capsys):
    blocker = tmp_path / "cache"
    blocker.write_text("x")
    for cache in (blocker, blocker / "below"):
        cfg = tmp_path / "textlm.toml"
        cfg.write_text(f'[task]\nname = "textlm"\ncontext = 8\ncache_dir = "{cache}"\n')
        assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
        line = _one_line(capsys)
        assert f"`task.cache_dir`={str(cache)!r} cannot be a directory" in line, line
        assert f"{str(blocker)!r} is a file" in line and "leave `task.cache_dir` empty" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["train", "solve", "analyze", "converge"])
@pytest.mark.parametrize("where", ["/proc/itde-out", "/sys/itde-out/run"])
def test_out_on_a_system_path_names_out(tmp_path, capsys, command, where):
    """procfs and sysfs refuse new directories even to root, for whom `os.access` says
    yes: `itde train` then failed when the run started with the OS's bare message."""
    assert main([command, "--out", where]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"itde {command}: error: `--out` {where!r} cannot be created as a "
                           "directory"), line  # fmt: skip
    assert "give another path" in line


def test_train_library_names_its_out_on_a_system_path(tmp_path):
    from itde.train import TrainExperiment, train

    with pytest.raises(PermissionError, match=r"`out` '/proc/itde-out' cannot be created"):
        train(TrainExperiment(), out="/proc/itde-out", progress=False)


def test_diverging_learning_rate_is_one_line_and_exit_2(tmp_path, capsys):
    """`lr = 1e6`: the run-time check of the solve fires asynchronously, in the step, the
    loss read or the evaluation; whichever, one line names `optim.lr`, its value and the fix
    (it was a 90-line chained traceback, exit status 1)."""
    cfg = tmp_path / "lr.toml"
    cfg.write_text(SORT.format(optim="lr = 1e6\nclip_norm = 1e9"))
    argv = ["train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith("itde train: error: training stopped at step "), line
    assert "lower `optim.lr` (now 1e+06)" in line and "the last checkpoint is kept" in line


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["analyze", "--rtol", "-1e-6"], "`--rtol`=-1e-06 must be in [1e-15, 1)"),
        (["analyze", "--rtol", "-INF"], "`--rtol`=-inf must be in [1e-15, 1)"),
        (["sample", "--checkpoint", "none", "--temperature", "-2.5E-1"],
         "`--temperature`=-0.25 must be a finite number >= 0"),
    ],
)  # fmt: skip
def test_a_negative_number_in_any_notation_reaches_the_range_check(capsys, argv, said):
    """argparse reads `-1e-6` as an option unless told otherwise ("argument --rtol:
    expected one argument"): every float Python reads is a value, so that the command's
    own check names the flag, the value and the range."""
    assert main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith(f"itde {argv[0]}: error: {said}"), line


def test_bpe_without_tokenizers_is_one_line_naming_the_package(tmp_path, capsys, monkeypatch):
    """`tokenizer = "bpe"` where Hugging Face `tokenizers` is not installed: it was a
    38-line traceback and exit status 1; the line names the package and its install."""
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` fails
    text = tmp_path / "corpus.txt"
    text.write_text("the river is a clock that nobody wound\n" * 20)
    cfg = tmp_path / "bpe.toml"
    cache = tmp_path / "cache"
    cfg.write_text(f'[task]\nname = "textlm"\ntext_path = "{text}"\ntokenizer = "bpe"\n'
                   f'vocab_size = 64\ncontext = 8\ncache_dir = "{cache}"\n')  # fmt: skip
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert line.startswith('itde train: error: `tokenizer = "bpe"` trains a byte-pair '
                           "tokenizer with Hugging Face `tokenizers`, which is not installed: "
                           "`pip install 'itde[text]'`"), line  # fmt: skip


def test_a_missing_package_is_one_line_and_a_missing_itde_module_a_traceback(monkeypatch,
                                                                            capsys):  # fmt: skip
    """Any package a command imports and does not find is one line naming it and where
    the extras are listed; a module of itde itself missing is a broken install, whose
    traceback is kept."""
    import argparse
    import sys

    from itde.cli._internal import _main as cli_main

    def command(args):
        if args.checkpoint == "itde":
            raise ModuleNotFoundError("No module named 'itde._gone'", name="itde._gone")
        import torch  # noqa: F401

    def parser():
        p = build()
        subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        subs.choices["sample"].set_defaults(func=command)
        return p

    build = cli_main.build_parser
    monkeypatch.setattr(cli_main, "build_parser", parser)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert cli_main.main(["sample", "--checkpoint", "x"]) == 2
    line = _one_line(capsys)
    assert line.startswith("itde sample: error: import of torch halted"), line
    assert "(`torch` is not installed: the README's Install section lists" in line, line
    with pytest.raises(ModuleNotFoundError, match="itde._gone"):
        cli_main.main(["sample", "--checkpoint", "itde"])
