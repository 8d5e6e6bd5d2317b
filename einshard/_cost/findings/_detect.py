"""What every detector of waste shares: the kinds, the step's parts as one context, row helpers."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..reading._uses import SAME, Uses
from ..report._report import StepRow
from ..xla import _hlo

REPEATED = "repeated"
UNSUMMED = "unsummed"
SLICED = "sliced all-reduce"
COPIED = "copied"
RESHARD = "reshard"
REMAT = "rematerialization"
BATCH = "activations gathered over the batch"
LOOP = "activations reduced in a loop"
MOVED = "activations gathered in place of weights"
FINDING_KINDS = (REPEATED, UNSUMMED, SLICED, COPIED, RESHARD, REMAT, BATCH, LOOP, MOVED)

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
    layouts: Sequence[Any] | None  # each leaf's Assignment under the rules (None: not an array), or None
    paths: Sequence[str]  # every argument leaf's path, aligned with ``layouts``
    parameter_paths: Sequence[str | None]  # the program's parameters' paths, by position
    operands: list[str | None]  # each row's input value
    sizes: dict[str, int]  # each argument leaf's bytes, whole, by path
    table: Any = None  # the rule table that gave the arguments their shardings, or None
    loops: Sequence[Any] = ()  # the step's loops whose carry comes from the batch (LoopNote), kept or not
    platform: str = "cpu"  # what the program was compiled for: 'cpu', 'gpu' or 'tpu' (the fixes' words)

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


def only_sliced(context: Context, position: int) -> bool:
    """Whether each device uses only a slice of a row's result (an all-reduce a reduce-scatter would do)."""
    value = context.values[position]
    fraction = context.uses.slice_fraction(value) if value is not None else None
    return fraction is not None and fraction < 1
