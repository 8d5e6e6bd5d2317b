"""Reading the layout a pytree has, to keep it through a compiled step.

A plain ``jax.jit`` lets XLA choose the layout of every output: a replicated
norm scale can come back split, and the next step then compiles again for the
new layout. :func:`shardings_of` reads the shardings of a placed tree, to pin
them as ``out_shardings`` (or as a constraint inside the step, e.g. Equinox's
``eqx.filter_shard``), so the rules' layouts survive every step.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.core import Tracer

from .._language._errors import EinshardError

__all__ = ["shardings_of"]


def shardings_of(tree: Any) -> Any:
    """The sharding of every array leaf of ``tree``; ``None`` for every other leaf.

    Pass the result as ``out_shardings`` of ``jax.jit`` for the outputs that
    are the next step's inputs, so each leaf keeps the layout its rule gave it
    (and the second step does not compile again); ``None`` lets JAX choose,
    which is what a loss or metrics need.

    Args:
        tree: A pytree of placed arrays (``jax.Array`` or ``ShapeDtypeStruct``
            with a sharding), e.g. a train state from
            :func:`einshard.integrations.flax.create_train_state`. Other
            leaves (Python numbers, NumPy arrays, functions) give ``None``.

    Returns:
        A pytree of the same structure: a ``jax.sharding.Sharding`` per placed
        array, ``None`` elsewhere.

    Raises:
        EinshardError: If called inside ``jit`` (traced values carry no
            layout of their own): read the shardings outside, before the step.

    >>> import jax, jax.numpy as jnp, einshard
    >>> params = einshard.shard_pytree({'w': jnp.ones((8, 64)), 'b': jnp.ones(64)},
    ...                                [('w', 'x y -> x y*'), ('b', '... -> * ...')])
    >>> def grow(params):
    ...     return {'w': params['w'] * 2, 'b': params['b'] + params['w'].sum(0)}
    >>> step = jax.jit(grow, out_shardings=einshard.shardings_of(params))
    >>> step(params)['b'].sharding.is_fully_replicated
    True
    """
    return jax.tree_util.tree_map(_sharding_of, tree)


def _sharding_of(leaf: Any) -> Any:
    if isinstance(leaf, Tracer):
        raise EinshardError(
            "shardings_of was given a traced value: inside jit, values carry no layout of their own",
            hint="Read the shardings outside the step, from the placed inputs: "
            "step = jax.jit(train_step, out_shardings=(einshard.shardings_of(state), None)).",
        )
    if isinstance(leaf, jax.Array):
        return leaf.sharding
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf.sharding
    return None  # NumPy arrays, Python numbers, functions: no layout to keep
