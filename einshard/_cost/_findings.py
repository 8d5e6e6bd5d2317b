"""Waste in a compiled step: what a better program would not send or hold, why, and what to change.

Each kind is read off the compiled program's data flow (and, for the last, what the compiler
printed while compiling it); its bytes are measured against the program without that waste:

* ``repeated``: one parameter's gradient reduced (or its value gathered) by several collectives;
  a better program sums the contributions first and reduces once.
* ``unsummed``: several all-reduces of the same shape and group whose results are added right
  after; a better program adds the partial sums first and reduces once.
* ``sliced all-reduce``: an all-reduce whose result each device only slices its own part of; a
  reduce-scatter sends half the bytes.
* ``copied``: a large parameter held whole on every device while the table splits the others.
* ``reshard``: an array moved between two layouts by the partitioner (all-to-all,
  collective-permute, or all-gather then slice); a better program keeps one layout.
* ``rematerialization``: XLA's "involuntary full rematerialization": it could not change an
  array's layout efficiently, so it gathered the whole array on every device and sliced it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from .._language._text import size_text
from . import _hlo
from ._attribution import Flow
from ._report import RING, Finding, StepRow

__all__ = ["FINDING_KINDS", "expression_of", "find_waste", "split_counts"]

REPEATED = "repeated"
UNSUMMED = "unsummed"
SLICED = "sliced all-reduce"
COPIED = "copied"
RESHARD = "reshard"
REMAT = "rematerialization"
FINDING_KINDS = (REPEATED, UNSUMMED, SLICED, COPIED, RESHARD, REMAT)

_REDUCTIONS = ("all-reduce", "reduce-scatter")
# Ops a value passes through unchanged in content (to a slice, to a sum).
_SAME = {"bitcast", "reshape", "copy", "transpose", "convert"}
# Names of JAX's collective primitives: a collective the user wrote (shard_map), not a reshard.
_USER_COLLECTIVES = (
    "psum",
    "pmax",
    "pmin",
    "ppermute",
    "all_to_all",
    "all_gather",
    "reduce_scatter",
    "pbroadcast",
)


# --- reading what a collective's result is used for --------------------------------------------


class _Uses:
    """Questions about how values are used, asked of the program's data flow (any computation)."""

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.module = flow.module

    def slice_fraction(self, value: _hlo.Instruction) -> Fraction | None:
        """The part of ``value`` its users read, when every use is a slice of it (else ``None``)."""
        return self._fraction(value.computation, value.name, _elements(value), 0)

    def _fraction(self, computation: str, name: str, whole: int, depth: int) -> Fraction | None:
        users = self.flow.users_in(computation).get(name, ())
        if not users or whole <= 0 or depth > 6:
            return None
        largest = Fraction(0)
        for user in users:
            if user.opcode in ("dynamic-slice", "slice") and user.operands and user.operands[0] == name:
                part: Fraction | None = Fraction(_elements(user), whole)
            elif user.opcode in _SAME:
                part = self._fraction(computation, user.name, whole, depth + 1)
            elif user.opcode == "fusion" and user.called:
                part = self._in_fusion(user, name, whole, depth)
            else:
                part = None
            if part is None:
                return None
            largest = max(largest, part)
        return largest

    def _in_fusion(self, fusion: _hlo.Instruction, name: str, whole: int, depth: int) -> Fraction | None:
        callee = fusion.called[0][1]
        largest = Fraction(0)
        for position, operand in enumerate(fusion.operands):
            if operand != name:
                continue
            parameter = _parameter(self.module, callee, position)
            if parameter is None:
                return None
            part = self._fraction(callee, parameter.name, whole, depth + 1)
            if part is None:
                return None
            largest = max(largest, part)
        return largest

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
                    parameter = _parameter(self.module, callee, index)
                    if parameter is not None:
                        inside[parameter.name] = leaves[operand]
            return _add_tree(self.module.computations.get(callee, ()), inside)
        return _add_tree([user], leaves)


def _elements(instruction: _hlo.Instruction) -> int:
    shapes = instruction.shapes
    return shapes[0].size if len(shapes) == 1 else 0


def _parameter(module: _hlo.Module, computation: str, position: int) -> _hlo.Instruction | None:
    wanted = str(position)
    for instruction in module.computations.get(computation, ()):
        if instruction.opcode == "parameter" and instruction.operands and instruction.operands[0] == wanted:
            return instruction
    return None


def _add_tree(
    instructions: Sequence[_hlo.Instruction], leaves: dict[str, int]
) -> tuple[set[int], list[list[int]]]:
    """Which leaves the adds among ``instructions`` sum together, and the sums of leaves alone.

    Returns the leaves of the largest sum, and each largest sum made only of leaves (an add of
    two such, directly: what XLA's ``AllReduceReassociate`` turns into one all-reduce).
    """
    summed: dict[str, set[int]] = {name: {position} for name, position in leaves.items()}
    pure: dict[str, set[int]] = {name: {position} for name, position in leaves.items()}
    best: set[int] = set()
    for instruction in instructions:
        if instruction.opcode in _SAME and instruction.operands and instruction.operands[0] in summed:
            summed[instruction.name] = summed[instruction.operands[0]]
        elif instruction.opcode == "add" and len(instruction.operands) == 2:
            left, right = instruction.operands
            total = summed.get(left, set()) | summed.get(right, set())
            if total:
                summed[instruction.name] = total
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


# --- layouts as expressions -----------------------------------------------------------------------

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


# --- the kinds ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Context:
    rows: list[StepRow]
    values: list[_hlo.Instruction | None]
    uses: _Uses
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
        while instruction.opcode in _SAME and instruction.operands and instruction.operands[0] in flow.entry:
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


def find_waste(
    rows: list[StepRow],
    origins: list[tuple[_hlo.Collective, int]],
    flow: Flow,
    n_devices: int,
    messages: Sequence[str] = (),
    layouts: Sequence[Any] | None = None,
    paths: Sequence[str] = (),
    parameter_paths: Sequence[str | None] = (),
    sizes: Mapping[str, int] | None = None,
    table: Any = None,
) -> list[Finding]:
    """Every finding of a compiled step, the costliest first."""
    values = [flow.result(collective.instruction, index) for collective, index in origins]
    operands = [
        c.instruction.operands[index] if index < len(c.instruction.operands) else None for c, index in origins
    ]
    uses = _Uses(flow)
    context = _Context(
        rows,
        values,
        uses,
        n_devices,
        messages,
        layouts,
        paths,
        parameter_paths,
        operands,
        dict(sizes or {}),
        table,
    )
    extra: set[int] = set()  # rows whose whole traffic a finding counts already
    found: list[Finding] = []
    found += _repeated(context, extra)
    found += _unsummed(context, extra)
    found += _sliced(context, extra)
    remats, claimed = _remats(context, extra)
    found += remats
    found += _reshards(context, extra | claimed)
    found += _copied(context)
    found = [finding for finding in found if finding.cost > 0]
    found.sort(key=lambda f: (-f.cost, FINDING_KINDS.index(f.kind)))
    return found


def _traffic(rows: list[StepRow], positions: Sequence[int]) -> int:
    return sum(rows[p].traffic for p in positions)


def _sources(rows: list[StepRow], positions: Sequence[int]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(source for p in positions if (source := rows[p].source) is not None))


def _params(rows: list[StepRow], positions: Sequence[int]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(param for p in positions if (param := rows[p].param) is not None))


def _array(row: StepRow) -> str:
    return f"{row.dtype}[{','.join(map(str, row.shape))}]"


def _merged(rows: list[StepRow], groups: list[tuple[list[int], list[list[int]]]]) -> list[int]:
    """Rows the GPU compiler folds into another (each pure sum keeps one)."""
    return [p for _, pure in groups for group in pure for p in group[1:]]


def _repeated(context: _Context, extra: set[int]) -> list[Finding]:
    """A parameter's gradient reduced piece by piece, or its value gathered more than once.

    Piece by piece: several collectives whose results are added (its contributions reduced one
    by one).
    Reductions of disjoint parts (a stacked layer weight, one slice per layer) are not repeated:
    they are put together, not added; gathers are repeated when they move more than the whole.
    """
    rows = context.rows
    by_param: dict[tuple[str, str, int], list[int]] = {}
    for position, row in enumerate(rows):
        if row.param is None or row.kind not in (*_REDUCTIONS, "all-gather"):
            continue
        family = "gather" if row.kind == "all-gather" else "reduce"
        by_param.setdefault((row.param, family, row.group_size), []).append(position)
    out = []
    gathered: dict[tuple[str, ...], list[tuple[str, list[int], int]]] = {}
    for (param, family, _), candidates in by_param.items():
        if len(candidates) < 2:
            continue
        removed: tuple[str, ...] = ()
        rewritten: tuple[tuple[int, str], ...] = ()
        if family == "reduce":
            values = [context.values[p] for p in candidates]
            if any(v is None for v in values):
                continue
            groups = context.uses.summed(values)  # type: ignore[arg-type]
            if not groups:
                continue
            summed, pure = max(groups, key=lambda g: len(g[0]))
            positions = [candidates[i] for i in summed]
            keep = max(positions, key=lambda p: rows[p].traffic)
            others = [p for p in positions if p != keep]
            wasted = _traffic(rows, others)
            if len(pure) == 1 and len(pure[0]) == len(summed):  # one sum of these alone: GPU adds first
                removed = ("gpu",)
                rewritten = tuple((p, "merged") for p in others)
        else:
            positions = candidates
            moved = sum(rows[p].total_bytes for p in positions)
            whole = context.sizes.get(param, 0)
            if not whole or moved <= whole:
                continue
            traffic = _traffic(rows, positions)
            gathered.setdefault(_sources(rows, positions), []).append(
                (param, positions, traffic - round(traffic * whole / moved))
            )
            continue
        others = [p for p in positions if p != max(positions, key=lambda q: rows[q].traffic)]
        extra.update(others)
        count, row = len(positions), rows[positions[0]]
        array, each = _array(row), size_text(row.bytes)
        cause = (
            f"The gradient of {param} is reduced {count} times per step ({count} {row.kind}s of "
            f"{array}, {each} each, then added): the parameter is used in {count} places (as tied "
            "embeddings are) and each contribution is reduced on its own."
        )
        fix = (
            "Add the contributions before reducing them (compute that gradient in jax.shard_map "
            "and psum the total once); XLA's GPU compiler does it itself here (accelerator='gpu' "
            "estimates that)."
            if removed
            else "Add the contributions before reducing them: compute that gradient in "
            "jax.shard_map and psum the total once."
        )
        out.append(
            Finding(
                REPEATED,
                wasted,
                0,
                (param,),
                _sources(rows, positions),
                cause,
                fix,
                tuple(positions),
                removed,
                rewritten,
            )
        )
    # Gathered again: one finding per place in the code (a norm scale in every layer: one line).
    for sources, items in gathered.items():
        params = tuple(param for param, _, _ in items)
        positions = [p for _, group, _ in items for p in group]
        row = rows[positions[0]]
        what = params[0] if len(params) == 1 else f"{len(params)} parameters ({params[0]}, ...)"
        cause = (
            f"{what} {'is' if len(params) == 1 else 'are'} gathered more than once per step "
            f"({len(positions)} all-gathers of {_array(row)} and the like), usually once in the forward "
            "pass and again in the backward pass."
        )
        fix = (
            "Keep the gathered weights for the backward pass (a jax.checkpoint policy that saves "
            "them), if the memory allows; otherwise this is the price of not holding them."
        )
        wasted = sum(w for _, _, w in items)
        out.append(Finding(REPEATED, wasted, 0, params, sources, cause, fix, tuple(positions)))
    return out


def _unsummed(context: _Context, extra: set[int]) -> list[Finding]:
    rows = context.rows
    keys: dict[tuple, list[int]] = {}
    for position, row in enumerate(rows):
        value = context.values[position]
        if row.kind != "all-reduce" or position in extra or value is None:
            continue
        keys.setdefault((row.dtype, row.shape, row.group_size, row.axes, row.times), []).append(position)
    raw: list[tuple[list[int], list[int]]] = []  # (rows summed, rows the GPU compiler merges away)
    for positions in keys.values():
        if len(positions) < 2:
            continue
        values = [context.values[p] for p in positions]
        for group, pure in context.uses.summed(values):  # type: ignore[arg-type]
            members = [positions[i] for i in group]
            merged = [positions[i] for g in pure for i in g[1:]]
            raw.append((members, merged))
    # One finding per place in the code (a layer written once and run many times: one finding).
    by_place: dict[tuple[str, ...], list[tuple[list[int], list[int]]]] = {}
    for members, merged in raw:
        by_place.setdefault(_sources(rows, members), []).append((members, merged))
    out = []
    for sources, groups in by_place.items():
        members = [p for group, _ in groups for p in group]
        wasted = [p for group, _ in groups for p in sorted(group, key=lambda q: rows[q].traffic)[:-1]]
        merged = {p for _, m in groups for p in m}
        extra.update(wasted)
        k, n = len(groups[0][0]), len(groups)
        row = rows[members[0]]
        times = f"{n} times, " if n > 1 else ""
        weights = tuple(dict.fromkeys(w for p in members for w in context.producers(p)))
        made = f", made by the matmuls with {', '.join(weights[:k])}" if weights else ""
        cause = (
            f"{k} partial sums of {_array(row)} ({size_text(row.bytes)} each, {times}"
            f"{row.phase or 'in the step'}{made}) are all-reduced one by one and added right after: "
            f"{k} reductions where one of their sum would do."
        )
        fix = (
            "Add them before reducing: fuse the layers that read the same input into one matmul "
            "(q, k and v into one QKV projection), so their input gradient is one partial sum."
        )
        removed: tuple[str, ...] = ("gpu",) if len(merged) >= len(wasted) else ()
        if removed:
            fix += " XLA's GPU compiler adds them first itself here (accelerator='gpu' estimates that)."
        out.append(
            Finding(
                UNSUMMED,
                _traffic(rows, wasted),
                0,
                _params(rows, members) or weights,
                sources,
                cause,
                fix,
                tuple(members),
                removed,
                tuple((p, "merged") for p in sorted(merged)) if removed else (),
            )
        )
    return out


def _sliced(context: _Context, extra: set[int]) -> list[Finding]:
    rows = context.rows
    positions = []
    for position, row in enumerate(rows):
        value = context.values[position]
        if row.kind != "all-reduce" or position in extra or value is None or row.group_size < 2:
            continue
        if context.uses.slice_fraction(value) == Fraction(1, row.group_size):
            positions.append(position)
    if not positions:
        return []
    scatter, _ = RING["reduce-scatter"]
    saved = sum(
        rows[p].traffic - round(scatter(rows[p].group_size) * rows[p].bytes) * rows[p].times
        for p in positions
    )
    params = _params(rows, positions)
    what = f"the gradients of {len(params)} parameters" if len(params) > 1 else (params[0] if params else "")
    what = what or f"{len(positions)} arrays"
    n = rows[positions[0]].group_size
    cause = (
        f"{_capital(what)} {'is' if len(positions) == 1 else 'are'} all-reduced whole "
        f"({len(positions)} all-reduce{'s' if len(positions) > 1 else ''}, "
        f"{size_text(sum(rows[p].total_bytes for p in positions))} per device), and each device then keeps "
        f"only its 1/{n} slice: a reduce-scatter sends half the bytes."
    )
    fix = (
        "XLA's GPU compiler makes this a reduce-scatter itself (ReduceScatterCreator), its CPU compiler "
        "does not: estimate with accelerator='gpu' for GPUs; in your own code, jax.lax.psum_scatter does it."
    )
    rewritten = tuple((p, "reduce-scatter") for p in positions)
    return [
        Finding(
            SLICED,
            saved,
            0,
            params,
            _sources(rows, positions),
            cause,
            fix,
            tuple(positions),
            ("gpu",),
            rewritten,
        )
    ]


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _is_user_collective(row: StepRow) -> bool:
    last = row.op_name.rsplit("/", 1)[-1]
    return any(last.startswith(name) for name in _USER_COLLECTIVES)


def _reshard_rows(context: _Context, excluded: set[int]) -> list[tuple[int, str, str]]:
    """``(row, from, to)`` for every reshard the partitioner inserted (expressions, or '')."""
    rows = context.rows
    out = []
    moved: dict[str, tuple[str, str]] = {}  # by instruction: the arrays of one all-to-all move together
    for position, row in enumerate(rows):
        if position in excluded or _is_user_collective(row):
            continue
        value = context.values[position]
        if row.kind in ("all-to-all", "collective-permute"):
            if row.instruction not in moved:
                moved[row.instruction] = _moved(context, position)
            out.append((position, *moved[row.instruction]))
        elif row.kind == "all-gather" and value is not None:
            fraction = context.uses.slice_fraction(value)
            if fraction is not None and fraction < 1:
                out.append((position, *_gathered(context, position, fraction)))
    return out


def _moved(context: _Context, position: int) -> tuple[str, str]:
    """The layouts an all-to-all moves an array between.

    As expressions where the program shows them (split over all devices before and after),
    else as its per-device shapes.
    """
    row = context.rows[position]
    value = context.values[position]
    if row.kind != "all-to-all" or value is None:
        return "", ""
    flow = context.uses.flow
    instruction = flow.all.get(row.instruction)
    if instruction is None:
        return "", ""
    sources = {id(a): a for a in (_source_array(flow, operand) for operand in instruction.operands)}
    source = next(iter(sources.values())) if len(sources) == 1 else None
    target = _gathered_chunks(flow, instruction)
    if source is None or target is None:
        return "", ""
    before = source.shapes[0].dims
    # The chunks may be put together in another shape first (a concatenate), then reshaped.
    users = flow.users_in(instruction.computation)
    for _ in range(3):
        if len(target.shapes) != 1 or len(target.shapes[0].dims) == len(before):
            break
        following = users.get(target.name, ())
        if len(following) != 1 or len(following[0].shapes) != 1:
            break
        if following[0].shapes[0].size != target.shapes[0].size:
            break
        target = following[0]
    after = target.shapes[0].dims
    n = row.group_size
    if len(before) != len(after) or math.prod(before) != math.prod(after):
        return "", ""
    grew = [a for a in range(len(before)) if after[a] == before[a] * n]
    shrank = [a for a in range(len(before)) if before[a] == after[a] * n]
    if len(grew) != 1 or len(shrank) != 1 or n != context.n_devices:
        return (
            f"{row.dtype}[{','.join(map(str, before))}] per device",
            f"{row.dtype}[{','.join(map(str, after))}] per device",
        )
    counts_before = [n if a == grew[0] else 1 for a in range(len(before))]
    counts_after = [n if a == shrank[0] else 1 for a in range(len(before))]
    return expression_of(counts_before, n), expression_of(counts_after, n)


def _source_array(flow: Flow, name: str) -> _hlo.Instruction | None:
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


def _gathered_chunks(flow: Flow, instruction: _hlo.Instruction) -> _hlo.Instruction | None:
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


def _gathered(context: _Context, position: int, fraction: Fraction) -> tuple[str, str]:
    """The layouts of an all-gather then slice: split on the gathered axis, then as sliced."""
    row = context.rows[position]
    value = context.values[position]
    n = row.group_size
    if value is None or n != context.n_devices:
        return "", ""
    gather = context.uses.flow.all.get(row.instruction)
    dimension = (gather.attribute("dimensions") if gather is not None else None) or "{0}"
    axis = int(dimension.strip("{}").split(",")[0] or 0)
    sliced = _slice_shape(context.uses, value)
    if sliced is None or len(sliced) != len(row.shape):
        return "", ""
    before = [n if a == axis else 1 for a in range(len(row.shape))]
    after = [row.shape[a] // sliced[a] if sliced[a] else 1 for a in range(len(row.shape))]
    return expression_of(before, n), expression_of(after, n)


def _slice_shape(uses: _Uses, value: _hlo.Instruction) -> tuple[int, ...] | None:
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
                        parameter = _parameter(uses.module, callee, position) if operand == name else None
                        if parameter is not None:
                            following.append((callee, parameter.name))
                elif user.opcode in ("bitcast", "copy"):
                    following.append((computation, user.name))
        frontier = following
    return None


def _reshards(context: _Context, excluded: set[int]) -> list[Finding]:
    rows = context.rows
    found = _reshard_rows(context, excluded)
    by_place: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    layouts: dict[tuple, tuple[str, str]] = {}
    for position, before, after in found:
        key = (
            rows[position].instruction if rows[position].kind == "all-to-all" else position,
            rows[position].kind,
        )
        place = (rows[position].kind, _sources(rows, [position]))
        by_place.setdefault(place, []).append(position)
        if before and place not in layouts:
            layouts[place] = (before, after)
        del key
    out = []
    for (kind, sources), positions in by_place.items():
        row = rows[positions[0]]
        what = (
            "an all-gather then a slice"
            if kind == "all-gather"
            else f"{'an' if kind[0] == 'a' else 'a'} {kind}"
        )
        arrays = f"{len(positions)} arrays" if len(positions) > 1 else _array(row)
        before, after = layouts.get((kind, sources), ("", ""))
        if kind == "collective-permute":
            between = "to other devices (the same shards)"
        elif before and "->" in before:
            between = f"from '{before}' to '{after}'"
        elif before:
            between = f"from {before} to {after}"
        else:
            between = "from one layout to another"
        cause = (
            f"The partitioner moves {arrays} ({size_text(sum(rows[p].total_bytes for p in positions))} "
            f"per device) {between} with {what}: the value is made in one layout and used in another."
        )
        fix = (
            "Give producer and consumer one layout: where the step fixes one of them (a rule, an "
            "einshard(...) call), make it the other's; where neither is fixed, an einshard(...) "
            "constraint at this line chooses one."
        )
        out.append(
            Finding(
                RESHARD,
                _traffic(rows, positions),
                0,
                _params(rows, positions),
                sources,
                cause,
                fix,
                tuple(positions),
            )
        )
    return out


_REMAT = re.compile(
    r"cannot go from sharding (?P<before>.*?) to (?P<after>.*?) efficiently for HLO operation "
    r"(?P<op>.*?)(?:\. As the last resort|$)"
)
_OPERATION = re.compile(
    r"%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\S+)\s+(?P<opcode>[\w\-]+)\((?P<operands>[^)]*)\)"
)


def _remats(context: _Context, excluded: set[int]) -> tuple[list[Finding], set[int]]:
    rows = context.rows
    claimed: set[int] = set()
    by_place: dict[tuple, list[tuple[str, str, str | None, str | None, list[int], int]]] = {}
    for message in dict.fromkeys(context.messages):
        match = _REMAT.search(message)
        if match is None:
            continue
        before, after = split_counts(match.group("before")), split_counts(match.group("after"))
        operation = match.group("op")
        op_name = _quoted(operation, "op_name")
        source = _source_of(context, operation)
        param = _param_of(context, operation, op_name)
        # The all-gather that replicates it (not counted yet): the same op name; else, as XLA
        # versions name them differently, a gather then slice of the same parameter or shape.
        free = [
            p
            for p, row in enumerate(rows)
            if p not in claimed and p not in excluded and row.kind == "all-gather"
        ]
        matched = [p for p in free if op_name and rows[p].op_name == op_name]
        if not matched:
            whole = _whole_shape(operation, before)
            sliced = [p for p in free if _only_sliced(context, p)]
            matched = [p for p in sliced if param and rows[p].param == param]
            matched = matched or [p for p in sliced if whole and rows[p].shape == whole]
        matched = matched[:1]
        claimed.update(matched)
        if matched:
            traffic = _traffic(rows, matched)
            source = source or rows[matched[0]].source
            param = param or rows[matched[0]].param
        else:
            traffic = _estimated_remat(operation, before)
        expressions = (
            expression_of(before, context.n_devices) if before else match.group("before"),
            expression_of(after, context.n_devices) if after else match.group("after"),
        )
        by_place.setdefault((expressions, source, param), []).append(
            (expressions[0], expressions[1], source, param, matched, traffic)
        )
    out = []
    for (expressions, source, param), items in by_place.items():
        count = len(items)
        positions = tuple(p for item in items for p in item[4])
        times = f" ({count} times)" if count > 1 else ""
        what = param or "an array"
        cause = (
            f"XLA could not move {what} from '{expressions[0]}' to '{expressions[1]}' efficiently{times}, "
            "so it gathered the whole array on every device and sliced it (an involuntary full "
            "rematerialization)."
        )
        fix = (
            "Make the two layouts agree (the rule of the parameter, or the einshard(...) constraint "
            "at this line), or change them one axis at a time, which XLA does with an all-to-all."
        )
        out.append(
            Finding(
                REMAT,
                sum(item[5] for item in items),
                0,
                (param,) if param else (),
                (source,) if source else (),
                cause,
                fix,
                positions,
            )
        )
    return out, claimed


def _only_sliced(context: _Context, position: int) -> bool:
    value = context.values[position]
    fraction = context.uses.slice_fraction(value) if value is not None else None
    return fraction is not None and fraction < 1


def _whole_shape(operation: str, before: list[int] | None) -> tuple[int, ...] | None:
    """The array's whole shape: the operation's shape in the message (per device) times its splits."""
    parsed = _OPERATION.search(operation)
    shapes = _hlo.parse_shapes(parsed.group("type")) if parsed else ()
    if not shapes or not before or len(before) != len(shapes[0].dims):
        return None
    return tuple(d * c for d, c in zip(shapes[0].dims, before, strict=True))


def _quoted(text: str, key: str) -> str | None:
    match = re.search(rf'{key}="((?:[^"\\]|\\.)*)"', text)
    return match.group(1).replace("\\'", "'") if match else None


def _source_of(context: _Context, operation: str) -> str | None:
    file, line = _quoted(operation, "source_file"), re.search(r"source_line=(\d+)", operation)
    if file and line:
        return f"{file}:{line.group(1)}"
    frame = re.search(r"stack_frame_id=(\d+)", operation)
    module = context.uses.module
    if frame and int(frame.group(1)) in module.frames:
        file, number = module.frame(int(frame.group(1)))
        return f"{file}:{number}"
    return None


def _param_of(context: _Context, operation: str, op_name: str | None) -> str | None:
    parsed = _OPERATION.search(operation)
    if parsed is None or parsed.group("opcode") != "parameter":
        return None
    number = parsed.group("operands").strip()
    if number.isdigit() and int(number) < len(context.parameter_paths):
        return context.parameter_paths[int(number)]
    return None


def _estimated_remat(operation: str, before: list[int] | None) -> int:
    """The gather's traffic from the message alone: the array whole, less the part each device had."""
    parsed = _OPERATION.search(operation)
    shapes = _hlo.parse_shapes(parsed.group("type")) if parsed else ()
    if not shapes or not before:
        return 0
    parts = math.prod(before)
    return round(shapes[0].bytes * parts * (parts - 1) / parts)


def _copied(context: _Context) -> list[Finding]:
    """Large parameters held whole on every device by a table meant to split parameters.

    A table is meant to split parameters when it splits some, or when it has splitting rules
    that match no leaf at all (written for layer names this model does not have). A parameter is
    a leaf the step updates (not its batch); large: a matrix at least the size of the smallest
    split parameter. One finding per reason (no rule, a rule that cannot split, the catch-all).
    """
    if not context.layouts:
        return []
    flow = context.uses.flow
    trained = {
        context.parameter_paths[k] for k in flow.updated_parameters() if k < len(context.parameter_paths)
    }
    layouts = [plan for plan in context.layouts if plan is not None and plan.path in trained]
    split = [plan for plan in layouts if math.prod(plan.layout.shards) > 1]
    used = {plan.rule for plan in context.layouts if plan is not None}
    idle = (
        [rule for rule in context.table.rules if rule not in used and _splits(rule)] if context.table else []
    )
    if not split and not idle:
        return []
    smallest = min((_plan_bytes(plan) for plan in split), default=0)
    ways = max((math.prod(plan.layout.shards) for plan in split), default=context.n_devices)
    by_reason: dict[str, list[Any]] = {}
    words: dict[str, str] = {}
    for plan in layouts:
        if len(plan.shape) < 2 or math.prod(plan.layout.shards) > 1 or _plan_bytes(plan) < smallest:
            continue
        why = _why_copied(plan, context.paths)
        if why is not None:
            by_reason.setdefault(why[0], []).append(plan)
            words.setdefault(why[0], why[1])
    out = []
    for reason, plans in by_reason.items():
        why = words[reason]
        if len(plans) == 1:  # the words speak of several
            why = why.replace("them", "it").replace("their rules do", "its rule does")
        plans.sort(key=lambda plan: -_plan_bytes(plan))
        total = sum(_plan_bytes(plan) for plan in plans)
        held = sum(_plan_bytes(plan) - _plan_bytes(plan) // ways for plan in plans)
        what = (
            f"{plans[0].path} ({size_text(total)}) is"
            if len(plans) == 1
            else f"{len(plans)} parameters ({size_text(total)}, the largest {plans[0].path}) are"
        )
        splits = f"splits other parameters {ways} ways" if split else "splits none"
        unused = (
            f"; its splitting rules {', '.join(str(rule) for rule in idle[:3])}"
            f"{' ...' if len(idle) > 3 else ''} match no parameter"
            if idle
            else ""
        )
        cause = f"{what} held whole on every device: {why}, while the table {splits}{unused}."
        examples = ", ".join(_suggested_rule(plan, ways, context.n_devices) for plan in plans[:2])
        fix = f"Add a rule for {'it' if len(plans) == 1 else 'them'} in front, e.g. {examples}."
        out.append(Finding(COPIED, 0, held, tuple(plan.path for plan in plans), (), cause, fix, ()))
    return out


def _splits(rule: Any) -> bool:
    """Whether a rule's expression splits an axis (a shape-dependent rule may)."""
    from .._language._expression import parse

    if not isinstance(rule.expression, str):
        return True
    return any(
        element.name is not None and (element.star or (element.count or 1) > 1)
        for element in parse(rule.expression).right
    )


def _plan_bytes(plan: Any) -> int:
    from .._arrays._build import itemsize

    return math.prod(plan.shape) * itemsize(plan.dtype)


def _why_copied(plan: Any, paths: Sequence[str]) -> tuple[str, str] | None:
    """Why the table copies a leaf it was not told to copy: a kind, and words.

    ``None`` when a rule says to copy it.
    """
    rule = plan.rule
    smaller = getattr(getattr(rule, "expression", None), "min_bytes", 0)
    if isinstance(smaller, int) and _plan_bytes(plan) < smaller:
        return None  # a shape rule that copies what is below its size on purpose (FSDP's min_bytes)
    if plan.note:
        return "note", f"their rules do not split them (e.g. {plan.path}: {plan.note})"
    if rule is None:
        return "unmatched", "no rule matches them (the table's policy replicates such leaves)"
    # A rule that matches every leaf (the table's catch-all) was not written for this one.
    pattern = re.compile(rule.pattern)
    if paths and all(pattern.search(p) for p in paths):
        return "catch-all", f"only the catch-all rule {rule} matches them"
    return None


def _suggested_rule(plan: Any, ways: int, n_devices: int) -> str:
    order = sorted(range(len(plan.shape)), key=lambda axis: -plan.shape[axis])
    for axis in order:
        if plan.shape[axis] % ways == 0:
            counts = [ways if a == axis else 1 for a in range(len(plan.shape))]
            return f"({_anchored(plan.path)!r}, {expression_of(counts, n_devices)!r})"
    return f"({_anchored(plan.path)!r}, ...) splitting an axis that {ways} divides (none does: pad one)"


def _anchored(path: str) -> str:
    return f"{re.escape(path.split('/', 1)[-1])}$"
