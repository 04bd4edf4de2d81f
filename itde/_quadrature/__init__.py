"""Token and feature domains discretised by quadrature rules.

The modules are imported by their own names (`itde._quadrature._rules`, ...); the public
names are `itde`'s."""
