"""The program's data flow: where each value of a compiled program comes from and where it goes.

Read from :mod:`~einshard._cost.xla._hlo`'s parsed module; the attribution, the uses and the
detectors of waste ask it.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from ..xla import _collectives, _hlo

__all__ = ["THROUGH", "Flow", "Origin", "Piece", "operand_shape"]

# Ops a value passes through unchanged in meaning (a parameter stays that parameter).
THROUGH = {
    "get-tuple-element",
    "bitcast",
    "copy",
    "reshape",
    "convert",
    "transpose",
    "dynamic-slice",
    "slice",
}
# Ops that combine a gradient with same-shaped state (an optimizer update), elementwise.
_ELEMENTWISE = THROUGH | {
    "add", "subtract", "multiply", "divide", "negate", "select", "sqrt", "rsqrt", "maximum", "minimum",
    "clamp", "power", "abs", "sign", "exponential", "log", "tanh", "all-reduce", "dynamic-update-slice",
}  # fmt: skip
# Ops that mix elements (a matmul, a loop): a fusion with one is not simple (see Flow.simple).
_MIXING = frozenset(
    {"dot", "convolution", "reduce", "reduce-window", "scatter", "gather", "sort", "custom-call", "while"}
)


class _Instructions:
    """The program's instructions by name, each computation parsed when one of its is asked for."""

    def __init__(self, module: _hlo.Module) -> None:
        self.module = module
        self._found: dict[str, _hlo.Instruction | None] = {}

    def get(self, name: str) -> _hlo.Instruction | None:
        if name not in self._found:
            self._found[name] = self.module.instruction(name)
        return self._found[name]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One array of a combined collective over a concatenated buffer (see :meth:`Flow.pieces`).

    Attributes:
        shape: The array's shape (before it was flattened into the buffer).
        operand: The value put into the buffer.
        value: The value slicing it out of the result, or ``None`` where none does.
    """

    shape: _hlo.Shape
    operand: str
    value: _hlo.Instruction | None


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a row comes from: its collective, the array's index, its operand and reduced value."""

    collective: _collectives.Collective
    index: int
    operand: str | None
    value: _hlo.Instruction | None


class Flow:
    """Data flow of the program: where values come from, where they go.

    The entry computation's at once, another computation's when asked.
    """

    def __init__(self, module: _hlo.Module) -> None:
        self.module = module
        self.entry = {i.name: i for i in module.computations[module.entry]}
        self.all = _Instructions(module)
        self._users: dict[str, dict[str, list[_hlo.Instruction]]] = {}
        self.users = self.users_in(module.entry)
        self.parameters = {
            i.parameter_number: i for i in self.entry.values() if i.parameter_number is not None
        }
        self._simple: dict[str, bool] = {}
        self._loops: dict[str, list[_hlo.Instruction]] = {}
        self._callers: dict[str, list[_hlo.Instruction]] = {}

    def simple(self, computation: str) -> bool:
        """Whether a computation only moves and combines values elementwise (no matmul, no loop)."""
        simple = self._simple.get(computation)
        if simple is None:
            # Read from the text: a fusion body is not parsed for this.
            computations = self.module.computations
            simple = computation in computations and not self.module.has_opcode(computation, _MIXING)
            self._simple[computation] = simple
        return simple

    def users_in(self, computation: str) -> dict[str, list[_hlo.Instruction]]:
        """The users of each value of one computation."""
        users = self._users.get(computation)
        if users is None:
            users = {}
            for instruction in self.module.computations.get(computation, ()):
                for operand in instruction.operands:
                    users.setdefault(operand, []).append(instruction)
            self._users[computation] = users
        return users

    def result(self, instruction: _hlo.Instruction, index: int) -> _hlo.Instruction | None:
        """The value holding array ``index`` of a collective's result, or ``None``.

        That is past an async pair's ``-done`` and a combined collective's ``get-tuple-element``.
        """
        users = self.users_in(instruction.computation)
        value = instruction
        if value.opcode.endswith("-start"):
            done = [u for u in users.get(value.name, ()) if u.opcode.endswith("-done")]
            if not done:
                return None
            value = done[0]
        if not value.type.startswith("("):
            return value
        for user in users.get(value.name, ()):
            if user.opcode == "get-tuple-element" and user.index == index:
                return user
        return None

    def passes(self, instruction: _hlo.Instruction, allowed: set[str]) -> bool:
        if instruction.opcode == "fusion":
            return all(self.simple(callee) for _, callee in instruction.called)
        return instruction.opcode in allowed

    def parameter(self, name: str, depth: int = 8) -> int | None:
        """The entry parameter a value is (through copies, reshapes, slices, simple fusions)."""
        for _ in range(depth):
            instruction = self.entry.get(name)
            if instruction is None:
                return None
            if instruction.opcode == "parameter":
                return instruction.parameter_number
            if not self.passes(instruction, THROUGH):
                return None
            big = [o for o in instruction.operands if self.size_of(o) > 1]
            if len(big) != 1:
                return None
            name = big[0]
        return None

    def padded_share(self, name: str, depth: int = 12) -> Fraction | None:
        """The share of value ``name`` written into zeros in place, or ``None`` when it is not so made.

        A ``dynamic-update-slice`` of a broadcast zero (or of the fused computation's parameter
        bound to one), through copies (async ones too), bitcasts, converts and a fusion's result
        or tuple element. XLA's TPU compiler gathers arrays so: each of ``n`` devices writes its
        ``1/n`` into zeros, and an all-reduce sums the parts.
        """
        value = self.all.get(name)
        callers: list[_hlo.Instruction] = []  # the fusions the walk went into, innermost last
        for _ in range(depth):
            if value is None:
                return None
            opcode = value.opcode
            if opcode == "dynamic-update-slice" and len(value.operands) > 1:
                update = self.size_of(value.operands[1])
                whole = value.shapes[0].size if len(value.shapes) == 1 else 0
                if not (update and whole) or not self._zeros(value.operands[0], callers):
                    return None
                return Fraction(update, whole)
            if (
                opcode in ("copy-done", "copy-start", "copy", "bitcast", "reshape", "convert")
                and value.operands
            ):
                value = self.all.get(value.operands[0])
            elif opcode == "get-tuple-element" and value.operands and value.index is not None:
                tuple_of = self.all.get(value.operands[0])
                root = self._root(tuple_of)
                if (
                    tuple_of is None
                    or root is None
                    or root.opcode != "tuple"
                    or value.index >= len(root.operands)
                ):
                    return None
                callers.append(tuple_of)
                value = self.all.get(root.operands[value.index])
            elif opcode == "fusion":
                callers.append(value)
                value = self._root(value)
            else:
                return None
        return None

    def _root(self, fusion: _hlo.Instruction | None) -> _hlo.Instruction | None:
        body = self._body(fusion)
        return next((i for i in body if i.root), None) if body else None

    def _zeros(self, name: str, callers: list[_hlo.Instruction]) -> bool:
        """Whether a value is a broadcast zero, behind bitcasts and the parameters of ``callers``."""
        value = self.all.get(name)
        for _ in range(8):
            if value is None:
                return False
            if value.opcode == "parameter" and callers and value.parameter_number is not None:
                caller = callers.pop()
                if value.parameter_number >= len(caller.operands):
                    return False
                value = self.all.get(caller.operands[value.parameter_number])
            elif value.opcode in ("bitcast", "reshape", "copy", "convert", "broadcast") and value.operands:
                value = self.all.get(value.operands[0])
            elif value.opcode == "constant":
                return _is_zero(value.literal)
            else:
                return False
        return False

    def parameter_size(self, index: int) -> int:
        instruction = self.parameters.get(index)
        return -1 if instruction is None else self.size_of(instruction.name)

    def size_of(self, name: str) -> int:
        """How many elements value ``name`` has (0: unknown, or a tuple)."""
        instruction = self.all.get(name)
        if instruction is None:
            return 0
        shapes = instruction.shapes
        return shapes[0].size if len(shapes) == 1 else 0

    def updated(self, start: list[_hlo.Instruction], forward_read: set[int]) -> int | None:
        """The parameter a gradient updates, or ``None``.

        That is a same-sized parameter met downstream, through elementwise work; one the
        forward or backward pass reads is preferred (not an optimizer moment).
        """
        seen = {i.name for i in start}
        frontier = list(start)
        candidates: list[tuple[int, int]] = []
        for depth in range(12):
            following = []
            for instruction in frontier:
                sizes = {s.size for s in instruction.shapes}
                for operand in instruction.operands:
                    if operand in seen:
                        continue
                    parameter = self.parameter(operand)
                    if parameter is not None and self.size_of(operand) in sizes:
                        candidates.append((depth, parameter))
                if depth == 0 or self.passes(instruction, _ELEMENTWISE):
                    for user in self.users.get(instruction.name, ()):
                        if user.name not in seen:
                            seen.add(user.name)
                            following.append(user)
            frontier = following
            if not frontier:
                break
        preferred = [c for c in candidates if c[1] in forward_read] or candidates
        return min(preferred)[1] if preferred else None

    def pieces(self, instruction: _hlo.Instruction) -> list[Piece] | None:
        """The arrays a combined collective over one concatenated buffer carries, or ``None``.

        XLA's GPU compiler combines reductions by concatenating them, flattened, into one buffer
        (a ``wrapped_concatenate`` fusion), reducing that, and slicing the result apart (one
        ``wrapped_slice`` fusion per array). Each piece is that array: its shape before it was
        flattened, its operand, and the slice of the result that carries it on.
        """
        if len(instruction.operands) != 1 or instruction.opcode not in ("all-reduce", "all-reduce-start"):
            return None
        source = self.all.get(instruction.operands[0])
        body = self._body(source)
        if source is None or body is None:
            return None
        root = next((i for i in body if i.root), None)
        if (
            root is None
            or root.opcode != "concatenate"
            or len(root.shapes) != 1
            or len(root.shapes[0].dims) != 1
        ):
            return None
        inside = {i.name: i for i in body}
        numbers = {i.name: i.parameter_number for i in body if i.parameter_number is not None}
        slices = self._slices(instruction)
        out: list[Piece] = []
        offset = 0
        for operand in root.operands:
            name = operand
            while name in inside and inside[name].opcode in ("bitcast", "reshape", "copy"):
                name = inside[name].operands[0]
            number = numbers.get(name)
            if number is None or number >= len(source.operands):
                return None
            outer = source.operands[number]
            flat = operand_shape(self, outer)
            if flat is None:
                return None
            shape = self._unflattened(outer, flat)
            out.append(Piece(shape, outer, slices.get((offset, offset + flat.size))))
            offset += flat.size
        return out if offset == root.shapes[0].size else None

    def outside(
        self, instruction: _hlo.Instruction, operand: str | None, value: _hlo.Instruction | None
    ) -> tuple[str | None, _hlo.Instruction | None]:
        """A collective's operand and reduced value as the entry sees them.

        A collective inside a computation that one entry instruction calls as a unit (XLA's
        async collective fusions: ``fusion-start``, ``async-start``, or a fusion) takes its operand
        from that caller's operand of the parameter's number; its result, when it is the
        computation's root, leaves through the caller (past its ``-done``). Elsewhere (a loop
        body) both stay as they are.
        """
        caller = self._caller(instruction.computation)
        if caller is None:
            return operand, value
        inside = self.module.computations[instruction.computation]
        if operand is not None:
            parameter = next((i for i in inside if i.name == operand and i.opcode == "parameter"), None)
            number = parameter.parameter_number if parameter is not None else None
            operand = (
                caller.operands[number] if number is not None and number < len(caller.operands) else None
            )
        root = instruction.root and not instruction.type.startswith("(")
        return operand, self.result(caller, 0) if root else None

    def _caller(self, computation: str) -> _hlo.Instruction | None:
        """The one entry instruction calling ``computation`` as a fusion or async op, or ``None``."""
        if computation == self.module.entry:
            return None
        callers = self._callers.get(computation)
        if callers is None:
            callers = self._callers[computation] = [
                i for i in self.module.callers(computation, "calls") if i.computation == self.module.entry
            ]
        if len(callers) != 1 or callers[0].opcode not in ("fusion", "fusion-start", "async-start"):
            return None
        return callers[0]

    def past_bitcasts(self, value: _hlo.Instruction | None) -> _hlo.Instruction | None:
        """The value as its only user reshapes it (a bitcast back from a flattened buffer), if so."""
        for _ in range(4):
            if value is None:
                return None
            users = self.users_in(value.computation).get(value.name, ())
            if len(users) != 1 or users[0].opcode not in ("bitcast", "reshape"):
                return value
            value = users[0]
        return value

    def _body(self, fusion: _hlo.Instruction | None) -> list[_hlo.Instruction] | None:
        if fusion is None or fusion.opcode != "fusion":
            return None
        called = [name for role, name in fusion.called if role == "calls"]
        return self.module.computations.get(called[0]) if len(called) == 1 else None

    def _slices(self, instruction: _hlo.Instruction) -> dict[tuple[int, int], _hlo.Instruction]:
        """The users slicing one range ``[start:end)`` out of a (1-D) collective's result, by range."""
        value = self.result(instruction, 0)
        if value is None:
            return {}
        out = {}
        for user in self.users_in(value.computation).get(value.name, ()):
            inside = self._body(user) if user.opcode == "fusion" else [user]
            if not inside:
                continue
            root = next((i for i in inside if i.root), inside[-1])
            if root.opcode != "slice":
                continue
            bounds = root.slice_bounds
            if bounds is not None and len(bounds) == 1:
                out[bounds[0]] = user
        return out

    def _unflattened(self, name: str, flat: _hlo.Shape) -> _hlo.Shape:
        """A flattened array's shape before its bitcast (or reshape) to 1-D, where the text shows it."""
        instruction = self.all.get(name)
        while (
            instruction is not None and instruction.opcode in ("bitcast", "reshape") and instruction.operands
        ):
            before = operand_shape(self, instruction.operands[0])
            if before is None or before.size != flat.size:
                break
            flat = before
            instruction = self.all.get(instruction.operands[0])
        return flat

    def loop_exits(self, start: list[_hlo.Instruction], depth: int = 4) -> list[_hlo.Instruction]:
        """Where values computed in a loop body come out of the loop, in the entry computation.

        A scan's backward pass reduces each layer's gradient inside the loop and writes it into
        its slot of the stacked gradient (a dynamic-update-slice): that slot is an element of the
        body's result, and the ``get-tuple-element`` of the same index of the ``while`` carries
        the whole stacked gradient on. Nested loops are followed out level by level; ``[]`` when
        the value does not reach the body's result through elementwise work.
        """
        for _ in range(depth):
            if not start or start[0].computation == self.module.entry:
                return start
            body = start[0].computation
            users = self.users_in(body)
            indices: set[int] = set()
            seen, frontier = {i.name for i in start}, list(start)
            for _ in range(8):
                following = []
                for value in frontier:
                    for user in users.get(value.name, ()):
                        if user.root and user.opcode == "tuple":
                            indices.update(
                                k for k, operand in enumerate(user.operands) if operand == value.name
                            )
                        elif user.name not in seen and self.passes(user, _ELEMENTWISE):
                            seen.add(user.name)
                            following.append(user)
                frontier = following
            loops = self._loops_of(body)
            if not indices or len(loops) != 1:
                return []
            outside = self.users_in(loops[0].computation).get(loops[0].name, ())
            start = [u for u in outside if u.opcode == "get-tuple-element" and u.index in indices]
        return []

    def _loops_of(self, body: str) -> list[_hlo.Instruction]:
        """The ``while`` instructions whose body is ``body`` (found in the text, then parsed)."""
        loops = self._loops.get(body)
        if loops is None:
            loops = self._loops[body] = [i for i in self.module.callers(body, "body") if i.opcode == "while"]
        return loops

    def updated_parameters(self) -> set[int]:
        """The entry parameters the step's outputs are elementwise updates of.

        Trained state (weights, optimizer moments), found through elementwise work from each
        output; the batch is read by matmuls only, so it is not among them.
        """
        root = next((i for i in self.entry.values() if i.root), None)
        if root is None:
            return set()
        outputs = list(root.operands) if root.opcode == "tuple" else [root.name]
        found: set[int] = set()
        for output in outputs:
            size = self.size_of(output)
            if size <= 1:
                continue
            seen, frontier = {output}, [output]
            for _ in range(10):
                following = []
                for name in frontier:
                    instruction = self.entry.get(name)
                    if instruction is None:
                        continue
                    if instruction.opcode == "parameter":
                        # The same size, or a multiple: the update of this device's slice of it.
                        number = instruction.parameter_number
                        if number is not None and self.size_of(name) % size == 0:
                            found.add(number)
                        continue
                    if not self.passes(instruction, _ELEMENTWISE):
                        continue
                    for operand in instruction.operands:
                        if operand not in seen:
                            seen.add(operand)
                            following.append(operand)
                frontier = following
                if not frontier:
                    break
        return found

    def forward_read(self, has_grad: bool) -> set[int]:
        """The parameters the forward or backward pass reads (through copies and gathers)."""
        out = set()
        for instruction in self.entry.values():
            number = instruction.parameter_number
            if number is None:
                continue
            frontier, depth = [instruction], 0
            while frontier and depth < 4:
                following = []
                for value in frontier:
                    for user in self.users.get(value.name, ()):
                        op_name = self.module.source(user)[0]
                        if "jvp(" in op_name:  # forward or backward: not the optimizer's state
                            out.add(number)
                        if self.passes(user, THROUGH | {"all-gather"}):
                            following.append(user)
                frontier, depth = following, depth + 1
        return out


def _is_zero(literal: str | None) -> bool:
    try:
        return literal is not None and float(literal) == 0
    except ValueError:
        return False


def operand_shape(flow: Flow, name: str) -> _hlo.Shape | None:
    instruction = flow.all.get(name)
    if instruction is None:
        return None
    shapes = instruction.shapes
    if len(shapes) == 1:
        return shapes[0]
    return None
