"""Pictures: the device grid of an expression, drawn from the layout alone.

A picture looks exactly like what ``jax.debug.visualize_array_sharding`` prints
for the placed array (the same ``rich`` table, the same cell sizes, the
same ``CPU 0,8`` labels), but needs no array and no devices: with
``n_devices=`` it is computed from the pure :class:`~einshard.Layout`, so a
laptop can draw the layout of a 256-device run.

``rich`` is an optional dependency (``pip install rich``),
imported only when a picture is drawn.
"""

from __future__ import annotations

import io
import itertools
import sys
from collections.abc import Sequence
from typing import IO, Any

from .._language import _layout
from .._language._errors import EinshardError
from .._language._layout import Layout
from .._language._numbers import checked_shape
from ._devices import Devices, call_devices, device_order

__all__ = ["picture", "visualize"]

_INSTALL_HINT = "pip install rich (or pip install '.[pictures]' in einshard's source folder)"

# JAX's constants (jax._src.debugging.visualize_sharding).
_HEIGHT_TO_WIDTH_RATIO = 2.5

# Bounds that keep a picture's size (and the time to draw it) bounded.
MAX_DEVICES_DRAWN = 4096
MAX_SCALE = 10.0
MAX_WIDTH = 1000


def picture(
    expression: str,
    shape: Sequence[int],
    *,
    n_devices: int | None = None,
    devices: Devices | None = None,
    platform: str | None = None,
    scale: float = 1.0,
    min_width: int = 9,
    max_width: int = 80,
) -> str:
    """Draws which device holds which block of an array, as plain text.

    The grid is the one ``jax.debug.visualize_array_sharding`` prints for the
    array ``einshard`` places (without colour): one cell per block, labelled
    with the platform and the ids of the devices that hold it. It is computed
    from the layout alone, so with ``n_devices`` no devices are needed and any
    device count can be drawn; the cells are then labelled with the device
    positions ``0 .. n_devices - 1`` in the einshard device order, which are
    the device ids when the devices are ``jax.devices()`` of one host.

    Arrays of rank 1 and 2 give one grid, as in JAX (a scalar is drawn as a
    1-D array of one element). For rank 3 and more, the last two axes are
    drawn and there is one grid per block of the leading axes, in row-major
    order, each under a title line such as ``array[0:2, :, :]`` naming the part
    of the array it shows; grids are separated by a blank line.

    Args:
        expression: An einshard expression, e.g. ``'a b -> 2 a2* b*'``.
        shape: The array's shape.
        n_devices: A device count to draw for, without any devices.
        devices: Real devices instead, in order (a sequence of devices, or a
            :class:`jax.sharding.Mesh` meaning its flat device order); cells
            are labelled with their ids and platform. When neither is given,
            the einshard device order of the call (the ambient mesh, the
            :func:`~einshard.use_devices` block, or ``jax.devices()``).
        platform: The platform in the labels (upper-cased, as JAX does).
            Defaults to the devices' platform, or ``CPU`` with ``n_devices``.
        scale: Scales the grid, as in ``jax.debug.visualize_sharding``: a
            number above 0 and at most 10.
        min_width: The narrowest cell, in characters (at least 1).
        max_width: The widest cell, and the width of the whole picture
            (at least 1, at most 1000).

    Returns:
        The picture, lines without trailing spaces and no final newline.

    Raises:
        EinshardError: If the expression does not fit the shape or the devices,
            ``n_devices`` and ``devices`` disagree, a size argument is out of its
            bounds, or the layout has more than 4096 devices (too many to draw).
        ImportError: If ``rich`` is not installed.

    >>> import einshard
    >>> print(einshard.picture('x y -> x2 y*', (4, 8), n_devices=4))
    ┌───────────────────────┬───────────────────────┐
    │                       │                       │
    │         CPU 0         │         CPU 1         │
    │                       │                       │
    │                       │                       │
    ├───────────────────────┼───────────────────────┤
    │                       │                       │
    │         CPU 2         │         CPU 3         │
    │                       │                       │
    │                       │                       │
    └───────────────────────┴───────────────────────┘
    """
    _check_size_arguments(scale, min_width, max_width)
    layout, shape, labels, kind = _grid_inputs(expression, shape, n_devices, devices, platform)
    rich = _import_rich()
    buffer = io.StringIO()
    console = rich.console.Console(
        file=buffer,
        width=max_width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        force_interactive=False,
        legacy_windows=False,
        soft_wrap=False,
    )
    for i, (title, shown, shards, cells) in enumerate(_grids(layout, shape, labels)):
        if i:
            console.print()
        if title is not None:
            console.print(rich.text.Text(title))
        console.print(_table(rich, shown, shards, cells, kind, scale, min_width, max_width))
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines())


def visualize(expression: str, shape: Sequence[int], *, file: IO[str] | None = None, **options: Any) -> None:
    """Prints the :func:`picture` of an expression for a shape.

    The printing counterpart of :func:`picture`, as
    ``jax.debug.visualize_array_sharding`` is for a placed array:
    ``print(picture(expression, shape, **options), file=file)``.

    Args:
        expression: An einshard expression.
        shape: The array's shape.
        file: Where to print; defaults to ``sys.stdout``.
        **options: :func:`picture`'s keywords: ``n_devices``, ``devices``,
            ``platform``, ``scale``, ``min_width``, ``max_width``.

    Raises:
        EinshardError: If the expression does not fit the shape or the devices.
        ImportError: If ``rich`` is not installed.

    >>> import einshard
    >>> einshard.visualize('x -> x*', (6,), n_devices=3, platform='tpu')
    ┌───────┬───────┬───────┐
    │ TPU 0 │ TPU 1 │ TPU 2 │
    └───────┴───────┴───────┘
    """
    print(picture(expression, shape, **options), file=sys.stdout if file is None else file)


def _check_size_arguments(scale: object, min_width: object, max_width: object) -> None:
    """Refuses sizes that are not positive or that would make a picture without bound."""
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not 0 < scale <= MAX_SCALE  # NaN fails this too
    ):
        raise EinshardError(
            f"scale={scale!r} is not a number above 0 and at most {MAX_SCALE:g}",
            hint="scale multiplies the grid's height (10 lines at scale=1); e.g. scale=0.5 or 2.",
        )
    for name, value in (("min_width", min_width), ("max_width", max_width)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WIDTH:
            raise EinshardError(
                f"{name}={value!r} is not a whole number of characters from 1 to {MAX_WIDTH}",
                hint="The defaults are min_width=9, max_width=80.",
            )


def _check_drawable(layout: Layout) -> None:
    if layout.n_devices > MAX_DEVICES_DRAWN:
        raise EinshardError(
            f"a picture draws at most {MAX_DEVICES_DRAWN} devices, and this layout has {layout.n_devices}",
            expression=layout.expression.text,
            span=layout.expression.right_span,
            hint="einshard.layout(expression, shape, n_devices=...) describes larger layouts: "
            ".shards, .shard_shape(shape), .block_index(position).",
        )


def _import_rich() -> Any:
    """The ``rich`` modules a picture needs, or an ImportError that says how to get them."""
    try:
        import rich.align
        import rich.box
        import rich.console
        import rich.padding
        import rich.table
        import rich.text
    except ImportError as error:
        raise ImportError(
            f"einshard pictures need the optional dependency 'rich'; install it with: {_INSTALL_HINT}"
        ) from error
    return rich


def _grid_inputs(
    expression: str,
    shape: Sequence[int],
    n_devices: int | None,
    devices: Devices | None,
    platform: str | None,
) -> tuple[Layout, tuple[int, ...], tuple[int, ...], str]:
    """The layout, the checked shape, the label (device id) of each position, and the platform."""
    if devices is None and n_devices is not None:
        labels: tuple[int, ...] | None = None
        kind = "CPU"
    else:
        order = call_devices(devices).order
        if order is None:  # an ambient mesh known only abstractly (in a trace): no devices to label
            order = device_order(None)
        if n_devices is not None and n_devices != len(order):
            raise EinshardError(
                f"n_devices={n_devices!r} but devices= has {len(order)} devices",
                hint="Pass one or the other.",
            )
        n_devices = len(order)
        labels = tuple(device.id for device in order)
        kind = order[0].platform.upper()
    shape = checked_shape(shape)
    layout = _layout.layout(expression, shape, n_devices=n_devices)
    _check_drawable(layout)
    if labels is None:
        labels = tuple(range(n_devices))
    if platform is not None:
        kind = str(platform).upper()
    return layout, shape, labels, kind


def _grids(
    layout: Layout, shape: tuple[int, ...], labels: tuple[int, ...]
) -> list[tuple[str | None, tuple[int, ...], tuple[int, ...], dict[tuple[int, int], list[int]]]]:
    """One ``(title, shape, shards, cells)`` per grid to draw: one, or one per block of the leading axes.

    A grid shows the last two axes (``shape`` and ``shards`` of one or two axes); ``cells`` gives
    the labels of the devices holding each block of them.
    """
    rank = len(shape)
    n_lead = max(rank - 2, 0)
    lead_shards = layout.shards[:n_lead]
    shown = shape[n_lead:] or (1,)  # a scalar is drawn as one element
    blocks = {position: layout.block_index(position) for position in range(layout.n_devices)}
    result = []
    for lead in itertools.product(*map(range, lead_shards)):
        cells: dict[tuple[int, int], list[int]] = {}
        for position, block in blocks.items():
            if block[:n_lead] != lead:
                continue
            index = block[n_lead:]
            cell = (index[0], index[1]) if len(index) == 2 else (0, index[0] if index else 0)
            cells.setdefault(cell, []).append(labels[position])
        title = _title(shape, layout.shards, lead) if n_lead else None
        result.append((title, shown, layout.shards[n_lead:] or (1,), cells))
    return result


def _title(shape: tuple[int, ...], shards: tuple[int, ...], lead: tuple[int, ...]) -> str:
    """``array[0:2, :, :]``: the part of the array a grid shows."""
    parts = []
    for size, count, index in zip(shape, shards, lead, strict=False):
        block = size // count
        parts.append(":" if count == 1 else f"{index * block}:{(index + 1) * block}")
    parts += [":"] * (len(shape) - len(lead))
    return f"array[{', '.join(parts)}]"


def _table(
    rich: Any,
    shape: tuple[int, ...],
    shards: tuple[int, ...],
    cells: dict[tuple[int, int], list[int]],
    kind: str,
    scale: float,
    min_width: int,
    max_width: int,
) -> Any:
    """The rich table ``jax.debug.visualize_sharding`` draws without colour, cell for cell.

    ``shape`` and ``shards`` have one or two axes. A block's fraction of an
    axis is ``1 / count``, the very float JAX computes as ``block / size``.
    """
    base_height = int(10 * scale)
    aspect_ratio = (shape[1] if len(shape) == 2 else 1) / shape[0] if shape[0] else 1.0
    base_width = int(base_height * aspect_ratio)
    num_rows = max(i for i, _ in cells) + 1
    num_cols = max(j for _, j in cells) + 1
    table = rich.table.Table(
        show_header=False,
        show_lines=True,
        padding=0,
        highlight=True,
        pad_edge=False,
        box=rich.box.SQUARE,
    )
    for i in range(num_rows):
        row = []
        for j in range(num_cols):
            entry = f"{kind} " + ",".join(str(label) for label in sorted(cells[i, j]))
            width_fraction = 1 / shards[-1]
            width = int(width_fraction * base_width * _HEIGHT_TO_WIDTH_RATIO)
            height = int(1 / shards[0] * base_height) if len(shape) == 2 else 1
            width = min(max(width, min_width), max_width)
            left_padding, remainder = divmod(width - len(entry) - 2, 2)
            right_padding = left_padding + remainder
            top_padding, remainder = divmod(height - 2, 2)
            bottom_padding = top_padding + remainder
            padding = (
                max(top_padding, 0),
                max(right_padding, 0),
                max(bottom_padding, 0),
                max(left_padding, 0),
            )
            text = rich.text.Text(entry)
            row.append(rich.padding.Padding(rich.align.Align(text, "center", vertical="middle"), padding))
        table.add_row(*row)
    return table
