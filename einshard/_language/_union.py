"""Disjoint sets of integers (union-find): which items a relation joins into one group.

One implementation for the two places that group things: the devices a collective-permute's
pairs connect (``_cost._hlo``) and the parameter axes the jaxpr reader finds split together
(``_planning._jaxpr``).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["UnionFind"]


class UnionFind:
    """Disjoint sets of integers, joined as they are found to belong together.

    >>> sets = UnionFind(range(5))
    >>> sets.join([0, 3]); sets.join([3, 4])
    >>> sets.groups()
    [[0, 3, 4], [1], [2]]
    """

    __slots__ = ("parent",)

    def __init__(self, items: Iterable[int] = ()) -> None:
        self.parent: dict[int, int] = {item: item for item in items}

    def find(self, item: int) -> int:
        """The representative of ``item``'s set (an item not seen yet is a set of its own)."""
        parent = self.parent
        parent.setdefault(item, item)
        while parent[item] != item:
            parent[item] = parent[parent[item]]  # path halving
            item = parent[item]
        return item

    def join(self, items: Iterable[int]) -> None:
        """Puts ``items`` in one set; the first one's representative stays the set's."""
        first = None
        for item in items:
            root = self.find(item)
            if first is None:
                first = root
            elif root != first:
                self.parent[root] = first

    def groups(self) -> list[list[int]]:
        """Every set, its items in increasing order, the sets by their smallest item."""
        out: dict[int, list[int]] = {}
        for item in sorted(self.parent):
            out.setdefault(self.find(item), []).append(item)
        return list(out.values())
