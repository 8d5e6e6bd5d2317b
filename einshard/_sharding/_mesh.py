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
import sys
import threading
import warnings
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._language._errors import EinshardError, EinshardWarning
from .._language._expression import REPLICATE, axis_names
from .._language._layout import Layout, compile_layout
from .._language._numbers import prime_factors
from ._devices import DeviceOrder

__all__ = [
    "ambient_spec",
    "device_mesh",
    "layout_mesh_shape",
    "layout_sharding",
    "mesh_axis_names",
    "shared_mesh_shape",
    "spec_entries",
    "spec_expression",
    "spec_split",
]

AxisRuns = tuple[tuple[str, ...], ...]


def mesh_axis_names(n: int) -> tuple[str, ...]:
    """The names of einshard's own mesh axes: ``a0``, ``a1`` and so on."""
    return tuple(f"a{i}" for i in range(n))


def shared_mesh_shape(n_devices: int) -> tuple[int, ...]:
    """The shape of the one mesh every layout over ``n_devices`` devices is written on, if it fits.

    Its axes are the prime factors of the device count, smallest first. A
    layout's mesh axes are written as runs of consecutive axes of this mesh, so
    every layout over a power-of-two count fits, and so does every layout whose
    counts grow along the right-hand side's order (``x2 y 3`` on 6, ``x4 3``
    on 12); the others (``x3 2`` on 6) get a mesh of their own (see
    :func:`layout_mesh_shape`).

    >>> shared_mesh_shape(8), shared_mesh_shape(12), shared_mesh_shape(1)
    ((2, 2, 2), (2, 2, 3), (1,))
    """
    return prime_factors(n_devices) or (1,)


def layout_mesh_shape(layout: Layout) -> tuple[int, ...]:
    """The mesh ``layout`` is written on: the shared one when it fits, else one of its own.

    A layout of its own order splits each of its mesh axes into its prime
    factors, largest first, so that the common orders that do not fit the
    shared mesh (``x3 4`` and ``x6 2`` on 12 devices) still share one mesh.
    """
    shared = shared_mesh_shape(layout.n_devices)
    if _runs(layout.mesh_shape, shared) is not None:
        return shared
    return tuple(p for size in layout.mesh_shape for p in reversed(prime_factors(size))) or (1,)


def _runs(targets: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
    """For each target size, the indices of a run of consecutive ``sizes`` whose product it is.

    Size-1 entries of ``sizes`` join no run. ``None`` when the targets do not
    split that way.
    """
    indices = [i for i, size in enumerate(sizes) if size > 1]
    runs = []
    k = 0
    for target in targets:
        run: list[int] = []
        product = 1
        while product < target and k < len(indices):
            run.append(indices[k])
            product *= sizes[indices[k]]
            k += 1
        if product != target:
            return None
        runs.append(tuple(run))
    return tuple(runs)


@functools.lru_cache(maxsize=256)
def device_mesh(devices: DeviceOrder, mesh_shape: tuple[int, ...]) -> Mesh:
    """The einshard mesh of this shape over this device order, cached (equal orders, equal meshes)."""
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(mesh_shape), mesh_axis_names(len(mesh_shape)))


@functools.lru_cache(maxsize=4096)
def layout_sharding(text: str, n_dims: int | None, devices: DeviceOrder) -> tuple[Layout, NamedSharding]:
    """The layout and the ``NamedSharding`` on einshard's mesh over ``devices``, cached.

    All layouts over one device order are written on one mesh where they fit
    (:func:`shared_mesh_shape`), so arrays of any two of them meet in one
    ``jit``; a layout that does not fit gets a mesh of its own, and the first
    time a process hands out layouts on two meshes of one device order, an
    :class:`~einshard.EinshardWarning` says so.
    """
    layout = compile_layout(text, n_dims, len(devices))
    mesh_shape = layout_mesh_shape(layout)
    runs = _runs(layout.mesh_shape, mesh_shape)
    assert runs is not None  # layout_mesh_shape chose a mesh the layout fits
    names = mesh_axis_names(len(mesh_shape))
    spec = _spec(layout, [tuple(names[i] for i in run) for run in runs])
    _note_mesh(devices, mesh_shape, layout)
    return layout, NamedSharding(device_mesh(devices, mesh_shape), spec)


def _spec(layout: Layout, runs: Sequence[tuple[str, ...]]) -> PartitionSpec:
    """The ``PartitionSpec`` of a layout whose canonical mesh axes are these runs of named axes."""
    spec: list[str | tuple[str, ...] | None] = []
    for axis in layout.spec:
        if axis is None:
            spec.append(None)
        else:
            run = runs[axis]
            spec.append(run[0] if len(run) == 1 else run)
    return PartitionSpec(*spec)


# For each device order, the meshes handed out so far, each with the first layout written on it.
_meshes_seen: dict[DeviceOrder, dict[tuple[int, ...], Layout]] = {}
_meshes_lock = threading.Lock()


def _note_mesh(devices: DeviceOrder, mesh_shape: tuple[int, ...], layout: Layout) -> None:
    """Warns the first time layouts on two different meshes of one device order are handed out."""
    with _meshes_lock:
        seen = _meshes_seen.setdefault(devices, {})
        if mesh_shape in seen:
            return
        earlier = next(iter(seen.items()), None)
        seen[mesh_shape] = layout
    if earlier is None:
        return
    shared = shared_mesh_shape(len(devices))
    # Name the layout that is off the shared mesh first, and suggest how it would fit.
    odd, other = (layout, earlier[1]) if mesh_shape != shared else (earlier[1], layout)
    suggestion = suggest_for_mesh(odd, shared)
    fix = f" An order that fits it: {suggestion!r}." if suggestion not in (None, odd.expression.text) else ""
    warnings.warn(
        f"{odd.expression.text!r} and {other.expression.text!r} are laid out on meshes of different "
        f"shapes over the same {len(devices)} devices ({_shape_text(layout_mesh_shape(odd))} and "
        f"{_shape_text(layout_mesh_shape(other))}), so arrays of the two cannot meet in one jit when "
        f"JAX must write an output of one on the other's mesh. Layouts whose counts multiply up in "
        f"the order {_shape_text(shared)} all share one mesh.{fix} See 'Layouts that cannot share a "
        "mesh' on the expressions page of the docs.",
        EinshardWarning,
        stacklevel=_user_stacklevel(),
    )


def _shape_text(shape: tuple[int, ...]) -> str:
    return " × ".join(map(str, shape))


def _user_stacklevel() -> int:
    """The stack level of the first frame outside einshard (and functools), for warnings."""
    frame = sys._getframe(1)
    level = 1
    package = __name__.rpartition(".")[0]
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == package or module.startswith(package + ".") or module == "functools"):
            return level
        frame = frame.f_back
        level += 1
    return level


@functools.lru_cache(maxsize=4096)
def ambient_spec(
    text: str, n_dims: int | None, axes: tuple[tuple[str, int], ...]
) -> tuple[Layout, PartitionSpec]:
    """The layout and the ``PartitionSpec`` on an ambient mesh with these ``(name, size)`` axes."""
    layout = compile_layout(text, n_dims, math.prod(size for _, size in axes))
    return layout, _spec(layout, match_runs(layout, axes))


def match_runs(layout: Layout, axes: Sequence[tuple[str, int]]) -> AxisRuns:
    """Matches each canonical mesh axis of ``layout`` to a run of consecutive ambient axes.

    Ambient axes of size 1 join no run (they split nothing).

    Raises:
        EinshardError: If the sizes do not split that way, naming the mesh and
            suggesting an expression that fits.
    """
    runs = _runs(layout.mesh_shape, [size for _, size in axes])
    if runs is None:
        raise _mismatch_error(layout, axes)
    return tuple(tuple(axes[i][0] for i in run) for run in runs)


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


# --- from a sharding back to text (explain_opt_state spells the layouts it reads off placed arrays) ---


def spec_entries(sharding: NamedSharding, rank: int) -> tuple[object, ...]:
    """The sharding's spec, one entry per axis of an array of ``rank`` axes (trailing ``None`` filled)."""
    entries = tuple(sharding.spec)
    return entries + (None,) * (rank - len(entries))


def spec_split(sharding: NamedSharding, rank: int) -> tuple[tuple[str, ...] | None, ...]:
    """Per array axis, the mesh axes of size above 1 that split it, or ``None``."""
    sizes = dict(sharding.mesh.shape)
    split = []
    for entry in spec_entries(sharding, rank):
        names = () if entry is None or entry is PartitionSpec.UNCONSTRAINED else entry
        names = (names,) if isinstance(names, str) else tuple(names)  # type: ignore[arg-type]
        split.append(tuple(name for name in names if sizes[name] > 1) or None)
    return tuple(split)


def spec_expression(sharding: object, rank: int) -> str:
    """An einshard expression for a sharding, over its mesh's axis order; else the sharding's text.

    Axes are named ``a``, ``b``, ... in order; a mesh axis that splits no array
    axis stays as a replication count: ``P(None, 'y')`` on a ``(2, 4)`` mesh
    ``('x', 'y')`` is ``'a b -> 2 a b4'``.
    """
    if getattr(sharding, "is_fully_replicated", False):
        return REPLICATE
    if not isinstance(sharding, NamedSharding) or rank > 26:
        return str(sharding)
    sizes = dict(sharding.mesh.shape)
    names = [name for name in sharding.mesh.axis_names if sizes[name] > 1]
    letters = axis_names(rank)
    owner: dict[str, int] = {}  # mesh axis -> array axis
    for axis, run in enumerate(spec_split(sharding, rank)):
        if run is None:
            continue
        start = names.index(run[0])
        if list(run) != names[start : start + len(run)] or any(name in owner for name in run):
            return str(sharding.spec)  # not a run of consecutive mesh axes: no expression says it
        owner.update(dict.fromkeys(run, axis))
    right: list[tuple[int | None, str]] = []  # (array axis or None, element)
    for axis, group in itertools.groupby(names, key=owner.get):
        count = math.prod(sizes[name] for name in group)
        right.append((axis, f"{letters[axis] if axis is not None else ''}{count}"))
    sharded = {axis for axis, _ in right if axis is not None}
    for axis in sorted(set(range(rank)) - sharded, reverse=True):
        at = next((k for k, (other, _) in enumerate(right) if other is not None and other > axis), len(right))
        right.insert(at, (axis, letters[axis]))
    return f"{' '.join(letters)} -> {' '.join(element for _, element in right)}"
