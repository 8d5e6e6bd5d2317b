"""Placing arrays: ``einshard`` and ``make_sharding``.

The same call works on concrete arrays (a placement, through
``jax.device_put``), on traced values inside ``jit`` / ``grad`` / ``vmap`` (a
sharding constraint, or a reshard under an Explicit mesh) and on
``jax.ShapeDtypeStruct`` (the struct, carrying the sharding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .._language._errors import EinshardError, short_repr
from .._language._expression import check_expression_type
from .._language._numbers import checked_n_dims, checked_shape
from .._sharding._devices import Devices, call_devices
from .._sharding._expression_sharding import expression_sharding
from ._leaves import is_array
from ._one_device import warn_if_one_device
from ._place import place_leaf

__all__ = ["check_arguments", "einshard", "make_sharding", "sharding_context"]

# Taken as they are, besides arrays; anything else goes through numpy.asarray.
_SCALARS = (int, float, complex, bool)


def make_sharding(
    expression: str,
    *,
    n_dims: int | None = None,
    shape: Sequence[int] | None = None,
    devices: Devices | None = None,
) -> NamedSharding:
    """Makes the ``NamedSharding`` an einshard expression describes.

    Repeated calls with the same expression, rank and devices return the same
    (equal, hashable) sharding from a cache, in microseconds.

    Args:
        expression: An einshard expression, e.g. ``'x y -> x y*'``.
        n_dims: The array's rank. Needed when the expression has ``...``;
            otherwise it must match the number of names on the left.
        shape: The array's shape. Gives the rank and checks that every sharded
            axis splits evenly.
        devices: The devices, in order (a sequence, or a mesh meaning its flat
            device order). Defaults to the ambient ``jax.set_mesh`` mesh, the
            :func:`~einshard.use_devices` block, or ``jax.devices()``.

    Returns:
        A :class:`jax.sharding.NamedSharding` over all the given devices.

    Raises:
        EinshardError: If the expression is malformed or does not fit the
            rank, shape or devices.

    >>> import einshard
    >>> sharding = einshard.make_sharding('x y -> x y*', shape=(128, 256))
    >>> sharding.shard_shape((128, 256))
    (128, 32)
    """
    if shape is not None:
        shape = checked_shape(shape)
        if n_dims is not None and n_dims != len(shape):
            raise EinshardError(
                f"n_dims={n_dims} does not match shape={shape}", hint="Pass one or the other."
            )
        n_dims = len(shape)
    check_arguments(expression, n_dims)
    return _call_sharding(expression, n_dims, shape, devices)


def einshard(x: Any, expression: str, *, devices: Devices | None = None) -> Any:
    """Shards an array as an einshard expression says.

    Args:
        x: A ``jax.Array`` (sharded or not: it is resharded), anything
            ``numpy.asarray`` takes (a NumPy array, a Python scalar, a nested
            list), a traced value inside ``jax.jit`` / ``grad`` / ``vmap``, or
            a ``jax.ShapeDtypeStruct``.
        expression: An einshard expression, e.g. ``'x y -> x y*'``.
        devices: The devices, in order (see :func:`make_sharding`).

    Returns:
        For a concrete input, a ``jax.Array`` with the same values, laid out as
        the expression says. For a traced value, the value under a sharding
        constraint (a reshard under an Explicit mesh). For a
        ``ShapeDtypeStruct``, the same struct carrying the sharding.

    Raises:
        EinshardError: If the expression is malformed or does not fit the
            array or the devices.

    >>> import jax.numpy as jnp, einshard
    >>> w = einshard.einshard(jnp.zeros((128, 256)), 'x y -> x y*')
    >>> w.sharding.shard_shape(w.shape)
    (128, 32)
    """
    if isinstance(x, str) and "->" in x:  # einshard('x y -> x y*', array): the order of einsum's arguments
        raise EinshardError(
            "the first argument is an expression: the array comes first, then the expression",
            expression=x,
            hint=f"Call einshard(array, {x!r}).",
        )
    if _holds_mapping(x):  # a dict, or a list of them: a tree, which NumPy would make objects of
        raise EinshardError(
            f"einshard places one array, and was given a {type(x).__name__}: "
            "a tree is placed by shard_pytree",
            hint="Place a tree of arrays (a dict, a list, a module) with "
            "einshard.shard_pytree(tree, rules), a table of (path regex, expression) pairs, "
            "e.g. shard_pytree(tree, [(r'.*', '... -> * ...')]).",
        )
    if not is_array(x) and not isinstance(x, _SCALARS):
        try:
            x = np.asarray(x)
        except Exception as error:  # anything np.asarray rejects is the caller's input
            raise EinshardError(
                f"cannot make an array of {type(x).__name__}: {error}",
                hint="Pass a jax.Array, a NumPy array, a scalar, or a jax.ShapeDtypeStruct; "
                "place a tree of arrays with einshard.shard_pytree(tree, rules).",
            ) from None
    check_array_value(x)  # strings, objects, ints beyond JAX's: JAX's own errors are not ours
    shape = tuple(np.shape(x))
    check_arguments(expression)
    return place_leaf(x, _call_sharding(expression, len(shape), shape, devices))


def _holds_mapping(x: Any) -> bool:
    """Whether ``x`` is a dict, or a list or tuple with a dict somewhere in it (a pytree, not an array)."""
    if isinstance(x, Mapping):
        return True
    return isinstance(x, (list, tuple)) and any(_holds_mapping(item) for item in x)


def _call_sharding(
    expression: str, n_dims: int | None, shape: tuple[int, ...] | None, devices: Devices | None
) -> NamedSharding:
    """The sharding of one array, with the call's context on an error; warns of one device.

    The context is added in a ``try`` rather than ``with adding_context(...)``: on this, the
    per-call path of the array functions, a ``try`` costs nothing and a ``with`` block half a
    microsecond (a sixth of a cached ``make_sharding``).
    """
    try:
        target = call_devices(devices)
        layout, sharding = expression_sharding(expression, n_dims, target, shape)
    except EinshardError as error:
        sharding_context(error, shape, devices)
        raise
    if devices is None and target.mesh is None:  # the default order: one device may be a surprise
        warn_if_one_device(layout, stacklevel=3)  # at the caller of make_sharding / einshard
    return sharding


def check_arguments(expression: object, n_dims: object = None) -> None:
    """Checks an expression and a rank a user passed, before they reach the caches.

    Raises:
        EinshardError: If the expression is not a string, or the rank not a
            non-negative integer.
    """
    if type(expression) is not str:  # the per-call path: two tests, no call, when both are fine
        check_expression_type(expression)
    if n_dims is not None:
        checked_n_dims(n_dims)


def sharding_context(error: EinshardError, shape: tuple[int, ...] | None, devices: Devices | None) -> None:
    """Adds ``while sharding an array of shape (4, 8) on 8 CPU devices``: what the call was doing.

    Called by the public functions that shard one array when an error leaves their work
    (in a ``try``: that is their per-call path).
    """
    what = f"an array of shape {shape}" if shape is not None else "an array"
    try:
        where = call_devices(devices).describe()
    except EinshardError:
        where = "on the given devices"
    error.add_context(f"while sharding {what} {where}")


def check_array_value(x: Any) -> None:
    """Refuses, as an :class:`EinshardError`, values JAX cannot hold as an array.

    NumPy arrays of strings, bytes, objects, records or dates (JAX's ``TypeError``), and Python
    ints beyond JAX's default integer type (JAX's ``OverflowError``).
    """
    dtype = getattr(x, "dtype", None)
    if isinstance(x, (np.ndarray, np.generic)) and dtype is not None and dtype.kind in "OUSVMm":
        what = "Python objects" if dtype.kind == "O" else f"dtype {dtype}"
        raise EinshardError(
            f"cannot shard an array of {what}",
            hint="Pass numbers: a jax.Array, a NumPy array, a scalar or a nested list of numbers; "
            "place a tree of arrays with einshard.shard_pytree(tree, rules).",
        )
    if isinstance(x, int) and not isinstance(x, bool):
        int_type = np.iinfo(jax.dtypes.canonicalize_dtype(np.int64))
        if not int_type.min <= x <= int_type.max:
            raise EinshardError(
                f"the integer {short_repr(x)} does not fit JAX's {int_type.dtype} "
                f"({int_type.min} to {int_type.max})",
                hint="Pass a float (e.g. float(x)), or enable 64-bit integers with "
                "jax.config.update('jax_enable_x64', True) if it fits int64.",
            )
