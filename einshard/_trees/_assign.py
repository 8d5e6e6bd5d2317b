"""Assigning every leaf of a tree its rule: which rule, which expression, which layout.

Pure: it needs only a device count, so :func:`~einshard.explain` can lay a tree out for
devices the machine does not have. The table's policies (``unmatched``,
``indivisible``) decide the leaves no rule fits. A leaf's errors get its
context here, once: the path, the shape, the rule and the device count.

The result, a :class:`TableAssignment`, says which of the table's rules are *unused* (they
decided no leaf) and which are *unmatched* (their regex matches no leaf's path, asked of the
compiled table: :meth:`~einshard._trees._rules.Rules.unmatched_rules`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._arrays._leaves import ARRAY_TYPES, is_array
from .._language._errors import EinshardError, adding_context
from .._language._expression import REPLICATE, axis_names
from .._language._layout import Layout, compile_layout
from ._paths import flatten_with_paths
from ._rules import Rule, Rules, RulesLike

__all__ = [
    "Assignment",
    "TableAssignment",
    "as_rules",
    "assign_leaves",
    "assign_rules",
    "describe_leaf",
    "leaf_context",
]


class Assignment(NamedTuple):
    """The rule one array leaf is assigned, and the layout it gives.

    Attributes:
        path: The leaf's path, e.g. ``'layers/0/mlp/w1/kernel'``.
        shape: The leaf's shape.
        dtype: The leaf's dtype.
        rule: The rule that decided it, or ``None`` (a scalar, or no rule
            matched and the policy replicates).
        expression: The expression applied.
        layout: The layout.
        note: Why the leaf did not simply follow its first matching rule, or ``None``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    rule: Rule | None
    expression: str
    layout: Layout
    note: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class TableAssignment:
    """What a table assigns the leaves of a tree: each leaf's rule, and the rules left over.

    Attributes:
        leaves: Each leaf with its :class:`Assignment` (``None`` for a leaf that passes through:
            not an array), in the order given.
        table: The table.
        unused: The table's *unused* rules: those that decided no leaf (matched none, or only
            leaves an earlier rule took, or passed over as not dividing).
    """

    leaves: list[tuple[Any, Assignment | None]]
    table: Rules
    unused: tuple[Rule, ...]

    @functools.cached_property
    def unmatched(self) -> tuple[Rule, ...]:
        """The table's *unmatched* rules: those whose regex matches no array leaf's path.

        All of them are unused; a final catch-all ``.*`` never is one (while there are leaves).
        """
        return self.table.unmatched_rules(a.path for _, a in self.leaves if a is not None)


def as_rules(rules: RulesLike) -> Rules:
    """The rule table, built if given as pairs or a dict."""
    return rules if isinstance(rules, Rules) else Rules(rules)


def assign_rules(tree: Any, rules: RulesLike, *, n_devices: int) -> tuple[TableAssignment, Any]:
    """Assigns every leaf of ``tree`` its rule, by the table and its policies: pure, for any device count.

    Returns:
        The :class:`TableAssignment`, and the tree structure.
    """
    leaves, paths, treedef = flatten_with_paths(tree)
    return assign_leaves(paths, leaves, rules, n_devices=n_devices), treedef


def assign_leaves(
    paths: Sequence[str], leaves: Sequence[Any], rules: RulesLike, *, n_devices: int
) -> TableAssignment:
    """:func:`assign_rules` for leaves already flattened with their paths (a step's arguments)."""
    table = as_rules(rules)
    used: set[int] = set()
    assigned: list[tuple[Any, Assignment | None]] = []
    # Leaves of one kind (same rule, same shape) share a layout: decide each kind once.
    fitting: dict[tuple[int, tuple[int, ...]], Layout] = {}
    # The loop runs once per leaf on every call: its lookups are bound once, out of it.
    match, fitted, append, array_types = table.match, fitting.get, assigned.append, ARRAY_TYPES
    for path, leaf in zip(paths, leaves, strict=True):
        if type(leaf) not in array_types and not is_array(leaf):
            append((leaf, None))
            continue
        shape = leaf.shape
        if type(shape) is not tuple:
            shape = tuple(shape)
        rule = match(path) if shape else None
        layout = None if rule is None else fitted((rule.index, shape))
        if layout is not None and rule is not None:
            assignment = Assignment(path, shape, leaf.dtype, rule, rule.expression, layout)  # type: ignore[arg-type]
            used.add(rule.index)
        else:
            assignment = _assign_leaf(path, leaf, table, n_devices)
            # A ByShape rule decides by dtype too: its leaves are assigned one by one.
            if (
                rule is not None
                and assignment.rule is rule
                and assignment.note is None
                and type(rule.expression) is str
            ):
                fitting[rule.index, shape] = assignment.layout
            if assignment.rule is not None:
                used.add(assignment.rule.index)
        append((leaf, assignment))
    return TableAssignment(assigned, table, tuple(rule for rule in table if rule.index not in used))


def describe_leaf(path: str, shape: tuple[int, ...]) -> str:
    """``'w' (shape (8, 16))``: a leaf, in messages."""
    return f"{path!r} (shape {shape})"


def leaf_context(
    error: EinshardError, path: str, shape: tuple[int, ...], rule: Rule | None, where: str
) -> None:
    """Adds ``while sharding 'w' (shape (8, 16)) with rule (...) on 8 devices``: the leaf at fault."""
    with_rule = f" with rule {rule}" if rule is not None else ""
    error.add_context(f"while sharding {describe_leaf(path, shape)}{with_rule} {where}")


def _assign_leaf(path: str, leaf: Any, rules: Rules, n_devices: int) -> Assignment:
    shape = tuple(leaf.shape)
    dtype = leaf.dtype
    if not shape:  # scalars are replicated whatever the rules say
        return Assignment(
            path, shape, dtype, None, REPLICATE, compile_layout(REPLICATE, 0, n_devices), "scalar"
        )
    rule = rules.match(path)
    if rule is None:
        if rules.unmatched == "replicate":
            layout = compile_layout(REPLICATE, len(shape), n_devices)
            return Assignment(path, shape, dtype, None, REPLICATE, layout, "no rule matched: replicated")
        tried = ", ".join(repr(r.pattern) for r in rules) or "(the table is empty)"
        raise EinshardError(
            f"no rule matches {describe_leaf(path, shape)}",
            hint=f"Add a rule for it, e.g. (r'{_suggest_pattern(path)}', '{_replicate_for(len(shape))}'), "
            f"end the table with "
            f"(r'.*', '{REPLICATE}') to replicate the rest, or build the table with "
            f"unmatched='replicate'.",
            context=[f"rules tried: {tried}"],
        )
    indivisible = rules.indivisible
    skipped: list[Rule] = []
    candidates = rules.matches(path) if indivisible == "next" else iter([rule])
    for candidate in candidates:
        with adding_context(leaf_context, path, shape, candidate, f"on {n_devices} devices"):
            expression, reason = candidate.expression_for(shape, dtype, n_devices)
            layout = compile_layout(expression, len(shape), n_devices)
            if indivisible == "error":
                layout.check_shape(shape)
        if indivisible != "error" and not _divides(layout, shape):
            if indivisible == "replicate":
                layout = compile_layout(REPLICATE, len(shape), n_devices)
                note = f"rule {candidate.index} does not divide {shape}: replicated"
                return Assignment(path, shape, dtype, None, REPLICATE, layout, note)
            skipped.append(candidate)
            continue
        note = reason
        if skipped:
            note = f"rule{'s' if len(skipped) > 1 else ''} {', '.join(str(r.index) for r in skipped)} "
            note += f"did not divide {shape}: rule {candidate.index} used" + (f"; {reason}" if reason else "")
        return Assignment(path, shape, dtype, candidate, expression, layout, note)
    tried = ", ".join(str(r) for r in skipped)
    raise EinshardError(
        f"no matching rule divides {describe_leaf(path, shape)} on {n_devices} devices",
        hint=f"Add a rule that fits, or end the table with (r'.*', '{REPLICATE}').",
        context=[f"rules tried: {tried}"],
    )


def _divides(layout: Layout, shape: tuple[int, ...]) -> bool:
    return all(size % count == 0 for size, count in zip(shape, layout.shards, strict=True))


def _suggest_pattern(path: str) -> str:
    """A regex for one leaf's kind: its last two path parts, unless one is a layer index."""
    parts = [part for part in path.split("/") if part and not part.isdigit()]
    return "/".join(parts[-2:]) + "$" if parts else ".*"


def _replicate_for(rank: int) -> str:
    names = " ".join(axis_names(rank)) if rank <= 26 else "..."
    return f"{names} -> * {names}"
