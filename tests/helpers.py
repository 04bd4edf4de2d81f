"""Registries shared by the conformance tests: every scheme added here is covered."""

import itde

QUADRATURES = dict(itde.RULES)  # name -> rule class

# (rule class, polynomial degree integrated exactly for n nodes, order on smooth data)
EXACT_DEGREE = {
    "midpoint": lambda n: 1,
    "trapezoid": lambda n: 1,
    "simpson": lambda n: 3,
    "gauss-legendre": lambda n: 2 * n - 1,
}


def torch_available():
    import importlib.util

    return importlib.util.find_spec("torch") is not None
