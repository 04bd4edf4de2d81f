"""A trained model's equation is `.equation`, as on every other itde model (issue 46): it
was `.ide` on `TokenModel` and `FieldModel`, so `equation_of` probed both names.

A checkpoint records its arrays' paths (`[0].ide.controls...`) in its sidecar; one written
before the rename (tests/fixtures/checkpoint_model_ide, by the itde of commit 733809f,
see its make.py) still loads, and gives the logits that itde computed.
"""

import json
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import itde
from itde.analysis._internal import equation_of
from itde.train import ModelConfig, load
from itde.train._internal import init_field_model, init_token_model

OLD_RUN = Path(__file__).parent / "fixtures" / "checkpoint_model_ide"
SMALL = ModelConfig(n_layers=1, n_features=4, n_heads=1, n_hidden=4)


def test_a_checkpoint_written_before_the_rename_loads_with_its_logits():
    sidecar = json.loads((OLD_RUN / "checkpoint.json").read_text())
    assert any(".ide." in path for path in sidecar["shapes"])  # the old name is recorded
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        model, cfg, meta = load(OLD_RUN)  # the model and its optimiser state, checked
        assert isinstance(model.equation, itde.TransformerIDE) and meta["step"] == 2
        logits = itde.train.predict(model, np.load(OLD_RUN / "inputs.npy"))
    np.testing.assert_allclose(logits, np.load(OLD_RUN / "logits.npy"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["TokenModel", "FieldModel"])
def test_ide_is_a_deprecated_alias_of_equation(kind):
    key = jax.random.key(0)
    if kind == "TokenModel":
        model = init_token_model(key, SMALL, vocab=5, context=4, causal=True)
    else:
        model = init_field_model(key, SMALL)
    assert type(model).__name__ == kind and isinstance(model.equation, itde.TransformerIDE)
    said = rf"`{kind}\.ide` is deprecated .*; use `{kind}\.equation`"
    with pytest.warns(DeprecationWarning, match=said):
        assert model.ide is model.equation


def test_equation_of_reads_equation_without_probing_the_old_name():
    model = init_token_model(jax.random.key(0), SMALL, vocab=5, context=4, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert equation_of(model) is model.equation
        assert equation_of(model.equation) is model.equation
    with pytest.raises(TypeError, match=r"holds one .* got str"):
        equation_of("model")
