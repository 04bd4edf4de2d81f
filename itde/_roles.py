"""Roles of parameters, declared where each parameter is defined.

A field of a module declares its role in its own metadata (`kernel()` for weights that
take weight decay); a module whose roles depend on its values says so in
`field_roles()` (e.g. a LayerNorm's scalars $\\sigma_1, \\sigma_2$ are redundant when it
has a per-feature gain). [`parameter_roles`][itde.parameter_roles] reads them off any
PyTree of modules, so an optimiser never keeps a list of field names.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax

#: A kernel or an embedding: trained, with weight decay.
DECAY = "decay"
#: Trained without weight decay (biases, gains, scales, constraint sets): the default.
TRAIN = "train"
#: Not trained (its update is zero).
FROZEN = "frozen"
ROLES = (DECAY, TRAIN, FROZEN)


def kernel(**kwargs):
    """A dataclass field holding a kernel (a weight that takes weight decay)."""
    metadata = dict(kwargs.pop("metadata", {}), role=DECAY)
    return eqx.field(metadata=metadata, **kwargs)


def _field_role(node, name: str) -> str | None:
    override = getattr(node, "field_roles", None)
    if callable(override):
        role = override().get(name)
        if role is not None:
            return role
    for f in dataclasses.fields(node):
        if f.name == name:
            return f.metadata.get("role")
    return None


def parameter_roles(tree):
    """A PyTree of the same structure as `tree` with the role (`"decay"`, `"train"`,
    `"frozen"`) of every array leaf: the role a field declares passes down to every leaf
    under it (the innermost declaration wins); an undeclared leaf is `"train"`. Usable as
    optax's `mask` (`role == "decay"`) and `multi_transform` labels."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    roles = []
    for path, _ in leaves:
        node, role = tree, None
        for key in path:
            if isinstance(key, jax.tree_util.GetAttrKey):
                if isinstance(node, eqx.Module):
                    role = _field_role(node, key.name) or role
                node = getattr(node, key.name)
            elif isinstance(key, jax.tree_util.SequenceKey):
                node = node[key.idx]
            elif isinstance(key, jax.tree_util.DictKey):
                node = node[key.key]
            else:  # a custom node: its children are not reachable by name
                break
        if role not in ROLES and role is not None:
            raise ValueError(f"unknown parameter role {role!r}; roles are {ROLES}.")
        roles.append(role or TRAIN)
    return jax.tree_util.tree_unflatten(treedef, roles)
