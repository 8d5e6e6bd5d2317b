"""From a layout and a device order to JAX shardings, meshes and specs.

Two cases. Without an ambient mesh, einshard builds its own canonical mesh
over the einshard device order (axis names ``a0``, ``a1``, …; size-1 axes
dropped), cached, so equal layouts give equal, hashable shardings and ``jit``
does not recompile. Under ``jax.set_mesh``, it lays the array out on the
ambient mesh itself: each mesh axis of the expression takes a run of
consecutive ambient axes whose sizes multiply to its size.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._devices import DeviceOrder
from ._errors import EinshardError
from ._layout import Layout, compile_layout

__all__ = ["ambient_spec", "layout_sharding", "mesh_axis_names"]

AxisRuns = tuple[tuple[str, ...], ...]


def mesh_axis_names(n: int) -> tuple[str, ...]:
    """The names of einshard's own mesh axes: ``a0``, ``a1`` and so on."""
    return tuple(f"a{i}" for i in range(n))


@functools.lru_cache(maxsize=256)
def _own_mesh(devices: DeviceOrder, mesh_shape: tuple[int, ...]) -> Mesh:
    shape = mesh_shape or (1,)  # a mesh needs an axis, even with one device
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(shape), mesh_axis_names(len(shape)))


@functools.lru_cache(maxsize=4096)
def layout_sharding(text: str, n_dims: int | None, devices: DeviceOrder) -> tuple[Layout, NamedSharding]:
    """The layout and the ``NamedSharding`` on einshard's own mesh, cached."""
    layout = compile_layout(text, n_dims, len(devices))
    names = mesh_axis_names(len(layout.mesh_shape))
    spec = PartitionSpec(*(None if axis is None else names[axis] for axis in layout.spec))
    return layout, NamedSharding(_own_mesh(devices, layout.mesh_shape), spec)


@functools.lru_cache(maxsize=4096)
def ambient_spec(
    text: str, n_dims: int | None, axes: tuple[tuple[str, int], ...]
) -> tuple[Layout, PartitionSpec]:
    """The layout and the ``PartitionSpec`` on an ambient mesh with these ``(name, size)`` axes."""
    layout = compile_layout(text, n_dims, math.prod(size for _, size in axes))
    runs = match_runs(layout, axes)
    spec = []
    for axis in layout.spec:
        if axis is None:
            spec.append(None)
        else:
            run = runs[axis]
            spec.append(run[0] if len(run) == 1 else run)
    return layout, PartitionSpec(*spec)


def match_runs(layout: Layout, axes: Sequence[tuple[str, int]]) -> AxisRuns:
    """Matches each canonical mesh axis of ``layout`` to a run of consecutive ambient axes.

    Ambient axes of size 1 join no run (they split nothing).

    Raises:
        EinshardError: If the sizes do not split that way, naming the mesh and
            suggesting an expression that fits.
    """
    sized = [(name, size) for name, size in axes if size > 1]
    runs = []
    i = 0
    for target in layout.mesh_shape:
        run: list[str] = []
        product = 1
        while product < target and i < len(sized):
            run.append(sized[i][0])
            product *= sized[i][1]
            i += 1
        if product != target:
            raise _mismatch_error(layout, axes)
        runs.append(tuple(run))
    return tuple(runs)


def _mismatch_error(layout: Layout, axes: Sequence[tuple[str, int]]) -> EinshardError:
    expression = layout.expression
    mesh = ", ".join(f"{name!r}: {size}" for name, size in axes)
    wanted = " × ".join(map(str, layout.mesh_shape)) or "1"
    suggestion = suggest_for_mesh(layout, [size for _, size in axes])
    hint = (
        f"Under an ambient mesh, each element's count must be the product of consecutive mesh "
        f"axes, in the mesh's order; this one splits the devices as {wanted}."
    )
    if suggestion is not None:
        hint += f" An expression that fits: {suggestion!r}"
    return EinshardError(
        f"the expression does not fit the ambient mesh Mesh({mesh})",
        expression=expression.text,
        span=expression.right_span,
        hint=hint,
    )


def suggest_for_mesh(layout: Layout, sizes: Sequence[int]) -> str | None:
    """An expression with the same axes and shard counts as ``layout`` that fits the mesh.

    Keeps the sharded elements with their counts, in their order if that fits
    and else in the first order that does, and puts standalone replication
    counts where the mesh needs them; if the counts cannot be kept, gives each
    sharded axis one mesh axis in order.
    """
    expression = layout.expression
    sizes = [s for s in sizes if s > 1]
    right = [e for e in expression.right if not e.is_ellipsis]
    sharded = [
        (e.name, size)
        for e, size in zip(right, layout.element_sizes, strict=True)
        if e.name is not None and size > 1
    ]
    unsharded = [
        e.name
        for e, size in zip(right, layout.element_sizes, strict=True)
        if e.name is not None and size == 1
    ]
    # Few sharded axes (one per mesh axis at most), so trying every order is cheap.
    orders = itertools.permutations(sharded) if len(sharded) <= 6 else iter([tuple(sharded)])
    parts = next((fit for order in orders if (fit := _fit_runs(order, sizes)) is not None), [])
    if not parts and sharded:
        for (name, _), size in zip(sharded, sizes, strict=False):
            parts.append(f"{name}{size}")
        rest = math.prod(sizes[len(sharded) :])
        if rest > 1:
            parts.append(str(rest))
        unsharded += [name for name, _ in sharded[len(sizes) :]]
    parts += unsharded
    if expression.has_ellipsis:
        parts.append("...")
    return expression.with_right(parts)


def _fit_runs(sharded: Sequence[tuple[str, int]], sizes: Sequence[int]) -> list[str] | None:
    """RIGHT elements giving each ``(name, count)`` a run of mesh axes, in order, or ``None``."""
    parts: list[str] = []
    j = 0
    for name, count in sharded:
        run = _find_run(sizes, j, count)
        if run is None:
            return None
        replication = math.prod(sizes[j : run[0]])
        if replication > 1:
            parts.append(str(replication))
        parts.append(f"{name}{count}")
        j = run[1]
    rest = math.prod(sizes[j:])
    if rest > 1:
        parts.append(str(rest))
    return parts


def _find_run(sizes: Sequence[int], j: int, count: int) -> tuple[int, int] | None:
    """The first ``(start, stop)`` with ``start >= j`` and ``prod(sizes[start:stop]) == count``."""
    for start in range(j, len(sizes)):
        product, stop = 1, start
        while product < count and stop < len(sizes):
            product *= sizes[stop]
            stop += 1
        if product == count:
            return start, stop
    return None
