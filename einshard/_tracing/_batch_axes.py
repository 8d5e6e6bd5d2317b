"""Which axis of each value of a step's program indexes the batch: read from its jaxpr.

The batch argument's leaves have the batch on their first axis. Following each value of the
program from its inputs (through ``jit``, ``checkpoint``, custom derivatives, ``scan``, ``while``
and ``cond``), a value either

* does not depend on the batch (:data:`ABSENT`: a parameter, a constant, an optimizer's count);
* has one axis that indexes the batch (an ``int``: the activations, their gradients);
* depends on the batch but has no axis of it (:data:`REDUCED`: the loss, a weight's gradient:
  the batch was summed or contracted away);
* or depends on it at an axis this reading cannot tell (:data:`UNKNOWN`).

A loop's carry keeps the batch's axis when its first value and every iteration's agree
(:func:`join`). Nothing here changes a program: ``_loops`` asks which carries are batch-major.
An operation the reading does not know gives :data:`UNKNOWN` wherever its inputs depend on the
batch, so a carry is never taken for batch-major by a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._jaxprs import CALL, inner_jaxpr, reshape_groups, runs, scan_counts, var_shape
from ._primitives import CONSTANT, CUMULATIVE, ELEMENTWISE, IDENTITY, RANDOM

__all__ = [
    "ABSENT",
    "REDUCED",
    "UNKNOWN",
    "Axis",
    "BatchAxes",
    "batch_axes_of",
    "combined",
    "join",
    "loop_carries",
]

Axis = int | None
ABSENT: Axis = None
"""The value does not depend on the batch."""
REDUCED = -1
"""The value depends on the batch, and none of its axes indexes it (it was summed or contracted away)."""
UNKNOWN = -2
"""The value depends on the batch at an axis the reading cannot tell."""


def join(a: Axis, b: Axis) -> Axis:
    """The axis of one value that is ``a`` on some paths and ``b`` on others (a loop's carry, a branch)."""
    if a is ABSENT:
        return b
    if b is ABSENT or a == b:
        return a
    return UNKNOWN


def combined(contributions: Sequence[Axis]) -> Axis:
    """The axis of an operation's output from what each input says of it.

    An input that names an axis names the output's; two that name different ones, or any
    unknown one, make it unknown. Inputs with no batch axis (reduced) leave an axis named by
    another (a batch-major value scaled by the loss is batch-major).
    """
    if UNKNOWN in contributions:
        return UNKNOWN
    axes = {a for a in contributions if a is not None and a >= 0}
    if len(axes) > 1:
        return UNKNOWN
    if axes:
        return axes.pop()
    return REDUCED if REDUCED in contributions else ABSENT


def _depends(axis: Axis) -> bool:
    return axis is not ABSENT


class BatchAxes:
    """The batch's axis of every value of one jaxpr, for the axes of its inputs."""

    def __init__(self, jaxpr: Any, in_axes: Sequence[Axis]) -> None:
        self.jaxpr = inner_jaxpr(jaxpr)
        self.env: dict[Any, Axis] = {}
        for var, axis in zip(self.jaxpr.invars, in_axes, strict=True):
            self.env[var] = axis
        for eqn in self.jaxpr.eqns:
            outs = _eqn_axes(eqn, self.inputs(eqn))
            for var, axis in zip(eqn.outvars, outs, strict=True):
                self.env[var] = axis

    def axis(self, atom: Any) -> Axis:
        """The batch's axis of a variable (a literal: none)."""
        return ABSENT if hasattr(atom, "val") else self.env.get(atom, ABSENT)

    def inputs(self, eqn: Any) -> list[Axis]:
        """The batch's axes of an equation's inputs."""
        return [self.axis(atom) for atom in eqn.invars]

    @property
    def outputs(self) -> list[Axis]:
        """The batch's axes of the jaxpr's outputs."""
        return [self.axis(atom) for atom in self.jaxpr.outvars]


def batch_axes_of(jaxpr: Any, in_axes: Sequence[Axis]) -> BatchAxes:
    """The batch's axis of every value of ``jaxpr`` (open or closed), given its inputs'."""
    return BatchAxes(jaxpr, in_axes)


# --- loops ----------------------------------------------------------------------------------------


def loop_carries(eqn: Any, ins: Sequence[Axis]) -> tuple[list[Axis], list[Axis]] | None:
    """A ``scan``'s or ``while``'s carries' batch axes and its body's inputs' axes, at the fixpoint.

    ``None`` for any other equation. The carry's axis is the join of its first value's and of
    every iteration's result (a carry that starts as zeros and becomes batch-major is
    batch-major); a scanned-over input loses its leading (loop) axis in the body.
    """
    name = eqn.primitive.name
    if name == "scan":
        n_consts, n_carry = scan_counts(eqn.params, len(ins))
        body = eqn.params["jaxpr"]
        consts, carry, xs = (
            ins[:n_consts],
            list(ins[n_consts : n_consts + n_carry]),
            ins[n_consts + n_carry :],
        )
        sliced = [_unstacked(axis) for axis in xs]
        return _fixpoint(body, lambda c: [*consts, *c, *sliced], carry, 0)
    if name == "while":
        body_consts = eqn.params["body_nconsts"]
        cond_consts = eqn.params["cond_nconsts"]
        consts = ins[cond_consts : cond_consts + body_consts]
        carry = list(ins[cond_consts + body_consts :])
        return _fixpoint(eqn.params["body_jaxpr"], lambda c: [*consts, *c], carry, 0)
    return None


def _unstacked(axis: Axis) -> Axis:
    """The axis of a scanned-over input's slice: the loop axis goes (the batch as the loop axis: unknown)."""
    if axis is None or axis < 0:
        return axis
    return axis - 1 if axis > 0 else UNKNOWN


def _fixpoint(
    body: Any, inputs: Callable[[list[Axis]], list[Axis]], carry: list[Axis], first: int
) -> tuple[list[Axis], list[Axis]]:
    # Each carry's axis only rises (absent, an axis, unknown): a few passes reach the fixpoint.
    for _ in range(2 * len(carry) + 2):
        outs = batch_axes_of(body, inputs(carry)).outputs
        new = [join(c, o) for c, o in zip(carry, outs[first : first + len(carry)], strict=True)]
        if new == carry:
            break
        carry = new
    return carry, inputs(carry)


# --- the rules ------------------------------------------------------------------------------------


def _eqn_axes(eqn: Any, ins: list[Axis]) -> list[Axis]:
    n = len(eqn.outvars)
    if not any(map(_depends, ins)):
        return [ABSENT] * n
    name = eqn.primitive.name
    rule = _RULES.get(name)
    if rule is not None:
        return rule(eqn, ins)
    if name in ELEMENTWISE:
        return [_elementwise(eqn, ins)]
    if name in IDENTITY:
        return list(ins[:n]) if len(ins) >= n else [combined(ins)] * n
    if name in RANDOM or name in CONSTANT:
        return [ABSENT] * n
    if name in CUMULATIVE:
        return [ins[0]]
    called = _call(eqn, ins)  # a call (jit, checkpoint ...), or another library's primitive with one
    if called is not None:
        return called
    return [UNKNOWN] * n


def _call(eqn: Any, ins: list[Axis]) -> list[Axis] | None:
    """Through a call's program (:func:`runs`: ``CALL``), inputs to inputs and outputs to outputs.

    ``None`` for any other: a ``shard_map``'s body sees one device's block, and its outputs put
    those blocks together along the axes its out_specs name, which the reading does not follow.
    """
    called = runs(eqn)
    if called is None or called.how != CALL:
        return None
    return batch_axes_of(called.programs[0], ins).outputs


def _shape(atom: Any) -> tuple[int, ...]:
    return var_shape(atom)


def _elementwise(eqn: Any, ins: list[Axis]) -> Axis:
    return _elementwise_to(eqn, ins, eqn.outvars[0])


def _each_output(eqn: Any, ins: list[Axis]) -> list[Axis]:
    return [_elementwise_to(eqn, ins, var) for var in eqn.outvars]


def _elementwise_to(eqn: Any, ins: list[Axis], out_var: Any) -> Axis:
    """An axis of an input of the output's rank and length at that axis is the output's."""
    out = _shape(out_var)
    contributions = []
    for atom, axis in zip(eqn.invars, ins, strict=True):
        if axis is None or axis < 0:
            contributions.append(axis)
            continue
        shape = _shape(atom)
        contributions.append(axis if len(shape) == len(out) and shape[axis] == out[axis] else UNKNOWN)
    return combined(contributions)


def _broadcast_in_dim(eqn: Any, ins: list[Axis]) -> list[Axis]:
    axis = ins[0]
    if axis is None or axis < 0:
        return [combined(ins[:1])]
    return [eqn.params["broadcast_dimensions"][axis]]


def _transpose(eqn: Any, ins: list[Axis]) -> list[Axis]:
    axis = ins[0]
    if axis is None or axis < 0:
        return [axis]
    return [list(eqn.params["permutation"]).index(axis)]


def _reshape(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """The batch's axis stays where a run of axes keeps it major (``(b, s, h) -> (b * s, h)``)."""
    axis = ins[0]
    if axis is None or axis < 0:
        return [combined(ins)]
    in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    for in_axes, out_axes in reshape_groups(in_shape, out_shape):
        if axis not in in_axes:
            continue
        major_in = [a for a in in_axes if in_shape[a] != 1]
        major_out = [a for a in out_axes if out_shape[a] != 1]
        if major_in and major_in[0] == axis and major_out and out_shape[major_out[0]] % in_shape[axis] == 0:
            return [major_out[0]]
        return [UNKNOWN]
    return [UNKNOWN]


def _squeeze(eqn: Any, ins: list[Axis]) -> list[Axis]:
    axis = ins[0]
    if axis is None or axis < 0:
        return [axis]
    dimensions = [d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"]]
    if axis in dimensions:
        return [UNKNOWN]
    return [axis - sum(d < axis for d in dimensions)]


def _reduce(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """A reduction over the batch's axis leaves none (``REDUCED``); over others, moves it down."""
    axes = eqn.params.get("axes", eqn.params.get("dimensions", ()))
    n_operands = len(eqn.outvars)
    out = []
    for axis in ins[:n_operands]:
        if axis is None or axis < 0:
            out.append(axis)
        elif axis in axes:
            out.append(REDUCED)
        else:
            out.append(axis - sum(a < axis for a in axes))
    return [combined(out)] * n_operands


def _keeps_unless(param: str) -> Callable[[Any, list[Axis]], list[Axis]]:
    """An operation along one axis (``param``): other axes keep the batch."""

    def rule(eqn: Any, ins: list[Axis]) -> list[Axis]:
        along = eqn.params[param]
        outs = []
        for var in eqn.outvars:
            axis = _elementwise_to(eqn, ins, var)
            outs.append(UNKNOWN if axis == along else axis)
        return outs

    return rule


def _slice(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """A slice, a dynamic slice or a pad keeps the batch's axis where it takes all of it."""
    axis = ins[0]
    rest = combined([a if a is None or a < 0 else UNKNOWN for a in ins[1:]])  # indices from the batch
    if axis is None or axis < 0:
        return [combined([axis, rest])]
    whole = _shape(eqn.invars[0])[axis] == _shape(eqn.outvars[0])[axis]
    if eqn.primitive.name == "pad":
        whole = whole and tuple(eqn.params["padding_config"][axis]) == (0, 0, 0)
    return [combined([axis if whole else UNKNOWN, rest])]


def _dynamic_update_slice(eqn: Any, ins: list[Axis]) -> list[Axis]:
    operand, update, *indices = ins
    out = _shape(eqn.outvars[0])
    parts = [operand, *(a if a is None or a < 0 else UNKNOWN for a in indices)]
    if update is not None and update >= 0:
        parts.append(update if _shape(eqn.invars[1])[update] == out[update] else UNKNOWN)
    else:
        parts.append(update)
    return [combined(parts)]


def _concatenate(eqn: Any, ins: list[Axis]) -> list[Axis]:
    along = eqn.params["dimension"]
    axis = _elementwise_to(eqn, ins, eqn.outvars[0])
    return [UNKNOWN if axis == along else axis]


def _dot_general(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """Output axes: the batch dimensions, then the left's free ones, then the right's."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs_rank, rhs_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lhs_free = [d for d in range(lhs_rank) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs_rank) if d not in rhs_contract and d not in rhs_batch]
    contributions = []
    for axis, contract, batch, free, offset in (
        (ins[0], lhs_contract, lhs_batch, lhs_free, len(lhs_batch)),
        (ins[1], rhs_contract, rhs_batch, rhs_free, len(lhs_batch) + len(lhs_free)),
    ):
        if axis is None or axis < 0:
            contributions.append(axis)
        elif axis in contract:
            contributions.append(REDUCED)
        elif axis in batch:
            contributions.append(list(batch).index(axis))
        else:
            contributions.append(offset + free.index(axis))
    return [combined(contributions)]


def _conv(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """A convolution: the input's batch dimension is the output's; its features are contracted."""
    numbers = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec
    contributions = []
    lhs, rhs = ins[0], ins[1]
    if lhs is None or lhs < 0:
        contributions.append(lhs)
    elif lhs == lhs_spec[0] and eqn.params.get("batch_group_count", 1) == 1:
        contributions.append(out_spec[0])
    elif lhs == lhs_spec[1]:
        contributions.append(REDUCED)
    else:
        contributions.append(UNKNOWN)
    if rhs is None or rhs < 0:
        contributions.append(rhs)
    elif rhs == rhs_spec[1]:
        contributions.append(REDUCED)
    elif rhs == rhs_spec[0]:
        contributions.append(out_spec[1])
    else:
        contributions.append(UNKNOWN)
    return [combined(contributions)]


def _gather(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """A lookup: the indices' batch dimensions are the output's, in order, around its offset dims."""
    numbers = eqn.params["dimension_numbers"]
    operand, indices = ins[0], ins[1]
    out_rank = len(_shape(eqn.outvars[0]))
    index_rank = len(_shape(eqn.invars[1]))
    batch_out = [d for d in range(out_rank) if d not in numbers.offset_dims]
    contributions = []
    if indices is None or indices < 0:
        contributions.append(indices)
    elif indices < index_rank - 1:  # the last axis of the indices is the index vector
        contributions.append(batch_out[indices])
    else:
        contributions.append(UNKNOWN)
    operand_batching = tuple(getattr(numbers, "operand_batching_dims", ()))
    if operand is None or operand < 0:
        contributions.append(operand)
    elif operand in operand_batching:
        position = tuple(numbers.start_indices_batching_dims)[operand_batching.index(operand)]
        contributions.append(batch_out[position] if position < len(batch_out) else UNKNOWN)
    elif operand in numbers.collapsed_slice_dims or operand in numbers.start_index_map:
        contributions.append(UNKNOWN)
    else:
        window = [
            d
            for d in range(len(_shape(eqn.invars[0])))
            if d not in numbers.collapsed_slice_dims and d not in operand_batching
        ]
        whole = eqn.params["slice_sizes"][operand] == _shape(eqn.invars[0])[operand]
        contributions.append(numbers.offset_dims[window.index(operand)] if whole else UNKNOWN)
    return [combined(contributions)]


def _scatter(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """A scatter's output is its operand's shape; updates written along the batch keep it there."""
    numbers = eqn.params["dimension_numbers"]
    operand, indices, updates = ins[0], ins[1], ins[2]
    operand_batching = tuple(getattr(numbers, "operand_batching_dims", ()))
    indices_batching = tuple(getattr(numbers, "scatter_indices_batching_dims", ()))

    def through_indices(index_axis: int) -> Axis:
        # An axis of the indices batched with the operand's lands there; any other picks rows.
        if index_axis in indices_batching:
            return operand_batching[indices_batching.index(index_axis)]
        return REDUCED

    contributions = [operand]
    if indices is None or indices < 0:
        contributions.append(indices)
    else:
        contributions.append(through_indices(indices))
    if updates is None or updates < 0:
        contributions.append(updates)
    elif updates in numbers.update_window_dims:
        window = [
            d
            for d in range(len(_shape(eqn.invars[0])))
            if d not in numbers.inserted_window_dims and d not in operand_batching
        ]
        target = window[list(numbers.update_window_dims).index(updates)]
        whole = _shape(eqn.invars[0])[target] == _shape(eqn.invars[2])[updates]
        contributions.append(target if whole else UNKNOWN)
    else:
        # The updates' scatter dimensions are the indices' batch dimensions, in order (the
        # indices' last axis is the index vector).
        scatter_dims = [d for d in range(len(_shape(eqn.invars[2]))) if d not in numbers.update_window_dims]
        index_dims = list(range(len(_shape(eqn.invars[1])) - 1))
        position = scatter_dims.index(updates)
        contributions.append(through_indices(index_dims[position]) if position < len(index_dims) else UNKNOWN)
    return [combined(contributions)] * len(eqn.outvars)


def _window(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """A windowed reduction keeps the batch's axis where its window is one element wide."""
    dims = eqn.params.get("window_dimensions", ())
    strides = eqn.params.get("window_strides", ())
    outs = []
    for var in eqn.outvars:
        axis = _elementwise_to(eqn, ins, var)
        if axis is not None and axis >= 0 and (dims[axis] != 1 or (strides and strides[axis] != 1)):
            axis = UNKNOWN
        outs.append(axis)
    return outs


def _scan(eqn: Any, ins: list[Axis]) -> list[Axis]:
    carries = loop_carries(eqn, ins)
    assert carries is not None
    carry, body_inputs = carries
    outs = batch_axes_of(eqn.params["jaxpr"], body_inputs).outputs
    stacked = [a if a is None or a < 0 else a + 1 for a in outs[len(carry) :]]
    return [*carry, *stacked]


def _while(eqn: Any, ins: list[Axis]) -> list[Axis]:
    carries = loop_carries(eqn, ins)
    assert carries is not None
    return carries[0]


def _cond(eqn: Any, ins: list[Axis]) -> list[Axis]:
    """Each output joins its branches' (the branch index, from the batch, makes every output unknown)."""
    index, operands = ins[0], ins[1:]
    if index is not ABSENT and index != REDUCED:
        return [UNKNOWN] * len(eqn.outvars)
    outs: list[Axis] = [ABSENT] * len(eqn.outvars)
    for branch in eqn.params["branches"]:
        for i, axis in enumerate(batch_axes_of(branch, operands).outputs):
            outs[i] = join(outs[i], axis)
    if index == REDUCED:  # which branch runs depends on the batch: every output does too
        outs = [REDUCED if axis is ABSENT else axis for axis in outs]
    return outs


def _split(eqn: Any, ins: list[Axis]) -> list[Axis]:
    axis = ins[0]
    if axis is not None and axis >= 0 and axis == eqn.params["axis"]:
        return [UNKNOWN] * len(eqn.outvars)
    return [axis] * len(eqn.outvars)


def _top_k(eqn: Any, ins: list[Axis]) -> list[Axis]:
    axis = ins[0]
    last = len(_shape(eqn.invars[0])) - 1
    return [UNKNOWN if axis == last else axis] * len(eqn.outvars)


def _rev(eqn: Any, ins: list[Axis]) -> list[Axis]:
    axis = ins[0]
    return [UNKNOWN if axis in eqn.params["dimensions"] else axis]


def _iota_like(eqn: Any, ins: list[Axis]) -> list[Axis]:
    return [ABSENT] * len(eqn.outvars)


_RULES: dict[str, Callable[[Any, list[Axis]], list[Axis]]] = {
    "broadcast_in_dim": _broadcast_in_dim,
    "transpose": _transpose,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "rev": _rev,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "scatter": _scatter,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter-mul": _scatter,
    "scatter_mul": _scatter,
    "scatter-min": _scatter,
    "scatter_min": _scatter,
    "scatter-max": _scatter,
    "scatter_max": _scatter,
    "slice": _slice,
    "dynamic_slice": _slice,
    "pad": _slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "concatenate": _concatenate,
    "sort": _keeps_unless("dimension"),
    "argsort": _keeps_unless("dimension"),
    "top_k": _top_k,
    "split": _split,
    "reduce_window_sum": _window,
    "reduce_window_max": _window,
    "reduce_window_min": _window,
    "reduce_window": _window,
    "select_and_scatter_add": _window,
    "select_and_gather_add": _window,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "clamp": _each_output,
    "bitcast_convert_type": _each_output,
    "optimization_barrier": lambda eqn, ins: list(ins),
    "iota": _iota_like,
    **dict.fromkeys(
        ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
         "reduce_xor", "argmax", "argmin", "reduce"),
        _reduce,
    ),
}  # fmt: skip
