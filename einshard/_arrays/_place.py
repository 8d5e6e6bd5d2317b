"""Putting values where their shardings say: one leaf, or a whole tree, in one or several processes.

:func:`place_tree` is the one placing service of the package; the array
functions, the rule-table functions and the integrations all call it (or
:func:`place_leaf` for a single value). Each kind of leaf is placed its own way:

* a traced value (inside ``jit``, ``grad``, ``vmap``): a sharding constraint,
  or a reshard when the sharding's mesh has Explicit axes (``jax.set_mesh``
  with ``AxisType.Explicit``);
* a ``jax.ShapeDtypeStruct``: the same struct, carrying the sharding;
* a concrete value (``jax.Array``, NumPy, Python scalar): ``jax.device_put``,
  all of a tree's in one call;
* with several processes, a ``jax.Array`` held whole on this process's devices
  and a sharding spanning other processes' devices: each process puts its own
  shards of it on its own devices (``jax.device_put`` would reject it).

Signatures, for the integrations:

* ``place_tree(tree, shardings) -> tree``: ``shardings`` has the structure of
  ``tree`` (as ``jax.tree_util`` flattens it), with a ``jax.sharding.Sharding``
  at each leaf to place and ``None`` at each leaf to pass through untouched;
  or it is a flat list with one entry per leaf of ``tree``.
* ``place_leaves(leaves, shardings) -> list``: the same over flat lists.
* ``place_leaf(x, sharding) -> value``: one leaf, of any kind above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AxisType, Sharding

__all__ = ["place_leaf", "place_leaves", "place_tree"]


def place_leaf(x: Any, sharding: Sharding) -> Any:
    """One value placed by ``sharding``, as its kind wants (see the module docstring)."""
    if isinstance(x, Tracer):
        if _has_explicit_axes(sharding):
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    if _needs_callback(x, sharding):
        return _from_whole(x, sharding)
    return jax.device_put(x, sharding)


def place_tree(tree: Any, shardings: Any) -> Any:
    """Every leaf of ``tree`` placed by its sharding; leaves whose sharding is ``None`` kept.

    Concrete leaves are put in one ``jax.device_put`` call where they can be,
    as ``jax.device_put(tree, shardings)`` would.

    Args:
        tree: Any pytree.
        shardings: A tree of the same structure with a sharding or ``None``
            at every leaf, or a list with one entry per leaf.

    Returns:
        The tree, same structure, each leaf placed.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not isinstance(shardings, list):
        shardings = treedef.flatten_up_to(shardings)
    return jax.tree_util.tree_unflatten(treedef, place_leaves(leaves, shardings))


def place_leaves(leaves: Sequence[Any], shardings: Sequence[Sharding | None]) -> list[Any]:
    """Each leaf placed by its sharding (``None``: kept); concrete ones in one ``jax.device_put``."""
    out = list(leaves)
    batch_at: list[int] = []
    for i, (leaf, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        if sharding is None:
            continue
        if isinstance(leaf, (Tracer, jax.ShapeDtypeStruct)) or _needs_callback(leaf, sharding):
            out[i] = place_leaf(leaf, sharding)
        else:
            batch_at.append(i)
    if batch_at:  # one call places them all
        placed = jax.device_put([leaves[i] for i in batch_at], [shardings[i] for i in batch_at])
        for i, value in zip(batch_at, placed, strict=True):
            out[i] = value
    return out


def _has_explicit_axes(sharding: Sharding) -> bool:
    mesh = getattr(sharding, "mesh", None)
    return any(kind == AxisType.Explicit for kind in getattr(mesh, "axis_types", ()))


def _needs_callback(x: Any, sharding: Sharding) -> bool:
    """A process-local ``jax.Array`` bound for a sharding over other processes' devices too."""
    return (
        isinstance(x, jax.Array)
        and not sharding.is_fully_addressable
        and x.is_fully_addressable
        and jax.process_count() > 1
    )


def _from_whole(x: jax.Array, sharding: Sharding) -> jax.Array:
    """Each process puts its own shards of a value it holds whole."""
    return jax.make_array_from_callback(tuple(x.shape), sharding, lambda index: x[index])
