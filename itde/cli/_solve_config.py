"""The config of `itde solve` (and of `itde analyze --config`): its `[model]`, `[grid]` and
`[solve]` tables as frozen dataclasses, read by `itde._config`'s TOML loader, which names
the key and the file of a mistake. Beside the command that reads it; no JAX at import."""

from __future__ import annotations

import dataclasses
import math

from .. import ConfigError
from .._internal import choices, positive, seed


@dataclasses.dataclass(frozen=True)
class RandomModelConfig:
    """A model with random discrete per-layer controls (the `[model]` table)."""

    n_layers: int = 6
    n_features: int = 32
    n_heads: int = 4
    n_hidden: int = 64
    activation: str = "relu"  # a name of itde.ACTIVATIONS
    eps: float = 0.0
    bias: bool = True
    causal: bool = False
    ffn_form: str = "residual"  # "residual" or "relaxation" (itde.FFN_FORMS)
    seed: int = 0
    # eps = 0 is the paper's exact projection; with eps > 0 the variance residual printed
    # by `itde solve` is about eps (LayerNorm lands inside the sphere by var/(var+eps)).

    def __post_init__(self):
        from .. import ACTIVATIONS, FFN_FORMS

        for name in ("n_layers", "n_features", "n_heads", "n_hidden"):
            positive(f"model.{name}", getattr(self, name))
        choices("model.activation", self.activation, ACTIVATIONS)
        choices("model.ffn_form", self.ffn_form, tuple(FFN_FORMS))
        seed("model.seed", self.seed)
        if self.n_features % self.n_heads:
            raise ConfigError(
                f"`model.n_heads`={self.n_heads} does not divide `model.n_features`="
                f"{self.n_features}"
            )
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ConfigError(f"`model.eps` must be >= 0, got {self.eps!r}")


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """Quadrature rules for tokens and features (the `[grid]` table); names as in
    `itde.RULES`. `token_interval` = [a, b], or omitted for unit spacing."""

    tokens: str = "midpoint"
    features: str = "midpoint"
    token_interval: tuple[float, ...] | None = None
    feature_interval: tuple[float, ...] | None = None

    def __post_init__(self):
        from .. import RULES

        for name in ("tokens", "features"):
            if getattr(self, name) not in RULES:
                raise ConfigError(
                    f"`grid.{name}`={getattr(self, name)!r} is not a quadrature rule; choose "
                    f"one of {sorted(RULES)}"
                )
        for name in ("token_interval", "feature_interval"):
            iv = getattr(self, name)
            if iv is not None and (len(iv) != 2 or not iv[1] > iv[0]):
                raise ConfigError(f"`grid.{name}` must be [a, b] with b > a, got {list(iv)}")


@dataclasses.dataclass(frozen=True)
class SolveConfig:
    """What `itde solve` integrates and where it writes (the `[solve]` table)."""

    n_tokens: int = 16
    seed: int = 1
    dt: float = 1.0
    out: str = "runs/solve"

    def __post_init__(self):
        positive("solve.n_tokens", self.n_tokens)
        positive("solve.dt", self.dt)
        seed("solve.seed", self.seed)
        from .._internal import check_depth_step

        check_depth_step(self.dt, 1.0, name="solve.dt", error=ConfigError)


@dataclasses.dataclass(frozen=True)
class SolveExperiment:
    """The config of `itde solve`."""

    model: RandomModelConfig = dataclasses.field(default_factory=RandomModelConfig)
    grid: GridConfig = dataclasses.field(default_factory=GridConfig)
    solve: SolveConfig = dataclasses.field(default_factory=SolveConfig)

    def __post_init__(self):
        from .. import RULES

        for count, n, axis, interval in (
            ("solve.n_tokens", self.solve.n_tokens, "tokens", self.grid.token_interval),
            ("model.n_features", self.model.n_features, "features", self.grid.feature_interval),
        ):
            rule = RULES[getattr(self.grid, axis)](interval=interval)
            try:
                rule.nodes_weights(n)
            except ValueError as e:
                raise ConfigError(
                    f"`{count}`={n} does not fit `grid.{axis}`={getattr(self.grid, axis)!r}: "
                    f"{e} Change one of the two keys."
                ) from None
