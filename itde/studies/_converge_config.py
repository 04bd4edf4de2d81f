"""The config of `itde converge` and of the studies it runs (`run_depth_study`,
`run_grid_study`): its `[problem]`, `[reference]` and `[study]` tables as frozen
dataclasses, read by `itde._config`'s TOML loader, which names the key and the file of a
mistake. No JAX at import: the command line reads it to build its parser."""

from __future__ import annotations

import dataclasses
import math

from .._config import ConfigError, choices, positive, seed

#: What `itde converge` refines: the depth step, or the token / feature / both resolutions.
AXES: tuple[str, ...] = ("depth", "tokens", "features", "all")


@dataclasses.dataclass(frozen=True)
class ProblemConfig:
    """The smooth test problem of the convergence study (the `[problem]` table):
    random controls that are Legendre series in depth, a moving constraint set."""

    n_tokens: int = 8
    n_features: int = 12
    n_heads: int = 2
    n_hidden: int = 16
    n_modes: int = 3
    activation: str = "gelu"  # a name of itde.ACTIVATIONS
    t1: float = 1.0
    amplitude: float = 0.3
    seed: int = 0

    def __post_init__(self):
        from .._registry import ACTIVATIONS

        for name in ("n_tokens", "n_features", "n_heads", "n_hidden", "n_modes", "t1"):
            positive(f"problem.{name}", getattr(self, name))
        if not (math.isfinite(self.amplitude) and self.amplitude >= 0):
            raise ConfigError(
                f"`problem.amplitude` must be a finite number >= 0 (the size of the controls' "
                f"higher Legendre modes, e.g. 0.3), got {self.amplitude!r}"
            )
        choices("problem.activation", self.activation, ACTIVATIONS)
        seed("problem.seed", self.seed)
        if self.n_features % self.n_heads:
            raise ConfigError(
                f"`problem.n_heads`={self.n_heads} does not divide `problem.n_features`="
                f"{self.n_features}"
            )


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """The reference solution (the `[reference]` table): projected Dopri8, adaptive."""

    rtol: float = 1e-12
    atol: float = 1e-12
    max_steps: int = 100_000

    def __post_init__(self):
        positive("reference.rtol", self.rtol)
        positive("reference.atol", self.atol)
        positive("reference.max_steps", self.max_steps)


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """What is refined and how (the `[study]` table). `steps` are numbers of depth
    steps over [0, t1]; `schemes` are names in `itde.SCHEMES`; `axis` one of `AXES`."""

    axis: str = "depth"
    schemes: tuple[str, ...] = ("lie", "strang", "parallel", "euler", "heun", "rk4", "tsit5")
    steps: tuple[int, ...] = (4, 8, 16, 32, 64)
    out: str = "runs/convergence"
    # the pre-norm equation u_t = A(N1 u) + F(N2 u) on the same controls (rows "pre_norm/...");
    # empty to skip
    pre_norm_schemes: tuple[str, ...] = ("lie", "strang", "heun", "rk4")
    # grid axes (tokens / features / all): one row per quadrature rule, refined over
    # `nodes` against a Gauss-Legendre reference with `reference_nodes`
    rules: tuple[str, ...] = (
        "midpoint",
        "trapezoid",
        "simpson",
        "gauss-legendre",
        "periodic-trapezoid",
    )
    nodes: tuple[int, ...] = (16, 32, 64, 128)
    reference_nodes: int = 192
    layers: int = 2
    modes: int = 5
    kernel_scale: float = 0.5
    decay: float = 0.5

    def __post_init__(self):
        from .._registry import SCHEMES

        choices("study.axis", self.axis, AXES)
        if not self.schemes:
            raise ConfigError("`study.schemes` is empty; list at least one scheme, e.g. ['lie']")
        if not self.rules:
            raise ConfigError("`study.rules` is empty; list at least one rule, e.g. ['midpoint']")
        for field in ("schemes", "pre_norm_schemes"):
            for s in getattr(self, field):
                if s not in SCHEMES:
                    raise ConfigError(
                        f"`study.{field}` holds {s!r}, not a scheme; choose from "
                        f"{sorted(SCHEMES)}"
                    )
        if len(self.steps) < 2 or any(n < 1 for n in self.steps):
            raise ConfigError(f"`study.steps` needs >= 2 positive step counts, got {self.steps}")
        if list(self.steps) != sorted(set(self.steps)):
            raise ConfigError(f"`study.steps` must be strictly increasing, got {self.steps}")
        from .._quadrature._rules import RULES

        for r in self.rules:
            if r not in RULES:
                raise ConfigError(
                    f"`study.rules` holds {r!r}, not a quadrature rule; choose from {sorted(RULES)}"
                )
        if (
            len(self.nodes) < 2
            or list(self.nodes) != sorted(set(self.nodes))
            or min(self.nodes) < 3
        ):
            raise ConfigError(
                f"`study.nodes` needs >= 2 strictly increasing node counts >= 3, got {self.nodes}"
            )
        if self.reference_nodes <= max(self.nodes):
            raise ConfigError(
                f"`study.reference_nodes`={self.reference_nodes} must exceed the finest of "
                f"`study.nodes` ({max(self.nodes)})"
            )
        positive("study.kernel_scale", self.kernel_scale)
        positive("study.decay", self.decay)
        positive("study.layers", self.layers)
        positive("study.modes", self.modes)


@dataclasses.dataclass(frozen=True)
class ConvergeExperiment:
    """The config of `itde converge`."""

    problem: ProblemConfig = dataclasses.field(default_factory=ProblemConfig)
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)
    study: StudyConfig = dataclasses.field(default_factory=StudyConfig)
