"""The whole batch's activations reduced inside a loop: ``activations reduced in a loop``.

Inside a ``while`` loop (a scanned model's layers), XLA's partitioner gives a loop-carried value
one layout for every iteration and is free to choose it. Under FSDP it may drop the activations'
batch split: each device then holds the whole batch's activations and computes each layer's
products as contractions over the split hidden axis, all-reducing those activations in every
layer, forward and backward. On the 1.5 B LLaMA-shaped step scanned on 8 H100s, that was 7 GiB
per device per step, and the peak rose from 3.7 GiB to 14.5 GiB. One constraint of the carry to
the batch's layout (``einshard.like_batch``, or the step compiled by ``einshard.constrain_loops``,
as ``plan`` and ``explain_step`` with a strategy do) removes them.

Self-contained: it reads the rows, the leaves' assignments and paths from the
:class:`~einshard._cost._detect.Context`.
"""

from __future__ import annotations

from .._language._text import size_text
from ._detect import LOOP, Context, array_text, is_user_collective, rows_sources, rows_traffic
from ._detect_batch import batch_arrays
from ._report import Finding

__all__ = ["find_loop_reductions"]


def find_loop_reductions(context: Context, extra: set[int]) -> list[Finding]:
    """All-reduces of the whole batch's activations inside a loop, while the table splits the batch.

    A row counts when it is an all-reduce run more than once per step (in a loop body), serving
    no parameter, not written by the user (``shard_map``), whose array on each device has the
    batch's whole first axis: the step's table splits the batch on that axis, so the partitioner
    dropped the split inside the loop. Its bytes are those rows' traffic: with the carry kept in
    the batch's layout, activations are not reduced at all.
    """
    arrays = batch_arrays(context)
    if not arrays or any(leaf.layout.shards[0] == 1 for leaf in arrays):
        return []  # no batch, or a batch the table does not split
    sizes = {leaf.shape[0] for leaf in arrays}
    rows = context.rows
    positions = [
        position
        for position, row in enumerate(rows)
        if position not in extra
        and row.kind == "all-reduce"
        and (row.times > 1 or not row.times_known)
        and row.param is None
        and row.group_size > 1
        and row.shape
        and row.shape[0] in sizes
        and not is_user_collective(row)
    ]
    sent = rows_traffic(rows, positions)
    if not positions or sent <= 0:
        return []
    extra.update(positions)
    sources = rows_sources(rows, positions)
    split = max(leaf.layout.shards[0] for leaf in arrays)
    example = rows[positions[0]]
    cause = (
        f"Inside a loop, XLA's partitioner dropped the activations' batch split: each device holds "
        f"the whole batch ({array_text(example)}, the batch's {example.shape[0]} first) and "
        f"all-reduces activations in every iteration ({len(positions)} all-reduce"
        f"{'s' if len(positions) > 1 else ''}, {size_text(sent)} sent per device per step), where "
        f"the table splits the batch {split} ways."
    )
    at = f" at {sources[0].rsplit('/', 1)[-1]}" if sources else ""
    expression = arrays[0].expression
    fix = (
        f"Keep the loop's carry in the batch's layout: run the step as "
        f"einshard.constrain_loops(step, {expression!r}) (jit that), or write "
        f"x = einshard.like_batch(x) at the top of the loop's body{at} and run it under "
        f"einshard.use_strategy({expression!r}); plan, and explain_step with the strategy itself as "
        "rules=, compile it so."
    )
    return [Finding(LOOP, sent, 0, (), sources, cause, fix, tuple(positions))]
