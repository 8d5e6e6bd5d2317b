"""What a leaf is: an array to place, or something passed as it is.

* :func:`is_array`: a leaf einshard places: a ``jax.Array`` (traced values included), a NumPy
  array or scalar, or a ``jax.ShapeDtypeStruct``. Python numbers, strings, functions and other
  objects are not: they pass through untouched.
* :func:`partition`: a tree's leaves of some kinds apart from the rest, and the function that
  puts other values in their places (Equinox's ``partition`` / ``combine``, over flat lists).
  With :func:`is_concrete_array` it splits the arrays a compiled function traces from the
  arguments passed as they are (sizes, optax transformations, callables).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

__all__ = [
    "ARRAY_TYPES",
    "carried_sharding",
    "is_array",
    "is_concrete_array",
    "is_jax_array",
    "is_traced",
    "itemsize",
    "nbytes",
    "partition",
]

ARRAY_TYPES: set[type] = {jax.ShapeDtypeStruct, np.ndarray}
"""Types known to be arrays; :func:`is_array` adds each new one it meets (tracers aside).

A loop over many leaves tests ``type(leaf) in ARRAY_TYPES`` first: a set lookup costs less
than a call, and ``isinstance`` against ``jax.Array``'s ABC is slow.
"""


def is_array(leaf: Any) -> bool:
    """Whether a leaf is an array to place: ``jax.Array``, NumPy array or scalar, ``ShapeDtypeStruct``.

    Traced values are ``jax.Array`` too. Python scalars, strings, functions and other objects
    pass through untouched.

    >>> import jax, numpy as np
    >>> is_array(np.ones(2)), is_array(np.float32(1)), is_array(jax.ShapeDtypeStruct((2,), np.int8))
    (True, True, True)
    >>> is_array(1.0), is_array('w'), is_array(None)
    (False, False, False)
    """
    kind = type(leaf)
    if kind in ARRAY_TYPES:  # by identity first: isinstance against jax.Array's ABC is slow
        return True
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        if not issubclass(kind, Tracer):  # whether a tracer is an array can depend on the tracer
            ARRAY_TYPES.add(kind)
        return True
    return False


def is_concrete_array(leaf: Any) -> bool:
    """Whether a leaf is an array with values, to trace: a ``jax.Array`` or a NumPy array.

    Not a NumPy or Python scalar (it may be a size that must stay static) nor a
    ``ShapeDtypeStruct`` (it has no values).
    """
    return isinstance(leaf, (jax.Array, np.ndarray))


def is_jax_array(leaf: Any) -> bool:
    """Whether a leaf is a ``jax.Array`` (placed, or traced inside a step): a value on devices.

    >>> import jax, numpy as np
    >>> is_jax_array(jax.numpy.ones(2)), is_jax_array(np.ones(2))
    (True, False)
    """
    return isinstance(leaf, jax.Array)


def carried_sharding(leaf: Any) -> Any:
    """The sharding a ``jax.Array`` or ``ShapeDtypeStruct`` carries; ``None`` if it has none or is neither."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return leaf.sharding
    return None


def is_traced(leaf: Any) -> bool:
    """Whether a step's compile traces a leaf: a ``jax.Array``, a NumPy array or a ``ShapeDtypeStruct``.

    Not a NumPy or Python scalar: it may be a size that must stay static. The step report, its
    compile and the roles reader all ask this, so they agree on what the program's parameters are.

    >>> import jax, numpy as np
    >>> is_traced(np.ones(2)), is_traced(jax.ShapeDtypeStruct((2,), np.int8)), is_traced(np.float32(1))
    (True, True, False)
    """
    return isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype; extended dtypes (PRNG keys) by their own ``itemsize``."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # extended dtypes, such as PRNG keys
        return int(getattr(dtype, "itemsize", 0) or 0)


def nbytes(shape: Any, dtype: Any) -> int:
    """A whole array's bytes: its element count times :func:`itemsize` (the one place this is computed).

    >>> import numpy as np
    >>> nbytes((16, 4096), np.float32), nbytes((), 'bfloat16')
    (262144, 2)
    """
    return math.prod(shape) * itemsize(dtype)


def partition(
    tree: Any, *kinds: Callable[[Any], bool], is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[list[Any]], Callable[..., Any]]:
    """The leaves of each kind, and ``combine``: the tree with other values in their places.

    Each leaf goes to the first kind that takes it; the leaves no kind takes stay as they are.
    ``combine(*groups)``, one sequence per kind in order, gives the tree with each group's
    values where that kind's leaves were.

    >>> (arrays,), combine = partition({'w': np.ones(2), 'n': 4}, is_concrete_array)
    >>> combine([np.zeros(3)])
    {'n': 4, 'w': array([0., 0., 0.])}
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    places: list[list[int]] = [[] for _ in kinds]
    for i, leaf in enumerate(leaves):
        for place, kind in zip(places, kinds, strict=True):
            if kind(leaf):
                place.append(i)
                break

    def combine(*groups: Any) -> Any:
        filled = list(leaves)
        for place, group in zip(places, groups, strict=True):
            for i, value in zip(place, group, strict=True):
                filled[i] = value
        return jax.tree_util.tree_unflatten(treedef, filled)

    return [[leaves[i] for i in place] for place in places], combine
