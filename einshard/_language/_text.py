"""How einshard writes sizes, times and tables for people: the reports' one text module.

Pure Python. ``rich`` (an optional dependency) draws the tables when it is installed; without it
they are plain text with the same columns. Cells and footer lines are drawn as they are, never
read as ``rich`` markup (a rule's regex such as ``'[a-z]+'`` would otherwise lose its brackets).
"""

from __future__ import annotations

import io

__all__ = ["seconds_text", "size_text", "table_text"]


def size_text(n: float) -> str:
    """A size in bytes, in binary units: ``512 B``, ``1.5 KiB``, ``64.0 MiB``.

    >>> size_text(512), size_text(1536), size_text(64 * 2**20)
    ('512 B', '1.5 KiB', '64.0 MiB')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def seconds_text(value: float | None) -> str:
    """A time in seconds, to 3 significant digits in the largest unit below it; ``-`` for ``None``.

    >>> seconds_text(2.5), seconds_text(0.00125), seconds_text(None), seconds_text(3e-21)
    ('2.5 s', '1.25 ms', '-', '0 ns')
    """
    if value is None:
        return "-"
    if abs(value) < 1e-12:  # a difference of sums, zero but for rounding: not "6.78e-12 ns"
        value = 0.0
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if value >= scale or unit == "ns":
            return f"{value / scale:.3g} {unit}"
    raise AssertionError("unreachable")


def table_text(
    header: list[str],
    body: list[list[str]],
    footer: list[str],
    empty: str | None = None,
    *,
    width: int = 200,
) -> str:
    """A report's table and its footer lines, drawn with ``rich`` when it is installed, else as plain text.

    Args:
        header: The column titles.
        body: The rows, one string per column.
        footer: Lines printed under the table.
        empty: What stands in for the table when ``body`` has no rows (``None``: the header alone).
        width: The widest the text may be, in characters (``rich`` wraps cells to fit).

    Returns:
        The text, lines without trailing spaces and no final newline.
    """
    try:
        return _rich_table(header, body, footer, empty, width)
    except ImportError:
        return _plain_table(header, body, footer, empty)


def _rich_table(
    header: list[str], body: list[list[str]], footer: list[str], empty: str | None, width: int
) -> str:
    import rich.box
    import rich.console
    import rich.table
    import rich.text

    table = rich.table.Table(*header, box=rich.box.SIMPLE_HEAD, show_edge=False)
    for line in body:
        table.add_row(*(rich.text.Text(cell) for cell in line))
    buffer = io.StringIO()
    console = rich.console.Console(file=buffer, width=width, color_system=None, force_terminal=False)
    if body or empty is None:
        console.print(table)
    else:
        console.print(empty, highlight=False, markup=False)
    for line in footer:
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines())


def _plain_table(header: list[str], body: list[list[str]], footer: list[str], empty: str | None) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *body, strict=True)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in body]
    if not body and empty is not None:
        lines = [empty]
    return "\n".join([*lines, *footer])
