"""XLA's involuntary full rematerialization, read from what the compiler printed."""

from __future__ import annotations

import math

from ..._language._expression import split_expression
from ..report._report import Finding
from ..xla import _hlo, _messages
from ._detect import REMAT, Context, only_sliced, rows_traffic


def find_remats(context: Context, excluded: set[int]) -> tuple[list[Finding], set[int]]:
    rows = context.rows
    claimed: set[int] = set()
    by_place: dict[tuple, list[tuple[str, str, str | None, str | None, list[int], int]]] = {}
    for message in dict.fromkeys(context.messages):
        remat = _messages.parse_remat(message)
        if remat is None:
            continue
        before, after, operation = remat.before_splits, remat.after_splits, remat.operation
        op_name, source, param = _described(context, operation)
        # The all-gather that replicates it (not counted yet): the same op name; else, as XLA
        # versions name them differently, a gather then slice of the same parameter or shape.
        free = [
            p
            for p, row in enumerate(rows)
            if p not in claimed and p not in excluded and row.kind == "all-gather"
        ]
        matched = [p for p in free if op_name and rows[p].op_name == op_name]
        if not matched:
            whole = _whole_shape(operation, before)
            sliced = [p for p in free if only_sliced(context, p)]
            matched = [p for p in sliced if param and rows[p].param == param]
            matched = matched or [p for p in sliced if whole and rows[p].shape == whole]
        matched = matched[:1]
        claimed.update(matched)
        if matched:
            traffic = rows_traffic(rows, matched)
            source = source or rows[matched[0]].source
            param = param or rows[matched[0]].param
        else:
            traffic = _estimated_remat(operation, before)
        expressions = (
            split_expression(before, context.n_devices) if before else remat.before,
            split_expression(after, context.n_devices) if after else remat.after,
        )
        by_place.setdefault((expressions, source, param), []).append(
            (expressions[0], expressions[1], source, param, matched, traffic)
        )
    out = []
    for (expressions, source, param), items in by_place.items():
        count = len(items)
        positions = tuple(p for item in items for p in item[4])
        times = f" ({count} times)" if count > 1 else ""
        what = param or "an array"
        cause = (
            f"XLA could not move {what} from '{expressions[0]}' to '{expressions[1]}' efficiently{times}, "
            "so it gathered the whole array on every device and sliced it (an involuntary full "
            "rematerialization)."
        )
        fix = (
            "Make the two layouts agree (the rule of the parameter, or the einshard(...) constraint "
            "at this line): then nothing moves. Where both layouts are needed, change them one axis at a "
            "time (einshard(...) to each in turn; XLA does each with an all-to-all or a slice), which "
            "sends less, not nothing."
        )
        out.append(
            Finding(
                REMAT,
                sum(item[5] for item in items),
                0,
                (param,) if param else (),
                (source,) if source else (),
                cause,
                fix,
                positions,
            )
        )
    return out, claimed


def _described(
    context: Context, operation: _hlo.Instruction | None
) -> tuple[str | None, str | None, str | None]:
    """The operation's op name, its source line and the parameter it is (``None`` where not known)."""
    if operation is None:
        return None, None, None
    op_name, file, line = context.uses.module.source(operation)
    source = f"{file}:{line}" if file is not None and line is not None else None
    param = None
    number = operation.parameter_number
    if number is not None and number < len(context.parameter_paths):
        param = context.parameter_paths[number]
    return op_name or None, source, param


def _whole_shape(operation: _hlo.Instruction | None, before: list[int] | None) -> tuple[int, ...] | None:
    """The array's whole shape: the operation's shape in the message (per device) times its splits."""
    shapes = operation.shapes if operation is not None else ()
    if not shapes or not before or len(before) != len(shapes[0].dims):
        return None
    return tuple(d * c for d, c in zip(shapes[0].dims, before, strict=True))


def _estimated_remat(operation: _hlo.Instruction | None, before: list[int] | None) -> int:
    """The gather's traffic from the message alone: the array whole, less the part each device had."""
    shapes = operation.shapes if operation is not None else ()
    if not shapes or not before:
        return 0
    parts = math.prod(before)
    return round(shapes[0].bytes * parts * (parts - 1) / parts)
