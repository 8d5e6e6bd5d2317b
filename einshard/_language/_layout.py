"""From a parsed expression, an array rank and a device count to a device layout.

Pure Python, no JAX: a :class:`Layout` says how many shards each array axis
has and which device (by its position in the einshard device order) holds
which block. It is what shardings, pictures and ``explain`` are made from.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

from ._errors import EinshardError, adding_context
from ._expression import LETTERS, Expression, RightElement, parse
from ._numbers import balanced_factors, checked_device_count, checked_n_dims, checked_shape, divisors_preview

__all__ = ["Layout", "carried_expression", "compile_layout", "integer_root", "layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each block of an array goes, for one expression, rank and device count.

    The devices form a mesh with one axis per RIGHT element, row-major over the
    einshard device order (the last element varies fastest). ``mesh_shape`` is
    the canonical form of that mesh: size-1 axes dropped and neighbouring
    replication axes merged, so equal layouts have equal meshes.

    Attributes:
        expression: The parsed expression.
        n_dims: The array's rank.
        n_devices: The device count.
        element_sizes: The resolved count of each RIGHT element, ``...`` excluded.
        shards: The number of shards of each array axis.
        axis_elements: For each array axis, the index of its RIGHT element in
            ``expression.right`` (``None`` for axes under ``...``).
        mesh_shape: The canonical mesh.
        spec: For each array axis, the index of its canonical mesh axis, or
            ``None`` when it is not split.
    """

    expression: Expression
    n_dims: int
    n_devices: int
    element_sizes: tuple[int, ...]
    shards: tuple[int, ...]
    axis_elements: tuple[int | None, ...]
    mesh_shape: tuple[int, ...]
    spec: tuple[int | None, ...]

    def __repr__(self) -> str:
        # The expression by its text: the parsed form, with every character span, buries the layout.
        fields = ", ".join(
            f"{field.name}={getattr(self, field.name)!r}"
            for field in dataclasses.fields(self)
            if field.name != "expression"
        )
        return f"Layout({self.expression.text!r}, {fields})"

    @property
    def replication(self) -> int:
        """How many devices hold each block."""
        return self.n_devices // math.prod(self.shards)

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raises :class:`EinshardError` unless every axis splits evenly.

        Args:
            shape: The array's shape.
        """
        shape = tuple(shape)
        if len(shape) != self.n_dims:
            raise _rank_error(self.expression, len(shape), shape)
        for axis, (size, count, element) in enumerate(
            zip(shape, self.shards, self.axis_elements, strict=True)
        ):
            if size % count == 0:
                continue
            assert element is not None  # axes under '...' are never split
            right = self.expression.right[element]
            resolved = f" ('{right}' resolves to {count} on {self.n_devices} devices)" if right.star else ""
            divisors = _divisors_text(math.gcd(size, self.n_devices))
            raise EinshardError(
                f"axis {right.name!r} (axis {axis} of shape {shape}) has size {size}, "
                f"which does not split into {count} shards{resolved}",
                expression=self.expression.text,
                span=right.span,
                hint=f"Use a count that divides {size} and the device count "
                f"({divisors}), or pad the array to a multiple of {count}.",
            )

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the block each device holds."""
        self.check_shape(shape)
        return tuple(size // count for size, count in zip(shape, self.shards, strict=True))

    def mesh_coordinates(self, position: int) -> tuple[int, ...]:
        """The canonical mesh coordinates of the device at ``position`` in the device order."""
        coordinates = []
        for size in reversed(self.mesh_shape):
            position, index = divmod(position, size)
            coordinates.append(index)
        return tuple(reversed(coordinates))

    def block_index(self, position: int) -> tuple[int, ...]:
        """Which block (shard index per array axis) the device at ``position`` holds."""
        coordinates = self.mesh_coordinates(position)
        return tuple(0 if axis is None else coordinates[axis] for axis in self.spec)

    def indices(self, shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """Device position → the slices of the array it holds.

        The pure counterpart of ``NamedSharding.devices_indices_map``: keys are
        positions in the einshard device order, not devices.
        """
        block = self.shard_shape(shape)
        result = {}
        for position in range(self.n_devices):
            index = self.block_index(position)
            result[position] = tuple(
                slice(None) if count == 1 else slice(i * b, (i + 1) * b)
                for i, b, count in zip(index, block, self.shards, strict=True)
            )
        return result


def integer_root(value: int, k: int) -> int | None:
    """The integer ``r`` with ``r ** k == value``, or ``None`` if there is none.

    Exact for any size of integer (einshard 0.2.0 used a float root, which
    missed ``64 ** (1/3) == 4``).

    >>> integer_root(64, 3), integer_root(32, 2)
    (4, None)
    """
    if value < 1 or k < 1:
        return None
    low, high = 1, 1 << (value.bit_length() // k + 1)
    while low <= high:
        middle = (low + high) // 2
        power = middle**k
        if power == value:
            return middle
        if power < value:
            low = middle + 1
        else:
            high = middle - 1
    return None


def compile_layout(text: str, n_dims: int | None, n_devices: int) -> Layout:
    """Resolves an expression for an array rank and a device count.

    Args:
        text: The expression.
        n_dims: The array's rank; ``None`` takes the number of LEFT names
            (an error if the expression has ``...``).
        n_devices: The number of devices.

    Returns:
        The :class:`Layout`.

    Raises:
        EinshardError: If the expression does not fit the rank or the devices.

    >>> layout = compile_layout('a b -> 2 a2* b*', 2, 16)
    >>> layout.element_sizes, layout.shards, layout.mesh_shape
    ((2, 4, 2), (4, 2), (2, 4, 2))
    """
    # Checked before the cache: it would take True for 1 (a cache never decides validity).
    return _compile_layout(text, checked_n_dims(n_dims), checked_device_count(n_devices))


@functools.lru_cache(maxsize=4096)
def _compile_layout(text: str, n_dims: int | None, n_devices: int) -> Layout:
    expression = parse(text)
    n_dims = _check_rank(expression, n_dims)
    element_sizes = _resolve_counts(expression, n_devices)

    # Each array axis is split by the RIGHT element of the same name.
    element_of = {e.name: i for i, e in enumerate(expression.right) if e.name is not None}
    axis_elements: list[int | None] = []
    for element in expression.left:
        if element.name is None:  # '...'
            axis_elements.extend([None] * (n_dims - len(expression.left) + 1))
        else:
            axis_elements.append(element_of[element.name])
    size_of = {}
    sizes = iter(element_sizes)
    for i, element in enumerate(expression.right):
        if not element.is_ellipsis:
            size_of[i] = next(sizes)
    shards = tuple(1 if e is None else size_of[e] for e in axis_elements)

    # Canonical mesh: drop size-1 axes, merge runs of replication axes.
    axis_of_element: dict[int, int] = {}
    mesh_shape: list[int] = []
    last_was_replication = False
    for i, element in enumerate(expression.right):
        size = size_of.get(i, 1)
        if size == 1:
            continue
        if element.name is None:
            if last_was_replication:
                mesh_shape[-1] *= size
            else:
                mesh_shape.append(size)
            last_was_replication = True
        else:
            axis_of_element[i] = len(mesh_shape)
            mesh_shape.append(size)
            last_was_replication = False
    spec = tuple(None if e is None else axis_of_element.get(e) for e in axis_elements)
    return Layout(
        expression=expression,
        n_dims=n_dims,
        n_devices=n_devices,
        element_sizes=element_sizes,
        shards=shards,
        axis_elements=tuple(axis_elements),
        mesh_shape=tuple(mesh_shape),
        spec=spec,
    )


def _check_rank(expression: Expression, n_dims: int | None) -> int:
    n_named = len(expression.left)
    if n_dims is None:
        if expression.has_ellipsis:
            raise EinshardError(
                "the expression has '...', so it needs the array's rank",
                expression=expression.text,
                span=next(e.span for e in expression.left if e.is_ellipsis),
                hint="Pass n_dims= or shape= (einshard(x, ...) reads them from the array).",
            )
        return n_named
    if expression.has_ellipsis:
        if n_dims < n_named - 1:
            raise _rank_error(expression, n_dims, None)
    elif n_dims != n_named:
        raise _rank_error(expression, n_dims, None)
    return n_dims


def _rank_error(expression: Expression, n_dims: int, shape: tuple[int, ...] | None) -> EinshardError:
    names = expression.left_names
    of_shape = f" (shape {shape})" if shape is not None else ""
    if expression.has_ellipsis:
        headline = (
            f"the expression names {len(names)} axes besides '...', but the array has {n_dims}{of_shape}"
        )
    else:
        headline = f"the expression names {len(names)} axes, but the array has {n_dims}{of_shape}"
    if n_dims > len(names) and not expression.has_ellipsis:
        left = " ".join([*map(str, expression.left), "..."])
        right = " ".join([*map(str, expression.right), "..."])
        hint = f"Name every axis of the array, or let '...' stand for the unsharded rest: '{left} -> {right}'"
    else:
        hint = "Name exactly the array's axes on the left-hand side, in order."
    return EinshardError(headline, expression=expression.text, span=expression.left_span, hint=hint)


def _resolve_counts(expression: Expression, n_devices: int) -> tuple[int, ...]:
    """The count of each RIGHT element (``...`` excluded), for ``n_devices`` devices."""
    elements = [e for e in expression.right if not e.is_ellipsis]
    fixed = math.prod(e.number for e in elements if not e.star)
    starred = [e for e in elements if e.star]
    base = math.prod(e.number for e in starred)
    text = expression.text
    if not starred:
        if fixed == n_devices:
            return tuple(e.number for e in elements)
        if n_devices % fixed == 0:
            hint = (
                f"Add a '*' to replicate over the other {n_devices // fixed}, or make a count "
                f"proportional: {expression.with_right([*map(str, expression.right), '*'])!r}"
            )
        else:
            hint = _fitting_hint(expression, elements, n_devices)
        plural = "" if fixed == 1 else "s"
        raise EinshardError(
            f"the expression needs exactly {fixed} device{plural}, but there are {n_devices}",
            expression=text,
            span=expression.right_span,
            hint=hint,
        )
    if n_devices % (fixed * base):
        raise EinshardError(
            f"the counts need a multiple of {fixed * base} devices, but there are {n_devices}",
            expression=text,
            span=expression.right_span,
            hint=_fitting_hint(expression, elements, n_devices),
        )
    rest = n_devices // (fixed * base)
    root = integer_root(rest, len(starred))
    if root is None:
        share = f"{n_devices} devices leave a factor of {rest}"
        raise EinshardError(
            f"{share} for {len(starred)} starred elements, which is not a whole {_power_name(len(starred))}",
            expression=text,
            span=_cover_spans([e.span for e in starred]),
            hint="Starred elements grow by the same factor. "
            + _fitting_hint(expression, elements, n_devices),
        )
    return tuple(e.number * root if e.star else e.number for e in elements)


def _cover_spans(spans: list[tuple[int, int]]) -> tuple[int, int]:
    return min(s for s, _ in spans), max(e for _, e in spans)


def _power_name(k: int) -> str:
    return {2: "square", 3: "cube"}.get(k, f"{k}th power")


def _fitting_hint(expression: Expression, elements: list[RightElement], n_devices: int) -> str:
    """Suggests counts for the expression's elements that multiply to ``n_devices``."""
    names = [e for e in elements if e.name is not None]
    targets = names or elements
    if not targets:
        return f"Add '*' to the right-hand side to replicate over all {n_devices} devices."
    factors = balanced_factors(n_devices, len(targets))
    suggestion = []
    picked = iter(factors)
    target_ids = {id(e) for e in targets}
    for element in expression.right:
        if element.is_ellipsis:
            suggestion.append("...")
        elif id(element) in target_ids:
            count = next(picked)
            suggestion.append(f"{element.name or ''}{count if count > 1 or not element.name else ''}")
        # standalone counts are dropped from the suggestion
    fixed = expression.with_right(suggestion)
    return (
        f"With {n_devices} devices the counts must multiply to {n_devices}; for example "
        f"{fixed!r}, or use '*' to let einshard fit any device count."
    )


def _divisors_text(n: int) -> str:
    """The divisors of ``n`` for a hint: all of them, or the first few."""
    divisors, complete = divisors_preview(n)
    if complete:
        return ", ".join(map(str, divisors))
    return f"for example {', '.join(map(str, divisors[:-1]))}, …, {divisors[-1]}"


def layout(expression: str, shape: Sequence[int], *, n_devices: int) -> Layout:
    """The layout of ``expression`` for an array of ``shape`` on ``n_devices`` devices.

    Needs no devices: use it to lay out a run on more devices than you have.

    Args:
        expression: An einshard expression.
        shape: The array's shape.
        n_devices: The device count.

    Returns:
        The :class:`Layout`, checked against ``shape``.

    Raises:
        EinshardError: If the expression does not fit the shape or device count.

    >>> import einshard
    >>> layout = einshard.layout('x y -> x y*', (128, 256), n_devices=256)
    >>> layout.shard_shape((128, 256)), layout.replication
    ((128, 1), 1)
    """
    shape = checked_shape(shape)
    with adding_context(_layout_context, shape, n_devices):
        parse(expression)  # a clear error for a non-string before the cache sees it
        result = compile_layout(expression, len(shape), n_devices)
        result.check_shape(shape)
    return result


def _layout_context(error: EinshardError, shape: tuple[int, ...], n_devices: int) -> None:
    error.add_context(f"for an array of shape {shape} on {n_devices} devices")


def carried_expression(layout: Layout, axes: Sequence[int | None]) -> str:
    """The layout's expression for an array whose axes carry ``axes`` of it (``None``: an axis of its own).

    Each carried axis keeps its name and split; an axis not carried leaves
    both sides, its count (or star) staying as a standalone element so the
    device mesh is unchanged; the array's own axes get fresh, unsplit names.
    For ``'x y -> x y*'``: ``(1,)`` gives ``'y -> y*'``, ``(0,)`` gives
    ``'x -> x *'``, ``(None, 0, 1)`` gives ``'a x y -> a x y*'``.
    """
    expression = layout.expression
    if tuple(axes) == tuple(range(layout.n_dims)):
        return expression.text
    used = set(expression.left_names)
    letters = LETTERS
    fresh = (n for n in itertools.chain(letters, (a + b for a in letters for b in letters)) if n not in used)
    # Each axis by name ('...' spelled out with fresh names), and each right element as text.
    names = [expression.right[e].name if e is not None else None for e in layout.axis_elements]
    names = [name if name is not None else next(fresh) for name in names]
    under = [names[a] for a, e in enumerate(layout.axis_elements) if e is None]
    right: list[tuple[str | None, str]] = []  # (axis name or None, element text)
    for element in expression.right:
        if element.is_ellipsis:
            right += [(name, name) for name in under]
        else:
            right.append((element.name, str(element)))
    leaf_names = [names[a] if a is not None else next(fresh) for a in axes]
    position = {name: j for j, name in enumerate(leaf_names)}
    out, emitted = [], 0
    for name, element in right:
        if name is not None and name in position:
            while emitted < position[name]:  # fresh names of the array's earlier axes go first
                if axes[emitted] is None:
                    out.append(leaf_names[emitted])
                emitted += 1
            out.append(element)
            emitted = max(emitted, position[name] + 1)
        else:  # a count or star stays, standalone
            standalone = element if name is None else element[len(name) :]
            if standalone:
                out.append(standalone)
    out += [leaf_names[j] for j in range(emitted, len(axes)) if axes[j] is None]
    return f"{' '.join(leaf_names)} -> {' '.join(out)}".strip()
