"""``explain``: what a rule table does to a tree, on any device count."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._arrays._leaves import nbytes
from .._language._text import size_text, table_text
from .._sharding._devices import Devices, call_devices
from ._assign import assign_rules
from ._rules import Rule, RulesLike

__all__ = ["Report", "ReportRow", "explain", "report_row"]


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One array leaf of an :func:`explain` report.

    Attributes:
        path: The leaf's path.
        shape: Its shape.
        dtype: Its dtype.
        rule: The deciding rule's regex, or ``None``.
        expression: The expression applied.
        shard_shape: The shape of the block each device holds.
        bytes: The leaf's size in bytes.
        bytes_per_device: The bytes each device holds of it.
        note: A fallback taken (scalar, no rule matched, next rule), or ``None``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    rule: str | None
    expression: str
    shard_shape: tuple[int, ...]
    bytes: int
    bytes_per_device: int
    note: str | None


@dataclasses.dataclass(frozen=True)
class Report:
    """What a rule table does to a tree: one row per array leaf, and totals.

    ``str(report)`` is a table (drawn with ``rich`` when it is installed).

    Attributes:
        rows: One :class:`ReportRow` per array leaf, in tree order.
        n_devices: The device count planned for.
        total_bytes: The bytes of all array leaves (the model, once).
        max_bytes_per_device: The bytes the busiest device holds.
        unused_rules: The *unused* rules: those that decided no leaf.
        unmatched_rules: Of those, the *unmatched* ones: their regex matches no path of the
            tree at all (a layer name the model does not have, a typo); a final catch-all ``.*``
            is never one.
    """

    rows: tuple[ReportRow, ...]
    n_devices: int
    total_bytes: int
    max_bytes_per_device: int
    unused_rules: tuple[Rule, ...]
    unmatched_rules: tuple[Rule, ...] = ()

    @property
    def replication_overhead(self) -> float:
        """Bytes held over all devices, as a multiple of the model's bytes (1.0: no copies)."""
        if not self.total_bytes:
            return 1.0
        return self.max_bytes_per_device * self.n_devices / self.total_bytes

    def __str__(self) -> str:
        return table_text(*_columns(self))


def explain(
    tree: Any,
    rules: RulesLike,
    *,
    n_devices: int | None = None,
    devices: Devices | None = None,
) -> Report:
    """Explains how a rule table lays out a tree, for any device count.

    Needs no devices when ``n_devices`` is given: plan a 256-device run on a
    laptop. Works on concrete trees and on ``jax.eval_shape`` output alike.

    Args:
        tree: A pytree of arrays or ``ShapeDtypeStruct`` leaves.
        rules: The rule table, with its policies (see :func:`~einshard.shard_pytree`).
        n_devices: The device count to plan for; defaults to that of ``devices``
            or of the einshard device order.
        devices: The devices, when ``n_devices`` is not given.

    Returns:
        A :class:`Report`.

    Raises:
        EinshardError: As :func:`~einshard.shard_pytree` would.

    >>> import jax, jax.numpy as jnp, einshard
    >>> tree = {'w': jax.ShapeDtypeStruct((1024, 1024), jnp.float32), 'b': jnp.zeros(1024)}
    >>> report = einshard.explain(tree, [('w', 'x y -> x y*'), ('.*', '... -> * ...')], n_devices=256)
    >>> report.total_bytes, report.max_bytes_per_device
    (4198400, 20480)
    """
    count = n_devices if n_devices is not None else call_devices(devices).count
    assignment, _ = assign_rules(tree, rules, n_devices=count)
    assigned = assignment.leaves
    rows = [
        report_row(
            assignment.path,
            assignment.shape,
            assignment.dtype,
            None if assignment.rule is None else assignment.rule.pattern,
            assignment.expression,
            assignment.layout.shard_shape(assignment.shape),
            assignment.note,
        )
        for _, assignment in assigned
        if assignment is not None
    ]
    # einshard lays every array over all devices, one block each, so every device holds the same.
    per_device = sum(row.bytes_per_device for row in rows)
    return Report(
        rows=tuple(rows),
        n_devices=count,
        total_bytes=sum(row.bytes for row in rows),
        max_bytes_per_device=per_device,
        unused_rules=assignment.unused,
        unmatched_rules=assignment.unmatched,
    )


def report_row(
    path: str,
    shape: tuple[int, ...],
    dtype: Any,
    rule: str | None,
    expression: str,
    shard_shape: tuple[int, ...],
    note: str | None,
) -> ReportRow:
    """A report's row for one leaf; its bytes, and each device's, from the shapes and the dtype."""
    return ReportRow(
        path=path,
        shape=tuple(shape),
        dtype=str(dtype),
        rule=rule,
        expression=expression,
        shard_shape=tuple(shard_shape),
        bytes=nbytes(shape, dtype),
        bytes_per_device=nbytes(shard_shape, dtype),
        note=note,
    )


def _columns(report: Report) -> tuple[list[str], list[list[str]], list[str]]:
    header = ["path", "shape", "dtype", "rule", "expression", "shard shape", "per device"]
    body = []
    for row in report.rows:
        rule = repr(row.rule) if row.rule is not None else f"({row.note})"
        if row.rule is not None and row.note:
            rule += f" ({row.note})"
        body.append(
            [
                row.path,
                str(row.shape),
                row.dtype,
                rule,
                row.expression,
                str(row.shard_shape),
                size_text(row.bytes_per_device),
            ]
        )
    footer = [
        f"{len(report.rows)} array{'' if len(report.rows) == 1 else 's'}, "
        f"{size_text(report.total_bytes)} on {report.n_devices} devices: "
        f"{size_text(report.max_bytes_per_device)} per device, "
        f"replication overhead {report.replication_overhead:.2f}x",
    ]
    copies = _copies(report)
    if copies:
        footer.append(copies)
    if report.unused_rules:
        footer.append("unused rules: " + ", ".join(str(rule) for rule in report.unused_rules))
    if report.unmatched_rules:
        count = len(report.unmatched_rules)
        footer.append(
            f"{count} rule{' matches' if count == 1 else 's match'} no path of this tree "
            "(a layer name it does not have?): "
            + ", ".join(repr(rule.pattern) for rule in report.unmatched_rules)
        )
    return header, body, footer


def _copies(report: Report, shown: int = 3) -> str | None:
    """The replication overhead in words: what each device holds beyond an even share, and for which leaves.

    An even share is the model's bytes over the device count, what each device would hold if every
    leaf were split over all devices; a leaf split over fewer (or replicated) adds the rest of its
    block to every device. ``None`` when there is nothing beyond the even share.
    """
    n = report.n_devices
    extra = {row.path: row.bytes_per_device - row.bytes / n for row in report.rows}
    beyond = report.max_bytes_per_device - report.total_bytes / n
    if n == 1 or beyond < 1:
        return None
    worst = sorted((path for path in extra if extra[path] >= 1), key=lambda path: -extra[path])
    leaves = ", ".join(f"{path} ({size_text(round(extra[path]))})" for path in worst[:shown])
    if len(worst) > shown:
        leaves += f" and {len(worst) - shown} more"
    return (
        f"replication: each device holds {size_text(round(beyond))} beyond an even 1/{n} share of the model "
        f"({size_text(round(report.total_bytes / n))}), from leaves not split over all {n} devices; "
        f"most from {leaves}"
    )
