"""Born sharded: running a function so that its outputs are created where they belong.

:func:`build_sharded` is the one born-sharded builder of the package:
:func:`~einshard.init_sharded` and the integrations' constructors call it.
The function's outputs are found abstractly, their shardings derived from
them, and the function compiled with those as ``out_shardings``: every device
computes only its own shards, and no output ever exists whole on one device.

Signature, for the integrations::

    build_sharded(fn, shardings_for, *args, **kwargs) -> fn(*args, **kwargs)

``shardings_for(abstract)`` gets the tree ``fn`` returns, with
``jax.ShapeDtypeStruct`` leaves, and returns the shardings (a tree of the
same structure, ``None`` where ``jax.jit`` may choose).
Array arguments (``jax.Array``, NumPy) are traced; every other argument is
passed as it is (sizes, optax transformations, callables).

Memory is bounded: a big output is made by several programs, each making a
consecutive part of the leaves (at least 32 MiB, at most 64 parts), so XLA's
scratch space (the random bits of an initializer, say) is bounded by a part,
not by the whole model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.core import eval_jaxpr

from ._leaves import is_concrete_array, nbytes, partition

__all__ = ["build_sharded"]

_PART_BYTES = 32 << 20  # smallest part of a born-sharded build compiled on its own
_MAX_PARTS = 64  # the most parts: bigger outputs get bigger parts, not more compiles


def build_sharded(
    fn: Callable[..., Any], shardings_for: Callable[[Any], Any], /, *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)``, every output born with the sharding ``shardings_for`` gives it.

    Args:
        fn: A function returning a pytree of arrays.
        shardings_for: From the abstract output (``ShapeDtypeStruct`` leaves)
            to its shardings, e.g. ``lambda abstract: pytree_shardings(abstract, rules)``.
        *args: Positional arguments for ``fn``; array leaves are traced.
        **kwargs: Keyword arguments for ``fn``; array leaves are traced.

    Returns:
        ``fn(*args, **kwargs)``, value for value, placed.
    """
    (arrays,), combine = partition((args, kwargs), is_concrete_array)

    def run(*arrays: Any) -> Any:
        call_args, call_kwargs = combine(arrays)
        return fn(*call_args, **call_kwargs)

    closed, abstract = jax.make_jaxpr(run, return_shape=True)(*arrays)
    shardings = shardings_for(abstract)
    groups = _parts(jax.tree_util.tree_leaves(abstract))
    if len(groups) == 1:
        return jax.jit(run, out_shardings=shardings)(*arrays)
    flat_shardings = jax.tree_util.tree_structure(abstract).flatten_up_to(shardings)
    outputs: list[Any] = [None] * len(flat_shardings)
    for group in groups:
        part = functools.partial(_run_part, closed, group)
        made = jax.jit(part, out_shardings=[flat_shardings[i] for i in group])(*arrays)
        for i, value in zip(group, made, strict=True):
            outputs[i] = value
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), outputs)


def _parts(leaves: Sequence[Any]) -> list[tuple[int, ...]]:
    """Consecutive output leaves, cut into parts of about the same size in bytes."""
    sizes = [nbytes(leaf.shape, leaf.dtype) for leaf in leaves]
    budget = max(_PART_BYTES, -(-sum(sizes) // _MAX_PARTS))
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if current and filled + size > budget:
            groups.append(tuple(current))
            current, filled = [], 0
        current.append(i)
        filled += size
    groups.append(tuple(current))
    return groups


def _run_part(closed: Any, group: tuple[int, ...], *arrays: Any) -> list[Any]:
    outputs = eval_jaxpr(closed.jaxpr, closed.consts, *arrays)
    return [outputs[i] for i in group]
