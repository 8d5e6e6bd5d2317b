"""Reading a compiled XLA program's text (``compiled.as_text()``): collectives, loops, sources.

Pure text processing: no JAX, so every format XLA prints is unit-tested on captured snippets
(tests/test_step.py). What is read:

* computations and their instructions (name, result type, opcode, operands, attributes);
* the collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute; the
  ``-start`` of an async pair counts, its ``-done`` does not) with their device groups, in every
  form XLA prints them: explicit lists ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` and
  ``[4,2]<=[2,4]T(1,0)``, and the named-mesh form ``mesh['a'=2,'b'=4] {'b'}`` of newer XLA;
* how many times each computation runs per step (a ``while`` body: its ``known_trip_count``);
* where an instruction came from: ``op_name`` and the source file and line, written inline
  (``source_file=... source_line=...``) or through the stack-frame tables of newer XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

__all__ = [
    "COLLECTIVES",
    "KINDS",
    "Collective",
    "Instruction",
    "Module",
    "Shape",
    "device_groups",
    "parse_module",
    "parse_replica_groups",
    "parse_shapes",
]

# Opcode -> the collective's kind; the -start of an async pair stands for the pair.
COLLECTIVES = {
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "reduce-scatter-start": "reduce-scatter",
    "all-to-all-start": "all-to-all",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
KINDS = tuple(dict.fromkeys(COLLECTIVES.values()))
"""The kinds of collective, in the order reports list them."""

_CALL_ROLES = ("calls=", "body=", "condition=", "to_apply=", "_computation=", "branch_computations=")
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


_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,\s]*)\]")


def parse_shapes(text: str) -> tuple[Shape, ...]:
    """The array types in a (tuple) type: ``(f32[2]{0}, bf16[3,4]{1,0})`` -> two shapes."""
    return tuple(
        Shape(dtype, tuple(int(d) for d in dims.split(",") if d.strip()))
        for dtype, dims in _SHAPE.findall(text)
    )


@dataclasses.dataclass
class Instruction:
    """One HLO instruction; ``attributes`` is the text after the operand list."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    computation: str
    root: bool = False

    @functools.cached_property
    def shapes(self) -> tuple[Shape, ...]:
        return parse_shapes(self.type)

    def attribute(self, key: str) -> str | None:
        """The raw value of ``key=...`` (balanced braces / brackets / quotes), or ``None``."""
        return _attribute(self.attributes, key)

    @functools.cached_property
    def called(self) -> tuple[tuple[str, str], ...]:
        """``(role, computation)`` for every computation this instruction calls."""
        if not any(role in self.attributes for role in _CALL_ROLES):
            return ()  # most instructions
        out: list[tuple[str, str]] = []
        for role in ("calls", "body", "condition", "to_apply", "true_computation", "false_computation"):
            value = self.attribute(role)
            if value:
                out += [(role, name) for name in _NAMES.findall(value)]
        branches = self.attribute("branch_computations")
        if branches:
            out += [("branch", name) for name in _NAMES.findall(branches)]
        return tuple(out)

    @functools.cached_property
    def metadata(self) -> dict[str, str]:
        value = self.attribute("metadata")
        if not value:
            return {}
        return {
            k: v1 if v1 else v2
            for k, v1, v2 in re.findall(r'(\w+)=(?:"((?:[^"\\]|\\.)*)"|(\S+?))(?=[\s}]|$)', value)
        }

    def trip_count(self) -> int | None:
        """The known trip count of a ``while``, from its backend config, or ``None``."""
        config = self.attribute("backend_config")
        if not config:
            return None
        try:
            value = json.loads(config)
        except ValueError:
            match = re.search(r'"?known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)', config)
            return int(match.group(1)) if match else None
        trip = value.get("known_trip_count") if isinstance(value, dict) else None
        return int(trip["n"]) if isinstance(trip, dict) and "n" in trip else None


_TOKENS = re.compile(r'[{}\[\]()",\\]')
_NAMES = re.compile(r"%?([\w.\-]+)")


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
    callers: dict[int, int] = dataclasses.field(default_factory=dict)  # stack frame id -> its caller's

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

    def containing(self, pattern: re.Pattern[str]) -> list[str]:
        """The computations with a line ``pattern`` finds something in (without parsing them)."""
        return [name for name, lines in self.computations.lines.items() if any(map(pattern.search, lines))]

    def mentions(self, pattern: re.Pattern[str]) -> bool:
        """Whether ``pattern`` finds something in any line (without parsing)."""
        return any(any(map(pattern.search, lines)) for lines in self.computations.lines.values())

    def times(self) -> dict[str, tuple[int, bool]]:
        """How many times each computation runs per call of the entry, and whether that is known.

        A ``while`` body runs its known trip count times (unknown: counted once, marked unknown);
        a conditional's branches count as run; the done half of an async pair adds nothing.
        """
        calls: dict[str, list[tuple[str, int, bool]]] = {}
        for computation, lines in self.computations.lines.items():
            for line in lines:
                # Only the lines that call a computation are read, from the text (most call none).
                roles = _ROLE.findall(line) if "=%" in line or "_computation" in line else ()
                if not roles or _ASYNC_DONE.search(line):
                    continue
                trip = None
                if " while(" in line:
                    match = _TRIP.search(line)
                    trip = int(match.group(1)) if match else None
                for role, callee, branches in roles:
                    for name in _NAMES.findall(branches) if branches else (callee,):
                        if role in ("body", "condition"):
                            factor, known = (trip, True) if trip is not None else (1, False)
                            if role == "condition" and trip is not None:
                                factor = trip + 1
                            calls.setdefault(name, []).append((computation, factor, known))
                        else:
                            calls.setdefault(name, []).append((computation, 1, True))
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
        """``(file, line)`` of a stack frame: the first one outside einshard, up its callers.

        An op that an ``einshard(...)`` call in the step made belongs to the step's line.
        """
        file, number = self.frames[frame]
        seen = {frame}
        while (
            file.startswith(_PACKAGE)
            and self.callers.get(frame) in self.frames
            and self.callers[frame] not in seen
        ):
            frame = self.callers[frame]
            seen.add(frame)
            file, number = self.frames[frame]
        return file, number


# einshard's own files: an op made inside einshard is attributed to the user code that called it.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_ROLE = re.compile(
    r"(?:^|, )(calls|body|condition|to_apply|true_computation|false_computation|branch_computations)="
    r"(?:%?([\w.\-]+)|\{([^{}]*)\})"
)
_ASYNC_DONE = re.compile(r"\s[\w\-]+-(?:done|update)\(")
_TRIP = re.compile(r'"?known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_COLLECTIVE_LINE = re.compile(
    r"\s(?:all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute)(?:-start)?\("
)
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")


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
    if opcode == "parameter":
        operands = (operand_text.strip(),)  # its number
    if not operands and operand_text.strip() and opcode not in ("parameter", "constant", "iota"):
        # Printed without '%' sigils: names are the last word of each comma-separated operand.
        operands = tuple(part.split()[-1] for part in operand_text.split(",") if part.split())
    attributes = rest[end + 1 :].lstrip(", ")
    return Instruction(name, type_, opcode, operands, attributes, computation, bool(root))


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


# --- device groups ---------------------------------------------------------------------------------


def _iota_groups(text: str) -> list[list[int]]:
    """``[G,S]<=[d1,d2,...]T(perm)``: iota over the dims, transposed, reshaped into G groups of S."""
    match = re.fullmatch(r"\[([\d,]+)\]\s*<=\s*\[([\d,]+)\]\s*(?:T\(([\d,]+)\))?", text.strip())
    if match is None:
        raise AssertionError(
            f"einshard cannot read this XLA text (please report it): unknown iota replica groups {text!r}"
        )
    shape = [int(n) for n in match.group(1).split(",")]
    dims = [int(n) for n in match.group(2).split(",")]
    perm = [int(n) for n in match.group(3).split(",")] if match.group(3) else list(range(len(dims)))
    ids = _transposed_iota(dims, perm)
    size = shape[-1] if len(shape) > 1 else shape[0]
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _transposed_iota(dims: Sequence[int], perm: Sequence[int]) -> list[int]:
    """The flat ids of ``iota(prod(dims)).reshape(dims).transpose(perm)``, row-major."""
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    return [
        sum(index[k] * strides[perm[k]] for k in range(len(perm)))
        for index in itertools.product(*(range(d) for d in out_dims))
    ]


_MESH_AXIS = re.compile(r"'?([^'=,\s\]]+)'?\s*=\s*(\d+)")


def _named_groups(text: str) -> list[list[int]]:
    """The groups of the named-mesh form ``mesh['a'=2,'b'=4] {'b'}``.

    The mesh may carry device ids after its axes, and the groups name sub-axes ``'b':(1)2``:
    each group holds the devices that vary over the listed (sub-)axes, the others fixed.
    """
    match = re.match(r"mesh\[(.*?)\],?\s*(.*?)\s*\{([^{}]*)\}\s*$", text.strip(), re.DOTALL)
    if match is None:
        raise AssertionError(
            "einshard cannot read this XLA text (please report it): "
            f"unknown named-mesh replica groups {text!r}"
        )
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(match.group(1))]
    devices_text = match.group(2).strip()
    total = math.prod(size for _, size in axes)
    if devices_text:
        iota = re.search(r"(?:<=|device_ids=\()\s*\[([\d,]+)\]\s*(?:T\(([\d,]+)\))?", devices_text)
        listed = re.search(r"\[([\d,\s]+)\]", devices_text)
        if iota:
            dims = [int(n) for n in iota.group(1).split(",")]
            perm = [int(n) for n in iota.group(2).split(",")] if iota.group(2) else list(range(len(dims)))
            ids = _transposed_iota(dims, perm)
        elif listed:
            ids = [int(n) for n in listed.group(1).split(",") if n.strip()]
        else:
            raise AssertionError(
                "einshard cannot read this XLA text (please report it): "
                f"unknown device ids in named-mesh replica groups {text!r}"
            )
    else:
        ids = list(range(total))
    # Split each axis into its sub-axes as named (pre-size, size), finest first within an axis.
    factors: list[tuple[str, int, int]] = []  # (axis, pre, size) for every piece, in mesh order
    chosen = []
    for item in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", match.group(3)):
        chosen.append((item[0], int(item[1]) if item[1] else None, int(item[2]) if item[2] else None))
    for name, size in axes:
        cuts = sorted(
            {1, size}
            | {p for n, p, s in chosen if n == name and p}
            | {p * s for n, p, s in chosen if n == name and p and s}
        )
        for pre, nxt in itertools.pairwise(cuts):
            factors.append((name, pre, nxt // pre))
    varying = set()
    for name, pre, size in chosen:
        for index, (axis, p, s) in enumerate(factors):
            if axis == name and (pre is None or (p >= pre and p * s <= pre * size)):
                varying.add(index)
    # Within an axis, a smaller pre-size is the more major piece.
    ordered = []
    for name, _ in axes:
        ordered += sorted((i for i, f in enumerate(factors) if f[0] == name), key=lambda i: factors[i][1])
    sizes = [factors[i][2] for i in ordered]
    groups: dict[tuple[int, ...], list[int]] = {}
    for position, coords in enumerate(itertools.product(*(range(s) for s in sizes))):
        key = tuple(c for c, i in zip(coords, ordered, strict=True) if i not in varying)
        groups.setdefault(key, []).append(ids[position])
    return list(groups.values())


def parse_replica_groups(text: str | None, num_devices: int) -> list[list[int]]:
    """Device groups from a ``replica_groups=`` value, in any of the forms XLA prints.

    >>> parse_replica_groups('{{0,1},{2,3}}', 4)
    [[0, 1], [2, 3]]
    >>> parse_replica_groups('[2,2]<=[2,2]T(1,0)', 4)
    [[0, 2], [1, 3]]
    >>> parse_replica_groups("mesh['a'=2,'b'=2] {'a'}", 4)
    [[0, 2], [1, 3]]
    """
    if text is None or text.strip() in ("", "{}"):
        return [list(range(num_devices))]
    text = text.strip()
    if text.startswith("{"):
        groups = [
            [int(n) for n in group.split(",") if n.strip()]
            for group in re.findall(r"\{([\d,\s]*)\}", text[1:-1])
        ]
        return groups or [list(range(num_devices))]
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("mesh"):
        return _named_groups(text)
    raise AssertionError(
        f"einshard cannot read this XLA text (please report it): unknown replica groups {text!r}"
    )


def device_groups(instruction: Instruction, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups a collective runs over (a permute: the devices of each cycle)."""
    pairs = instruction.attribute("source_target_pairs")
    if instruction.opcode.startswith("collective-permute") and pairs is not None:
        return _permute_groups(pairs)
    return _groups(instruction.attribute("replica_groups"), num_devices)


@functools.lru_cache(maxsize=1024)
def _groups(text: str | None, num_devices: int) -> tuple[tuple[int, ...], ...]:
    # Most collectives of a program share a few group texts: each is read once.
    return tuple(tuple(group) for group in parse_replica_groups(text, num_devices))


@functools.lru_cache(maxsize=1024)
def _permute_groups(pairs: str) -> tuple[tuple[int, ...], ...]:
    edges = [tuple(int(n) for n in pair.split(",")) for pair in re.findall(r"\{(\d+,\d+)\}", pairs)]
    return tuple(tuple(group) for group in _connected(edges))


def _connected(edges: Iterable[tuple[int, ...]]) -> list[list[int]]:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for x in sorted(parent):
        groups.setdefault(find(x), []).append(x)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction, as read from the text (before mapping onto a mesh)."""

    instruction: Instruction
    kind: str
    groups: tuple[tuple[int, ...], ...]
    times: int
    times_known: bool


_CHAIN = re.compile(r'chain_id="?(\d+)')


def collectives(module: Module) -> list[Collective]:
    """Every collective of the program that runs, with its groups and how often it runs.

    TPU's compiler splits one collective over several async collective fusions (each fusion
    carries a copy of the instruction, with the same ``channel_id`` and a ``chain_id``): such a
    run is counted once, at its first copy in the text.
    """
    runs = module.times()
    out = []
    chained: set[tuple[str, str, str]] = set()
    for computation in module.containing(_COLLECTIVE_LINE):
        times, known = runs.get(computation, (0, True))
        if times == 0:
            continue
        for instruction in module.computations[computation]:
            kind = COLLECTIVES.get(instruction.opcode)
            if kind is None:
                continue
            channel = instruction.attribute("channel_id")
            chain = _CHAIN.search(instruction.attribute("frontend_attributes") or "")
            if channel is not None and chain is not None:
                key = (kind, channel, chain.group(1))
                if key in chained:
                    continue
                chained.add(key)
            groups = device_groups(instruction, module.num_partitions)
            out.append(Collective(instruction, kind, groups, times, known))
    return out


# --- shardings as XLA prints them -------------------------------------------------------------------

_NAMED_SHARDING = re.compile(r"mesh\[(?P<mesh>[^\]]*)\][^\[]*\[(?P<dims>.*)\]")
_SUB_AXIS = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


def split_counts(sharding: str) -> list[int] | None:
    """How many ways each dimension is split, from a sharding as XLA prints it, or ``None``."""
    text = sharding.strip()
    named = _NAMED_SHARDING.search(text)
    if named:
        sizes = {name: int(size) for name, size in _MESH_AXIS.findall(named.group("mesh"))}
        counts = []
        for dim in re.findall(r"\{([^{}]*)\}", named.group("dims")):
            count = 1
            for axis, _, sub in _SUB_AXIS.findall(dim):
                count *= int(sub) if sub else sizes.get(axis, 1)
            counts.append(count)
        return counts
    tiled = re.search(r"devices=\[([\d,]+)\]", text)
    if tiled:
        counts = [int(n) for n in tiled.group(1).split(",")]
        if "last_tile_dim_replicate" in text or "last_tile_dims" in text:
            counts = counts[:-1]
        return counts
    return None


# --- kernels: what each instruction computes and moves ---------------------------------------------
#
# What a program costs to run is read from its instructions: each kernel's matrix flops (its dots,
# convolutions and library gemms, with their dimension numbers), the element type and precision
# its matrix units run at, and the bytes it reads and writes. XLA's own cost analysis is not used
# for a GPU program: for a bf16 GPT step on one H200 it reported 1.05e12 flops where the step's
# dots come to 4.52e12 (it leaves out the dots inside Triton gemm fusions), and a compile-only
# TPU program has none at all.

# Instructions that launch nothing: views, tuples, the halves of async pairs the walk reads apart.
FREE_OPCODES = frozenset(
    {
        "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "token",
        "get-dimension-size", "set-dimension-size",
    }
)  # fmt: skip
# Custom calls that are library matrix multiplications; their backend config has the dimension numbers.
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$matmul")
# A fused parameter read only through these reads only what they take.
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_VIEWS = frozenset({"bitcast", "reshape"})


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What one instruction that launches work computes and moves, per run.

    Attributes:
        instruction: The instruction (a fusion, a library call, a copy ...).
        flops: Its matrix flops (dots, convolutions, gemms: two per multiply-add).
        matmul: The element type its matrix flops run at (``'bf16'``, ``'f8e4m3fn'``, ``'tf32'``
            for f32 through TF32, ``'f32'`` at full precision), or ``''`` without any.
        bytes: The bytes it reads and writes (an in-place update: the update; a sliced operand:
            the slice).
    """

    instruction: Instruction
    flops: float
    matmul: str
    bytes: int


def _operand_shapes(module: Module, instruction: Instruction) -> list[Shape]:
    shapes = []
    for name in instruction.operands:
        operand = module.instruction(name)
        if operand is not None:
            shapes += operand.shapes
    return shapes


def _gemm_config(instruction: Instruction) -> dict:
    config = instruction.attribute("backend_config")
    try:
        value = json.loads(config) if config else {}
    except ValueError:
        return {}
    return value.get("gemm_backend_config", {}) if isinstance(value, dict) else {}


def _dims(text: str | None) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text or "")]


def matmul_flops(module: Module, instruction: Instruction) -> float:
    """The matrix flops of one dot, convolution or library gemm (0 for anything else)."""
    if instruction.opcode == "dot":
        lhs = _operand_shapes(module, instruction)[:1]
        if not lhs or not instruction.shapes:
            return 0.0
        contracted = math.prod(lhs[0].dims[d] for d in _dims(instruction.attribute("lhs_contracting_dims")))
        return 2.0 * instruction.shapes[0].size * contracted
    if instruction.opcode == "convolution":
        shapes = _operand_shapes(module, instruction)
        labels = instruction.attribute("dim_labels") or ""
        kernel_labels = labels.partition("_")[2].partition("->")[0]
        if len(shapes) < 2 or "o" not in kernel_labels or not instruction.shapes:
            return 0.0
        kernel = shapes[1]
        outputs = kernel.dims[kernel_labels.index("o")] if len(kernel.dims) == len(kernel_labels) else 1
        return 2.0 * instruction.shapes[0].size * kernel.size / max(outputs, 1)
    if instruction.opcode == "custom-call" and _gemm_target(instruction):
        numbers = _gemm_config(instruction).get("dot_dimension_numbers", {})
        lhs = _operand_shapes(module, instruction)[:1]
        if not lhs or not instruction.shapes:
            return 0.0
        contracted = math.prod(lhs[0].dims[int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
        return 2.0 * instruction.shapes[0].size * contracted
    return 0.0


def _gemm_target(instruction: Instruction) -> bool:
    target = (instruction.attribute("custom_call_target") or "").strip('"')
    return target in _GEMM_TARGETS


def matmul_type(module: Module, instruction: Instruction) -> str:
    """The element type a dot's matrix units run at: its operands', f32 split by precision.

    An f32 dot at the default precision runs through TF32 on a GPU (JAX's default); at
    ``highest`` (or XLA's ``dot_f32_f32_f32`` algorithm) it does not.
    """
    shapes = _operand_shapes(module, instruction)
    dtype = shapes[0].dtype if shapes else (instruction.shapes[0].dtype if instruction.shapes else "")
    if dtype != "f32":
        return dtype
    precision = instruction.attribute("operand_precision") or ""
    precision += instruction.attribute("algorithm") or ""
    if instruction.opcode == "custom-call":
        config = _gemm_config(instruction).get("precision_config", {})
        precision = json.dumps(config)
    precision = precision.lower()
    if "tf32" in precision:
        return "tf32"
    if "highest" in precision or "f32_f32_f32" in precision:
        return "f32"
    return "tf32"


def _called(instruction: Instruction, role: str = "calls") -> str | None:
    return next((name for r, name in instruction.called if r == role), None)


def _matmuls(module: Module, computation: str) -> tuple[float, str]:
    """The matrix flops of a computation and those it calls (a fusion's body), and their type."""
    flops, kind = 0.0, ""
    for instruction in module.computations.get(computation, ()):
        f = matmul_flops(module, instruction)
        if f:
            flops += f
            kind = kind or matmul_type(module, instruction)
        for role, callee in instruction.called:
            if role == "calls":
                inner, inner_kind = _matmuls(module, callee)
                flops += inner
                kind = kind or inner_kind
    return flops, kind


def _fusion_bytes(module: Module, computation: str) -> int:
    """What a fusion reads and writes: a parameter only sliced, its slices; an updated one, the update."""
    instructions = module.computations.get(computation, [])
    users: dict[str, list[Instruction]] = {}
    for instruction in instructions:
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction)
    root = next((i for i in instructions if i.root), None)
    if root is None:
        return 0
    by_name = {i.name: i for i in instructions}
    outputs = [by_name[o] for o in root.operands if o in by_name] if root.opcode == "tuple" else [root]
    in_place: set[str] = set()
    written = 0
    for output in outputs:
        if output.opcode == "dynamic-update-slice" and len(output.operands) > 1:
            target = output.operands[0]
            while target in by_name and by_name[target].opcode in _VIEWS:
                target = by_name[target].operands[0]
            in_place.add(target)
            update = by_name.get(output.operands[1])
            written += sum(s.bytes for s in update.shapes) if update is not None else 0
        else:
            written += sum(s.bytes for s in output.shapes)

    def read(name: str, whole: int) -> int:
        taken = 0
        for user in users.get(name, ()):
            if user.opcode in _VIEWS:
                taken += read(user.name, whole)
            elif user.opcode in _SLICING and user.operands and user.operands[0] == name:
                taken += sum(s.bytes for s in user.shapes)
            elif user.opcode == "dynamic-update-slice" and user.operands and user.operands[0] == name:
                continue
            else:
                return whole
        return min(taken, whole)

    reads = 0
    for instruction in instructions:
        if instruction.opcode == "parameter" and instruction.name not in in_place:
            reads += read(instruction.name, sum(s.bytes for s in instruction.shapes))
    return reads + written


def kernel(module: Module, instruction: Instruction) -> Kernel:
    """What an instruction that launches work computes and moves (see :class:`Kernel`)."""
    opcode = instruction.opcode
    if opcode == "fusion":
        body = _called(instruction)
        flops, kind = _matmuls(module, body) if body else (0.0, "")
        return Kernel(instruction, flops, kind, _fusion_bytes(module, body) if body else 0)
    flops = matmul_flops(module, instruction)
    kind = matmul_type(module, instruction) if flops else ""
    result = instruction.shapes
    if opcode == "custom-call" and _gemm_target(instruction):
        result = result[:1]  # the rest is the library's workspace
    if opcode == "dynamic-update-slice":
        update = _operand_shapes(module, instruction)[1:2]
        return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in update))
    if opcode in ("dynamic-slice", "slice", "gather"):
        return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in result))
    moved = sum(s.bytes for s in _operand_shapes(module, instruction)) + sum(s.bytes for s in result)
    return Kernel(instruction, flops, kind, moved)


def program_matmul_flops(module: Module) -> float:
    """The matrix flops of one run of the program.

    Every dot, convolution and library gemm, in whatever computation it is (fusion bodies
    included), times how often that computation runs.
    """
    runs = module.times()
    total = 0.0
    for name in module.computations:
        times = runs.get(name, (0, True))[0]
        if not times:
            continue
        for instruction in module.computations[name]:
            if instruction.opcode in ("dot", "convolution", "custom-call"):
                total += times * matmul_flops(module, instruction)
    return total


def async_collective(module: Module, instruction: Instruction) -> Instruction | None:
    """The collective an async ``-start`` (or a generic ``async-start``) begins, or ``None``."""
    if instruction.opcode in COLLECTIVES and instruction.opcode.endswith("-start"):
        return instruction
    if instruction.opcode == "async-start":
        body = _called(instruction)
        for inner in module.computations.get(body, ()) if body else ():
            if inner.opcode in COLLECTIVES:
                return inner
    return None


def is_async_done(instruction: Instruction) -> bool:
    """Whether the instruction waits for an async ``-start`` (its first operand)."""
    return instruction.opcode.endswith("-done") or instruction.opcode == "async-done"
