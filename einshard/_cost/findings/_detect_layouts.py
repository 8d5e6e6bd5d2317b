"""Layouts a better table would not have: ``reshard`` (moved between layouts) and ``copied`` (held whole)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from ..._arrays._leaves import nbytes
from ..._language._expression import parse, split_expression
from ..._language._text import size_text
from ..._trees._rules import ending_pattern
from ..reading._uses import gathered_chunks, slice_shape, source_array
from ..report._report import Finding
from ._detect import (
    COPIED,
    RESHARD,
    Context,
    array_text,
    is_user_collective,
    rows_params,
    rows_sources,
    rows_traffic,
)

# --- layouts as expressions -----------------------------------------------------------------------


def _reshard_rows(context: Context, excluded: set[int]) -> list[tuple[int, str, str]]:
    """``(row, from, to)`` for every reshard the partitioner inserted (expressions, or '')."""
    rows = context.rows
    out = []
    moved: dict[str, tuple[str, str]] = {}  # by instruction: the arrays of one all-to-all move together
    for position, row in enumerate(rows):
        if position in excluded or is_user_collective(row):
            continue
        value = context.values[position]
        if row.kind in ("all-to-all", "collective-permute"):
            if row.instruction not in moved:
                moved[row.instruction] = _moved(context, position)
            out.append((position, *moved[row.instruction]))
        elif row.kind == "all-gather" and value is not None:
            fraction = context.uses.slice_fraction(value)
            if fraction is not None and fraction < 1:
                out.append((position, *_gathered(context, position, fraction)))
    return out


def _moved(context: Context, position: int) -> tuple[str, str]:
    """The layouts an all-to-all moves an array between.

    As expressions where the program shows them (split over all devices before and after),
    else as its per-device shapes.
    """
    row = context.rows[position]
    value = context.values[position]
    if row.kind != "all-to-all" or value is None:
        return "", ""
    flow = context.uses.flow
    instruction = flow.all.get(row.instruction)
    if instruction is None:
        return "", ""
    sources = {id(a): a for a in (source_array(flow, operand) for operand in instruction.operands)}
    source = next(iter(sources.values())) if len(sources) == 1 else None
    target = gathered_chunks(flow, instruction)
    if source is None or target is None:
        return "", ""
    before = source.shapes[0].dims
    # The chunks may be put together in another shape first (a concatenate), then reshaped.
    users = flow.users_in(instruction.computation)
    for _ in range(3):
        if len(target.shapes) != 1 or len(target.shapes[0].dims) == len(before):
            break
        following = users.get(target.name, ())
        if len(following) != 1 or len(following[0].shapes) != 1:
            break
        if following[0].shapes[0].size != target.shapes[0].size:
            break
        target = following[0]
    after = target.shapes[0].dims
    n = row.group_size
    if len(before) != len(after) or math.prod(before) != math.prod(after):
        return "", ""
    grew = [a for a in range(len(before)) if after[a] == before[a] * n]
    shrank = [a for a in range(len(before)) if before[a] == after[a] * n]
    if len(grew) != 1 or len(shrank) != 1 or n != context.n_devices:
        return (
            f"{row.dtype}[{','.join(map(str, before))}] per device",
            f"{row.dtype}[{','.join(map(str, after))}] per device",
        )
    counts_before = [n if a == grew[0] else 1 for a in range(len(before))]
    counts_after = [n if a == shrank[0] else 1 for a in range(len(before))]
    return split_expression(counts_before, n), split_expression(counts_after, n)


def _gathered(context: Context, position: int, fraction: Fraction) -> tuple[str, str]:
    """The layouts of an all-gather then slice: split on the gathered axis, then as sliced."""
    row = context.rows[position]
    value = context.values[position]
    n = row.group_size
    if value is None or n != context.n_devices:
        return "", ""
    gather = context.uses.flow.all.get(row.instruction)
    axis = ((gather.dimensions if gather is not None else ()) or (0,))[0]
    sliced = slice_shape(context.uses, value)
    if sliced is None or len(sliced) != len(row.shape):
        return "", ""
    before = [n if a == axis else 1 for a in range(len(row.shape))]
    after = [row.shape[a] // sliced[a] if sliced[a] else 1 for a in range(len(row.shape))]
    return split_expression(before, n), split_expression(after, n)


def find_reshards(context: Context, excluded: set[int]) -> list[Finding]:
    rows = context.rows
    found = _reshard_rows(context, excluded)
    by_place: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    layouts: dict[tuple, tuple[str, str]] = {}
    for position, before, after in found:
        place = (rows[position].kind, rows_sources(rows, [position]))
        by_place.setdefault(place, []).append(position)
        if before and place not in layouts:
            layouts[place] = (before, after)
    out = []
    for (kind, sources), positions in by_place.items():
        row = rows[positions[0]]
        what = (
            "an all-gather then a slice"
            if kind == "all-gather"
            else f"{'an' if kind[0] == 'a' else 'a'} {kind}"
        )
        arrays = f"{len(positions)} arrays" if len(positions) > 1 else array_text(row)
        before, after = layouts.get((kind, sources), ("", ""))
        if kind == "collective-permute":
            between = "to other devices (the same shards)"
        elif before and "->" in before:
            between = f"from '{before}' to '{after}'"
        elif before:
            between = f"from {before} to {after}"
        else:
            between = "from one layout to another"
        cause = (
            f"The partitioner moves {arrays} ({size_text(sum(rows[p].total_bytes for p in positions))} "
            f"per device) {between} with {what}: the value is made in one layout and used in another."
        )
        fix = (
            "Give producer and consumer one layout: where the step fixes one of them (a rule, an "
            "einshard(...) call), make it the other's; where neither is fixed, an einshard(...) "
            "constraint at this line chooses one."
        )
        out.append(
            Finding(
                RESHARD,
                rows_traffic(rows, positions),
                0,
                rows_params(rows, positions),
                sources,
                cause,
                fix,
                tuple(positions),
            )
        )
    return out


def find_copied(context: Context) -> list[Finding]:
    """Large parameters held whole on every device by a table meant to split parameters.

    A table is meant to split parameters when it splits some, or when it has splitting rules
    that match no leaf at all (written for layer names this model does not have). A parameter is
    a leaf the step updates (not its batch); large: a matrix at least the size of the smallest
    split parameter. One finding per reason (no rule, a rule that cannot split, the catch-all).
    """
    if not context.layouts:
        return []
    flow = context.uses.flow
    trained = {
        context.parameter_paths[k] for k in flow.updated_parameters() if k < len(context.parameter_paths)
    }
    layouts = [leaf for leaf in context.layouts if leaf is not None and leaf.path in trained]
    split = [leaf for leaf in layouts if math.prod(leaf.layout.shards) > 1]
    unmatched = context.table.unmatched_rules(context.paths) if context.table else ()
    idle = [rule for rule in unmatched if _splits(rule)]
    if not split and not idle:
        return []
    smallest = min((_assignment_bytes(leaf) for leaf in split), default=0)
    ways = max((math.prod(leaf.layout.shards) for leaf in split), default=context.n_devices)
    by_reason: dict[str, list[Any]] = {}
    words: dict[str, str] = {}
    catch_alls = context.table.matching_all(context.paths) if context.table else ()
    for leaf in layouts:
        if len(leaf.shape) < 2 or math.prod(leaf.layout.shards) > 1 or _assignment_bytes(leaf) < smallest:
            continue
        why = _why_copied(leaf, catch_alls)
        if why is not None:
            by_reason.setdefault(why[0], []).append(leaf)
            words.setdefault(why[0], why[1])
    out = []
    for reason, chosen in by_reason.items():
        why = words[reason]
        if len(chosen) == 1:  # the words speak of several
            why = why.replace("them", "it").replace("their rules do", "its rule does")
        chosen.sort(key=lambda leaf: -_assignment_bytes(leaf))
        total = sum(_assignment_bytes(leaf) for leaf in chosen)
        held = sum(_assignment_bytes(leaf) - _assignment_bytes(leaf) // ways for leaf in chosen)
        what = (
            f"{chosen[0].path} ({size_text(total)}) is"
            if len(chosen) == 1
            else f"{len(chosen)} parameters ({size_text(total)}, the largest {chosen[0].path}) are"
        )
        splits = f"splits other parameters {ways} ways" if split else "splits none"
        unused = (
            f"; its splitting rules {', '.join(str(rule) for rule in idle[:3])}"
            f"{' ...' if len(idle) > 3 else ''} match no parameter"
            if idle
            else ""
        )
        cause = f"{what} held whole on every device: {why}, while the table {splits}{unused}."
        examples = ", ".join(_suggested_rule(leaf, ways, context.n_devices) for leaf in chosen[:2])
        fix = f"Add a rule for {'it' if len(chosen) == 1 else 'them'} in front, e.g. {examples}."
        out.append(Finding(COPIED, 0, held, tuple(leaf.path for leaf in chosen), (), cause, fix, ()))
    return out


def _splits(rule: Any) -> bool:
    """Whether a rule's expression splits an axis (a shape-dependent rule may)."""
    if not isinstance(rule.expression, str):
        return True
    return any(
        element.name is not None and (element.star or (element.count or 1) > 1)
        for element in parse(rule.expression).right
    )


def _assignment_bytes(leaf: Any) -> int:
    return nbytes(leaf.shape, leaf.dtype)


def _why_copied(leaf: Any, catch_alls: Sequence[Any]) -> tuple[str, str] | None:
    """Why the table copies a leaf it was not told to copy: a kind, and words.

    ``None`` when a rule says to copy it.
    """
    rule = leaf.rule
    smaller = getattr(getattr(rule, "expression", None), "min_bytes", 0)
    if isinstance(smaller, int) and _assignment_bytes(leaf) < smaller:
        return None  # a shape rule that copies what is below its size on purpose (FSDP's min_bytes)
    if leaf.note:
        return "note", f"their rules do not split them (e.g. {leaf.path}: {leaf.note})"
    if rule is None:
        return "unmatched", "no rule matches them (the table's policy replicates such leaves)"
    # A rule that matches every leaf (the table's catch-all) was not written for this one.
    if rule in catch_alls:
        return "catch-all", f"only the catch-all rule {rule} matches them"
    return None


def _suggested_rule(leaf: Any, ways: int, n_devices: int) -> str:
    order = sorted(range(len(leaf.shape)), key=lambda axis: -leaf.shape[axis])
    for axis in order:
        if leaf.shape[axis] % ways == 0:
            counts = [ways if a == axis else 1 for a in range(len(leaf.shape))]
            return f"({ending_pattern(leaf.path)!r}, {split_expression(counts, n_devices)!r})"
    return f"({ending_pattern(leaf.path)!r}, ...) splitting an axis that {ways} divides (none does: pad one)"
