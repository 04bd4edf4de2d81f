"""`[model] tie_embeddings = true`: the head is the token embedding (nanoGPT, GPT-2).

One parameter with two uses: its gradient is the sum of the embedding's and the head's
(checked against an untied model whose readout is set to $E^\\top$), the model has
`vocab * (width + 1)` fewer parameters (no readout, no bias), it equals a PyTorch
nanoGPT-like pre-LN GPT with a tied head (logits and the embedding's gradient), and it
trains, checkpoints, resumes and loads; an untied checkpoint still loads.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.train import ConfigError, Run, TrainExperiment, from_dict, load, loss_fn, train

TABLE = {
    "task": {"name": "charlm", "context": 8, "eval_size": 8},
    "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 16,
              "activation": "gelu", "block": "pre_norm", "final_norm": True,
              "tie_embeddings": True},
    "optim": {"steps": 6, "batch_size": 4, "warmup": 0, "lr": 1e-2},
    "run": {"log_every": 2, "eval_every": 3, "checkpoint_every": 3, "progress": False},
}  # fmt: skip


def _cfg(**model):
    return from_dict(TrainExperiment, {**TABLE, "model": {**TABLE["model"], **model}})


def _count(model):
    return sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


@pytest.fixture(scope="module")
def tied_run():
    run = Run(_cfg())
    model, _ = run.init_state()
    return run, model


GRAD = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))


@pytest.mark.slow  # two gradient compilations; by default the PyTorch test below checks
# the embedding's gradient against autograd's sum of both uses
def test_tied_gradient_is_the_sum_of_both_uses(tied_run):
    """d/dE of the tied loss = d/dE + (d/dW)^T of the untied model with W = E^T."""
    run, tied = tied_run
    assert tied.tied and tied.readout is None and tied.readout_bias is None
    untied = dataclasses.replace(tied, readout=tied.embedding.T)
    x, y = (jnp.asarray(a) for a in run.batch(0))
    loss_tied, g_tied = GRAD(tied, (x, y), run.task)
    loss_untied, g_untied = GRAD(untied, (x, y), run.task)
    np.testing.assert_allclose(loss_tied, loss_untied, rtol=1e-6)  # the same function
    want = g_untied.embedding + g_untied.readout.T
    np.testing.assert_allclose(g_tied.embedding, want, rtol=1e-5, atol=1e-7)
    # and both uses matter: neither part alone is the gradient
    for part in (g_untied.embedding, g_untied.readout.T):
        assert float(jnp.max(jnp.abs(part - g_tied.embedding))) > 1e-4


def test_tied_model_has_vocab_times_width_plus_one_fewer_parameters(tied_run):
    run, tied = tied_run
    untied, _ = Run(_cfg(tie_embeddings=False)).init_state()
    vocab, width = tied.embedding.shape
    assert _count(untied) - _count(tied) == vocab * (width + 1)
    # weight decay still covers the embedding (its role is a kernel, as before), and the
    # optimiser's decay mask has no readout to decay
    assert itde.parameter_roles(tied).embedding == "decay"
    from itde.train._internal import _decay_mask

    mask = _decay_mask(eqx.filter(tied, eqx.is_inexact_array))
    assert mask.embedding is True and mask.readout is None and mask.readout_bias is None


def test_tied_pre_ln_model_equals_a_pytorch_gpt_with_a_tied_head(tied_run):
    """nanoGPT's layout in PyTorch: wte + wpe, pre-LN blocks, ln_f, `lm_head.weight is
    wte.weight`, no bias; the loss and the gradient of the embedding (PyTorch's autograd
    sums the two uses) equal itde's to float32 round-off."""
    import torch

    run, model = tied_run
    enc = itde.to_torch(model.equation).eval()

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(*model.embedding.shape)
            self.wpe = torch.nn.Embedding(*model.position.shape)
            self.enc = enc
            self.lm_head = torch.nn.Linear(model.embedding.shape[1], model.embedding.shape[0],
                                           bias=False)  # fmt: skip
            self.lm_head.weight = self.wte.weight  # tied, as nanoGPT

        def forward(self, idx, mask):
            u0 = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            return self.lm_head(self.enc(u0, mask=mask, is_causal=True))

    net = GPT()
    with torch.no_grad():
        net.wte.weight.copy_(torch.from_numpy(np.array(model.embedding)))
        net.wpe.weight.copy_(torch.from_numpy(np.array(model.position)))
    x, y = (np.asarray(a) for a in run.batch(0))
    # itde.to_torch's encoder is bidirectional; the causal (Volterra) mask is PyTorch's
    causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    logits = net(torch.from_numpy(x.copy()).long(), causal)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y.copy()).long().reshape(-1)
    )
    loss.backward()
    ours, grad = GRAD(model, (jnp.asarray(x), jnp.asarray(y)), run.task)
    np.testing.assert_allclose(ours, loss.item(), rtol=2e-6)
    np.testing.assert_allclose(grad.embedding, net.wte.weight.grad.numpy(), rtol=1e-3, atol=1e-6)


@pytest.mark.slow  # by default test_train_finetune's GPT-2 run (a tied head) trains,
# resumes bit for bit, loads and exports; test_train_resume covers resume itself
def test_tied_model_trains_saves_resumes_and_loads(tmp_path):
    cfg = _cfg()
    whole = train(cfg, out=tmp_path / "whole")
    assert whole.complete and whole.model.tied
    part = train(cfg, out=tmp_path / "part", stop_at=3)
    assert part.step == 3
    resumed = train(resume=tmp_path / "part")
    for a, b in zip(jax.tree.leaves(resumed.model), jax.tree.leaves(whole.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model, loaded_cfg, meta = load(tmp_path / "whole")
    assert model.tied and loaded_cfg.model.tie_embeddings and meta["step"] == 6
    np.testing.assert_array_equal(model.embedding, whole.model.embedding)
    assert np.isfinite(whole.metrics["eval_nats_per_char"])


@pytest.mark.slow  # a training compilation; by default test_train_finetune's tied GPT-2
# learns, and the PyTorch test above checks the tied loss and gradient
def test_tied_model_learns():
    """The loss of a fixed batch goes down over a few steps."""
    cfg = _cfg()
    run = Run(cfg)
    model, opt_state = run.place_state(*run.init_state())
    step = run.make_step()
    batch = run.batch(0)
    losses = []
    for _ in range(8):
        model, opt_state, loss = step(model, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses


def test_untied_checkpoint_of_the_earlier_layout_still_loads(tmp_path):
    """A checkpoint whose config lacks the new keys (as an earlier itde wrote it) loads,
    untied, and may be resumed with its config given again."""
    import json

    from itde.train._internal import _checkpoint as ckpt
    from itde.train._internal import config_for_resume

    table = {**TABLE, "model": {k: v for k, v in TABLE["model"].items() if k != "tie_embeddings"}}
    cfg = from_dict(TrainExperiment, table)
    run = Run(cfg)
    meta = run.meta()
    for key in ("tie_embeddings", "init"):  # the sidecar of an earlier version
        del meta["config"]["model"][key]
    ckpt.save(tmp_path, 0, run.init_state(), meta)
    model, _, _ = load(tmp_path)
    assert not model.tied and model.readout is not None and model.readout_bias is not None
    assert config_for_resume(tmp_path, cfg, "<test>")[0] == cfg
    assert (
        "tie_embeddings"
        not in json.loads((tmp_path / "checkpoint.json").read_text())["config"]["model"]
    )


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ({"task": {"name": "burgers"}, "model": {"tie_embeddings": True}},
         "`model.tie_embeddings` = true ties the head"),
        ({"model": {"tie_embeddings": "yes"}}, "`model.tie_embeddings` must be true or false"),
    ],
)  # fmt: skip
def test_tie_embeddings_is_checked(table, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        from_dict(TrainExperiment, table)
