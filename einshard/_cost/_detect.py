"""What every detector of waste shares: the kinds, the step's parts as one context, row helpers."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from . import _hlo
from ._report import StepRow
from ._uses import (
    SAME,
    Uses,
)

REPEATED = "repeated"
UNSUMMED = "unsummed"
SLICED = "sliced all-reduce"
COPIED = "copied"
RESHARD = "reshard"
REMAT = "rematerialization"
FINDING_KINDS = (REPEATED, UNSUMMED, SLICED, COPIED, RESHARD, REMAT)

REDUCTIONS = ("all-reduce", "reduce-scatter")
# Names of JAX's collective primitives: a collective the user wrote (shard_map), not a reshard.
USER_COLLECTIVES = (
    "psum",
    "pmax",
    "pmin",
    "ppermute",
    "all_to_all",
    "all_gather",
    "reduce_scatter",
    "pbroadcast",
)

# --- the kinds ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    rows: list[StepRow]
    values: list[_hlo.Instruction | None]
    uses: Uses
    n_devices: int
    messages: Sequence[str]
    layouts: Sequence[Any] | None  # the leaves' plans under the rules (Assignment or None), or None
    paths: Sequence[str]  # every argument leaf's path, aligned with ``layouts``
    parameter_paths: Sequence[str | None]  # the program's parameters' paths, by position
    operands: list[str | None]  # each row's input value
    sizes: dict[str, int]  # each argument leaf's bytes, whole, by path
    table: Any = None  # the rule table that gave the arguments their shardings, or None

    def producers(self, position: int) -> tuple[str, ...]:
        """The parameters the op that made a row's input reads (a matmul's weight)."""
        name = self.operands[position]
        flow = self.uses.flow
        instruction = flow.entry.get(name) if name is not None else None
        if instruction is None:
            return ()
        while instruction.opcode in SAME and instruction.operands and instruction.operands[0] in flow.entry:
            instruction = flow.entry[instruction.operands[0]]
        if instruction.opcode not in ("dot", "convolution", "fusion"):
            return ()
        found = []
        for operand in instruction.operands:
            parameter = flow.parameter(operand)
            if parameter is not None and parameter < len(self.parameter_paths):
                path = self.parameter_paths[parameter]
                if path is not None:
                    found.append(path)
        return tuple(found)


def rows_traffic(rows: list[StepRow], positions: Sequence[int]) -> int:
    return sum(rows[p].traffic for p in positions)


def rows_sources(rows: list[StepRow], positions: Sequence[int]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(source for p in positions if (source := rows[p].source) is not None))


def rows_params(rows: list[StepRow], positions: Sequence[int]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(param for p in positions if (param := rows[p].param) is not None))


def array_text(row: StepRow) -> str:
    return f"{row.dtype}[{','.join(map(str, row.shape))}]"


def merged(rows: list[StepRow], groups: list[tuple[list[int], list[list[int]]]]) -> list[int]:
    """Rows the GPU compiler folds into another (each pure sum keeps one)."""
    return [p for _, pure in groups for group in pure for p in group[1:]]


def capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def is_user_collective(row: StepRow) -> bool:
    last = row.op_name.rsplit("/", 1)[-1]
    return any(last.startswith(name) for name in USER_COLLECTIVES)


_NAMES = "abcdefghijklmnopqrstuvwxyz"


def expression_of(counts: Sequence[int], n_devices: int) -> str:
    """``[1, 8]`` on 8 devices -> ``'a b -> a b8'``; the devices left over hold copies."""
    names = [_NAMES[i % 26] * (1 + i // 26) for i in range(len(counts))]
    right = [f"{name}{count}" if count > 1 else name for name, count in zip(names, counts, strict=True)]
    copies = n_devices // max(1, math.prod(counts))
    if copies > 1:
        right.append(str(copies))
    return f"{' '.join(names)} -> {' '.join(right)}"


_NAMED_SHARDING = re.compile(r"mesh\[(?P<mesh>[^\]]*)\][^\[]*\[(?P<dims>.*)\]")
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?\s*=\s*(\d+)")
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
