"""How many times each part of a compiled program runs: the one answer, for the flops and the walk.

Part of the reader of XLA's text (``_hlo`` parses it; this module asks the parsed instructions and
runs no regular expression): how many times a computation called in a role runs per run of its
caller (:func:`runs_per_call`, which :meth:`~._hlo.Module.times` and the step time's walk both
follow), and a ``while``'s trip count read from its counter where XLA prints none
(:func:`counted_trips`: TPU's compiler keeps no ``known_trip_count``). It takes the module as
``_hlo`` gives it (typed ``Any``: ``_hlo`` imports this module, not the other way round).
"""

from __future__ import annotations

from typing import Any

__all__ = ["counted_trips", "runs_per_call"]

# What a loop's scalar counter may pass through unchanged.
_SCALAR_COPIES = frozenset({"copy", "convert", "bitcast", "reshape"})


def runs_per_call(role: str, trip_count: int | None) -> tuple[int, bool]:
    """How many times a computation called in ``role`` runs per run of its caller, and if known.

    A ``while`` body runs its trip count times and its condition once more; without a known trip
    count (``trip_count`` ``None``), each is counted once, and marked unknown: the report says
    so. Every branch of a conditional counts as run once: which one runs is decided by data, and
    counting each keeps every collective of the program on the schedule (an upper bound, by the
    branches not taken). Anything else (a fusion's body, a call, a reduction) runs once per call.

    >>> runs_per_call('body', 16), runs_per_call('condition', 16), runs_per_call('body', None)
    ((16, True), (17, True), (1, False))
    >>> runs_per_call('branch', None)
    (1, True)
    """
    if role in ("body", "condition"):
        if trip_count is None:
            return 1, False
        return (trip_count, True) if role == "body" else (trip_count + 1, True)
    return 1, True


def counted_trips(module: Any, loop: Any) -> int | None:
    """A ``while``'s trip count read from its counter, or ``None`` where the program has another form.

    The form a ``scan`` or ``fori_loop`` compiles to: the condition's root compares an element
    of the loop's state with a constant (``i < N``, ``i <= N``, ``N > i``, ``N >= i``); the
    state starts it at a constant ``c``; the body adds a positive constant ``s`` to it (each
    behind scalar copies and converts). Then the body runs ``ceil((N - c) / s)`` times (at least 0).
    """
    roles = dict(loop.called)
    condition, body = roles.get("condition", ""), roles.get("body", "")
    if condition not in module.computations or body not in module.computations or not loop.operands:
        return None
    compare = _root(module, condition)
    if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    direction = (compare.attribute("direction") or "").upper()
    left, right = compare.operands
    index, limit = _state_element(module, left), _integer(module, right)
    if index is None or limit is None:  # N > i: i < N
        index, limit = _state_element(module, right), _integer(module, left)
        direction = {"GT": "LT", "GE": "LE"}.get(direction, "")
    if direction not in ("LT", "LE") or index is None or limit is None:
        return None
    limit += direction == "LE"
    state, root = _behind_copies(module, loop.operands[0]), _root(module, body)
    if state is None or state.opcode != "tuple" or root is None or root.opcode != "tuple":
        return None
    if index >= len(state.operands) or index >= len(root.operands):
        return None
    start = _integer(module, state.operands[index])
    increment = _behind_copies(module, root.operands[index])
    if start is None or increment is None or increment.opcode != "add" or len(increment.operands) != 2:
        return None
    a, b = increment.operands
    step = _integer(module, b) if _state_element(module, a) == index else None
    if step is None and _state_element(module, b) == index:
        step = _integer(module, a)
    if step is None or step <= 0:
        return None
    return max(0, -(-(limit - start) // step))


def _root(module: Any, computation: str) -> Any:
    return next((i for i in module.computations[computation] if i.root), None)


def _behind_copies(module: Any, name: str) -> Any:
    value = module.instruction(name)
    while value is not None and value.opcode in _SCALAR_COPIES and value.operands:
        value = module.instruction(value.operands[0])
    return value


def _integer(module: Any, name: str) -> int | None:
    """The value of an integer constant (behind scalar copies), or ``None``."""
    value = _behind_copies(module, name)
    if value is None or value.opcode != "constant" or value.literal is None:
        return None
    try:
        return int(value.literal)
    except ValueError:
        return None


def _state_element(module: Any, name: str) -> int | None:
    """The index of the loop state's element a value is (``get-tuple-element`` of a parameter)."""
    value = _behind_copies(module, name)
    if value is None or value.opcode != "get-tuple-element" or not value.operands:
        return None
    state = module.instruction(value.operands[0])
    return value.index if state is not None and state.opcode == "parameter" else None
