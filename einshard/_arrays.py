"""Placing arrays: ``einshard`` and ``make_sharding``.

The same call works on concrete arrays (a placement, through
``jax.device_put``), on traced values inside ``jit`` / ``grad`` / ``vmap`` (a
sharding constraint, or a reshard under an Explicit mesh) and on
``jax.ShapeDtypeStruct`` (the struct, carrying the sharding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding

from ._devices import Devices, resolve_devices
from ._errors import EinshardError
from ._inputs import check_array_value, checked_shape
from ._layout import Layout
from ._multihost import place
from ._sharding import ambient_mesh, ambient_spec, layout_sharding

__all__ = ["einshard", "make_sharding"]


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
        shape = _checked_shape(shape)
        if n_dims is not None and n_dims != len(shape):
            raise EinshardError(
                f"n_dims={n_dims} does not match shape={shape}", hint="Pass one or the other."
            )
        n_dims = len(shape)
    _, sharding = _resolve(expression, n_dims, devices, shape)
    return sharding


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
    if isinstance(x, Tracer):
        return _constrain(x, expression, devices)
    if isinstance(x, jax.ShapeDtypeStruct):
        _, sharding = _resolve(expression, len(x.shape), devices, tuple(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
        try:
            x = np.asarray(x)
        except Exception as error:  # anything np.asarray rejects is the caller's input
            raise EinshardError(
                f"cannot make an array of {type(x).__name__}: {error}",
                hint="Pass a jax.Array, a NumPy array, a scalar, or a jax.ShapeDtypeStruct.",
            ) from None
        if x.dtype.kind in "OUSV":  # objects, strings, bytes, records: no JAX dtype holds them
            what = "Python objects" if x.dtype == object else f"dtype {x.dtype}"
            raise EinshardError(
                f"cannot shard an array of {what}",
                hint="Pass numbers: a jax.Array, a NumPy array, a scalar or a nested list of numbers.",
            )
    check_array_value(x)  # strings, objects, ints beyond JAX's: JAX's own errors are not ours
    shape = tuple(np.shape(x))
    _, sharding = _resolve(expression, len(shape), devices, shape)
    return place(x, sharding)


def _resolve(
    expression: str,
    n_dims: int | None,
    devices: Devices | None,
    shape: tuple[int, ...] | None,
) -> tuple[Layout, NamedSharding]:
    """The layout and concrete sharding, with the divisibility check and error context."""
    if not isinstance(expression, str):
        raise EinshardError(
            f"an einshard expression must be a string, not {type(expression).__name__}",
            hint="Write it like 'x y -> x y*'.",
        )
    if n_dims is not None and (not isinstance(n_dims, int) or isinstance(n_dims, bool) or n_dims < 0):
        raise EinshardError(f"n_dims must be a non-negative integer, not {n_dims!r}")
    try:
        ambient = ambient_mesh() if devices is None else None
        if ambient is not None:
            abstract, concrete = ambient
            layout, spec = ambient_spec(expression, n_dims, _mesh_axes(abstract))
            sharding = NamedSharding(concrete if concrete is not None else abstract, spec)
        else:
            order = resolve_devices(devices)
            layout, sharding = layout_sharding(expression, n_dims, order)
        if shape is not None:
            layout.check_shape(shape)
        return layout, sharding
    except EinshardError as error:
        raise error.add_context(_context(shape, devices)) from None


def _constrain(x: Tracer, expression: str, devices: Devices | None) -> Any:
    """Inside a trace: a sharding constraint, or a reshard under an Explicit mesh."""
    shape = tuple(x.shape)
    ambient = ambient_mesh() if devices is None else None
    if ambient is None:
        _, sharding = _resolve(expression, len(shape), devices, shape)
        return jax.lax.with_sharding_constraint(x, sharding)
    abstract, _ = ambient
    try:
        layout, spec = ambient_spec(expression, len(shape), _auto_axes(abstract))
        layout.check_shape(shape)
    except EinshardError as error:
        raise error.add_context(_context(shape, None)) from None
    if any(t == AxisType.Explicit for t in abstract.axis_types):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _mesh_axes(mesh: Any) -> tuple[tuple[str, int], ...]:
    return tuple(mesh.shape.items())


def _auto_axes(mesh: Any) -> tuple[tuple[str, int], ...]:
    """The mesh axes a traced value can be laid out over: inside ``shard_map``, not the manual ones.

    A value inside ``shard_map`` is one process's block over its manual axes; einshard lays it
    out over the axes that are left (``shard_map(..., axis_names={'data'})`` leaves the others).
    """
    types = getattr(mesh, "axis_types", None) or ()
    manual = {name for name, kind in zip(mesh.axis_names, types, strict=False) if kind == AxisType.Manual}
    if not manual:
        return _mesh_axes(mesh)
    left = tuple((name, size) for name, size in mesh.shape.items() if name not in manual)
    if not left:
        raise EinshardError(
            f"inside shard_map every mesh axis is manual ({', '.join(mesh.axis_names)}): "
            "there are no devices to lay this value out over",
            hint="Inside shard_map a value is already one device's block: shard the arrays before "
            "shard_map, or leave mesh axes to einshard with shard_map(..., axis_names={...}).",
        )
    return left


def _checked_shape(shape: Any) -> tuple[int, ...]:
    return checked_shape(shape)  # whole sizes only: 8.5 is an error, not 8


def _context(shape: tuple[int, ...] | None, devices: Devices | None) -> str:
    ambient = ambient_mesh() if devices is None else None
    if ambient is not None:
        abstract, _ = ambient
        where = "on the ambient mesh " + ", ".join(f"{k}={v}" for k, v in abstract.shape.items())
    else:
        try:
            order = resolve_devices(devices)
            plural = "" if len(order) == 1 else "s"
            where = f"on {len(order)} {order[0].platform.upper()} device{plural}"
        except EinshardError:
            where = "on the given devices"
    what = f"an array of shape {shape}" if shape is not None else "an array"
    return f"while sharding {what} {where}"
