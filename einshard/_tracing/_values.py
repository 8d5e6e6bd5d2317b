"""What the jaxpr reader knows of one value.

A :class:`Value` carries per axis the parameter axes it is a factor of. The small questions asked
of a program (shapes, bytes, inner jaxprs, scan counts, reshape groups, the backward pass, the
user's line) are ``_tracing._jaxprs``'s.
"""

from __future__ import annotations

CONST, PARAM, ACT, BACK = 0, 1, 2, 3
"""What a value derives from, in increasing precedence: constants only, parameters (a weight
and constants: a *view* of it), the batch (an activation), or the gradients (backward)."""

EMPTY: frozenset = frozenset()

# Roles of a (leaf, axis) node, as the reading finds them.
CORE = frozenset({"contraction", "free", "gathered", "conv-in", "conv-out", "batch"})


class Value:
    """What the reader knows of one value: its kind, and per axis the tags it carries.

    A tag ``(node, outer, size)`` says that this axis is a factor of a parameter axis ``node``:
    ``outer`` is the product of the parameter axis's factors that are more major than this
    one, ``size`` this factor's length. Splitting the parameter axis ``p`` ways contiguously
    splits this axis too exactly when ``p`` does not divide ``outer``.
    """

    __slots__ = ("axes", "kind", "leaves")

    def __init__(self, kind: int, axes: tuple[frozenset, ...], leaves: frozenset = EMPTY) -> None:
        self.kind = kind
        self.axes = axes
        self.leaves = leaves


def plain(kind: int, rank: int) -> Value:
    return Value(kind, (EMPTY,) * rank)


def same_value(a: Value, b: Value) -> bool:
    return a.kind == b.kind and a.axes == b.axes and a.leaves == b.leaves
