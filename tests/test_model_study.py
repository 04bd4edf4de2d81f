"""The depth study of a given model (`itde.studies.model_depth_study`, `itde converge
--checkpoint / --hf`): observed orders on a converted network, the network's distance to
its limit, and the command line on a Hugging Face directory, which `itde analyze --hf`
reads too (on a trained checkpoint: test_commands.py, after its textlm run)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import itde
from itde.cli import main
from itde.studies import format_model_study, model_depth_study


def _encoder(layers=2, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        8, 2, 12, dropout=0.0, activation="gelu", batch_first=True, dtype=torch.float64
    )
    enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc


def test_study_of_a_converted_network():
    enc = _encoder()
    m = itde.from_torch(enc)
    u0 = jax.random.normal(jax.random.key(0), (3, 5, 8), jnp.float64)
    mask = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], bool)
    r = model_depth_study(m, u0, mask=mask, steps=(2, 4, 8, 16), keep_outputs=True, progress=False)
    orders = {row["scheme"]: row["observed_order"] for row in r["results"]}
    assert 0.85 < orders["lie"] < 1.2 and orders["strang"] > 1.8 and orders["rk4"] > 3.6, orders
    assert r["model"]["continuum_form"] and r["reference"]["self_error"] < 1e-9
    assert r["reference"]["dt"] == pytest.approx(1 / 16 / 4)  # 4x finer than the finest
    # the network's output is the source network's, and its distance to the limit is the
    # distance of that output from the reference limit
    net, limit = r["outputs"]["network"], r["outputs"]["limit"]
    with torch.no_grad():
        y = enc(torch.as_tensor(np.array(u0)), src_key_padding_mask=~torch.as_tensor(
            np.array(mask)))  # fmt: skip
    y = np.where(np.asarray(mask)[..., None], y.numpy(), 0.0)
    assert np.max(np.abs(net - y)) < 1e-12
    d = np.linalg.norm(net - limit) / np.linalg.norm(limit)
    assert r["network"]["distance_to_limit"] == pytest.approx(d, rel=1e-12)
    text = format_model_study(r)
    assert "from the continuum limit" in text and "rk4" in text
    json.dumps({k: v for k, v in r.items() if k != "outputs"})  # JSON-ready


def test_study_refuses_bad_arguments():
    m = itde.from_torch(_encoder(layers=1))
    u0 = jnp.zeros((2, 3, 8))
    with pytest.raises(ValueError, match="batch of initial states"):
        model_depth_study(m, u0[0], progress=False)
    with pytest.raises(ValueError, match="not known"):
        model_depth_study(m, u0, schemes=("rk5",), progress=False)
    with pytest.raises(ValueError, match="at least two"):
        model_depth_study(m, u0, steps=(4,), progress=False)
    with pytest.raises(ValueError, match="must be positive integers"):
        model_depth_study(m, u0, steps=(0, 2), progress=False)
    for bad in (0, 1, 2.5):
        with pytest.raises(ValueError, match=r"`reference_refinement`=.* must be an integer >= 2"):
            model_depth_study(m, u0, reference_refinement=bad, progress=False)
    for bad in (1, 6, 2.0):
        with pytest.raises(ValueError, match=r"`asymptotic`=.* must be None .* from 2 to the 5"):
            model_depth_study(m, u0, asymptotic=bad, progress=False)
    with pytest.raises(TypeError, match="TransformerIDE"):
        model_depth_study(object(), u0, progress=False)


def _hf_dir(tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "river", "is", "a", "clock",
             "that", "nobody", "wound", "it", "keeps", "time"]  # fmt: skip
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = tf.BertTokenizer(str(tmp_path / "vocab.txt"))
    config = tf.BertConfig(
        vocab_size=len(words), hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=12, max_position_embeddings=32, hidden_act="gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "bert")
    tok.save_pretrained(tmp_path / "bert")
    text = tmp_path / "inputs.txt"
    text.write_text("the river is a clock\nit keeps time\nthat nobody wound\n")
    return tmp_path / "bert", text


@pytest.mark.runs("converge --hf", "analyze --hf")
def test_cli_studies_and_analyzes_a_hugging_face_directory(tmp_path, capsys):
    """`converge --hf` and `analyze --hf` of one directory (one conversion's programs for
    both). `analyze --hf` reads the converted network itself (not its continuum form): the
    spectra are those of the checkpoint's own query and key weights."""
    from transformers import BertModel

    directory, text = _hf_dir(tmp_path)
    out = tmp_path / "study"
    argv = ["converge", "--hf", str(directory), "--text", str(text), "--inputs", "3",
            "--steps", "1", "2", "4", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "BertModel" in capsys.readouterr().out
    r = json.loads((out / "convergence_model.json").read_text())
    assert r["model"]["block"] == "PostNorm" and r["model"]["n_features"] == 8
    assert r["results"][0]["errors"][0] == pytest.approx(r["network"]["distance_to_limit"])
    assert main(["converge", "--hf", str(tmp_path), "--out", str(out)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main([*argv[:5], "--inputs", "9", "--out", str(out)]) == 2
    assert "fewer than `--inputs`=9" in capsys.readouterr().err

    out = tmp_path / "an"
    argv = ["analyze", "--hf", str(directory), "--text", str(text), "--inputs", "3",
            "--no-lyapunov", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "BertModel" in capsys.readouterr().out
    r = json.loads((out / "analysis.json").read_text())
    assert r["inputs"] == 3 and r["heads"] == 2 and r["depths"] == [0.0, 1.0, 2.0]
    bert = BertModel.from_pretrained(directory)
    for n, layer in enumerate(bert.encoder.layer):
        wq = layer.attention.self.query.weight.detach().double().numpy()  # [out, in]
        wk = layer.attention.self.key.weight.detach().double().numpy()
        for h in range(2):
            rows = slice(4 * h, 4 * h + 4)
            qk = wq[rows].T @ wk[rows]  # W^Q_h W^K_h^T, features x features
            assert r["spectra"]["qk_max_abs_eigenvalue"][n][h] == pytest.approx(
                np.abs(np.linalg.eigvals(qk)).max(), rel=1e-9
            )
