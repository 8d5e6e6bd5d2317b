"""Reading a compiled XLA program's text (``compiled.as_text()``): computations, instructions, sources.

The one reader of XLA's text, with the modules of this folder: no module of the cost model
outside it runs a regular expression on it (tests/test_layers.py holds them to it); they ask the
parsed :class:`Module` and :class:`Instruction`. The collectives and their device groups are read
in :mod:`._collectives`, the compiler's messages in :mod:`._messages`. Pure text processing: no
JAX, so every format XLA prints is unit-tested on captured snippets (tests/test_step.py). What is read:

* computations and their instructions (name, result type, opcode, operands, attributes, a
  parameter's number, a slice's bounds), and who calls a computation in which role;
* the collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute; the
  ``-start`` of an async pair counts, its ``-done`` does not) with their device groups, in every
  form XLA prints them: explicit lists ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` and
  ``[4,2]<=[2,4]T(1,0)``, and the named-mesh form ``mesh['a'=2,'b'=4] {'b'}`` of newer XLA;
* how many times each computation runs per step (a ``while`` body: its ``known_trip_count``);
* where an instruction came from: ``op_name`` and the source file and line, written inline
  (``source_file=... source_line=...``) or through the stack-frame tables of newer XLA;
* the shardings XLA prints, and its message of an involuntary full rematerialization;
* a TPU compiler's refusal of a program that does not fit the chip's memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Iterator, Mapping

from ..._language._sources import user_frame
from . import _hlo_loops

__all__ = [
    "COLLECTIVES",
    "KINDS",
    "Instruction",
    "Module",
    "Shape",
    "parse_instruction",
    "parse_module",
    "parse_shapes",
]

# --- the text's vocabulary: each opcode family and call role written once; the regexes read from it --

# A collective's opcode -> its kind. Each also runs as an async pair, whose ``-start`` stands for
# the pair (its ``-done`` carries nothing new).
_COLLECTIVE_KINDS = {
    "all-reduce": "all-reduce", "all-gather": "all-gather", "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all", "collective-permute": "collective-permute",
}  # fmt: skip
COLLECTIVES = {
    opcode + suffix: kind for opcode, kind in _COLLECTIVE_KINDS.items() for suffix in ("", "-start")
}
KINDS = tuple(dict.fromkeys(_COLLECTIVE_KINDS.values()))
"""The kinds of collective, in the order reports list them."""

# The attribute naming the computations an instruction calls -> the role it calls them in.
_CALL_ROLES = {
    "calls": "calls", "body": "body", "condition": "condition", "to_apply": "to_apply",
    "true_computation": "true_computation", "false_computation": "false_computation",
    "branch_computations": "branch",
}  # fmt: skip
_CALL_MARKS = tuple(f"{key}=" for key in _CALL_ROLES)  # a line calls no computation without one


def _may_call(line: str) -> bool:
    """Whether a line of text may call a computation: the one pre-filter, with or without '%' sigils."""
    return any(mark in line for mark in _CALL_MARKS)


@functools.lru_cache(maxsize=64)
def opcode_line(opcodes: frozenset[str]) -> re.Pattern[str]:
    """Finds an instruction of one of ``opcodes`` in a line of text (without parsing it)."""
    longest_first = sorted(opcodes, key=len, reverse=True)  # all-reduce-start before all-reduce
    return re.compile(r"\s(?:" + "|".join(map(re.escape, longest_first)) + r")\(")


_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,\s]*)\]")
_TOKENS = re.compile(r'[{}\[\]()",\\]')
_NAMES = re.compile(r"%?([\w.\-]+)")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_ROLE = re.compile(r"(?:^|, )(" + "|".join(map(re.escape, _CALL_ROLES)) + r")=(?:%?([\w.\-]+)|\{([^{}]*)\})")
_METADATA = re.compile(r'(\w+)=(?:"((?:[^"\\]|\\.)*)"|(\S+?))(?=[\s}]|$)')
_ASYNC_DONE = re.compile(r"\s[\w\-]+-(?:done|update)\(")
_TRIP = re.compile(r'"?known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_SLICE = re.compile(r"\[(\d+):(\d+)(?::(\d+))?\]")

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s2": 2, "u2": 2, "c64": 64, "c128": 128, "token": 0}


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    digits = re.search(r"\d+", dtype)
    if digits is None:
        raise AssertionError(
            f"einshard cannot read this XLA text (please report it): unknown HLO element type {dtype!r}"
        )
    return int(digits.group())


@dataclasses.dataclass(frozen=True)
class Shape:
    """One array type of an HLO instruction: ``f32[256,128]{1,0}`` -> ``('f32', (256, 128))``."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return (self.size * _bits(self.dtype) + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_shapes(text: str) -> tuple[Shape, ...]:
    """The array types in a (tuple) type: ``(f32[2]{0}, bf16[3,4]{1,0})`` -> two shapes."""
    return tuple(
        Shape(dtype, tuple(int(d) for d in dims.split(",") if d.strip()))
        for dtype, dims in _SHAPE.findall(text)
    )


@dataclasses.dataclass
class Instruction:
    """One HLO instruction; ``attributes`` is the text after the operand list.

    Attributes:
        name: The value's name (without ``%``).
        type: Its result type as printed (``f32[8,4]{1,0}``, or a tuple of such).
        opcode: What it does (``all-reduce``, ``fusion``, ``parameter``...).
        operands: The names of the values it reads (a parameter reads none).
        attributes: The text after the operand list.
        computation: The computation it is in.
        root: Whether it is its computation's result.
        parameter_number: A parameter's number in its computation (``parameter(3)``: 3), else ``None``.
        literal: A constant's value as printed (``constant(4)``: ``'4'``), else ``None``.
    """

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    computation: str
    root: bool = False
    parameter_number: int | None = None
    literal: str | None = None

    @functools.cached_property
    def shapes(self) -> tuple[Shape, ...]:
        return parse_shapes(self.type)

    def attribute(self, key: str) -> str | None:
        """The raw value of ``key=...`` (balanced braces / brackets / quotes), or ``None``."""
        return _attribute(self.attributes, key)

    @functools.cached_property
    def called(self) -> tuple[tuple[str, str], ...]:
        """``(role, computation)`` for every computation this instruction calls (roles: ``_CALL_ROLES``)."""
        if not _may_call(self.attributes):
            return ()  # most instructions
        out: list[tuple[str, str]] = []
        for key, role in _CALL_ROLES.items():
            value = self.attribute(key)
            if value:
                out += [(role, name) for name in _NAMES.findall(value)]
        return tuple(out)

    @property
    def index(self) -> int | None:
        """The element a ``get-tuple-element`` takes (``index=2``), or ``None``."""
        value = self.attribute("index")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def dimensions(self) -> tuple[int, ...]:
        """The ``dimensions={...}`` an instruction works along (a gather's, a reduction's); ``()`` if none."""
        return self.numbers("dimensions")

    def numbers(self, key: str) -> tuple[int, ...]:
        """The integers of a ``key={1,2}`` attribute (``lhs_contracting_dims``...); ``()`` if none."""
        value = self.attribute(key)
        return tuple(int(n) for n in value.strip("{}").split(",") if n.strip()) if value else ()

    def backend_config(self) -> dict:
        """The ``backend_config`` JSON as a dict (``{}`` when absent or not JSON)."""
        config = self.attribute("backend_config")
        try:
            value = json.loads(config) if config else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    @property
    def slice_bounds(self) -> tuple[tuple[int, int], ...] | None:
        """A ``slice``'s ``(start, stop)`` per dimension (``slice={[0:4], [2:6]}``).

        ``None`` without the attribute, or where a dimension is strided (a step other than 1).
        """
        value = self.attribute("slice")
        if value is None:
            return None
        bounds = _SLICE.findall(value)
        if not bounds or any(step not in ("", "1") for _, _, step in bounds):
            return None
        return tuple((int(start), int(stop)) for start, stop, _ in bounds)

    @functools.cached_property
    def metadata(self) -> dict[str, str]:
        value = self.attribute("metadata")
        if not value:
            return {}
        return {k: v1 if v1 else v2 for k, v1, v2 in _METADATA.findall(value)}

    def trip_count(self) -> int | None:
        """The known trip count of a ``while``, from its backend config, or ``None``."""
        config = self.attribute("backend_config")
        if not config:
            return None
        try:
            value = json.loads(config)
        except ValueError:
            match = _TRIP.search(config)
            return int(match.group(1)) if match else None
        trip = value.get("known_trip_count") if isinstance(value, dict) else None
        return int(trip["n"]) if isinstance(trip, dict) and "n" in trip else None


def _attribute(text: str, key: str) -> str | None:
    """The value of the top-level attribute ``key`` in an instruction's attribute text.

    Only that attribute's value is scanned (the text of all attributes, with its metadata and
    backend configs, can be long): an attribute begins the text or follows ``', '``.
    """
    needle = key + "="
    start = 0
    while True:
        found = text.find(needle, start)
        if found < 0:
            return None
        if found == 0 or text[found - 2 : found] == ", ":
            break
        start = found + 1
    begin = found + len(needle)
    end = _top_level_end(text, begin, ",")
    value = text[begin:end].strip()
    if key == "replica_groups" and value.startswith("mesh[") and text.startswith(" device_ids=", end + 1):
        # jax 0.10's named form carries its device order after a comma:
        # replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}
        rest = end + 1 + len(" device_ids=")
        value += ", device_ids=" + text[rest : _top_level_end(text, rest, ",")].strip()
    return value


def _top_level_end(text: str, start: int, closer: str) -> int:
    """The index of the first ``closer`` (``,`` or ``)``) at depth 0 from ``start``, or ``len``."""
    depth = 0
    quote = False
    escaped = -1
    for match in _TOKENS.finditer(text, start):
        char, position = match.group(), match.start()
        if quote:
            if position == escaped:
                continue
            if char == "\\":
                escaped = position + 1
            elif char == '"':
                quote = False
        elif char == '"':
            quote = True
        elif depth == 0 and char == closer:
            return position
        elif char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
    return len(text)


class Computations(Mapping[str, list[Instruction]]):
    """The module's computations by name; each is parsed the first time it is looked at.

    A compiled program is mostly fusion bodies that the report never reads: their lines are kept
    as text until asked for.
    """

    def __init__(self, lines: dict[str, list[str]]) -> None:
        self.lines = lines
        self._parsed: dict[str, list[Instruction]] = {}

    def __getitem__(self, name: str) -> list[Instruction]:
        parsed = self._parsed.get(name)
        if parsed is None:
            parsed = [
                i for i in (_parse_instruction(line, name) for line in self.lines[name]) if i is not None
            ]
            self._parsed[name] = parsed
        return parsed

    def __contains__(self, name: object) -> bool:
        return name in self.lines  # without parsing it (Mapping's would)

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines)

    def __len__(self) -> int:
        return len(self.lines)


@dataclasses.dataclass
class Module:
    """A parsed HLO module: its computations, entry, and source tables."""

    computations: Computations
    entry: str
    num_partitions: int
    frames: dict[int, tuple[str, int]]  # stack frame id -> (file, line)
    frame_callers: dict[int, int] = dataclasses.field(default_factory=dict)  # stack frame id -> its caller's
    _user_frames: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict, repr=False)

    def instructions(self) -> dict[str, Instruction]:
        """Every instruction by name (parses the whole module)."""
        return {i.name: i for name in self.computations for i in self.computations[name]}

    @functools.cached_property
    def _owners(self) -> dict[str, str]:
        owners = {}
        for computation, lines in self.computations.lines.items():
            for line in lines:
                match = _NAME.match(line)
                if match:
                    owners[match.group(1)] = computation
        return owners

    def instruction(self, name: str) -> Instruction | None:
        """The instruction called ``name`` (parses only its computation), or ``None``."""
        computation = self._owners.get(name)
        if computation is None:
            return None
        by_name = self._by_name.get(computation)
        if by_name is None:
            by_name = self._by_name[computation] = {i.name: i for i in self.computations[computation]}
        return by_name.get(name)

    @functools.cached_property
    def _by_name(self) -> dict[str, dict[str, Instruction]]:
        return {}

    def callers(self, computation: str, role: str) -> list[Instruction]:
        """The instructions calling ``computation`` in ``role`` (a role of :attr:`Instruction.called`).

        Found in the text, then only the computations they are in are parsed.
        """
        return [
            instruction
            for caller in self._calling.get((role, computation), ())
            for instruction in self.computations[caller]
            if (role, computation) in instruction.called
        ]

    @functools.cached_property
    def _calling(self) -> dict[tuple[str, str], list[str]]:
        """``(role, callee)`` -> the computations with a line calling it in that role (from the text)."""
        calling: dict[tuple[str, str], list[str]] = {}
        for computation, lines in self.computations.lines.items():
            for line in lines:
                if not _may_call(line):
                    continue
                for key, callee, branches in _ROLE.findall(line):
                    for name in _NAMES.findall(branches) if branches else (callee,):
                        found = calling.setdefault((_CALL_ROLES[key], name), [])
                        if computation not in found:
                            found.append(computation)
        return calling

    def has_opcode(self, computation: str, opcodes: frozenset[str]) -> bool:
        """Whether ``computation`` has an instruction of one of ``opcodes`` (read from its text, unparsed)."""
        return any(map(opcode_line(opcodes).search, self.computations.lines[computation]))

    def op_names_mention(self, text: str) -> bool:
        """Whether some instruction's op name (JAX's metadata) contains ``text`` (read without parsing)."""
        pattern = re.compile(r'op_name="[^"]*' + re.escape(text))
        return any(any(map(pattern.search, lines)) for lines in self.computations.lines.values())

    def containing(self, pattern: re.Pattern[str]) -> list[str]:
        """The computations with a line ``pattern`` finds something in (without parsing them)."""
        return [name for name, lines in self.computations.lines.items() if any(map(pattern.search, lines))]

    def times(self) -> dict[str, tuple[int, bool]]:
        """How many times each computation runs per call of the entry, and whether that is known.

        Each call by :func:`~._hlo_loops.runs_per_call` (the walk's rule too); an async done adds none.
        """
        return dict(self._times)

    @functools.cached_property
    def _times(self) -> dict[str, tuple[int, bool]]:
        calls: dict[str, list[tuple[str, int, bool]]] = {}
        for computation, lines in self.computations.lines.items():
            for line in lines:
                # Only the lines that call a computation are read, from the text (most call none).
                roles = _ROLE.findall(line) if _may_call(line) else ()
                if not roles or _ASYNC_DONE.search(line):
                    continue
                trip = None
                if " while(" in line:
                    parsed = _parse_instruction(line, computation)
                    trip = self.trip_count(parsed) if parsed is not None else None
                for key, callee, branches in roles:
                    factor, known = _hlo_loops.runs_per_call(_CALL_ROLES[key], trip)
                    for name in _NAMES.findall(branches) if branches else (callee,):
                        calls.setdefault(name, []).append((computation, factor, known))
        memo: dict[str, tuple[int, bool]] = {self.entry: (1, True)}

        def times(name: str, seen: frozenset[str]) -> tuple[int, bool]:
            if name in memo:
                return memo[name]
            total, known = 0, True
            for caller, factor, caller_known in calls.get(name, ()):
                if caller in seen:
                    continue
                n, k = times(caller, seen | {name})
                total += n * factor
                known = known and k and caller_known
            memo[name] = (total, known)
            return memo[name]

        return {name: times(name, frozenset()) for name in self.computations}

    def trip_count(self, loop: Instruction) -> int | None:
        """How many times a ``while`` runs its body, or ``None`` (unknown).

        XLA's ``known_trip_count``, else read from its counter (:func:`~._hlo_loops.counted_trips`).
        """
        known = loop.trip_count()
        return known if known is not None else _hlo_loops.counted_trips(self, loop)

    def source(self, instruction: Instruction) -> tuple[str, str | None, int | None]:
        """``(op_name, file, line)`` of an instruction, from either form of its metadata."""
        metadata = instruction.metadata
        op_name = metadata.get("op_name", "").replace("\\'", "'")
        file, line = metadata.get("source_file"), metadata.get("source_line")
        if file is not None and line is not None and line.isdigit():
            return op_name, file, int(line)
        frame = metadata.get("stack_frame_id")
        if frame is not None and frame.isdigit() and int(frame) in self.frames:
            file, number = self.frame(int(frame))
            return op_name, file, number
        return op_name, None, None

    def frame(self, frame: int) -> tuple[str, int]:
        """``(file, line)`` of a stack frame: the user's, up its callers (``_sources.user_frame``).

        An op inside a library (Flax's ``nn.Dense``, Equinox, optax, einshard's own calls) belongs
        to the user's line that called into it.
        """
        found = self._user_frames.get(frame)
        if found is None:
            stack = [frame]
            caller = self.frame_callers.get(frame)
            while caller in self.frames and caller not in stack:
                stack.append(caller)
                caller = self.frame_callers.get(caller)
            found = user_frame([self.frames[f] for f in stack]) or self.frames[frame]
            self._user_frames[frame] = found
        return found


def _split_type(text: str) -> tuple[str, str]:
    """``'(f32[2], f32[3]) all-reduce(...)'`` -> the type and the rest."""
    if text.startswith("("):
        depth = 0
        for i, char in enumerate(text):
            depth += char == "("
            depth -= char == ")"
            if depth == 0:
                return text[: i + 1], text[i + 1 :].lstrip()
    type_, _, rest = text.partition(" ")
    return type_, rest


def _parse_instruction(line: str, computation: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    root, name, rest = match.groups()
    type_, rest = _split_type(rest)
    opcode_match = _OPCODE.match(rest)
    if opcode_match is None:
        return None
    opcode = opcode_match.group(1)
    start = opcode_match.end()
    end = rest.find(")", start)
    if opcode == "constant" and not rest.startswith("(", start):
        end = len(rest) if end < 0 else end  # a literal (braces and numbers only) can be long: skip it whole
    elif end < 0 or "(" in rest[start:end] or '"' in rest[start:end]:
        end = _top_level_end(rest, start, ")")  # operands with tuple types or quotes: balanced
    operand_text = rest[start:end]
    operands = tuple(_OPERAND.findall(operand_text))
    number = operand_text.strip() if opcode == "parameter" else ""
    if not operands and operand_text.strip() and opcode not in ("parameter", "constant", "iota"):
        # Printed without '%' sigils: names are the last word of each comma-separated operand.
        operands = tuple(part.split()[-1] for part in operand_text.split(",") if part.split())
    attributes = rest[end + 1 :].lstrip(", ")
    parameter_number = int(number) if number.isdigit() else None
    literal = operand_text.strip() if opcode == "constant" else None
    return Instruction(
        name, type_, opcode, operands, attributes, computation, bool(root), parameter_number, literal
    )


def parse_instruction(text: str) -> Instruction | None:
    """One instruction as XLA prints it in a message (``%p = f32[8,4] parameter(0), ...``), or ``None``."""
    return _parse_instruction(text.strip(), "")


def parse_module(text: str) -> Module:
    """Parses the text of a compiled HLO module (``compiled.as_text()``)."""
    computations: dict[str, list[str]] = {}
    entry = None
    current: str | None = None
    partitions = re.search(r"num_partitions=(\d+)", text)
    files: dict[int, str] = {}
    locations: dict[int, tuple[int, int]] = {}
    frame_locations: dict[int, int] = {}
    callers: dict[int, int] = {}
    table = None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = stripped
                continue
            if table and re.match(r"^\d+\s", stripped):
                number, _, value = stripped.partition(" ")
                if table == "FileNames":
                    files[int(number)] = value.strip().strip('"')
                elif table == "FileLocations":
                    file_id = re.search(r"file_name_id=(\d+)", value)
                    line_no = re.search(r"\bline=(\d+)", value)
                    if file_id and line_no:
                        locations[int(number)] = (int(file_id.group(1)), int(line_no.group(1)))
                elif table == "StackFrames":
                    location = re.search(r"file_location_id=(\d+)", value)
                    if location:
                        frame_locations[int(number)] = int(location.group(1))
                    # XLA prints a frame's caller as parent_frame_id = its id + 1 (1: none).
                    parent = re.search(r"parent_frame_id=(\d+)", value)
                    if parent and int(parent.group(1)) > 1:
                        callers[int(number)] = int(parent.group(1)) - 1
                continue
            match = _COMPUTATION.match(line)
            if match and not stripped.startswith("HloModule"):
                table = None
                name = match.group(2)
                computations[name] = []
                current = name
                if match.group(1):
                    entry = name
            continue
        if stripped == "}":
            current = None
            continue
        computations[current].append(line)
    if entry is None:
        raise AssertionError(
            "einshard cannot read this XLA text (please report it): no ENTRY computation in the HLO text"
        )
    frames = {}
    for frame, location in frame_locations.items():
        if location in locations:
            file_id, number = locations[location]
            frames[frame] = (files.get(file_id, "?"), number)
    return Module(
        Computations(computations), entry, int(partitions.group(1)) if partitions else 1, frames, callers
    )
