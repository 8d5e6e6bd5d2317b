"""An expression's sharding on the devices of a call: (expression, rank, devices, shape) to sharding.

Every function that turns an expression into a sharding comes here: arrays
(:func:`~einshard.make_sharding`, :func:`~einshard.einshard`), trees (once per
kind of leaf) and several processes (:func:`~einshard.from_process_local`).
(Pictures need no sharding: they draw the pure :class:`~einshard.Layout`.) The device
target is decided before, once per call, by
:func:`~einshard._sharding._devices.call_devices`. The arguments a user gives (the
expression's type, the rank, the shape) are checked once, by the public function, before it
asks; adding context to an error is the public function's job too.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import AxisType, NamedSharding

from .._language._errors import EinshardError
from .._language._layout import Layout
from ._devices import CallDevices
from ._mesh import ambient_spec, layout_sharding

__all__ = ["expression_sharding"]


def expression_sharding(
    expression: str,
    n_dims: int | None,
    target: CallDevices,
    shape: tuple[int, ...] | None = None,
) -> tuple[Layout, NamedSharding]:
    """The layout and the sharding of an expression on the devices of a call; cached below.

    On einshard's own mesh over the target's device order, or on the ambient
    mesh (with its devices when they are known, else abstract, inside a trace).

    Args:
        expression: The expression's text.
        n_dims: The array's rank, or ``None`` to take it from the expression.
        target: Where the array goes (from :func:`~einshard._sharding._devices.call_devices`).
        shape: The array's shape, if known: every split axis must divide.

    Raises:
        EinshardError: If the expression does not fit the rank, the shape or
            the devices. (A call's own arguments are checked before, by
            the public function.)
    """
    if target.mesh is not None:
        layout, spec = ambient_spec(expression, n_dims, _auto_axes(target.mesh))
        sharding = NamedSharding(target.concrete if target.concrete is not None else target.mesh, spec)
    else:
        assert target.order is not None
        layout, sharding = layout_sharding(expression, n_dims, target.order)
    if shape is not None:
        layout.check_shape(shape)
    return layout, sharding


def _auto_axes(mesh: Any) -> tuple[tuple[str, int], ...]:
    """The mesh axes a value can be laid out over: inside ``shard_map``, not the manual ones.

    A value inside ``shard_map`` is one device's block over its manual axes; einshard lays it
    out over the axes that are left (``shard_map(..., axis_names={'data'})`` leaves the others).

    Raises:
        EinshardError: If every axis is manual: there is nothing left to lay the value out over.
    """
    types = getattr(mesh, "axis_types", None) or ()
    manual = {name for name, kind in zip(mesh.axis_names, types, strict=False) if kind == AxisType.Manual}
    if not manual:
        return tuple(mesh.shape.items())
    left = tuple((name, size) for name, size in mesh.shape.items() if name not in manual)
    if not left:
        raise EinshardError(
            f"inside shard_map every mesh axis is manual ({', '.join(mesh.axis_names)}): "
            "there are no devices to lay this value out over",
            hint="Inside shard_map a value is already one device's block: shard the arrays before "
            "shard_map, or leave mesh axes to einshard with shard_map(..., axis_names={...}).",
        )
    return left
