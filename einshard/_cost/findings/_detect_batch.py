"""A batch left whole while the parameters are split: ``activations gathered over the batch``.

Under FSDP the parameters are split over the devices and gathered where they are used; the batch
is meant to be split over the same devices, so that each device computes on its own examples
and no activation moves. When the batch is replicated instead (left to a table's catch-all:
a strategy's rules given without its ``.batch``), XLA's partitioner splits the activations
itself to meet the split weights, and gathers or reduces them over the devices, forward and
backward: collectives that serve no parameter. On a LLaMA-shaped step under FSDP on 8 devices,
that was 18.5 GiB per device per step instead of 7.8 GiB.

Self-contained: it reads the rows, the leaves' assignments and the table from the
:class:`~einshard._cost.findings._detect.Context`, and nothing of the data flow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..._language._text import size_text
from ..._trees._rules import Rules
from ..._trees._strategy import batch_pattern
from ..report._report import Finding
from ._detect import BATCH, Context, is_user_collective, rows_sources, rows_traffic

__all__ = ["batch_arrays", "find_batch_gathers"]

BATCH_SPLIT = "b ... -> b* ..."
# Collectives that move activations between layouts: with these among the rows that serve no
# parameter, the partitioner is laying out activations (all-reduces alone are tensor
# parallelism's own partial sums, by design).
_MOVES = ("all-gather", "reduce-scatter", "all-to-all")


def find_batch_gathers(context: Context, extra: set[int]) -> list[Finding]:
    """The collectives of activations a split batch would not need, as one finding.

    When the step's batch argument is not split on its first axis (replicated, or split on
    another axis by a per-leaf rule) because the table's catch-all decided it (or no rule did),
    the table splits parameters, and collectives serving no parameter move activations (an
    all-gather, reduce-scatter or all-to-all among them: all-reduces alone are tensor
    parallelism's partial sums, by design). Those rows are the finding's (added to ``extra``,
    so that the detectors after it do not count them again); their bytes are what the split
    batch saves.
    """
    arrays = batch_arrays(context)
    if not arrays or any(leaf.layout.shards[0] > 1 for leaf in arrays):
        return []  # no batch array, or the table splits the batch on its batch axis
    batch = _batch_name(context.paths)
    assert batch is not None
    why = _why_whole(arrays[0], context.paths)
    if why is None:
        return []  # a rule written for the batch replicates it: on purpose
    split = [
        leaf
        for path, leaf in zip(context.paths, context.layouts or (), strict=False)
        if leaf is not None and not _under(path, batch) and math.prod(leaf.layout.shards) > 1
    ]
    rows = context.rows
    if not split:
        return []
    positions = [
        position
        for position, row in enumerate(rows)
        if position not in extra and row.param is None and row.group_size > 1 and not is_user_collective(row)
    ]
    if not any(rows[p].kind in _MOVES for p in positions):
        return []  # all-reduces alone: tensor parallelism's partial sums, by design
    sent = rows_traffic(rows, positions)
    if sent <= 0:
        return []
    extra.update(positions)
    ways = max(math.prod(leaf.layout.shards) for leaf in split)
    kinds: dict[str, int] = {}
    for p in positions:
        kinds[rows[p].kind] = kinds.get(rows[p].kind, 0) + 1
    counted = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in kinds.items())
    names = ", ".join(leaf.path for leaf in arrays[:2]) + (" ..." if len(arrays) > 2 else "")
    whole = (
        "replicated"
        if all(math.prod(leaf.layout.shards) == 1 for leaf in arrays)
        else "not split on its first axis"
    )
    cause = (
        f"The batch ({names}) is {whole}: {why}, while the table splits the parameters {ways} ways. "
        "XLA's partitioner then splits the activations itself to meet the split weights, and moves "
        f"them over the devices with collectives that serve no parameter ({counted}: "
        f"{size_text(sent)} sent per device per step)."
    )
    pattern = batch_pattern(batch)
    fix = (
        f"Split the batch over the devices as the parameters are: put ({pattern!r}, "
        f"{BATCH_SPLIT!r}) in front of the table{_divides(arrays, context.n_devices)}, or give "
        "the strategy itself as rules= (plan(...).best, strategies.fsdp()): its .batch lays out "
        "the batch, as plan does."
    )
    return [Finding(BATCH, sent, 0, (), rows_sources(rows, positions), cause, fix, tuple(positions))]


def batch_arrays(context: Context) -> list[Any]:
    """The assignments of the batch argument's array leaves (not scalars), or ``[]``."""
    if not context.layouts or not context.paths:
        return []
    batch = _batch_name(context.paths)
    if batch is None:
        return []
    return [
        leaf
        for path, leaf in zip(context.paths, context.layouts, strict=False)
        if leaf is not None and _under(path, batch) and leaf.shape
    ]


def _batch_name(paths: Sequence[str]) -> str | None:
    """The step's batch argument's name, read off the leaves' paths, as ``StepCall.batch_name`` says.

    The argument named ``batch``, else the last of two or more (keyword arguments, which come
    last, are not told apart here). A step ``fn(*args)`` names its arguments ``args/0``,
    ``args/1``: then the last of those.
    """
    tops = list(dict.fromkeys(path.split("/", 1)[0] for path in paths))
    if "batch" in tops:
        return "batch"
    if len(tops) >= 2:
        return tops[-1]
    seconds = list(dict.fromkeys("/".join(path.split("/", 2)[:2]) for path in paths))
    if len(tops) == 1 and len(seconds) >= 2 and all(s.rpartition("/")[2].isdigit() for s in seconds):
        return seconds[-1]
    return None


def _under(path: str, name: str) -> bool:
    return path == name or path.startswith(name + "/")


def _why_whole(leaf: Any, paths: Sequence[str]) -> str | None:
    """Why the batch is replicated, when no rule was written for it; ``None`` when one was."""
    rule = leaf.rule
    if rule is None:
        return "no rule matches it (the table's policy replicates such leaves)"
    alone = Rules([(rule.pattern, rule.expression)])
    if getattr(rule, "catches_all", False) or alone.matching_all(paths):
        return f"only the table's catch-all rule {rule} matches it"
    return None


def _divides(arrays: Sequence[Any], n_devices: int) -> str:
    """A note when the batch's first axis does not divide by the device count."""
    bad = [leaf for leaf in arrays if leaf.shape[0] % n_devices]
    if not bad:
        return ""
    return f" (its first axis, {bad[0].shape[0]} in {bad[0].path}, must divide by {n_devices}: pad it)"
