"""The fine-tuning example: `configs/finetune_hf.toml` and `docs/how-to/finetune-hf.md`, run
as shipped, and `itde.interop.smollm2_dir`, which writes the installed SmolLM2 where the
config reads its model.

The page's blocks run in order, as written, in a scratch directory holding a copy of
`configs/`: its Python blocks in one namespace, its `itde` command through
`itde.cli.main`. In the default tier the page's tiny random GPT-2 is the model (the
SmolLM2 block is left out) and the shipped config runs unedited: 20 steps, then the
reloaded `transformers` model's logits are compared with the fine-tuned itde model's.
Under `-m slow` the page runs on SmolLM2 (the tiny-model block left out, the config's
steps cut to 2), and `smollm2_dir`'s directory is checked against transformers' own
GGUF loading: the same logits, bit for bit, and the same token ids.
"""

import contextlib
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

import itde
import itde.train
from itde.cli import main
from itde.train import TrainExperiment, from_dict, load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "how-to" / "finetune-hf.md"
CONFIG = ROOT / "configs" / "finetune_hf.toml"
BASE = "runs/base-model"  # where the config reads its model, from the repository's root


def _blocks() -> list[tuple[str, str]]:
    """`(language, code)` of the page's fenced blocks, in order."""
    text = PAGE.read_text(encoding="utf-8")
    return re.findall(r"^```(\w+)\n(.*?)^```", text, flags=re.M | re.S)


def _scratch(tmp_path, monkeypatch) -> Path:
    """A working directory holding a copy of `configs/`, an encoded-text cache of its own,
    and transformers kept offline."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ITDE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return tmp_path


def _run_page(model: str) -> tuple[str, dict]:
    """Run the page's Python and `itde` blocks in order; `model`: `"tiny"` runs the tiny
    GPT-2's block and leaves SmolLM2's out, `"smollm2"` the reverse. Returns what the
    Python blocks printed and their namespace."""
    printed, namespace, kinds = io.StringIO(), {}, []
    for lang, code in _blocks():
        if lang == "python":
            kind = ("smollm2" if "smollm2_dir(" in code
                    else "tiny" if "GPT2LMHeadModel" in code else "both")  # fmt: skip
            kinds.append(kind)
            if kind in (model, "both"):
                with contextlib.redirect_stdout(printed):
                    exec(compile(code, PAGE.name, "exec"), namespace)
        elif lang == "bash":
            for line in code.splitlines():
                assert line.startswith("itde "), line
                assert main(shlex.split(line)[1:]) == 0, line
    assert kinds.count("smollm2") == 1 and kinds.count("tiny") == 1, kinds
    return printed.getvalue(), namespace


def _checked(out: str, page: dict) -> dict[str, float]:
    """The page's printed comparisons, by label, checked against the models read here
    (not by the page's code): transformers' logits of the written directory, the itde
    model of the run's checkpoint, and the model before fine-tuning."""
    import jax.numpy as jnp
    import torch
    import transformers as tf

    labels = {"itde vs transformers:": "ours", "fine-tuned vs before:": "change",
              "export vs OUT/hf:": "export", "step": "step"}  # fmt: skip
    found = {}
    for label, key in labels.items():
        m = re.search(re.escape(label) + r" ([0-9.e+-]+)", out)
        assert m, (label, out)
        found[key] = float(m.group(1))
    ids = torch.tensor([page["ids"]])
    with torch.no_grad():
        hf = tf.AutoModelForCausalLM.from_pretrained("runs/finetune_hf/hf").eval()
        theirs = hf(ids).logits[0].numpy()
        start = tf.AutoModelForCausalLM.from_pretrained(BASE).eval()(ids).logits[0].numpy()
    model, _, meta = itde.train.load("runs/finetune_hf")
    ours = np.asarray(itde.train.predict(model, jnp.asarray(ids.numpy())))[0]
    assert found["step"] == meta["step"]
    assert found["ours"] == pytest.approx(float(np.abs(ours - theirs).max()), rel=1e-5, abs=1e-12)
    assert found["change"] == pytest.approx(float(np.abs(theirs - start).max()), rel=1e-5)
    return found


def test_the_shipped_config_reads_the_base_model_directory():
    cfg = load_config(TrainExperiment, CONFIG)
    assert from_dict(TrainExperiment, to_dict(cfg)) == cfg  # the sidecar round trip
    m, t = cfg.model, cfg.task
    assert t.name == "textlm" and t.tokenizer == m.init
    # the `hf:` path is read from the config's folder: the repository's runs/base-model
    assert m.init_dir.resolve() == (ROOT / BASE).resolve()
    # the architecture is the model's, and a completed run writes OUT/hf (per layer, dt 1)
    assert (m.scheme, m.dt, m.n_layers, m.n_features) == ("lie", 1.0, None, None)
    # the page's excerpt of the config is the config's own lines
    excerpt = next(code for lang, code in _blocks() if lang == "toml")
    shipped = CONFIG.read_text().splitlines()
    assert all(line in shipped for line in excerpt.splitlines()), excerpt


def test_the_shipped_config_without_its_model_names_the_key_and_the_fix(
    tmp_path, monkeypatch, capsys
):
    _scratch(tmp_path, monkeypatch)
    assert main(["train", "--config", "configs/finetune_hf.toml", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"`(model\.init|task\.tokenizer)`='hf:configs/\.\./runs/base-model", err), err
    assert "save" in err and "save_pretrained" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs" / "finetune_hf" / "checkpoint.json").exists()


@pytest.mark.runs("train textlm")
def test_the_how_to_fine_tunes_a_tiny_gpt2_with_the_shipped_config(tmp_path, monkeypatch):
    """The page as written on its tiny GPT-2, with the shipped config unedited: the
    reloaded transformers model is the fine-tuned itde model, to float32 round-off, and
    the fine-tuning moved it."""
    _scratch(tmp_path, monkeypatch)
    out, page = _run_page("tiny")
    got = _checked(out, page)
    steps = load_config(TrainExperiment, CONFIG).optim.steps
    assert got["step"] == steps == 20
    assert got["ours"] < 1e-5, out  # float32 round-off of a 2-layer width-32 network
    assert got["change"] > 1e3 * max(got["ours"], 1e-9), out  # the run changed the model
    assert 0.03 < got["change"] < 0.12, out  # the page says "about 0.06"
    assert got["export"] == 0.0, out  # export_hf_dir writes the same weights as OUT/hf
    rows = [json.loads(r) for r in Path("runs/finetune_hf/metrics.jsonl").read_text().split("\n")
            if r]  # fmt: skip
    assert [r["step"] for r in rows if "eval_nats_per_token" in r] == [5, 10, 15, 20]
    # the written directory is the source class with the base model's tokenizer files
    written = Path("runs/finetune_hf/hf")
    assert json.loads((written / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert (written / "tokenizer.json").read_bytes() == Path(BASE, "tokenizer.json").read_bytes()


# ----------------------------------------------------------------------- smollm2_dir
def test_smollm2_dir_refuses_a_file_and_a_foreign_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"`out`='.*file' is a file; give a new or empty"):
        itde.interop.smollm2_dir(tmp_path / "file")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds files that are not SmolLM2 written by"):
        itde.interop.smollm2_dir(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["config.json"]  # left as it was


def test_smollm2_dir_returns_a_written_directory_unread_and_names_a_missing_gguf(
    tmp_path, monkeypatch
):
    """A directory whose record names the installed GGUF file is returned as it is (with
    `gguf` hidden, any attempt to read the GGUF would raise); an empty one needs `gguf`,
    and its absence names the `models` extra."""
    from itde.interop._internal import _pretrained

    find = _pretrained.importlib.util.find_spec
    monkeypatch.setattr(_pretrained.importlib.util, "find_spec",
                        lambda name: None if name == "gguf" else find(name))  # fmt: skip
    gguf = itde.interop.smollm2_gguf()
    done = tmp_path / "done"
    done.mkdir()
    (done / "itde_source.json").write_text(
        json.dumps({"gguf": gguf.name, "bytes": gguf.stat().st_size})
    )
    assert itde.interop.smollm2_dir(done) == done
    # a record of another file is not this model
    (done / "itde_source.json").write_text(json.dumps({"gguf": gguf.name, "bytes": 1}))
    with pytest.raises(ValueError, match="not SmolLM2 written by smollm2_dir"):
        itde.interop.smollm2_dir(done)
    with pytest.raises(ImportError, match=r"`gguf` package.*pip install 'itde\[models\]'"):
        itde.interop.smollm2_dir(tmp_path / "new")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.runs("train textlm")
def test_the_how_to_fine_tunes_smollm2(tmp_path, monkeypatch):
    """The page on SmolLM2 written by `smollm2_dir` (the config's steps cut to 2, its
    batch to 2 windows). The directory is transformers' GGUF loading of the same file: the
    same logits bit for bit, the same token ids from its tokenizer.json as from the GGUF's
    tokenizer; the fine-tuned model reloads with the itde model's logits."""
    import torch
    import transformers as tf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from itde.data import HFTokenizer

    _scratch(tmp_path, monkeypatch)
    cfg = Path("configs/finetune_hf.toml")
    text = cfg.read_text()
    for key, value in {"steps": 2, "warmup": 0, "batch_size": 2, "eval_size": 2,
                       "eval_every": 2, "checkpoint_every": 2, "log_every": 1}.items():  # fmt: skip
        text, n = re.subn(rf"^{key} = \d+", f"{key} = {value}", text, flags=re.M)
        assert n == 1, key
    cfg.write_text(text)
    out, page = _run_page("smollm2")
    got = _checked(out, page)
    assert got["step"] == 2 and got["export"] == 0.0, out
    # float32 round-off through 30 layers (measured 6e-5 on logits of ~20 after 40 steps)
    scale = float(np.abs(page["theirs"]).max())
    assert got["ours"] < 1e-5 * scale and got["change"] > 1e3 * got["ours"], (out, scale)

    gguf = itde.interop.smollm2_gguf()
    config = tf.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    reference = tf.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=reference)
    reference.load_state_dict(tensors["tensors"], strict=False)
    written = tf.AutoModelForCausalLM.from_pretrained(BASE).eval()
    paragraph = "The river rose slowly through the night, and by morning the low fields lay wet."
    tokenizer = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = tokenizer(paragraph)["input_ids"]
    assert tf.AutoTokenizer.from_pretrained(BASE)(paragraph)["input_ids"] == ids
    assert HFTokenizer.from_dir(BASE).encode(paragraph).tolist() == ids  # what `itde train` reads
    with torch.no_grad():
        want = reference.eval()(torch.tensor([ids])).logits.numpy()
        have = written(torch.tensor([ids])).logits.numpy()
    np.testing.assert_array_equal(have, want)
    assert written.model.embed_tokens.weight.dtype == torch.float32


def test_the_page_says_to_write_the_base_model_with_one_block():
    """Two blocks write `runs/base-model` (SmolLM2, the tiny GPT-2): the page says, before
    the first, to run one of them."""
    text = PAGE.read_text(encoding="utf-8")
    writes = (f'smollm2_dir("{BASE}")', f'save_pretrained("{BASE}")')
    writers = [code for lang, code in _blocks() if any(w in code for w in writes)]
    assert len(writers) == 2
    before = text[: text.index(writers[0])].split("## 1. The model directory")[1]
    assert "run **one** of the two blocks below, not both" in " ".join(before.split()), before
