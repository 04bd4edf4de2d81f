r"""Two-dimensional token domains: a tensor-product quadrature on a rectangle.

For images (ViT patches) the token coordinate is $x = (x_1, x_2) \in
\Omega_x = [a_1, b_1] \times [a_2, b_2]$; the attention integral
$\int_{\Omega_x} \cdot \, dx$ becomes $\sum_p w_p\,\cdot$ with the product rule
$w_{(i,j)} = w^{(1)}_i w^{(2)}_j$ at the nodes $(x^{(1)}_i, x^{(2)}_j)$. Tokens are
flattened in raster order (row $i$ along $x_1$, column $j$ along $x_2$ fastest), the
order of a ViT's patch sequence. As in one dimension the weights enter attention as the
log-bias $\log w_p$.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._domain import AbstractTokenDomain
from ._rules import AbstractQuadrature


class TensorGrid2D(AbstractTokenDomain):
    r"""The tensor product of two 1-D rules on a rectangle of $n_1 \times n_2$ tokens.

    Exact for $x_1^i x_2^j$ whenever each 1-D rule is exact for its power (degree
    $i$ in rule 1 and $j$ in rule 2); for smooth integrands the error is the sum of the
    two 1-D errors (order $\min(p_1, p_2)$ in the spacing).

    **Arguments:**

    - `rule_x1`, `rule_x2`: quadrature rules on $[a_1, b_1]$ and $[a_2, b_2]$.
    - `n1`, `n2`: the numbers of nodes along $x_1$ (rows) and $x_2$ (columns).
    """

    rule_x1: AbstractQuadrature
    rule_x2: AbstractQuadrature
    n1: int = eqx.field(static=True)
    n2: int = eqx.field(static=True)

    def __check_init__(self):
        for name, n in (("rule_x1", self.n1), ("rule_x2", self.n2)):
            rule = getattr(self, name)
            if not isinstance(rule, AbstractQuadrature):
                raise TypeError(
                    f"`TensorGrid2D({name}=...)` must be a quadrature rule such as "
                    f"`GaussLegendre(interval=(0, 1))`, got {rule!r}."
                )
            rule.nodes_weights(n)  # validates n for the rule (raises naming the fix)

    @property
    def n_tokens(self) -> int:
        return self.n1 * self.n2

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n1, self.n2)

    def nodes_weights(self, n_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Flattened nodes `[n1 * n2, 2]` and product weights `[n1 * n2]` (float64 NumPy).

        `n_tokens`, if given, must equal `n1 * n2` (the state's token count).
        """
        self._check_tokens(n_tokens)
        x1, w1 = self.rule_x1.nodes_weights(self.n1)
        x2, w2 = self.rule_x2.nodes_weights(self.n2)
        g1, g2 = np.meshgrid(x1, x2, indexing="ij")
        nodes = np.stack([g1.ravel(), g2.ravel()], axis=-1)
        return nodes, np.outer(w1, w2).ravel()

    def uniform_weights(self, n_tokens: int | None = None) -> bool:
        """True when both rules' weights are uniform (then so is every product, and only
        then)."""
        self._check_tokens(n_tokens)
        return self.rule_x1.uniform_weights(self.n1) and self.rule_x2.uniform_weights(self.n2)

    def nodes(self) -> np.ndarray:
        return self.nodes_weights()[0]

    def area(self) -> float:
        """$|\\Omega_x| = (b_1 - a_1)(b_2 - a_2)$."""
        return self.rule_x1.length(self.n1) * self.rule_x2.length(self.n2)

    def integrate(self, values: Float[Array, "*batch t"]) -> Float[Array, "*batch"]:
        """$\\sum_p w_p\\,g_p$ over the last (flattened token) axis."""
        values = jnp.asarray(values)
        self._check_tokens(values.shape[-1])
        return values @ jnp.asarray(self.token_weights(), values.dtype)

    def _check_tokens(self, n_tokens):
        if n_tokens is not None and n_tokens != self.n_tokens:
            raise ValueError(
                f"the state has {n_tokens} tokens but the TensorGrid2D is {self.n1} x "
                f"{self.n2} = {self.n_tokens}; reshape the patches or change n1, n2."
            )
