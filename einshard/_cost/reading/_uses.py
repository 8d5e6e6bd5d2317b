"""What a collective's result is used for: slices, sums, the arrays its chunks are cut from.

Data-flow queries over a compiled program, on top of :class:`~einshard._cost.reading._flow.Flow`,
that the detectors ask.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction

from ..xla import _hlo
from ._flow import Flow

SAME = {"bitcast", "reshape", "copy", "transpose", "convert"}
# Ops a value passes through unchanged in content (to a slice, to a sum).

# --- reading what a collective's result is used for --------------------------------------------


class Uses:
    """Questions about how values are used, asked of the program's data flow (any computation)."""

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.module = flow.module

    def slice_fraction(self, value: _hlo.Instruction) -> Fraction | None:
        """The part of ``value`` its users read, when every use is a slice of it (else ``None``)."""
        return self._fraction(value.computation, value.name, elements(value), 0)

    def _fraction(self, computation: str, name: str, whole: int, depth: int) -> Fraction | None:
        users = self.flow.users_in(computation).get(name, ())
        if not users or whole <= 0 or depth > 6:
            return None
        return _largest(self._user_part(computation, name, user, whole, depth) for user in users)

    def _user_part(
        self, computation: str, name: str, user: _hlo.Instruction, whole: int, depth: int
    ) -> Fraction | None:
        if user.opcode in ("dynamic-slice", "slice") and user.operands and user.operands[0] == name:
            return Fraction(elements(user), whole)
        if user.opcode in SAME:
            return self._fraction(computation, user.name, whole, depth + 1)
        if user.opcode == "fusion" and user.called:
            return self._in_fusion(user, name, whole, depth)
        return None

    def _in_fusion(self, fusion: _hlo.Instruction, name: str, whole: int, depth: int) -> Fraction | None:
        callee = fusion.called[0][1]
        parameters = [
            parameter_instruction(self.module, callee, position)
            for position, operand in enumerate(fusion.operands)
            if operand == name
        ]
        return _largest(
            None if parameter is None else self._fraction(callee, parameter.name, whole, depth + 1)
            for parameter in parameters
        )

    def reaches(self, value: _hlo.Instruction, target: str, depth: int = 12) -> bool:
        """Whether ``target`` (a value of the same computation) is computed from ``value``."""
        users = self.flow.users_in(value.computation)
        seen, frontier = {value.name}, [value.name]
        for _ in range(depth):
            following = []
            for name in frontier:
                for user in users.get(name, ()):
                    if user.name == target:
                        return True
                    if user.name not in seen:
                        seen.add(user.name)
                        following.append(user.name)
            frontier = following
            if not frontier:
                break
        return False

    def summed(self, values: Sequence[_hlo.Instruction]) -> list[tuple[list[int], list[list[int]]]]:
        """Groups of ``values`` (positions) added together right after, with their pure sums.

        A pure sum is a chain of adds of these values alone: what XLA's GPU compiler reassociates.
        """
        by_user: dict[str, tuple[_hlo.Instruction, list[int]]] = {}
        for position, value in enumerate(values):
            for user in self.flow.users_in(value.computation).get(value.name, ()):
                entry = by_user.setdefault(user.name, (user, []))
                if position not in entry[1]:
                    entry[1].append(position)
        # A value its users put to other use than the sum must be reduced anyway: not a candidate.
        sums: dict[str, tuple[set[int], list[list[int]]]] = {}
        for user, positions in by_user.values():
            if len(positions) >= 2:
                sums[user.name] = self._sums(user, [values[p] for p in positions], positions)
        only_summed = {
            position
            for position, value in enumerate(values)
            if all(
                position in sums.get(user.name, (set(), []))[0]
                for user in self.flow.users_in(value.computation).get(value.name, ())
            )
        }
        out: list[tuple[list[int], list[list[int]]]] = []
        taken: set[int] = set()
        for user, _ in by_user.values():
            if user.name not in sums:
                continue
            group, pure = sums[user.name]
            group = {p for p in group if p in only_summed and p not in taken}
            pure = [[p for p in g if p in group] for g in pure]
            pure = [g for g in pure if len(g) >= 2]
            if len(group) >= 2:
                taken.update(group)
                out.append((sorted(group), pure))
        return out

    def _sums(
        self, user: _hlo.Instruction, values: Sequence[_hlo.Instruction], positions: Sequence[int]
    ) -> tuple[set[int], list[list[int]]]:
        """Which of ``values`` (by ``positions``) one user adds together, and its sums of them alone."""
        leaves = {value.name: position for value, position in zip(values, positions, strict=True)}
        if user.opcode == "fusion" and user.called:
            callee = user.called[0][1]
            inside = {}
            for index, operand in enumerate(user.operands):
                if operand in leaves:
                    parameter = parameter_instruction(self.module, callee, index)
                    if parameter is not None:
                        inside[parameter.name] = leaves[operand]
            return add_tree(self.module.computations.get(callee, ()), inside)
        return add_tree([user], leaves)


def elements(instruction: _hlo.Instruction) -> int:
    shapes = instruction.shapes
    return shapes[0].size if len(shapes) == 1 else 0


def parameter_instruction(module: _hlo.Module, computation: str, position: int) -> _hlo.Instruction | None:
    for instruction in module.computations.get(computation, ()):
        if instruction.parameter_number == position:
            return instruction
    return None


def add_tree(
    instructions: Sequence[_hlo.Instruction], leaves: dict[str, int]
) -> tuple[set[int], list[list[int]]]:
    """Which leaves the adds among ``instructions`` sum together, and the sums of leaves alone.

    Returns the leaves of the largest sum, and each largest sum made only of leaves (an add of
    two such, directly: what XLA's ``AllReduceReassociate`` turns into one all-reduce).
    """
    summed: dict[str, set[int]] = {name: {position} for name, position in leaves.items()}
    pure: dict[str, set[int]] = {name: {position} for name, position in leaves.items()}
    # The same slice of each (FSDP: every device's own part, then added): a slice of their sum.
    cut: dict[str, tuple | None] = dict.fromkeys(leaves)
    best: set[int] = set()
    for instruction in instructions:
        first = instruction.operands[0] if instruction.operands else None
        if instruction.opcode in SAME and first in summed:
            summed[instruction.name] = summed[first]
            cut[instruction.name] = cut.get(first)
        elif instruction.opcode in ("slice", "dynamic-slice") and first in summed and cut.get(first) is None:
            summed[instruction.name] = summed[first]
            cut[instruction.name] = (
                instruction.opcode,
                instruction.operands[1:],
                instruction.attribute("slice"),
                instruction.attribute("dynamic_slice_sizes"),
            )
        elif instruction.opcode == "add" and len(instruction.operands) == 2:
            left, right = instruction.operands
            if left in summed and right in summed and cut.get(left) != cut.get(right):
                continue  # different parts of them: not a sum of the whole
            total = summed.get(left, set()) | summed.get(right, set())
            if total:
                summed[instruction.name] = total
                cut[instruction.name] = cut.get(left) if left in summed else cut.get(right)
                if len(total) > len(best):
                    best = total
            if left in pure and right in pure:
                pure[instruction.name] = pure[left] | pure[right]
    groups = [sorted(p) for name, p in pure.items() if len(p) >= 2]
    # The largest pure sums only (a pure sum inside a larger one is part of it).
    groups.sort(key=len, reverse=True)
    kept: list[list[int]] = []
    for group in groups:
        if not any(set(group) <= set(k) for k in kept):
            kept.append(group)
    return best if len(best) >= 2 else set(), kept


def source_array(flow: Flow, name: str) -> _hlo.Instruction | None:
    """The array an all-to-all's chunk is cut from (through a slicing fusion or slice)."""
    instruction = flow.all.get(name)
    for _ in range(3):
        if instruction is None:
            return None
        if instruction.opcode in ("fusion", "slice", "bitcast", "reshape", "dynamic-slice", "copy"):
            arrays = [flow.all.get(o) for o in instruction.operands]
            arrays = [a for a in arrays if a is not None and a.opcode not in ("constant", "partition-id")]
            if len(arrays) != 1:
                return None
            instruction = arrays[0]
            if instruction.opcode not in ("slice", "bitcast", "reshape"):
                return instruction if len(instruction.shapes) == 1 else None
        else:
            return instruction if len(instruction.shapes) == 1 else None
    return None


def gathered_chunks(flow: Flow, instruction: _hlo.Instruction) -> _hlo.Instruction | None:
    """The array an all-to-all's received chunks are put together into, where one user does only that."""
    users = flow.users_in(instruction.computation)
    parts = [u for u in users.get(instruction.name, ()) if u.opcode == "get-tuple-element"]
    takers = {u.name: u for part in parts for u in users.get(part.name, ())}
    if len(takers) != 1:
        return None
    (taker,) = takers.values()
    if len(taker.operands) != len(parts) or len(taker.shapes) != 1:
        return None
    return taker


def slice_shape(uses: Uses, value: _hlo.Instruction) -> tuple[int, ...] | None:
    """The shape of the slice the users take of ``value`` (the first one found)."""
    frontier = [(value.computation, value.name)]
    for _ in range(6):
        following = []
        for computation, name in frontier:
            for user in uses.flow.users_in(computation).get(name, ()):
                if user.opcode in ("dynamic-slice", "slice") and user.operands[0] == name:
                    return user.shapes[0].dims if len(user.shapes) == 1 else None
                if user.opcode == "fusion" and user.called:
                    callee = user.called[0][1]
                    for position, operand in enumerate(user.operands):
                        parameter = (
                            parameter_instruction(uses.module, callee, position) if operand == name else None
                        )
                        if parameter is not None:
                            following.append((callee, parameter.name))
                elif user.opcode in ("bitcast", "copy"):
                    following.append((computation, user.name))
        frontier = following
    return None


def _largest(parts: Iterable[Fraction | None]) -> Fraction | None:
    """The largest part read, or ``None`` when any use reads an unknown part (0 for none)."""
    largest = Fraction(0)
    for part in parts:
        if part is None:
            return None
        largest = max(largest, part)
    return largest
