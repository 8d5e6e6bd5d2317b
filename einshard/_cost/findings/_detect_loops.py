"""The whole batch's activations moved inside a loop: two findings.

``activations reduced in a loop`` and ``activations gathered in place of weights``.

Inside a ``while`` loop (a scanned model's layers), XLA's partitioner gives a loop-carried value
one layout for every iteration and is free to choose it. Under FSDP, given only the arguments'
layouts, it may drop the activations' batch split: each device then holds the whole batch's
activations and computes each layer's products as contractions over the split hidden axis,
all-reducing those activations in every layer, forward and backward. On the 1.5 B LLaMA-shaped
step scanned on 8 H100s, that was 7 GiB per device per step, and the peak rose from 3.7 GiB to
14.5 GiB. One constraint of the carry to the batch's layout (``einshard.like_batch``, or the step
compiled by ``einshard.constrain_loops``, as ``plan`` and ``explain_step`` with a strategy do)
removes them: ``activations reduced in a loop`` is that finding, raised only while some loop's
carry is not kept so (the report's ``batch_loops`` say which are).

With the carry kept, the partitioner may still move activations inside the body: where a
matmul's activations are smaller than its weight (a small batch: 16 x 32 tokens of 256 against
a 256 x 1024 weight), Shardy keeps the larger operand's split, the weight's, and reshards the
activations to meet it. Each device gathers the whole batch's activations, computes its block of
the MLP's hidden units, and the next matmul's partial sums are reduced back to the batch's
layout: tensor parallelism's program, chosen per matmul. At such sizes it sends fewer bytes than
gathering the weights (their gradients need no reduction), so it is not waste in itself; but
XLA's CPU compiler reduces those partial sums with all-reduces that each device then slices,
where a reduce-scatter sends half, as XLA's GPU compiler makes it. ``activations gathered in
place of weights`` names what the partitioner did, counts that half, and says what changes it.

Self-contained: it reads the rows, the leaves' assignments and paths, the loops and the program
from the :class:`~einshard._cost.findings._detect.Context`.
"""

from __future__ import annotations

from fractions import Fraction

from ..._language._text import size_text
from ..hardware._links import sent_fraction
from ..report._report import Finding, StepRow
from ..xla import _hlo
from ._detect import LOOP, MOVED, Context, array_text, is_user_collective, rows_sources, rows_traffic
from ._detect_batch import batch_arrays

__all__ = ["find_loop_reductions", "find_moved_activations"]


def find_loop_reductions(context: Context, extra: set[int]) -> list[Finding]:
    """All-reduces of the whole batch's activations inside a loop whose carry nobody keeps split.

    A row counts when it is an all-reduce run more than once per step (in a loop body), serving
    no parameter, not written by the user (``shard_map``), whose array on each device has the
    batch's whole size at an axis: the step's table splits the batch, so the partitioner dropped
    the split inside the loop. Not raised when every loop whose carry comes from the batch is
    kept in the batch's layout (by einshard or by the model: its fix is applied), nor where the
    activations gathered there meet a larger weight (the partitioner's choice by size, which
    keeping the carry does not change): those are :func:`find_moved_activations`'s. Its bytes
    are those rows' traffic: with the carry kept in the batch's layout, activations are not
    reduced at all.
    """
    if _all_kept(context) or not _split_batch(context):
        return []
    rows = context.rows
    moving = _activation_rows(context, extra)
    if _meets_larger_weight(context, moving) is not None:
        return []
    positions = [p for p in moving if rows[p].kind == "all-reduce"]
    sent = rows_traffic(rows, positions)
    if not positions or sent <= 0:
        return []
    extra.update(positions)
    arrays = batch_arrays(context)
    split = max(leaf.layout.shards[0] for leaf in arrays)
    example = rows[positions[0]]
    size = max(leaf.shape[0] for leaf in arrays if leaf.shape[0] in example.shape)
    axis = example.shape.index(size)
    cause = (
        f"Inside a loop, XLA's partitioner dropped the activations' batch split: each device holds "
        f"the whole batch ({array_text(example)}, the batch's {size} "
        f"{'first' if axis == 0 else f'at axis {axis}'}) "
        f"and all-reduces activations in every iteration ({len(positions)} all-reduce"
        f"{'s' if len(positions) > 1 else ''}, {size_text(sent)} sent per device per step), where "
        f"the table splits the batch {split} ways."
    )
    loop = _loop_line(context, positions[0])
    at = f" (the loop at {loop})" if loop else ""
    expression = arrays[0].expression
    unkept = [note for note in context.loops if not note.constrained]
    why = (
        f" einshard could not keep the loop at {unkept[0].source or 'a line JAX did not keep'}: "
        f"{unkept[0].reason}."
        if unkept
        else ""
    )
    fix = (
        f"Keep the loop's carry in the batch's layout: run the step as "
        f"einshard.constrain_loops(step, {expression!r}) (jit that), or write "
        f"x = einshard.like_batch(x) at the top of the loop's body{at} and run it under "
        f"einshard.use_strategy({expression!r}); plan, and explain_step with the strategy itself as "
        f"rules=, compile it so.{why}"
    )
    sources = (loop,) if loop else rows_sources(rows, positions)
    return [Finding(LOOP, sent, 0, (), sources, cause, fix, tuple(positions))]


def find_moved_activations(context: Context, extra: set[int]) -> list[Finding]:
    """Activations moved in place of weights inside a loop, with all-reduces a reduce-scatter would do.

    The rows: collectives run in a loop body, serving no parameter, not the user's, whose array
    has the batch's whole size at an axis, where every loop whose carry comes from the batch is
    kept in the batch's layout (the report's ``batch_loops``), or where the activations gathered
    meet a larger weight (kept or not, the partitioner moves the smaller operand). They are the
    partitioner's own choice, not a dropped split; what a better program would not send is the
    all-reduces' part that each device slices away (the CPU compiler's; XLA's GPU compiler sends
    a reduce-scatter). No finding where there is none of that (a GPU's program), and none claims
    the rows then.
    """
    if not _split_batch(context):
        return []
    rows = context.rows
    positions = _activation_rows(context, extra)
    weight = _meets_larger_weight(context, positions)
    kept = _all_kept(context)
    if not kept and weight is None:
        return []  # a dropped split: find_loop_reductions's
    sliced = [p for p in positions if rows[p].kind == "all-reduce" and _only_own_slice(context, p)]
    scatter = "reduce-scatter"
    scattered = {p: round(sent_fraction(scatter, rows[p].group_size) * rows[p].bytes) for p in sliced}
    saved = sum(rows[p].traffic - scattered[p] * rows[p].times for p in sliced)
    if saved <= 0:
        return []
    extra.update(positions)
    counts: dict[str, int] = {}
    for p in positions:
        counts[rows[p].kind] = counts.get(rows[p].kind, 0) + 1
    counted = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in counts.items())
    sent = rows_traffic(rows, positions)
    loop = _loop_line(context, positions[0])
    matmul = _matmul_line(context, [p for p in positions if rows[p].kind == "all-gather"])
    n = rows[sliced[0]].group_size
    example = rows[positions[0]]
    carry = "whose carry is kept in the batch's layout, " if kept else ""
    if weight is not None:
        gathered, weight_bytes = weight
        sizes = (
            f" ({array_text(gathered)}, {size_text(gathered.bytes)}, against a layer's largest weight, "
            f"{size_text(weight_bytes)})"
        )
    else:
        sizes = f" ({array_text(example)})"
    same = (
        ""
        if kept
        else " Keeping the loop's carry in the batch's layout (einshard.like_batch at the top of its "
        "body, einshard.constrain_loops) does not change this: the partitioner moves the smaller "
        "operand either way."
    )
    cause = (
        f"Inside the loop{f' at {loop}' if loop else ''}, {carry}XLA's partitioner moves activations "
        f"in place of weights: where a matmul's activations are smaller than its weight{sizes} it keeps "
        f"the weight's split, gathers the whole batch's activations to meet it, and reduces the next "
        f"matmul's partial sums back to the batch's layout ({counted}: {size_text(sent)} sent per device "
        f"per step). That is its choice by size, not a dropped split; but each device keeps only its "
        f"1/{n} slice of {len(sliced)} of those all-reduces' results: a reduce-scatter sends half their "
        f"bytes.{same}"
    )
    where = f" after the matmul at {matmul}" if matmul else " after the matmul the activations meet"
    fix = (
        "XLA's GPU compiler makes them reduce-scatters itself, its CPU compiler does not: a report with "
        "target= (target='h100') shows the program the hardware you run on gets. To gather the weights "
        f"in place of the activations instead, lay out the matmul's result as the batch: "
        f"h = einshard.like_batch(h){where}. Whether that sends less depends on the sizes: it gathers "
        "each layer's weights forward and backward and reduces their gradients, where this program "
        "moves activations (the partitioner moves the smaller of the two)."
    )
    sources = (loop,) if loop else rows_sources(rows, positions)
    return [Finding(MOVED, saved, 0, (), sources, cause, fix, tuple(positions))]


def _split_batch(context: Context) -> bool:
    """Whether the step has a batch argument the table splits on its first axis."""
    arrays = batch_arrays(context)
    return bool(arrays) and all(leaf.layout.shards[0] > 1 for leaf in arrays)


def _meets_larger_weight(context: Context, positions: list[int]) -> tuple[StepRow, int] | None:
    """The activation moved in a loop and a larger weight of one layer: ``(its row, the weight's bytes)``.

    A layer's weights are the step's stacked parameters (their first axis the loop's trip
    count, at least a matrix per layer); the activation is the largest array the rows move.
    Where one layer's largest weight is larger, the partitioner kept the weight's split by size
    (Shardy moves the smaller operand of a matmul); ``None`` where none is.
    """
    rows = context.rows
    moved = [rows[p] for p in positions]
    trips = {row.times for row in moved if row.times > 1}
    if not moved or not trips or not context.layouts:
        return None
    largest = max(moved, key=lambda row: row.bytes)
    layers = [
        context.sizes.get(path, 0) // leaf.shape[0]
        for path, leaf in zip(context.paths, context.layouts, strict=False)
        if leaf is not None and len(leaf.shape) >= 3 and leaf.shape[0] in trips
    ]
    weight = max(layers, default=0)
    return (largest, weight) if weight > largest.bytes else None


def _all_kept(context: Context) -> bool:
    """Whether the step has loops whose carry comes from the batch, and every one is kept in its layout."""
    return bool(context.loops) and all(note.constrained for note in context.loops)


def _activation_rows(context: Context, extra: set[int]) -> list[int]:
    """The rows moving the whole batch's activations in a loop (see the finders)."""
    sizes = {leaf.shape[0] for leaf in batch_arrays(context)}
    return [
        position
        for position, row in enumerate(context.rows)
        if position not in extra
        and (row.times > 1 or not row.times_known)
        and row.param is None
        and row.group_size > 1
        and any(size in row.shape for size in sizes)
        and not is_user_collective(row)
    ]


def _only_own_slice(context: Context, position: int) -> bool:
    value = context.values[position]
    fraction = context.uses.slice_fraction(value) if value is not None else None
    return fraction == Fraction(1, context.rows[position].group_size)


def _loop_line(context: Context, position: int) -> str | None:
    """``file:line`` of the loop whose body runs a row's collective: the user's line of the loop."""
    value = context.values[position]
    if value is None:
        return None
    module = context.uses.module
    computation = value.computation
    for _ in range(8):  # up through the computations that call it (a fusion, a branch) to a loop
        loops = [i for i in module.callers(computation, "body") if i.opcode == "while"]
        if loops:
            return _line(module, loops[0])
        callers = [i for role in _CALLING for i in module.callers(computation, role)]
        if not callers:
            return None
        computation = callers[0].computation
    return None


_CALLING = ("calls", "branch", "true_computation", "false_computation")


def _matmul_line(context: Context, gathers: list[int]) -> str | None:
    """``file:line`` of a matmul that reads a gathered activation (the first gather's first such user)."""
    for position in gathers:
        value = context.values[position]
        if value is None:
            continue
        flow = context.uses.flow
        for user in flow.users_in(value.computation).get(value.name, ()):
            if user.opcode in ("dot", "convolution", "fusion") and (line := _line(flow.module, user)):
                return line
    return None


def _line(module: _hlo.Module, instruction: _hlo.Instruction) -> str | None:
    _, file, line = module.source(instruction)
    return f"{file.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line}" if file is not None else None
