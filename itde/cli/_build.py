"""The random model of a solve config (`itde solve`, `itde analyze --config`)."""

from __future__ import annotations

from ._solve_config import SolveExperiment


def _build_solve(cfg: SolveExperiment):
    import jax

    from .. import RULES, Grid, TransformerIDE
    from .._internal import block_from_names

    g = cfg.grid
    grid = Grid(
        RULES[g.tokens](interval=g.token_interval),
        RULES[g.features](interval=g.feature_interval),
        cfg.model.n_features,
    )
    m = cfg.model
    return TransformerIDE.init(
        jax.random.key(m.seed),
        n_layers=m.n_layers,
        n_features=m.n_features,
        n_heads=m.n_heads,
        n_hidden=m.n_hidden,
        activation=m.activation,
        eps=m.eps,
        bias=m.bias,
        causal=m.causal,
        block=block_from_names("post_norm", m.ffn_form),
        grid=grid,
    )
