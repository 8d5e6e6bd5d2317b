"""Putting values where their shardings say: one leaf, or a whole tree, in one or several processes.

:func:`place_leaves` is the one placing service of the package; the rule-table
functions and the integrations call it (the array functions call :func:`place_leaf`
for a single value). Each kind of leaf is placed its own way:

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

* ``place_leaves(leaves, shardings) -> list``: a tree's leaves, flat, with a
  ``jax.sharding.Sharding`` for each leaf to place and ``None`` for each leaf to
  pass through untouched.
* ``place_leaf(x, sharding) -> value``: one leaf, of any kind above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AxisType, Sharding

from ._leaves import is_jax_array

__all__ = ["place_leaf", "place_leaves"]


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
        is_jax_array(x)
        and not sharding.is_fully_addressable
        and x.is_fully_addressable
        and jax.process_count() > 1
    )


def _from_whole(x: jax.Array, sharding: Sharding) -> jax.Array:
    """Each process puts its own shards of a value it holds whole."""
    return jax.make_array_from_callback(tuple(x.shape), sharding, lambda index: x[index])
