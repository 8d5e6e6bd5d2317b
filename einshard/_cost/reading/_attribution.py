"""Attribution: each collective of the compiled program as report rows, by following its data flow.

A collective's row says which mesh axes its groups run over, in which phase it runs (forward,
backward, optimizer, from JAX's op names), the source line, and the parameter it serves: the
parameter an all-gather gathers, or the one a reduced gradient updates.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from ..hardware._links import sent_fraction
from ..report._report import StepRow
from ..xla import _collectives, _hlo
from ._flow import THROUGH, Flow, Origin, operand_shape

__all__ = ["attributed_rows", "mesh_axes"]


def mesh_axes(
    groups: Sequence[Sequence[int]], mesh: tuple[tuple[str, int], ...], positions: Sequence[int]
) -> tuple[str, ...] | None:
    """The mesh axes a collective's groups run over, or ``None`` when they are not whole axes."""
    return _mesh_axes(tuple(map(tuple, groups)), mesh, tuple(positions))


@functools.lru_cache(maxsize=1024)
def _mesh_axes(
    groups: tuple[tuple[int, ...], ...], mesh: tuple[tuple[str, int], ...], positions: tuple[int, ...]
) -> tuple[str, ...] | None:
    sizes = [size for _, size in mesh]

    def coords(partition: int) -> tuple[int, ...]:
        flat = positions[partition] if partition < len(positions) else partition
        out = []
        for size in reversed(sizes):
            out.append(flat % size)
            flat //= size
        return tuple(reversed(out))

    varying: set[int] = set()
    for group in groups:
        points = [coords(p) for p in group]
        for axis in range(len(sizes)):
            if len({c[axis] for c in points}) > 1:
                varying.add(axis)
    span = math.prod(sizes[a] for a in varying)
    for group in groups:
        points = {coords(p) for p in group}
        if len(points) != span:
            return None
        fixed = {tuple(c[a] for a in range(len(sizes)) if a not in varying) for c in points}
        if len(fixed) != 1:
            return None
    return tuple(mesh[a][0] for a in sorted(varying))


def _phase(op_name: str, has_grad: bool) -> str:
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name or not has_grad:
        return "forward"
    return "optimizer" if "/" in op_name else ""


def attributed_rows(
    module: _hlo.Module,
    flow: Flow,
    mesh: tuple[tuple[str, int], ...],
    positions: list[int],
    paths: list[str | None] | None,
    devices: Sequence[int] | None = None,
) -> tuple[list[StepRow], list[Origin]]:
    """One row per array of every collective, and for each row where it comes from.

    A combined collective over a concatenated buffer (XLA's GPU compiler's) gives one row per
    array put into the buffer (:meth:`Flow.pieces`). ``devices``: the device id of each
    partition, for the rows' :attr:`~StepRow.groups` (``None``: partition ``p`` is device ``p``).
    """
    found = _collectives.collectives(module)
    origins: list[Origin] = []
    # A backward pass shows as op names 'transpose(jvp(...))'; the raw text is enough to tell.
    has_grad = module.op_names_mention("transpose(")
    forward_read = flow.forward_read(has_grad) if has_grad and paths is not None else set()
    rows = []
    as_devices: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = {}
    for collective in found:
        instruction = collective.instruction
        op_name, file, line = module.source(instruction)
        # The largest group: a permute's cycles can include devices that keep their own shard.
        group_size = max((len(group) for group in collective.groups), default=1)
        axes = mesh_axes(collective.groups, mesh, positions)
        groups = as_devices.get(collective.groups)
        if groups is None:  # the collectives of a program share a few groups: one object each
            groups = as_devices[collective.groups] = _device_groups(collective.groups, devices)
        pieces = flow.pieces(instruction)
        arrays: list[tuple[_hlo.Shape, str | None, _hlo.Instruction | None]] = []
        if pieces is not None:
            arrays = [(piece.shape, piece.operand, piece.value) for piece in pieces]
        else:
            inputs = [s for s in (operand_shape(flow, o) for o in instruction.operands) if s is not None]
            if instruction.opcode == "send":  # a megascale transfer: its array, not its token
                inputs = [s for s in inputs if s.dtype != "token"]
            outputs = list(instruction.shapes)
            if instruction.opcode.endswith("-start") or len(outputs) != len(inputs):
                outputs = [_output_of(collective.kind, s, instruction, group_size) for s in inputs]
            for index, (source_shape, result_shape) in enumerate(zip(inputs, outputs, strict=False)):
                shape = result_shape if collective.kind == "all-gather" else source_shape
                operand = instruction.operands[index] if index < len(instruction.operands) else None
                value = flow.result(instruction, index)
                if instruction.computation != module.entry:
                    operand, value = flow.outside(instruction, operand, value)
                arrays.append((shape, operand, value))
        phase, source = _phase(op_name, has_grad), f"{file}:{line}" if file is not None else None
        if not phase or source is None:  # a resharding of an argument: it serves its first user
            user_phase, source = _user_phase(flow, instruction, has_grad, source)
            phase = phase or user_phase
        fraction = sent_fraction(collective.kind, group_size)
        for index, (shape, operand, value) in enumerate(arrays):
            # One of a combined collective: the line of its own array, not the collective's (the
            # combiner keeps the first array's metadata); ``None`` where the array's shows none.
            own = source if len(arrays) == 1 else _array_source(flow, operand)
            param = None
            if paths is not None:
                parameter = None
                if operand is not None and operand in flow.entry:
                    parameter = flow.parameter(operand)
                    if parameter is not None and flow.parameter_size(parameter) != flow.size_of(operand):
                        parameter = None  # a value computed from a parameter is not that parameter
                backward = _phase(op_name, has_grad) == "backward"
                if parameter is None and collective.kind in ("all-reduce", "reduce-scatter") and backward:
                    # A gradient: the parameter its reduced value updates. In a loop body (a
                    # scan-stacked layer's slice, one per trip), from where it leaves the loop.
                    exits = flow.loop_exits([value]) if value is not None else []
                    parameter = flow.updated(exits, forward_read) if exits else None
                if parameter is not None and parameter < len(paths):
                    param = paths[parameter]
            origins.append(Origin(collective, index, operand, flow.past_bitcasts(value)))
            rows.append(
                StepRow(
                    kind=collective.kind,
                    dtype=shape.dtype,
                    shape=shape.dims,
                    bytes=shape.bytes,
                    group_size=group_size,
                    axes=axes,
                    times=collective.times,
                    times_known=collective.times_known,
                    traffic=round(fraction * shape.bytes) * collective.times,
                    seconds=None,
                    phase=phase,
                    op_name=op_name,
                    source=own,
                    param=param,
                    instruction=instruction.name,
                    groups=groups,
                )
            )
    return rows, origins


def _array_source(flow: Flow, operand: str | None) -> str | None:
    """``file:line`` of the code that made one array of a combined collective, or ``None``.

    Read from the array's own producer (through copies and reshapes that carry no line).
    """
    name = operand
    for _ in range(6):
        instruction = flow.all.get(name) if name is not None else None
        if instruction is None:
            return None
        _, file, line = flow.module.source(instruction)
        if file is not None and line is not None:
            return f"{file}:{line}"
        if instruction.opcode not in THROUGH or not instruction.operands:
            return None
        name = instruction.operands[0]
    return None


def _device_groups(
    groups: tuple[tuple[int, ...], ...], devices: Sequence[int] | None
) -> tuple[tuple[int, ...], ...]:
    """The groups of partitions as groups of device ids (the same without ``devices``)."""
    if not devices:
        return groups
    return tuple(tuple(devices[p] if p < len(devices) else p for p in group) for group in groups)


def _user_phase(
    flow: Flow, instruction: _hlo.Instruction, has_grad: bool, source: str | None
) -> tuple[str, str | None]:
    frontier = [instruction]
    for _ in range(6):
        following = []
        for value in frontier:
            for user in flow.users.get(value.name, ()):
                op_name, file, line = flow.module.source(user)
                phase = _phase(op_name, has_grad)
                if phase:
                    return phase, source or (f"{file}:{line}" if file is not None else None)
                following.append(user)
        frontier = following
    return "", source


def _output_of(kind: str, shape: _hlo.Shape, instruction: _hlo.Instruction, n: int) -> _hlo.Shape:
    dims = list(shape.dims)
    axis = (instruction.dimensions or (0,))[0]
    if kind == "all-gather" and dims:
        dims[axis] *= n
    elif kind == "reduce-scatter" and dims:
        dims[axis] //= n
    return _hlo.Shape(shape.dtype, tuple(dims))
